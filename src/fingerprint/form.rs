//! `application/x-www-form-urlencoded` decoding without lossy UTF-8 repair.
//!
//! The pairs are split and decoded exactly as the WHATWG URL standard's
//! urlencoded parser does (split on `&`, drop empty sequences, split each at
//! the first `=`, `+` → space, `%XX` → byte, a `%` without two hex digits kept
//! as is), but the decoded bytes are kept as bytes: `form_urlencoded::parse`
//! replaces invalid UTF-8 with U+FFFD, which would make `%FF` and `%FE` the
//! same value.

use std::borrow::Cow;

/// A decoded name/value pair.
pub(crate) type Pair<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

/// Decodes the pairs of a form body or query string, in order.
pub(crate) fn pairs(input: &[u8]) -> Vec<Pair<'_>> {
    input
        .split(|&b| b == b'&')
        .filter(|sequence| !sequence.is_empty())
        .map(|sequence| {
            let (name, value) = match sequence.iter().position(|&b| b == b'=') {
                Some(k) => (&sequence[..k], &sequence[k + 1..]),
                None => (sequence, &[][..]),
            };
            (decode(name), decode(value))
        })
        .collect()
}

fn decode(input: &[u8]) -> Cow<'_, [u8]> {
    if !input.iter().any(|&b| b == b'+' || b == b'%') {
        return Cow::Borrowed(input);
    }
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        let b = input[i];
        match b {
            b'+' => out.push(b' '),
            b'%' => match (input.get(i + 1).and_then(|&h| hex(h)), input.get(i + 2).and_then(|&l| hex(l))) {
                (Some(high), Some(low)) => {
                    out.push(high << 4 | low);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            _ => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(out)
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Canonical form body: pairs stably sorted by name (values of one name keep
/// their order), re-encoded with `form_urlencoded`'s byte serializer and
/// joined as `name=value&…`.
pub(crate) fn canonical(input: &[u8]) -> Vec<u8> {
    let mut pairs = pairs(input);
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(input.len());
    for (k, (name, value)) in pairs.iter().enumerate() {
        if k > 0 {
            out.push(b'&');
        }
        for piece in form_urlencoded::byte_serialize(name) {
            out.extend_from_slice(piece.as_bytes());
        }
        out.push(b'=');
        for piece in form_urlencoded::byte_serialize(value) {
            out.extend_from_slice(piece.as_bytes());
        }
    }
    out
}
