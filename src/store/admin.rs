//! Operating on records after the fact: what an operator and the
//! [`RecoveryWorker`](crate::recovery::RecoveryWorker) do with a store ([`Admin`]).
//!
//! - **Inspect** one record by its identity ([`Admin::inspect`]) or, within a scope, by its
//!   operation id ([`Admin::inspect_operation`], what an operation status route serves: a
//!   caller sees only its own). A [`RecordInfo`] never carries the raw key (it is not stored).
//! - **List** `unknown` records oldest first, bounded ([`Admin::list_unknown`]), and **count**
//!   records by state ([`Admin::counts`]).
//! - **Settle** an `unknown` record with a response, or release it so the next retry executes
//!   ([`Admin::settle`]): a fenced, state-checked transition. A record that is not `unknown` is
//!   refused with [`SettleError::NotUnknown`]; one whose token moved on, with
//!   [`SettleError::Superseded`]. A settlement that loses a race changes nothing.
//! - **Evict** a record, whatever its state ([`Admin::evict`]).
//! - **Recover**: turn `processing` records whose lease ran out into `unknown` (or release them
//!   when their route was declared re-executable), bounded ([`Admin::sweep_leases`]); and take a
//!   batch of due `unknown` records of one operation for its reconciler, pushing each one's next
//!   look back by its own backoff ([`Admin::checkout_unknown`]), so instances running at once
//!   never hand one record to two reconcilers within its backoff.
//!
//! ```
//! use tower_idempotency::store::{Admin, Begin, BeginRequest, Claim, Outcome, SettleRequest, Settlement, Store};
//! use tower_idempotency::{Fingerprint, IdempotencyKey, MemoryStore, RecordId, RecordState, Scope, StoredResponse};
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! let scope = Scope::new("tenant-1");
//! let id = RecordId::new(&scope, "POST /charges", &IdempotencyKey::new("k").unwrap());
//! let fp = Fingerprint::from_parts(1, [7; 32]);
//! let request = BeginRequest::new(&id, &fp).labels(&scope, "POST /charges");
//! let Begin::Claimed(claim) = store.begin(request).await.unwrap() else { panic!() };
//! // The downstream call timed out after it was sent: nobody knows whether it happened.
//! claim.finish(Outcome::Unknown(StoredResponse::new(http::StatusCode::GATEWAY_TIMEOUT, ""))).await.unwrap();
//!
//! let info = store.inspect_operation(&scope, &id.operation_id()).await.unwrap().unwrap();
//! assert_eq!(info.state, RecordState::Unknown);
//! assert!(store.inspect_operation(&Scope::new("tenant-2"), &id.operation_id()).await.unwrap().is_none());
//!
//! // The operator checked with the provider: the charge went through.
//! let settled = Settlement::Completed(StoredResponse::new(http::StatusCode::CREATED, "charged"));
//! store.settle(SettleRequest::new(&id, settled).fenced(info.fencing_token)).await.unwrap();
//! assert_eq!(store.inspect(&id).await.unwrap().unwrap().state, RecordState::Completed);
//! # });
//! ```

use std::future::Future;
use std::time::{Duration, SystemTime};

use http::{HeaderValue, StatusCode};

use super::{Retention, StoreError};
use crate::key::{RecordId, Scope};
use crate::record::{RecordState, StoredResponse};

/// What a store shows of one record: never the raw key (it is not stored), nor the stored body.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// The scoped identity (a digest: safe to log).
    pub id: RecordId,
    /// The record's state, retention applied (a record past it reads `expired`).
    pub state: RecordState,
    /// The operation (route identity) it was claimed under, if the claim named it (records
    /// written before this was kept have none, nor do operations longer than 512 bytes).
    pub operation: Option<String>,
    /// The operation id handlers see ([`IdempotencyContext::operation_id`](crate::IdempotencyContext::operation_id)).
    pub operation_id: String,
    /// The version of the fingerprint stored with it.
    pub fingerprint_version: u8,
    /// The fencing token of the claim that made it (0 for records of atomic claims).
    pub fencing_token: u64,
    /// When it was claimed.
    pub created_at: SystemTime,
    /// When it last changed.
    pub updated_at: SystemTime,
    /// When it stops answering as it does now and becomes a tombstone (for an `expired`
    /// record: `None`).
    pub expires_at: Option<SystemTime>,
    /// When it is forgotten, and its key free again.
    pub forget_at: Option<SystemTime>,
    /// Until when a `processing` record's lease runs.
    pub lease_until: Option<SystemTime>,
    /// The stored response's status, if it keeps one.
    pub status: Option<StatusCode>,
    /// The stored response's `Location` header, if any.
    pub location: Option<HeaderValue>,
    /// How often a reconciler was given the record so far.
    pub attempts: u32,
}

