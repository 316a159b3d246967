//! The cached value of a finished record: a small versioned binary encoding, sealed with a MAC
//! over the identity, the whole value and the time it may be replayed until (see [`Keying`]).
//!
//! Format 2: the format, the state (1 completed, 2 failed), the fingerprint's version and digest,
//! the status (u16, big-endian), the length of the encoded headers and trailers (u32,
//! big-endian), those fields ([`StoredResponse::encode_fields`]), the body; then the seal: the
//! time it may be replayed until (milliseconds since the Unix epoch, u64 big-endian) and the MAC
//! (32 bytes). Format 1 (without the seal) is never trusted: its values are misses. Change the
//! format only with a new version byte.

use bytes::Bytes;
use http::StatusCode;

use super::keying::Keying;
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::{Record, RecordState, StoredResponse};

/// The version byte of the cached value's encoding.
const CACHE_FORMAT: u8 = 2;
/// Version, state, fingerprint version and digest, status, length of the fields.
const CACHE_HEADER_LEN: usize = 1 + 1 + 1 + 32 + 2 + 4;

/// The value of a finished record before its seal ([`Keying::seal`]).
pub(crate) fn encode_payload(state: RecordState, fingerprint: &Fingerprint, response: &StoredResponse) -> Vec<u8> {
    let fields = response.encode_fields();
    let mut value = Vec::with_capacity(CACHE_HEADER_LEN + fields.len() + response.body.len());
    value.push(CACHE_FORMAT);
    value.push(if state == RecordState::Failed { 2 } else { 1 });
    value.push(fingerprint.version());
    value.extend_from_slice(fingerprint.digest());
    value.extend_from_slice(&response.status.as_u16().to_be_bytes());
    value.extend_from_slice(&u32::try_from(fields.len()).unwrap_or(u32::MAX).to_be_bytes());
    value.extend_from_slice(&fields);
    value.extend_from_slice(&response.body);
    value
}

/// What a cached value holds.
#[derive(Debug, PartialEq)]
pub(super) enum Decoded {
    /// The record, verified: written by this deployment for this identity, unaltered.
    Record(Record),
    /// The MAC does not verify (altered, another identity's, another deployment's, or of a
    /// format without a MAC), or the value is past its time.
    Unverified,
    /// The MAC verifies, yet the value does not decode (a format this build does not know).
    Unreadable,
}

/// Reads a value sealed for `id` with `keying`, at `now` (milliseconds since the Unix epoch).
/// Anything else is not trusted.
pub(super) fn decode(keying: &Keying, id: &RecordId, value: &[u8], now: u64) -> Decoded {
    match keying.open(id, value, now) {
        None => Decoded::Unverified,
        Some(payload) => decode_payload(payload).map_or(Decoded::Unreadable, Decoded::Record),
    }
}

