//! Record states, their transitions, and the stored response ([contract §4](crate::contract#4-what-is-stored-and-what-is-replayed), [contract §5](crate::contract#5-record-states)).
//!
//! ```text
//! processing ─► completed | failed | unknown
//! unknown    ─► completed | failed            (only with evidence, by reconciliation)
//! any        ─► expired (tombstone) ─► deleted
//! ```
//!
//! Every state has a retention ([`Retention`](crate::Retention)): an unsettled record
//! (`processing`, `unknown`) expires too, so no key is locked forever. Settling an `unknown`
//! record, by hand or by a reconciler, is [`Admin::settle`](crate::store::Admin::settle); the
//! [`RecoveryWorker`](crate::recovery::RecoveryWorker) settles what requests left behind.
//!
//! Nothing goes back to `processing`, and `completed` never changes except to expire.
//!
//! ```
//! use tower_idempotency::RecordState::*;
//! assert!(Processing.can_become(Completed));
//! assert!(!Completed.can_become(Processing));
//! assert!(!Completed.can_become(Failed));
//! assert!(Unknown.can_become(Failed));
//! ```

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::fingerprint::Fingerprint;

mod fields;

/// Where a record is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordState {
    /// A claim is held and the handler may be running.
    Processing,
    /// The handler's effect committed; the stored response is replayed.
    Completed,
    /// The handler's business rejection was stored; retries get the same error.
    Failed,
    /// An earlier attempt died and nobody knows whether its effect happened.
    Unknown,
    /// Past retention: the response is gone, a tombstone (fingerprint, state) remains.
    Expired,
}

impl RecordState {
    /// Whether a record in this state may move to `next` ([contract §5](crate::contract#5-record-states)).
    pub const fn can_become(self, next: RecordState) -> bool {
        use RecordState::*;
        match (self, next) {
            (Processing, Completed | Failed | Unknown) => true,
            (Unknown, Completed | Failed) => true,
            (Expired, Expired) => false,
            (_, Expired) => true,
            _ => false,
        }
    }

    /// The state's name as stored by the durable stores.
    pub const fn as_str(self) -> &'static str {
        match self {
            RecordState::Processing => "processing",
            RecordState::Completed => "completed",
            RecordState::Failed => "failed",
            RecordState::Unknown => "unknown",
            RecordState::Expired => "expired",
        }
    }

    /// Parses a stored state name.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "processing" => RecordState::Processing,
            "completed" => RecordState::Completed,
            "failed" => RecordState::Failed,
            "unknown" => RecordState::Unknown,
            "expired" => RecordState::Expired,
            _ => return None,
        })
    }
}

/// A response as stored for replay: status, allow-listed headers and trailers, and the exact
/// body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers kept by the allow-list, in their original order.
    pub headers: Fields,
    /// The trailers kept (gRPC's `grpc-status`, `grpc-message` and the like), in order.
    pub trailers: Fields,
    /// The body, byte for byte.
    pub body: Bytes,
}

/// A list of header or trailer fields, in order.
pub type Fields = Vec<(HeaderName, HeaderValue)>;

impl StoredResponse {
    /// A stored response with no headers or trailers.
    pub fn new(status: StatusCode, body: impl Into<Bytes>) -> Self {
        Self { status, headers: Vec::new(), trailers: Vec::new(), body: body.into() }
    }

    /// The headers and trailers in the stores' binary form, as the SQL stores keep them and the
    /// Redis fast path seals them. Format 2: a `0x02` byte, then each field as a tag byte (its
    /// high bit set for a trailer) followed by what the tag does not name: common names and
    /// whole fields (`content-type: application/json`, `grpc-status: 0`, ...) are the tag
    /// alone or the tag and the value; other names and values are LEB128 lengths and bytes.
    ///
    /// ```
    /// use http::{HeaderValue, StatusCode, header};
    /// use tower_idempotency::StoredResponse;
    ///
    /// let mut response = StoredResponse::new(StatusCode::CREATED, "{}");
    /// response.headers.push((header::CONTENT_TYPE, HeaderValue::from_static("application/json")));
    /// let encoded = response.encode_fields();
    /// assert_eq!(encoded.len(), 2, "the format's byte, and one for a JSON content type");
    /// assert_eq!(StoredResponse::decode_fields(&encoded), Some((response.headers, vec![])));
    /// ```
    pub fn encode_fields(&self) -> Vec<u8> {
        fields::encode(&self.headers, &self.trailers)
    }

    /// Reads fields written by [`encode_fields`](Self::encode_fields), in its present format or
    /// the earlier one (records written before keep it), into `(headers, trailers)`; `None` if
    /// the bytes are neither.
    pub fn decode_fields(bytes: &[u8]) -> Option<(Fields, Fields)> {
        fields::decode(bytes)
    }

    /// The stored trailers as a map, if there are any.
    pub fn trailer_map(&self) -> Option<HeaderMap> {
        (!self.trailers.is_empty()).then(|| to_map(&self.trailers))
    }
}

fn to_map(fields: &[(HeaderName, HeaderValue)]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(fields.len());
    for (name, value) in fields {
        map.append(name.clone(), value.clone());
    }
    map
}

/// What a store knows about an identity that is already claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The record's state.
    pub state: RecordState,
    /// The fingerprint of the request that made the record.
    pub fingerprint: Fingerprint,
    /// The stored answer, for `completed` and `failed` records.
    pub response: Option<StoredResponse>,
}

impl Record {
    /// A record with no stored response.
    pub fn new(state: RecordState, fingerprint: Fingerprint) -> Self {
        Self { state, fingerprint, response: None }
    }

    /// A record carrying a stored response.
    pub fn with_response(state: RecordState, fingerprint: Fingerprint, response: StoredResponse) -> Self {
        Self { state, fingerprint, response: Some(response) }
    }
}

#[cfg(test)]
mod tests {
    use super::RecordState::{self, *};

    const ALL: [RecordState; 5] = [Processing, Completed, Failed, Unknown, Expired];

    #[test]
    fn nothing_returns_to_processing_and_completed_only_expires() {
        for state in ALL {
            assert!(!state.can_become(Processing), "{state:?} must not return to processing");
        }
        for next in ALL {
            assert_eq!(Completed.can_become(next), next == Expired, "completed -> {next:?}");
        }
    }

    #[test]
    fn headers_and_trailers_round_trip_through_the_binary_form() {
        let mut response = super::StoredResponse::new(http::StatusCode::CREATED, "x");
        response.headers.push((http::header::LOCATION, http::HeaderValue::from_static("/a")));
        response.headers.push((http::header::LINK, http::HeaderValue::from_bytes(b"<\xff>").unwrap()));
        response.trailers.push((http::HeaderName::from_static("grpc-status"), http::HeaderValue::from_static("0")));
        let encoded = response.encode_fields();
        let decoded = super::StoredResponse::decode_fields(&encoded);
        assert_eq!(decoded, Some((response.headers.clone(), response.trailers.clone())));
        assert_eq!(super::StoredResponse::decode_fields(&encoded[..encoded.len() - 2]), None, "cut in a literal");
        assert_eq!(super::StoredResponse::decode_fields(b"x"), None);
    }

    #[test]
    fn state_names_round_trip() {
        for state in ALL {
            assert_eq!(RecordState::parse(state.as_str()), Some(state));
        }
        assert_eq!(RecordState::parse("nonsense"), None);
    }
}