impl RecordInfo {
    /// How long ago it was claimed, as of now (zero if the clocks disagree).
    pub fn age(&self) -> Duration {
        SystemTime::now().duration_since(self.created_at).unwrap_or_default()
    }
}

/// How many records a store holds in each state, retention applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateCounts {
    /// Claimed, the handler may be running (or died: its lease tells).
    pub processing: u64,
    /// Completed, replayed.
    pub completed: u64,
    /// Stored failures, replayed.
    pub failed: u64,
    /// Outcome unknown, waiting for a settlement.
    pub unknown: u64,
    /// Tombstones.
    pub expired: u64,
    /// How long ago the oldest `unknown` record was claimed (`None`: there is none).
    pub oldest_unknown: Option<Duration>,
}

impl StateCounts {
    /// These counts with the open states (`processing`, `unknown` and the oldest unknown)
    /// taken from `open`.
    pub(crate) fn with_open_of(self, open: &StateCounts) -> StateCounts {
        StateCounts { processing: open.processing, unknown: open.unknown, oldest_unknown: open.oldest_unknown, ..self }
    }
}

/// How an `unknown` record is settled, by hand or by a reconciler.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// The effect happened: store this answer as `completed`; retries replay it.
    Completed(StoredResponse),
    /// The effect was refused: store this answer as `failed`; retries replay it.
    Failed(StoredResponse),
    /// The effect surely did not happen: release the record, so the next retry executes.
    NotExecuted,
}

/// One settlement of an `unknown` record.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SettleRequest<'a> {
    /// The record.
    pub id: &'a RecordId,
    /// What it becomes.
    pub settlement: Settlement,
    /// The fencing token the record must still carry (`None`: whatever it carries, as long as
    /// the record is `unknown`). Give the token from the [`RecordInfo`] the decision was made on.
    pub fencing_token: Option<u64>,
    /// How long a settled answer is replayed, and its tombstone kept.
    pub retention: Retention,
}

impl<'a> SettleRequest<'a> {
    /// Settles `id` as `settlement`, unfenced, with the default retention.
    pub fn new(id: &'a RecordId, settlement: Settlement) -> Self {
        Self { id, settlement, fencing_token: None, retention: Retention::default() }
    }

    /// Settles only if the record still carries `token`.
    pub fn fenced(mut self, token: u64) -> Self {
        self.fencing_token = Some(token);
        self
    }

    /// The retention of the settled answer.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }
}

/// A settlement was refused; nothing changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettleError {
    /// No such record (or it is past its tombstone time).
    #[error("no idempotency record under this identity")]
    NotFound,
    /// The record is not `unknown` (it is in the given state): only an unknown outcome is
    /// settled after the fact.
    #[error("the idempotency record is {} , not unknown", .0.as_str())]
    NotUnknown(RecordState),
    /// The record carries another fencing token than the one the settlement names.
    #[error("the idempotency record was superseded")]
    Superseded,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What [`Admin::sweep_leases`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseSweep {
    /// `processing` records whose lease ran out, now `unknown`.
    pub marked_unknown: usize,
    /// `processing` records whose lease ran out on a re-executable route, released.
    pub released: usize,
}

/// How long a reconciler waits before it is given the same `unknown` record again: `first`
/// after the first look, doubling per look, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first look (default 30 s).
    pub first: Duration,
    /// The longest wait (default 1 h).
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { first: Duration::from_secs(30), max: Duration::from_secs(3600) }
    }
}

impl Backoff {
    /// The wait after the look numbered `attempts` (1 for the first).
    pub fn after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first.saturating_mul(1 << doublings).min(self.max)
    }
}

