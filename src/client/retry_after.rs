//! `Retry-After` (RFC 9110 §10.2.3): a number of seconds or an HTTP-date.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// The wait that a `Retry-After` value asks for, measured from `now`: `"120"` is two minutes,
/// `"Wed, 21 Oct 2015 07:28:00 GMT"` is the time until then (zero if it has passed). `None` for
/// anything else (a negative or fractional number, a malformed date).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tower_idempotency::client::parse_retry_after;
///
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_400);
/// assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
/// assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now), Some(Duration::from_secs(80)));
/// assert_eq!(parse_retry_after("soon", now), None);
/// ```
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Digits only: seconds. A number too large for u64 is "a very long time".
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The `retry-after` field of `headers` (HTTP header or gRPC metadata), read at `now`.
pub(crate) fn retry_after_of(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    parse_retry_after(value, now)
}
