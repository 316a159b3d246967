//! The one decision every store makes when a record stands in the way of a claim.
//!
//! Each store reads what it keeps (a map entry, a table row) into a [`Found`], asks [`decide`]
//! what it means for this request, and carries the answer out in its own way: a claim, an
//! answer from the record, a fenced move to `unknown`, a take-over, or a bounded wait.

use std::time::Duration;

use super::{Outcome, StaleLeasePolicy};
use crate::fingerprint::Fingerprint;
use crate::record::{RecordState, StoredResponse};

/// What a store found under the identity, with the clock comparisons already made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    /// The record's state as stored.
    pub(crate) state: RecordState,
    /// The fingerprint of the request that made the record.
    pub(crate) fingerprint: Fingerprint,
    /// How long a `processing` record's lease has left (zero: run out).
    pub(crate) lease_left: Duration,
    /// Whether the record is past its retention (its response's, or an unsettled record's).
    pub(crate) response_expired: bool,
    /// Whether the record is past its tombstone time, as good as absent.
    pub(crate) forgotten: bool,
}

/// What to do about a record in the way of a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing live is in the way (the record is forgotten): claim the identity.
    Claim,
    /// Answer from the record, as a record in this state: replay or refuse.
    Answer(RecordState),
    /// The leased holder died and the route must not run twice: move the record to `unknown`
    /// (fenced by the holder's token), then answer from it.
    MarkUnknown,
    /// The leased holder died and the route is safe to re-execute: take the claim over with a
    /// new fencing token.
    TakeOver,
    /// The leased holder is alive: wait for it, at most this long, then look again.
    Wait {
        /// How long the holder's lease has left.
        lease_left: Duration,
    },
}

/// Decides what `found` means for a request with `fingerprint` under `policy`.
pub(crate) fn decide(found: &Found, fingerprint: &Fingerprint, policy: StaleLeasePolicy) -> Decision {
    if found.forgotten {
        return Decision::Claim;
    }
    // Every state has a retention: a record past it is a tombstone, whatever it was.
    if found.state == RecordState::Expired || found.response_expired {
        return Decision::Answer(RecordState::Expired);
    }
    if found.fingerprint != *fingerprint || found.state != RecordState::Processing {
        return Decision::Answer(found.state);
    }
    if !found.lease_left.is_zero() {
        return Decision::Wait { lease_left: found.lease_left };
    }
    match policy {
        StaleLeasePolicy::MarkUnknown => Decision::MarkUnknown,
        StaleLeasePolicy::Reexecute => Decision::TakeOver,
    }
}

/// What a claim's outcome leaves under its identity: `None` for a release (no record); else
/// the state its `processing` record moves to, checked against the state machine of
/// [`RecordState::can_become`], and the response it stores.
pub(crate) fn stored_outcome(outcome: Outcome) -> Option<(RecordState, StoredResponse)> {
    match outcome {
        Outcome::Release => None,
        Outcome::Complete(response) => Some((COMPLETED, response)),
        Outcome::Reject(response) => Some((FAILED, response)),
        Outcome::Unknown(response) => Some((ABANDONED, response)),
    }
}

/// The state of a claim that stored its answer.
const COMPLETED: RecordState = {
    assert!(RecordState::Processing.can_become(RecordState::Completed));
    RecordState::Completed
};

/// The state of a claim that stored a definitive rejection.
const FAILED: RecordState = {
    assert!(RecordState::Processing.can_become(RecordState::Failed));
    RecordState::Failed
};

/// The state a dead holder's record moves to, checked against the state machine.
pub(crate) const ABANDONED: RecordState = {
    assert!(RecordState::Processing.can_become(RecordState::Unknown));
    RecordState::Unknown
};

/// The state a record past its retention moves to, checked against the state machine.
pub(crate) const EXPIRED: RecordState = {
    assert!(RecordState::Completed.can_become(RecordState::Expired));
    assert!(RecordState::Failed.can_become(RecordState::Expired));
    assert!(RecordState::Processing.can_become(RecordState::Expired));
    assert!(RecordState::Unknown.can_become(RecordState::Expired));
    RecordState::Expired
};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Decision, Found, decide};
    use crate::fingerprint::Fingerprint;
    use crate::record::RecordState::{self, *};
    use crate::store::StaleLeasePolicy::{MarkUnknown, Reexecute};

    const MINE: Fingerprint = Fingerprint::from_parts(1, [1; 32]);
    const OTHER: Fingerprint = Fingerprint::from_parts(1, [2; 32]);

    fn found(state: RecordState, fingerprint: Fingerprint) -> Found {
        Found { state, fingerprint, lease_left: Duration::ZERO, response_expired: false, forgotten: false }
    }

    #[test]
    fn a_forgotten_record_is_claimed_again_whatever_it_was() {
        for state in [Processing, Completed, Failed, Unknown, Expired] {
            let record = Found { forgotten: true, ..found(state, OTHER) };
            assert_eq!(decide(&record, &MINE, MarkUnknown), Decision::Claim);
        }
    }

    #[test]
    fn finished_records_answer_and_expire_with_their_response() {
        assert_eq!(decide(&found(Completed, MINE), &MINE, MarkUnknown), Decision::Answer(Completed));
        assert_eq!(decide(&found(Failed, OTHER), &MINE, MarkUnknown), Decision::Answer(Failed));
        let expired = Found { response_expired: true, ..found(Completed, OTHER) };
        assert_eq!(decide(&expired, &MINE, MarkUnknown), Decision::Answer(Expired));
        assert_eq!(decide(&found(Expired, MINE), &MINE, Reexecute), Decision::Answer(Expired));
    }

    #[test]
    fn unsettled_records_expire_too() {
        for state in [Processing, Unknown] {
            let past = Found { response_expired: true, lease_left: Duration::from_secs(1), ..found(state, MINE) };
            assert_eq!(decide(&past, &MINE, MarkUnknown), Decision::Answer(Expired), "{state:?}");
        }
    }

    #[test]
    fn a_processing_record_waits_is_marked_or_is_taken_over() {
        let live = Found { lease_left: Duration::from_millis(5), ..found(Processing, MINE) };
        assert_eq!(decide(&live, &MINE, MarkUnknown), Decision::Wait { lease_left: Duration::from_millis(5) });
        assert_eq!(decide(&found(Processing, MINE), &MINE, MarkUnknown), Decision::MarkUnknown);
        assert_eq!(decide(&found(Processing, MINE), &MINE, Reexecute), Decision::TakeOver);
        assert_eq!(decide(&live, &OTHER, Reexecute), Decision::Answer(Processing));
    }
}
