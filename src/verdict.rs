//! What the layer makes of a record that is already there: is it this request's, and what
//! does the request get from it.

use crate::fingerprint::Fingerprint;
use crate::record::{Record, RecordState};
use crate::telemetry::RequestResult;

/// Whether a stored record's fingerprint is this request's: compared as they are when both have
/// the same version, else with the request's fingerprint at the record's version (computed only
/// then, by `at_version`). A record of a version this crate does not know is another request.
pub(crate) fn same_request(
    stored: &Fingerprint,
    request: &Fingerprint,
    at_version: impl FnOnce(u8) -> Option<Fingerprint>,
) -> bool {
    if stored.version() == request.version() {
        return stored == request;
    }
    at_version(stored.version()).is_some_and(|request| request == *stored)
}

/// What the layer does with a record that is already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A tombstone: `idempotency_key_expired`.
    Expired,
    /// Another request's record: `idempotency_key_reused`.
    Reused,
    /// This request's stored answer: replay it.
    Replay,
    /// An earlier attempt's outcome is unknown.
    Unknown,
    /// Still in flight.
    InFlight,
}

impl Verdict {
    /// The verdict on `record`, given whether it is this request's ([`same_request`]).
    pub(crate) fn of(record: &Record, same_request: bool) -> Self {
        match record.state {
            RecordState::Expired => Verdict::Expired,
            _ if !same_request => Verdict::Reused,
            RecordState::Completed | RecordState::Failed if record.response.is_some() => Verdict::Replay,
            RecordState::Unknown => Verdict::Unknown,
            _ => Verdict::InFlight,
        }
    }

    /// What became of the request.
    pub(crate) fn result(self) -> RequestResult {
        match self {
            Verdict::Expired => RequestResult::KeyExpired,
            Verdict::Reused => RequestResult::KeyReused,
            Verdict::Replay => RequestResult::Replayed,
            Verdict::Unknown => RequestResult::OutcomeUnknown,
            Verdict::InFlight => RequestResult::InFlight,
        }
    }
}
