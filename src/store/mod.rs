//! The store seam: one trait that serves the atomic mode (claim, business write and stored
//! response in one database transaction) and the leased mode (claim committed first with a
//! lease and a fencing token, completion by a fenced update).
//!
//! A store *begins* a claim; the claim is an owned value that lives while the handler runs and
//! is *finished* with the outcome. What the handler needs from the claim (a transaction handle
//! in atomic mode) is handed out by [`Claim::handle`] and travels in the request's extensions.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{Begin, BeginRequest, Claim, Outcome, Retention, Store};
//! use tower_idempotency::{Fingerprint, IdempotencyKey, MemoryStore, RecordId, Scope, StoredResponse};
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! let id = RecordId::new(&Scope::new("t"), "POST /orders", &IdempotencyKey::new("k").unwrap());
//! let fp = Fingerprint::from_parts(1, [7; 32]);
//! let request = BeginRequest::new(&id, &fp);
//!
//! let Begin::Claimed(claim) = store.begin(request.clone()).await.unwrap() else { panic!() };
//! claim.finish(Outcome::Complete(StoredResponse::new(http::StatusCode::CREATED, "done"))).await.unwrap();
//!
//! let Begin::Existing(record) = store.begin(request).await.unwrap() else { panic!() };
//! assert_eq!(record.response.unwrap().body, "done");
//! # });
//! ```

pub mod admin;
mod decide;
pub mod memory;
mod plain;
mod shadow;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) mod sql;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use sql::postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sql::sqlite;

use std::future::Future;
use std::time::Duration;

pub use self::plain::PlainTransaction;
pub use self::shadow::{ShadowEntry, ShadowSeen};

use crate::fingerprint::Fingerprint;
use crate::key::{RecordId, Scope};
use crate::record::{Record, StoredResponse};

pub use admin::{Admin, Backoff, LeaseSweep, RecordInfo, SettleError, SettleRequest, Settlement, StateCounts};

/// What to do with a `processing` record whose lease has expired (its holder died).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StaleLeasePolicy {
    /// Do not re-run blindly: the record becomes `unknown` (the default).
    #[default]
    MarkUnknown,
    /// The route is safe to re-execute (at-least-once with fencing): take the claim over with
    /// a new fencing token; the old holder's late completion is refused.
    Reexecute,
}

/// How a store couples the claim to the handler's business write ([contract §6](crate::contract#6-coupling-to-the-business-write)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CouplingMode {
    /// The claim, the handler's writes and the stored response are one database transaction,
    /// handed to the handler; the response leaves only after COMMIT.
    #[default]
    Atomic,
    /// The claim commits first as `processing` with a lease and a fencing token; the outcome
    /// is written by a fenced update. For handlers that call the outside world.
    Leased,
}

/// How long a record is kept, in every state ([contract §8](crate::contract#8-retention)).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::Retention;
/// let retention = Retention { response: Duration::from_secs(3600), ..Retention::default() };
/// assert_eq!(retention.unsettled, Duration::from_secs(30 * 24 * 3600));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// How long the stored response is replayed after completion (default 24 h).
    pub response: Duration,
    /// How long the tombstone is kept after the record expires (default 7 days), so a late
    /// retry gets `idempotency_key_expired` instead of a second execution.
    pub tombstone: Duration,
    /// How long an unsettled record (`processing` or `unknown`) is kept before it expires into
    /// a tombstone like any other (default 30 days), counted from its claim (or from the moment
    /// its handler marked its outcome unknown). No key is locked forever: after it a retry gets
    /// `idempotency_key_expired`, and after the tombstone time the key is free again.
    pub unsettled: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            response: Duration::from_secs(24 * 3600),
            tombstone: Duration::from_secs(7 * 24 * 3600),
            unsettled: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

impl Retention {
    /// How long a record in `state` keeps answering as it does, from when it reached that
    /// state: the response retention for a finished record, the unsettled one otherwise.
    pub(crate) fn live_for(&self, state: crate::record::RecordState) -> Duration {
        use crate::record::RecordState::{Completed, Failed};
        if matches!(state, Completed | Failed) { self.response } else { self.unsettled }
    }
}

/// Everything a store needs to claim an identity.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BeginRequest<'a> {
    /// The scoped identity.
    pub id: &'a RecordId,
    /// The request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// How long to wait, at most, for an in-flight duplicate to settle.
    pub wait: Duration,
    /// The lease of a leased claim.
    pub lease: Duration,
    /// What to do with an expired lease.
    pub stale_lease: StaleLeasePolicy,
    /// How long the record is kept.
    pub retention: Retention,
    /// The scope the identity was made with, if the caller gives it: stored as a digest so
    /// that [`Admin::inspect_operation`] answers only the scope's own operations.
    pub scope: Option<&'a Scope>,
    /// The operation (route identity) the identity was made with, if the caller gives it:
    /// stored in clear (a route name, never a key) so that reconcilers are found per operation.
    pub operation: Option<&'a str>,
}