/// Operations on a store's records after the fact: inspection, settlement, eviction and
/// recovery. See the [module docs](self).
///
/// A trait of its own, apart from [`Store`](super::Store), so that stores made outside this
/// crate keep compiling; every store of this crate implements it, and so does
/// [`FastPath`](crate::FastPath) over one that does (forgetting its cached copy of any record
/// that changes).
pub trait Admin: Clone + Send + Sync + 'static {
    /// The record of `id`, if there is one.
    fn inspect(&self, id: &RecordId) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send;

    /// The record of `scope` whose operation id is `operation_id`; `None` for another scope's,
    /// a malformed id, or none: the same answer, so a caller learns nothing of others' records.
    fn inspect_operation(
        &self,
        scope: &Scope,
        operation_id: &str,
    ) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send;

    /// At most `limit` `unknown` records, oldest (by claim) first.
    fn list_unknown(&self, limit: usize) -> impl Future<Output = Result<Vec<RecordInfo>, StoreError>> + Send;

    /// How many records are in each state.
    ///
    /// The SQL stores count every record of the table for it: on a table of billions that is a
    /// scan of the whole table. [`open_counts`](Self::open_counts) counts only the records still
    /// open, which an operator watches, on their own index.
    fn counts(&self) -> impl Future<Output = Result<StateCounts, StoreError>> + Send;

    /// How many records are `processing` and `unknown`, and how old the oldest `unknown` is,
    /// as [`counts`](Self::counts) tells them (retention applied); the other states are
    /// left at zero. The SQL stores find them on the index of open records, so the price is
    /// that of the open records, whatever the size of the table.
    ///
    /// The default takes them from [`counts`](Self::counts).
    fn open_counts(&self) -> impl Future<Output = Result<StateCounts, StoreError>> + Send {
        async move { Ok(StateCounts::default().with_open_of(&self.counts().await?)) }
    }

    /// Settles an `unknown` record: a fenced, state-checked transition.
    fn settle(&self, request: SettleRequest<'_>) -> impl Future<Output = Result<(), SettleError>> + Send;

    /// Deletes the record of `id`, whatever its state. Whether there was one. A holder still
    /// running loses its claim (its outcome is refused as a lost claim).
    fn evict(&self, id: &RecordId) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Turns at most `limit` `processing` records whose lease ran out into `unknown`, or
    /// releases them when their claim declared the route re-executable
    /// ([`StaleLeasePolicy::Reexecute`](super::StaleLeasePolicy::Reexecute)). Each a fenced,
    /// state-checked transition.
    fn sweep_leases(&self, limit: usize) -> impl Future<Output = Result<LeaseSweep, StoreError>> + Send;

    /// Takes at most `limit` `unknown` records of `operation` that are due for a look, oldest
    /// first, counting the look and pushing each one's next look back by `backoff` (so that no
    /// other worker is given it meanwhile).
    fn checkout_unknown(
        &self,
        operation: &str,
        limit: usize,
        backoff: Backoff,
    ) -> impl Future<Output = Result<Vec<RecordInfo>, StoreError>> + Send;
}

/// The longest operation name a store keeps with a record (longer ones, such as a method and a
/// long raw path used as the operation, are not kept: such records are found by their
/// identity, never handed to a reconciler).
pub(crate) const MAX_KEPT_OPERATION: usize = 512;

/// The operation name a store keeps for `operation`.
pub(crate) fn kept_operation(operation: Option<&str>) -> Option<&str> {
    operation.filter(|op| op.len() <= MAX_KEPT_OPERATION && !op.contains('\0'))
}

/// Parses an operation id (`8-4-4-4-12` lowercase hex) back into its 16 bytes.
pub(crate) fn parse_operation_id(text: &str) -> Option<[u8; 16]> {
    let bytes = text.as_bytes();
    if bytes.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    let mut n = 0;
    let mut high: Option<u8> = None;
    for (i, &b) in bytes.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if b != b'-' {
                return None;
            }
            continue;
        }
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => return None,
        };
        match high.take() {
            None => high = Some(digit),
            Some(h) => {
                out[n] = (h << 4) | digit;
                n += 1;
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_ids_parse_back_to_their_bytes_and_nothing_else_does() {
        let id = RecordId::new(&Scope::new("s"), "op", &crate::IdempotencyKey::new("k").unwrap());
        assert_eq!(parse_operation_id(&id.operation_id()), Some(id.operation_id_bytes()));
        for bad in ["", "not-an-id", &id.operation_id().to_uppercase(), &id.operation_id().replace('-', "_")] {
            assert_eq!(parse_operation_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_bound() {
        let backoff = Backoff { first: Duration::from_secs(1), max: Duration::from_secs(5) };
        let waits: Vec<_> = (1..=5).map(|n| backoff.after(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 5, 5]);
        assert_eq!(backoff.after(u32::MAX), Duration::from_secs(5));
    }
}
