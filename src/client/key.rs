//! The key of a logical request: the caller's own, else a fresh UUID v4, chosen once before the
//! first attempt and carried by every retry.

use http::{Extensions, HeaderMap, HeaderName, HeaderValue};

use crate::IdempotencyKey;

/// The `Idempotency-Key` header (HTTP) and `idempotency-key` metadata (gRPC).
pub(crate) const KEY_HEADER: HeaderName = HeaderName::from_static("idempotency-key");

/// Makes sure `headers` carry a key and returns it: an `Idempotency-Key` header already there
/// stays as it is; else the [`IdempotencyKey`] in `extensions`; else a fresh UUID v4.
pub(crate) fn attach_key(headers: &mut HeaderMap, extensions: &Extensions) -> String {
    if let Some(existing) = headers.get(&KEY_HEADER) {
        return String::from_utf8_lossy(existing.as_bytes()).into_owned();
    }
    let key = match extensions.get::<IdempotencyKey>() {
        Some(key) => key.as_str().to_owned(),
        None => uuid::Uuid::new_v4().hyphenated().to_string(),
    };
    // A key is visible ASCII (`IdempotencyKey` checks it; a UUID is), so it is a valid value.
    if let Ok(value) = HeaderValue::from_str(&key) {
        headers.insert(KEY_HEADER, value);
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_callers_header_wins_then_its_extension_then_a_fresh_uuid() {
        let mut headers = HeaderMap::new();
        headers.insert(KEY_HEADER, HeaderValue::from_static("from-header"));
        let mut extensions = Extensions::new();
        extensions.insert(IdempotencyKey::new("from-extension").unwrap());
        assert_eq!(attach_key(&mut headers, &extensions), "from-header");

        let mut headers = HeaderMap::new();
        assert_eq!(attach_key(&mut headers, &extensions), "from-extension");
        assert_eq!(headers[KEY_HEADER], "from-extension");

        let mut headers = HeaderMap::new();
        let fresh = attach_key(&mut headers, &Extensions::new());
        assert_eq!(uuid::Uuid::parse_str(&fresh).unwrap().get_version_num(), 4);
        assert_eq!(headers[KEY_HEADER], fresh.as_str());
        assert_ne!(attach_key(&mut HeaderMap::new(), &Extensions::new()), fresh);
    }
}
