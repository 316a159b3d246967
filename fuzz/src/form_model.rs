//! A reference form-urlencoded decoder (the WHATWG urlencoded parser, keeping bytes as bytes)
//! and the documented canonical order.

/// The decoded `(name, value)` pairs of `input`, in order.
pub fn pairs(input: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    for sequence in input.split(|&b| b == b'&') {
        if sequence.is_empty() {
            continue;
        }
        let (name, value) = match sequence.iter().position(|&b| b == b'=') {
            Some(k) => (&sequence[..k], &sequence[k + 1..]),
            None => (sequence, &b""[..]),
        };
        out.push((decode(name), decode(value)));
    }
    out
}

fn decode(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < input.len() {
        let b = input[i];
        let hex = input.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (b, hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(h)) if h.bytes().all(|d| d.is_ascii_hexdigit()) => {
                out.push(u8::from_str_radix(h, 16).unwrap());
                i += 2;
            }
            _ => out.push(b),
        }
        i += 1;
    }
    out
}

/// The pairs in canonical order: stably sorted by name, values of one name in their order.
pub fn canonical_pairs(input: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut pairs = pairs(input);
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs
}