/// Reads a value's payload (without its MAC); `None` if it is not one.
pub(crate) fn decode_payload(value: &[u8]) -> Option<Record> {
    let (&[format, state, version], rest) = value.split_first_chunk::<3>()?;
    if format != CACHE_FORMAT {
        return None;
    }
    let state = match state {
        1 => RecordState::Completed,
        2 => RecordState::Failed,
        _ => return None,
    };
    let (digest, rest) = rest.split_first_chunk::<32>()?;
    let (status, rest) = rest.split_first_chunk::<2>()?;
    let (length, rest) = rest.split_first_chunk::<4>()?;
    let status = StatusCode::from_u16(u16::from_be_bytes(*status)).ok()?;
    let length = usize::try_from(u32::from_be_bytes(*length)).ok()?;
    if rest.len() < length {
        return None;
    }
    let (fields, body) = rest.split_at(length);
    let (headers, trailers) = StoredResponse::decode_fields(fields)?;
    let mut response = StoredResponse::new(status, Bytes::copy_from_slice(body));
    response.headers = headers;
    response.trailers = trailers;
    Some(Record::with_response(state, Fingerprint::from_parts(version, *digest), response))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    fn response() -> StoredResponse {
        let mut response = StoredResponse::new(StatusCode::CREATED, &b"{\"id\":1}\xff"[..]);
        response.headers.push((http::header::LOCATION, HeaderValue::from_static("/things/1")));
        response.headers.push((http::header::CONTENT_TYPE, HeaderValue::from_static("application/json")));
        response.trailers.push((HeaderName::from_static("grpc-status"), HeaderValue::from_static("0")));
        response
    }

    fn id(key: &str) -> RecordId {
        RecordId::new(&crate::Scope::new("t"), "POST /x", &crate::IdempotencyKey::new(key).expect("key"))
    }

    #[test]
    fn cached_records_round_trip() {
        let keying = Keying::derive(b"secret");
        let fingerprint = Fingerprint::from_parts(1, [9; 32]);
        for state in [RecordState::Completed, RecordState::Failed] {
            let value = keying.seal(&id("a"), 1000, encode_payload(state, &fingerprint, &response()));
            let record = Record::with_response(state, fingerprint, response());
            assert_eq!(decode(&keying, &id("a"), &value, 999), Decoded::Record(record));
            assert_eq!(decode(&keying, &id("a"), &value, 1000), Decoded::Unverified, "past its time");
        }
    }

    #[test]
    fn values_are_trusted_only_for_their_identity_and_deployment_and_unaltered() {
        let keying = Keying::derive(b"secret");
        let payload = encode_payload(RecordState::Completed, &Fingerprint::from_parts(1, [9; 32]), &response());
        let value = keying.seal(&id("a"), u64::MAX, payload.clone());
        assert_eq!(decode(&keying, &id("b"), &value, 0), Decoded::Unverified);
        assert_eq!(decode(&Keying::derive(b"other"), &id("a"), &value, 0), Decoded::Unverified);
        let mut altered = value.clone();
        let last_body_byte = payload.len() - 1;
        altered[last_body_byte] ^= 0x20;
        assert_eq!(decode(&keying, &id("a"), &altered, 0), Decoded::Unverified);
        let mut format_1 = payload;
        format_1[0] = 1;
        assert_eq!(decode(&keying, &id("a"), &format_1, 0), Decoded::Unverified, "format 1 has no MAC");
        let unknown_format = keying.seal(&id("a"), u64::MAX, vec![9; 60]);
        assert_eq!(decode(&keying, &id("a"), &unknown_format, 0), Decoded::Unreadable);
    }

    #[test]
    fn format_2_is_laid_out_byte_for_byte() {
        let response = response();
        let value = encode_payload(RecordState::Failed, &Fingerprint::from_parts(1, [9; 32]), &response);
        let fields = response.encode_fields();
        let mut expected = vec![2, 2, 1];
        expected.extend_from_slice(&[9; 32]);
        expected.extend_from_slice(&201u16.to_be_bytes());
        expected.extend_from_slice(&u32::try_from(fields.len()).unwrap().to_be_bytes());
        expected.extend_from_slice(&fields);
        expected.extend_from_slice(b"{\"id\":1}\xff");
        assert_eq!(value, expected, "values already cached must keep decoding");
    }

    #[test]
    fn unreadable_values_are_misses() {
        let value = encode_payload(RecordState::Completed, &Fingerprint::from_parts(1, [9; 32]), &response());
        let decode = decode_payload;
        for cut in 0..CACHE_HEADER_LEN {
            assert_eq!(decode(&value[..cut]), None, "a value cut to {cut} bytes must not decode");
        }
        let mut other_format = value.clone();
        other_format[0] = 1;
        assert_eq!(decode(&other_format), None, "an unknown format is a miss");
        let mut other_state = value.clone();
        other_state[1] = 7;
        assert_eq!(decode(&other_state), None);
        let mut bad_status = value.clone();
        bad_status[35..37].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(decode(&bad_status), None);
        let mut long_fields = value;
        long_fields[37..41].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(decode(&long_fields), None);
        assert_eq!(decode(b""), None);
    }
}