impl<'a> BeginRequest<'a> {
    /// A request with no waiting, a 30 s lease, the default stale-lease policy and retention.
    pub fn new(id: &'a RecordId, fingerprint: &'a Fingerprint) -> Self {
        Self {
            id,
            fingerprint,
            wait: Duration::ZERO,
            lease: Duration::from_secs(30),
            stale_lease: StaleLeasePolicy::default(),
            retention: Retention::default(),
            scope: None,
            operation: None,
        }
    }

    /// Names the scope and operation the identity was made with (the layer always does), so
    /// the record can be found by its operation id within its scope and reconciled per
    /// operation.
    pub fn labels(mut self, scope: &'a Scope, operation: &'a str) -> Self {
        self.scope = Some(scope);
        self.operation = Some(operation);
        self
    }

    /// Sets the bounded wait for an in-flight duplicate.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the stale-lease policy.
    pub fn stale_lease(mut self, policy: StaleLeasePolicy) -> Self {
        self.stale_lease = policy;
        self
    }

    /// Sets the retention.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }
}

/// What [`Store::begin`] found.
#[derive(Debug)]
pub enum Begin<C> {
    /// The identity is ours: run the handler, then [`Claim::finish`].
    Claimed(C),
    /// A record already exists (completed, failed, unknown, expired, or in flight with a
    /// different fingerprint): the layer replays or refuses.
    Existing(Record),
    /// A duplicate with the same fingerprint is still in flight after the bounded wait.
    InFlight {
        /// A hint for the client's `Retry-After`.
        retry_after: Duration,
    },
}

/// How a claim is settled.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Commit the business write and store the response for replay (`completed`).
    Complete(StoredResponse),
    /// Roll the business write back and store the response as a definitive rejection
    /// (`failed`), so retries get the same answer.
    Reject(StoredResponse),
    /// Roll back and store nothing: the next retry executes afresh.
    Release,
    /// The handler knows its own outcome is unknown (a downstream call timed out after it was
    /// sent): the record becomes `unknown` (never `completed`), keeping this response for
    /// operators, and retries get `idempotency_outcome_unknown` until it is settled
    /// ([`Admin::settle`], a reconciler). In atomic mode the business write commits with it.
    Unknown(StoredResponse),
}

/// What renewing a lease found ([`Claim::renew`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Renewal {
    /// The lease now runs for the requested time from the renewal.
    Renewed,
    /// The claim no longer holds the record (its lease was taken over, or the record moved on
    /// or was evicted): the outcome cannot be stored.
    Lost,
    /// The claim holds no lease to renew (an atomic claim, fenced by its transaction).
    NotLeased,
}

/// A store could not answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store is unreachable or failed; nothing was claimed.
    #[error("idempotency store unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store answered with data it cannot read (a corrupt or foreign record).
    #[error("idempotency record unreadable: {0}")]
    Corrupt(String),
}

