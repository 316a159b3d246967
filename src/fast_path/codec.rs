//! The cached value of a finished record: a small versioned binary encoding.
//!
//! Format 1: the format, the state (1 completed, 2 failed), the fingerprint's version and digest,
//! the status (u16, big-endian), the length of the encoded headers and trailers (u32,
//! big-endian), those fields ([`StoredResponse::encode_fields`]), then the body to the end.
//! Values already in Redis must keep decoding: change the format only with a new version byte.

use bytes::Bytes;
use http::StatusCode;

use crate::fingerprint::Fingerprint;
use crate::record::{Record, RecordState, StoredResponse};

/// The version byte of the cached value's encoding.
const CACHE_FORMAT: u8 = 1;
/// Version, state, fingerprint version and digest, status, length of the fields.
const CACHE_HEADER_LEN: usize = 1 + 1 + 1 + 32 + 2 + 4;

/// The cached value of a finished record (see the [module docs](self)).
pub(crate) fn encode(state: RecordState, fingerprint: &Fingerprint, response: &StoredResponse) -> Vec<u8> {
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

/// Reads a value written by [`encode`]; `None` for anything else (a miss).
pub(crate) fn decode(value: &[u8]) -> Option<Record> {
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

    #[test]
    fn cached_records_round_trip() {
        let fingerprint = Fingerprint::from_parts(1, [9; 32]);
        for state in [RecordState::Completed, RecordState::Failed] {
            let value = encode(state, &fingerprint, &response());
            assert_eq!(decode(&value), Some(Record::with_response(state, fingerprint, response())));
        }
    }

    #[test]
    fn format_1_is_laid_out_byte_for_byte() {
        let response = response();
        let value = encode(RecordState::Failed, &Fingerprint::from_parts(1, [9; 32]), &response);
        let fields = response.encode_fields();
        let mut expected = vec![1, 2, 1];
        expected.extend_from_slice(&[9; 32]);
        expected.extend_from_slice(&201u16.to_be_bytes());
        expected.extend_from_slice(&u32::try_from(fields.len()).unwrap().to_be_bytes());
        expected.extend_from_slice(&fields);
        expected.extend_from_slice(b"{\"id\":1}\xff");
        assert_eq!(value, expected, "values already cached must keep decoding");
    }

    #[test]
    fn unreadable_values_are_misses() {
        let value = encode(RecordState::Completed, &Fingerprint::from_parts(1, [9; 32]), &response());
        for cut in 0..CACHE_HEADER_LEN {
            assert_eq!(decode(&value[..cut]), None, "a value cut to {cut} bytes must not decode");
        }
        let mut other_format = value.clone();
        other_format[0] = 2;
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
