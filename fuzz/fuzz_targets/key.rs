//! `Idempotency-Key` parsing: any field value either parses to a valid key or is refused,
//! never panics; a parsed key is 1–255 visible ASCII characters and reads back the same when
//! sent again as an sf-string or (where it can be) a bare token.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::key::{MAX_KEY_LEN, parse_field_value, parse_key};

fuzz_target!(|data: &[u8]| {
    let parsed = parse_field_value(data);
    if let Ok(value) = HeaderValue::from_bytes(data) {
        let name = HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        headers.insert(name.clone(), value.clone());
        let via_headers = parse_key(&headers, &name).map(|key| key.expect("the header is present"));
        assert_eq!(format!("{via_headers:?}"), format!("{parsed:?}"), "parse_key and parse_field_value disagree");
        headers.append(name.clone(), value);
        assert!(parse_key(&headers, &name).is_err(), "two Idempotency-Key fields must be refused");
    }
    let Ok(key) = parsed else { return };
    let key = key.as_str();
    assert!(!key.is_empty() && key.len() <= MAX_KEY_LEN, "key length {}", key.len());
    assert!(key.bytes().all(|b| b.is_ascii_graphic()), "key {key:?} has a non-visible character");

    let mut quoted = String::from("\"");
    for c in key.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    let again = parse_field_value(quoted.as_bytes()).expect("a valid key sent as an sf-string parses");
    assert_eq!(again.as_str(), key);
    if !key.bytes().any(|b| matches!(b, b'"' | b'\\' | b',' | b';')) {
        let bare = parse_field_value(key.as_bytes()).expect("a valid key without delimiters parses bare");
        assert_eq!(bare.as_str(), key);
    }
});