/// Finishing a claim failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinishError {
    /// Another claim holds the identity now, so the outcome was not stored: a leased claim's
    /// lease was taken over (or its record moved on), or an atomic claim's record lost to one
    /// committed first (its business write rolled back).
    #[error("the claim was lost to another; the outcome was not stored")]
    ClaimLost,
    /// The handler still holds the transaction handle: the transaction was rolled back.
    #[error("the transaction handle is still held after the response; rolled back")]
    HandleStillHeld,
    /// COMMIT failed or its result is unknown.
    #[error("commit outcome uncertain")]
    CommitUncertain(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store failed before COMMIT; nothing was committed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A backend that claims identities and keeps records.
///
/// Implementations: [`MemoryStore`](crate::MemoryStore) (leased mode, in process); durable
/// stores implement the same trait, so the layer never learns which backend it talks to.
/// The conformance suite in `testkit::store` checks an implementation against the contract.
pub trait Store: Clone + Send + Sync + 'static {
    /// A held claim.
    type Claim: Claim;

    /// Claims the identity, or reports what is already there. Waits, bounded by
    /// `request.wait`, on a duplicate with the same fingerprint that is in flight.
    fn begin(&self, request: BeginRequest<'_>) -> impl Future<Output = Result<Begin<Self::Claim>, StoreError>> + Send;

    /// Turns records past their retention into tombstones and deletes tombstones past theirs,
    /// at most `limit` records per call. Returns how many records it changed or deleted.
    fn purge(&self, limit: usize) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// A random secret that identifies this store's records (its deployment), generated once
    /// and kept as long as the records: the SQL stores draw it when they create their table,
    /// a [`MemoryStore`](crate::MemoryStore) when it is made. Replicas over the same records
    /// read the same secret; stores with different records have different ones.
    ///
    /// The Redis fast path derives its key namespace and the MAC key of its cached values from
    /// it, so that deployments sharing one Redis never read or trust each other's entries.
    /// The default is `None`: a fast path in front of such a store stays out of Redis unless
    /// the application gives a secret itself (`FastPath::secret`).
    fn deployment_secret(&self) -> impl Future<Output = Result<Option<[u8; 32]>, StoreError>> + Send {
        std::future::ready(Ok(None))
    }

    /// A plain transaction for the old path, handed to the handler while the layer is off or
    /// in shadow mode (see [`rollout`](crate::rollout)): no claim, no stored answer, committed
    /// when the handler is done. Taking a connection waits at most `wait`.
    ///
    /// The default is `None` (a store without transactions, or a leased one: in enforce mode
    /// its handlers get no handle either). The SQL stores in atomic mode begin one on their
    /// pool; `FastPath` passes its store's through.
    fn plain_transaction(
        &self,
        wait: Duration,
    ) -> impl Future<Output = Result<Option<PlainTransaction<<Self::Claim as Claim>::Handle>>, StoreError>> + Send {
        let _ = wait;
        std::future::ready(Ok(None))
    }

    /// Records shadow mode's `entries` (see [`rollout`](crate::rollout)), each under its
    /// shadow identity, and says what it found under each, in their order. The layer calls it
    /// off the requests' path, with a batch of entries whose answers have already left and
    /// whose identities are distinct. An error says the whole batch failed: nothing of it is
    /// known to be recorded.
    ///
    /// An entry takes the place of a forgotten record; any other record already there is kept
    /// and returned as [`ShadowSeen::Existing`] (or [`InFlight`](ShadowSeen::InFlight)). A
    /// recorded entry is a `completed` record (`failed` for [`ShadowEntry::failed`]) with the
    /// status only: no body, no labels, never leased.
    ///
    /// The default claims and settles each entry in turn (a claim that never waits). The SQL
    /// stores write the whole batch with one statement, and read back only the records that
    /// were already there; `FastPath` passes its store's through.
    fn record_shadow(
        &self,
        entries: Vec<ShadowEntry>,
    ) -> impl Future<Output = Result<Vec<ShadowSeen>, StoreError>> + Send {
        let store = self.clone();
        async move { Ok(shadow::record_by_claims(&store, entries).await) }
    }
}

/// A claim on an identity, held while the handler runs.
///
/// Dropping a claim without finishing it (the handler failed, panicked or was cancelled)
/// must not leave an effect without an answer: a transactional claim rolls back, a leased
/// claim gives up its lease so the stale-lease policy applies to the next retry.
pub trait Claim: Send + 'static {
    /// What the handler receives through the request's extensions (a transaction handle in
    /// atomic mode). Use [`NoHandle`] when the store hands nothing out.
    type Handle: Clone + Send + Sync + 'static;

    /// The handle for the handler, if this store hands one out.
    fn handle(&self) -> Option<Self::Handle>;

    /// The fencing token of a leased claim: strictly greater than any earlier claim's on the
    /// same identity. `None` for an atomic claim, which the database transaction itself fences
    /// (nothing of it is visible to anyone until it commits).
    fn fencing_token(&self) -> Option<u64>;

    /// Settles the claim. In atomic mode this stores the response and COMMITs (or rolls back).
    fn finish(self, outcome: Outcome) -> impl Future<Output = Result<(), FinishError>> + Send;

    /// Extends a leased claim's lease to `lease` from now, fenced by its token and checked
    /// against its state: the layer's heartbeat calls it at a fraction of the lease while the
    /// handler runs. The future owns what it needs (it borrows nothing from the claim), so the
    /// heartbeat runs beside the handler.
    ///
    /// The default answers [`Renewal::NotLeased`], which is right for claims without a lease
    /// (atomic ones); a store with leased claims overrides it, or its handlers lose their claim
    /// when they outlive the lease.
    fn renew(&self, lease: Duration) -> impl Future<Output = Result<Renewal, StoreError>> + Send + 'static {
        let _ = lease;
        std::future::ready(Ok(Renewal::NotLeased))
    }
}

/// The handle of a store that hands nothing to the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoHandle {}
