//! The stored form of a response's headers and trailers: what the SQL stores keep in
//! `response_headers` and the Redis fast path seals with the body.
//!
//! **Format 2** (written since issue 16): a `0x02` byte, then each field as a tag byte and what
//! the tag asks for (no fields at all: no bytes, as in format 1). The tag's high bit says the section (set: a trailer). Its low seven bits
//! name the field:
//!
//! - `0`: a literal name and a literal value;
//! - `1..=63`: a name from [`NAMES`] (`n` is `NAMES[n - 1]`) and a literal value;
//! - `64..=127`: a whole field from [`FIELDS`] (`n` is `FIELDS[n - 64]`), nothing more.
//!
//! A literal is its length (unsigned LEB128, at most `u32::MAX`) and its bytes. The tables only
//! grow, at their ends: a stored index keeps its meaning. A created order's `content-type:
//! application/json` and `location: /orders/…` take 48 bytes this way where format 1 took 98.
//!
//! **Format 1** (what records written before keep, read as ever): for each field its section
//! byte (`h` or `t`), then the name's and the value's lengths (u32, big-endian) each followed by
//! its bytes. A list in either format never starts with the other's first byte, so one read
//! serves both.

use http::{HeaderName, HeaderValue};

use super::Fields;

/// The first byte of format 2.
const FORMAT_2: u8 = 0x02;
/// Format 1's section bytes.
const HEADER_SECTION: u8 = b'h';
const TRAILER_SECTION: u8 = b't';
/// A tag's section bit (set: a trailer), and its index bits.
const TRAILER_BIT: u8 = 0x80;
const INDEX_BITS: u8 = 0x7f;
/// Where [`FIELDS`]' indexes start.
const FIRST_FIELD: u8 = 64;

/// Names that answers often keep (the default stored headers first, then gRPC's trailers):
/// their index stands for them. Append only.
const NAMES: [&str; 17] = [
    "content-type",
    "location",
    "etag",
    "last-modified",
    "link",
    "content-language",
    "content-location",
    "cache-control",
    "content-encoding",
    "content-disposition",
    "vary",
    "retry-after",
    "expires",
    "grpc-status",
    "grpc-message",
    "grpc-status-details-bin",
    "grpc-encoding",
];

/// Whole fields that answers often keep: their index stands for name and value. Append only.
const FIELDS: [(&str, &str); 7] = [
    ("content-type", "application/json"),
    ("content-type", "application/json; charset=utf-8"),
    ("content-type", "application/problem+json"),
    ("content-type", "text/plain; charset=utf-8"),
    ("content-type", "application/grpc"),
    ("content-type", "application/grpc+proto"),
    ("grpc-status", "0"),
];

/// `headers` then `trailers` in format 2; no fields at all are no bytes, which both formats
/// read as the empty list (so an encoding is never longer than any list it was decoded from).
pub(super) fn encode(headers: &Fields, trailers: &Fields) -> Vec<u8> {
    if headers.is_empty() && trailers.is_empty() {
        return Vec::new();
    }
    let fields = headers.iter().map(|f| (0, f)).chain(trailers.iter().map(|f| (TRAILER_BIT, f)));
    let mut out = vec![FORMAT_2];
    for (section, (name, value)) in fields {
        let (name, value) = (name.as_str(), value.as_bytes());
        if let Some(n) = FIELDS.iter().position(|(n, v)| *n == name && v.as_bytes() == value) {
            out.push(section | (FIRST_FIELD + n as u8));
            continue;
        }
        match NAMES.iter().position(|n| *n == name) {
            Some(n) => out.push(section | (n as u8 + 1)),
            None => {
                out.push(section);
                literal(&mut out, name.as_bytes());
            }
        }
        literal(&mut out, value);
    }
    out
}

/// Fields in either format, as `(headers, trailers)`; `None` if the bytes are neither.
pub(super) fn decode(bytes: &[u8]) -> Option<(Fields, Fields)> {
    match bytes.split_first() {
        Some((&FORMAT_2, rest)) => decode_2(rest),
        _ => decode_1(bytes),
    }
}

fn decode_2(mut bytes: &[u8]) -> Option<(Fields, Fields)> {
    let (mut headers, mut trailers) = (Vec::new(), Vec::new());
    while let Some((&tag, rest)) = bytes.split_first() {
        bytes = rest;
        let field = match tag & INDEX_BITS {
            0 => {
                let name = HeaderName::from_bytes(read_literal(&mut bytes)?).ok()?;
                (name, HeaderValue::from_bytes(read_literal(&mut bytes)?).ok()?)
            }
            n if n < FIRST_FIELD => {
                let name = HeaderName::from_static(NAMES.get(usize::from(n) - 1)?);
                (name, HeaderValue::from_bytes(read_literal(&mut bytes)?).ok()?)
            }
            n => {
                let (name, value) = FIELDS.get(usize::from(n - FIRST_FIELD))?;
                (HeaderName::from_static(name), HeaderValue::from_static(value))
            }
        };
        if tag & TRAILER_BIT == 0 { headers.push(field) } else { trailers.push(field) }
    }
    Some((headers, trailers))
}

