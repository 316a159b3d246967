//! Lowercase hex encoding (sha2 0.11 digests no longer format with `{:x}`).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Encodes bytes as lowercase hex.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)] as char);
        out.push(DIGITS[usize::from(byte & 0x0f)] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn encodes_every_nibble_in_lowercase() {
        assert_eq!(super::encode(&[0x00, 0x9f, 0xa0, 0xff]), "009fa0ff");
    }
}
