//! Version 2's media type parameters: how the fingerprint reads and normalises them.

/// One parameter: its lowercased name and, unless it had no `=`, its unquoted value.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Parameter {
    name: Vec<u8>,
    value: Option<Vec<u8>>,
}

impl Parameter {
    /// The parameter in `piece` (the text between two `;`), `None` when it is blank.
    pub(super) fn parse(piece: &[u8]) -> Option<Self> {
        let piece = piece.trim_ascii();
        if piece.is_empty() {
            return None;
        }
        let Some(eq) = piece.iter().position(|&b| b == b'=') else {
            return Some(Self { name: piece.to_ascii_lowercase(), value: None });
        };
        let name = piece[..eq].trim_ascii().to_ascii_lowercase();
        let mut value = unquote(piece[eq + 1..].trim_ascii());
        if name == b"charset" {
            value.make_ascii_lowercase();
        }
        Some(Self { name, value: Some(value) })
    }

    /// Whether it is `charset=utf-8` (already lowercased).
    pub(super) fn is_charset_utf8(&self) -> bool {
        self.name == b"charset" && self.value.as_deref() == Some(b"utf-8")
    }

    /// Appends `;name=value`, the value quoted unless it is a non-empty token.
    pub(super) fn write(&self, out: &mut Vec<u8>) {
        out.push(b';');
        out.extend_from_slice(&self.name);
        let Some(value) = &self.value else { return };
        out.push(b'=');
        if !value.is_empty() && value.iter().all(|&b| is_tchar(b)) {
            out.extend_from_slice(value);
            return;
        }
        out.push(b'"');
        for &b in value {
            if b == b'"' || b == b'\\' {
                out.push(b'\\');
            }
            out.push(b);
        }
        out.push(b'"');
    }
}

/// Splits a media type at every `;` outside a quoted string (without allocating: nearly every
/// request has one content type, most of them without parameters).
pub(super) fn split(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    // The start of the next piece; `None` once the last piece was given out.
    let mut start = Some(0);
    let (mut k, mut quoted, mut escaped) = (0, false, false);
    std::iter::from_fn(move || {
        let from = start?;
        while let Some(&b) = value.get(k) {
            k += 1;
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                b';' if !quoted => {
                    start = Some(k);
                    return Some(&value[from..k - 1]);
                }
                _ => {}
            }
        }
        start = None;
        Some(&value[from..])
    })
}

/// A value without its quotes and escapes when it is a quoted string; else as it is.
fn unquote(value: &[u8]) -> Vec<u8> {
    let Some(inner) = value.strip_prefix(b"\"").and_then(|v| v.strip_suffix(b"\"")) else {
        return value.to_vec();
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => out.extend(bytes.next()),
            _ => out.push(b),
        }
    }
    out
}

/// RFC 9110 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn splits_at_semicolons_outside_quoted_strings_and_keeps_empty_pieces() {
        let pieces = |value: &[u8]| split(value).map(<[u8]>::to_vec).collect::<Vec<_>>();
        assert_eq!(pieces(b"a/b"), [b"a/b".to_vec()]);
        assert_eq!(pieces(b""), [b"".to_vec()]);
        assert_eq!(pieces(b"a;"), [b"a".to_vec(), b"".to_vec()]);
        assert_eq!(pieces(b";;"), [b"".to_vec(), b"".to_vec(), b"".to_vec()]);
        let quoted: &[u8] = br#"t/s; q="x;\"y;" ;z"#;
        assert_eq!(pieces(quoted), [b"t/s".to_vec(), br#" q="x;\"y;" "#.to_vec(), b"z".to_vec()]);
    }
}