fn decode_1(mut bytes: &[u8]) -> Option<(Fields, Fields)> {
    fn part<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
        let (len, rest) = bytes.split_first_chunk::<4>()?;
        let len = u32::from_be_bytes(*len) as usize;
        if rest.len() < len {
            return None;
        }
        let (part, rest) = rest.split_at(len);
        *bytes = rest;
        Some(part)
    }
    let (mut headers, mut trailers) = (Vec::new(), Vec::new());
    while let Some((&section, rest)) = bytes.split_first() {
        bytes = rest;
        let name = HeaderName::from_bytes(part(&mut bytes)?).ok()?;
        let value = HeaderValue::from_bytes(part(&mut bytes)?).ok()?;
        match section {
            HEADER_SECTION => headers.push((name, value)),
            TRAILER_SECTION => trailers.push((name, value)),
            _ => return None,
        }
    }
    Some((headers, trailers))
}

/// Appends `bytes` as a literal: its length in unsigned LEB128, then the bytes.
fn literal(out: &mut Vec<u8>, bytes: &[u8]) {
    let mut len = bytes.len();
    while len >= 0x80 {
        out.push((len as u8 & 0x7f) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
    out.extend_from_slice(bytes);
}

/// Reads a literal off the front of `bytes`: `None` if its length is malformed, past
/// `u32::MAX`, or longer than what is left.
fn read_literal<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
    let mut len: u64 = 0;
    for shift in (0..35).step_by(7) {
        let (&byte, rest) = bytes.split_first()?;
        *bytes = rest;
        len |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            let len = usize::try_from(u32::try_from(len).ok()?).ok()?;
            if bytes.len() < len {
                return None;
            }
            let (literal, rest) = bytes.split_at(len);
            *bytes = rest;
            return Some(literal);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue};

    use super::{FIELDS, FORMAT_2, NAMES, decode, encode};
    use crate::record::Fields;

    fn field(name: &str, value: &[u8]) -> (HeaderName, HeaderValue) {
        (HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_bytes(value).unwrap())
    }

    /// Format 1, as records written before format 2 keep it.
    fn format_1(headers: &Fields, trailers: &Fields) -> Vec<u8> {
        let fields = headers.iter().map(|f| (b'h', f)).chain(trailers.iter().map(|f| (b't', f)));
        let mut out = Vec::new();
        for (section, (name, value)) in fields {
            out.push(section);
            for part in [name.as_str().as_bytes(), value.as_bytes()] {
                out.extend_from_slice(&(part.len() as u32).to_be_bytes());
                out.extend_from_slice(part);
            }
        }
        out
    }

    fn mixed() -> (Fields, Fields) {
        let headers = vec![
            field("content-type", b"application/json"),
            field("location", b"/orders/6a321645-a23b-40c1-929b-813d72a6be46"),
            field("content-type", b"application/JSON"),
            field("x-custom", b"<\xff>"),
            field("link", &[b'a'; 300]),
            field(&"x".repeat(200), b""),
        ];
        let trailers = vec![field("grpc-status", b"0"), field("grpc-status", b"13"), field("x-trailer", b"v")];
        (headers, trailers)
    }

    #[test]
    fn both_formats_round_trip_and_format_2_is_what_is_written() {
        let (headers, trailers) = mixed();
        let encoded = encode(&headers, &trailers);
        assert_eq!(encoded[0], FORMAT_2);
        assert_eq!(decode(&encoded), Some((headers.clone(), trailers.clone())));
        assert_eq!(decode(&format_1(&headers, &trailers)), Some((headers, trailers)));
        assert_eq!(decode(&[]), Some((vec![], vec![])), "format 1's empty list");
        assert_eq!(decode(&[FORMAT_2]), Some((vec![], vec![])));
        assert_eq!(encode(&vec![], &vec![]), Vec::<u8>::new(), "no fields are no bytes, in either format");
    }

    #[test]
    fn every_table_entry_round_trips_in_both_sections() {
        let named: Fields = NAMES.iter().map(|name| field(name, b"v")).collect();
        let whole: Fields = FIELDS.iter().map(|(name, value)| field(name, value.as_bytes())).collect();
        for fields in [named, whole] {
            assert_eq!(decode(&encode(&fields, &fields)), Some((fields.clone(), fields)));
        }
    }

    #[test]
    fn a_created_orders_headers_take_48_bytes_instead_of_98() {
        let headers = vec![
            field("content-type", b"application/json"),
            field("location", b"/orders/6a321645-a23b-40c1-929b-813d72a6be46"),
        ];
        assert_eq!((encode(&headers, &vec![]).len(), format_1(&headers, &vec![]).len()), (48, 98));
    }

    #[test]
    fn malformed_lists_are_refused_never_misread() {
        let (headers, trailers) = mixed();
        let encoded = encode(&headers, &trailers);
        for end in 1..encoded.len() {
            let cut = decode(&encoded[..end]);
            // A cut that falls between two fields is a shorter list; anywhere else, refused.
            if let Some((h, t)) = cut {
                assert!(headers.starts_with(&h) && (t.is_empty() || (h == headers && trailers.starts_with(&t))));
            }
        }
        for bad in [
            vec![FORMAT_2, 0x3f, 0],                            // a name index past the table
            vec![FORMAT_2, 0x7f],                               // a field index past the table
            vec![FORMAT_2, 1, 0x80, 0x80, 0x80, 0x80, 0x80, 1], // a length of more than five bytes
            vec![FORMAT_2, 1, 0xff, 0xff, 0xff, 0xff, 0x1f],    // a length past u32::MAX
            vec![FORMAT_2, 0, 1, b' ', 0],                      // not a header name
            vec![FORMAT_2, 1, 1, b'\n'],                        // not a header value
            vec![FORMAT_2, 1, 5, b'a'],                         // shorter than its length
            b"x".to_vec(),                                      // neither format
        ] {
            assert_eq!(decode(&bad), None, "{bad:?}");
        }
    }
}
