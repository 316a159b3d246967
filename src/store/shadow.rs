//! What shadow mode records (see [`rollout`](crate::rollout)): one entry per request whose
//! answer enforce mode would have stored, written in batches after the answers have left
//! ([`Store::record_shadow`](super::Store::record_shadow)), and what the store found under each
//! entry's shadow identity.

use http::StatusCode;

use super::{Begin, BeginRequest, Claim, Outcome, Retention, Store, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::{Record, StoredResponse};

/// What shadow mode records of a request once its answer has been produced: its shadow
/// identity, its fingerprint and its answer's status (never the body: a shadow record is never
/// replayed), and whether enforce mode would have stored that answer as a definitive failure.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ShadowEntry {
    /// The request's shadow identity ([`RecordId::shadow`]).
    pub id: RecordId,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The status of the answer the handler produced.
    pub status: StatusCode,
    /// Whether the answer is a stored failure (a `failed` record, its writes rolled back),
    /// rather than a completed one.
    pub failed: bool,
    /// How long the record is kept: as a record of enforce mode.
    pub retention: Retention,
}

impl ShadowEntry {
    /// The entry of a request under `id` with `fingerprint`, answered `status` (a completed
    /// answer), kept for `retention`.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::store::{Retention, ShadowEntry};
    /// use tower_idempotency::{Fingerprint, IdempotencyKey, RecordId, Scope};
    ///
    /// let key = IdempotencyKey::new("k-1").unwrap();
    /// let id = RecordId::new(&Scope::new("tenant"), "orders.create", &key).shadow();
    /// let entry = ShadowEntry::new(id, Fingerprint::from_parts(2, [7; 32]), StatusCode::CREATED, Retention::default());
    /// assert!(!entry.failed);
    /// assert!(entry.as_failure().failed);
    /// ```
    pub fn new(id: RecordId, fingerprint: Fingerprint, status: StatusCode, retention: Retention) -> Self {
        Self { id, fingerprint, status, failed: false, retention }
    }

    /// The same entry for a stored failure: enforce mode would have kept the answer as a
    /// `failed` record.
    pub fn as_failure(mut self) -> Self {
        self.failed = true;
        self
    }

    /// The outcome a claim of this entry settles with: its status, no body.
    pub(crate) fn outcome(&self) -> Outcome {
        let response = StoredResponse::new(self.status, "");
        if self.failed { Outcome::Reject(response) } else { Outcome::Complete(response) }
    }
}

/// What the store found under a [`ShadowEntry`]'s shadow identity when it recorded it.
#[derive(Debug)]
#[non_exhaustive]
pub enum ShadowSeen {
    /// Nothing live held the identity: the entry is recorded (enforce mode would have
    /// executed the request).
    Recorded,
    /// A live record held it, and was kept as it is: enforce mode would have answered the
    /// request from it (a replay, or a refusal for a reused key, an expired key, ...).
    Existing(Record),
    /// A record whose request is still in flight held it (only a store that records shadow
    /// entries with claims can leave one): enforce mode would have answered 409.
    InFlight,
    /// The entry was not recorded: the store failed (the error), or had nothing to say.
    NotRecorded(Option<StoreError>),
}

/// [`Store::record_shadow`]'s default: each entry by a claim of its own that never waits,
/// settled at once with the entry's status.
pub(crate) async fn record_by_claims<St: Store>(store: &St, entries: Vec<ShadowEntry>) -> Vec<ShadowSeen> {
    let mut seen = Vec::with_capacity(entries.len());
    for entry in &entries {
        let request = BeginRequest::new(&entry.id, &entry.fingerprint).retention(entry.retention);
        seen.push(match store.begin(request).await {
            Ok(Begin::Claimed(claim)) => match claim.finish(entry.outcome()).await {
                Ok(()) => ShadowSeen::Recorded,
                Err(error) => ShadowSeen::NotRecorded(Some(StoreError::Unavailable(Box::new(error)))),
            },
            Ok(Begin::Existing(record)) => ShadowSeen::Existing(record),
            Ok(Begin::InFlight { .. }) => ShadowSeen::InFlight,
            Err(error) => ShadowSeen::NotRecorded(Some(error)),
        });
    }
    seen
}
