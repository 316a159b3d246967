//! Record states, their transitions, and the stored response (CONTRACT §4, §5).
//!
//! ```text
//! processing ─► completed | failed | unknown
//! unknown    ─► completed | failed            (only with evidence, by reconciliation)
//! any        ─► expired (tombstone) ─► deleted
//! ```
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
    /// Whether a record in this state may move to `next` (CONTRACT §5).
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

/// A response as stored for replay: status, allow-listed headers and the exact body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers kept by the allow-list, in their original order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, byte for byte.
    pub body: Bytes,
}

impl StoredResponse {
    /// A stored response with no headers.
    pub fn new(status: StatusCode, body: impl Into<Bytes>) -> Self {
        Self { status, headers: Vec::new(), body: body.into() }
    }

    /// The stored headers as a map.
    pub fn header_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.headers.len());
        for (name, value) in &self.headers {
            map.append(name.clone(), value.clone());
        }
        map
    }
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
    fn state_names_round_trip() {
        for state in ALL {
            assert_eq!(RecordState::parse(state.as_str()), Some(state));
        }
        assert_eq!(RecordState::parse("nonsense"), None);
    }
}
