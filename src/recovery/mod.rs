//! Recovery: the [`RecoveryWorker`] an application spawns to settle what requests left behind,
//! and the [`Reconciler`]s it asks, per operation, for evidence.
//!
//! One pass ([`RecoveryWorker::run_once`]), in bounded batches:
//!
//! 1. **Stale leases.** `processing` records whose lease ran out (their holder died: a crash,
//!    a kill, a lost connection) become `unknown`, or are released when their claim declared
//!    the route re-executable ([`StaleLeasePolicy::Reexecute`](crate::StaleLeasePolicy::Reexecute)).
//! 2. **Reconciliation.** For every operation with a reconciler, the due `unknown` records,
//!    oldest first, are given to it; it looks for evidence (the business table, the
//!    downstream's status) and answers a [`Reconciliation`]. Each answer is a fenced,
//!    state-checked settlement ([`Admin::settle`]): one that loses a race changes nothing. A
//!    record still unknown is looked at again after its backoff, which doubles per look
//!    ([`Backoff`]).
//! 3. **Retention.** Records past their retention become tombstones and tombstones past theirs
//!    are deleted ([`Store::purge`]), at most [`purge_rate`](RecoveryWorker::purge_rate) a
//!    second if one is given.
//! 4. **Counts.** The records in each state ([`Admin::counts`]): a census of the whole table,
//!    every pass by default. On a large table, give it an interval of its own
//!    ([`census_every`](RecoveryWorker::census_every)) or none
//!    ([`without_census`](RecoveryWorker::without_census)): the passes between count only the
//!    open records, `processing` and `unknown` ([`Admin::open_counts`], on their own index).
//!
//! It reports what it did ([`RecoveryReport`]) and, with feature `metrics`, emits it through
//! the `metrics` facade (names and labels are a published interface):
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `idempotency_recovery_total` | counter | `action`: `marked_unknown`, `reconciled`, `released`, `purged` |
//! | `idempotency_records` | gauge | `state`: `processing`, `completed`, `failed`, `unknown`, `expired` |
//! | `idempotency_oldest_unknown_seconds` | gauge | — (0 when there is none) |
//!
//! `processing`, `unknown` and the oldest unknown are set every pass; `completed`, `failed`
//! and `expired` at each census.
//!
//! **Several instances at once.** Every step is safe to run from several processes over one
//! store. PostgreSQL picks each batch `FOR UPDATE SKIP LOCKED`, so concurrent workers take
//! disjoint batches; SQLite runs each batch as one write statement under its single write lock,
//! so workers take turns. Handing a record to a reconciler pushes its next look back by its
//! backoff in the same statement, so two workers do not ask about one record within it; and a
//! settlement names the fencing token and the state it expects, so a record is never settled
//! twice.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::recovery::{Reconciliation, RecoveryWorker};
//! use tower_idempotency::MemoryStore;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! let worker = RecoveryWorker::new(store)
//!     .every(Duration::from_secs(60))
//!     .reconciler("POST /charges", |record: tower_idempotency::store::RecordInfo| async move {
//!         // Ask the payment provider about the charge keyed by this operation id ...
//!         let _ = record.operation_id;
//!         Reconciliation::StillUnknown
//!     });
//! let report = worker.run_once().await.unwrap();
//! assert_eq!(report.marked_unknown, 0);
//!
//! // In a service: run it until shutdown.
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let task = tokio::spawn(worker.run(async { let _ = stopped.await; }));
//! stop.send(()).unwrap();
//! task.await.unwrap();
//! # });
//! ```

#[cfg(feature = "metrics")]
mod metrics;
mod pace;
mod reconcile;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use self::pace::Pace;
use crate::join;
use crate::record::StoredResponse;
use crate::store::{Admin, Backoff, RecordInfo, Retention, StateCounts, Store, StoreError};

/// The counter of what the worker did, labelled `action` (`marked_unknown`, `reconciled`,
/// `released`, `purged`).
pub const RECOVERY_TOTAL: &str = "idempotency_recovery_total";

/// The gauge of records per state, labelled `state`, set from the store's counts after each pass.
pub const RECORDS: &str = "idempotency_records";

/// The gauge of the oldest `unknown` record's age in seconds (0 when there is none).
pub const OLDEST_UNKNOWN_SECONDS: &str = "idempotency_oldest_unknown_seconds";

/// A reconciler's answer about one `unknown` record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reconciliation {
    /// The effect happened: the record becomes `completed` with this answer, replayed to
    /// retries.
    Completed(StoredResponse),
    /// The effect was refused: the record becomes `failed` with this answer.
    Failed(StoredResponse),
    /// The effect surely did not happen (safe to run again): the record is released, and the
    /// next retry executes.
    NotExecuted,
    /// No evidence either way (yet): asked again after the record's backoff.
    StillUnknown,
}

/// Looks for the evidence of one operation's `unknown` records. Given the record (its identity,
/// operation id, fencing token, age), it answers a [`Reconciliation`].
///
/// Any `Fn(RecordInfo) -> impl Future<Output = Reconciliation>` is one. A reconciler that
/// cannot reach its evidence answers [`Reconciliation::StillUnknown`].
pub trait Reconciler: Send + Sync + 'static {
    /// Looks at `record`.
    fn reconcile(&self, record: RecordInfo) -> Pin<Box<dyn Future<Output = Reconciliation> + Send + 'static>>;
}

impl<F, Fut> Reconciler for F
where
    F: Fn(RecordInfo) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Reconciliation> + Send + 'static,
{
    fn reconcile(&self, record: RecordInfo) -> Pin<Box<dyn Future<Output = Reconciliation> + Send + 'static>> {
        Box::pin(self(record))
    }
}

/// What one or more passes of the worker did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryReport {
    /// Stale `processing` records turned `unknown`.
    pub marked_unknown: usize,
    /// Records released: stale leases of re-executable routes, and `unknown` records a
    /// reconciler found not executed.
    pub released: usize,
    /// `unknown` records a reconciler settled as `completed` or `failed`.
    pub reconciled: usize,
    /// `unknown` records a reconciler could not decide (or that did not answer in time).
    pub still_unknown: usize,
    /// Settlements that lost a race (the record moved on meanwhile): nothing changed.
    pub superseded: usize,
    /// Records turned into tombstones or deleted past their retention.
    pub purged: usize,
    /// The store's counts after the pass (of the last pass, for a sum of passes): on a pass
    /// without a census, `processing`, `unknown` and the oldest unknown as of the pass, the
    /// other states as of the last census (zero if there was none).
    pub counts: Option<StateCounts>,
    /// Whether the (last) pass took a census: counted every record by state, not only the open
    /// ones.
    pub census: bool,
}

impl RecoveryReport {
    fn add(&mut self, other: &RecoveryReport) {
        self.marked_unknown += other.marked_unknown;
        self.released += other.released;
        self.reconciled += other.reconciled;
        self.still_unknown += other.still_unknown;
        self.superseded += other.superseded;
        self.purged += other.purged;
        self.counts = other.counts.or(self.counts);
        self.census = other.census;
    }
}

/// The task that recovers stale leases, reconciles `unknown` records and purges past retention.
/// See the [module docs](self).
pub struct RecoveryWorker<St> {
    store: St,
    reconcilers: Vec<(Arc<str>, Arc<dyn Reconciler>)>,
    batch: usize,
    /// How many records one purge call takes; `None`: [`batch`](Self::batch).
    purge_batch: Option<usize>,
    /// How fast the purge may go; `None`: as fast as the store answers.
    purge_pace: Option<Pace>,
    every: Duration,
    backoff: Backoff,
    retention: Retention,
    reconcile_timeout: Duration,
    concurrency: usize,
    /// How often a pass counts every record; `None`: never.
    census_every: Option<Duration>,
    /// When the last census was taken, and what it counted.
    last_census: Mutex<Option<(Instant, StateCounts)>>,
}

impl<St: std::fmt::Debug> std::fmt::Debug for RecoveryWorker<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let operations: Vec<&str> = self.reconcilers.iter().map(|(op, _)| &**op).collect();
        f.debug_struct("RecoveryWorker")
            .field("store", &self.store)
            .field("reconcilers", &operations)
            .field("batch", &self.batch)
            .field("purge_batch", &self.purge_batch.unwrap_or(self.batch))
            .field("purge_rate", &self.purge_pace.as_ref().map(Pace::records_per_second))
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl<St: Store + Admin> RecoveryWorker<St> {
    /// A worker over `store`: batches of 500, a pass every 60 s, no reconcilers, reconciler
    /// backoff from 30 s to 1 h, settled answers kept for the default retention.
    pub fn new(store: St) -> Self {
        Self {
            store,
            reconcilers: Vec::new(),
            batch: 500,
            purge_batch: None,
            purge_pace: None,
            every: Duration::from_secs(60),
            backoff: Backoff::default(),
            retention: Retention::default(),
            reconcile_timeout: Duration::from_secs(30),
            concurrency: 8,
            census_every: Some(Duration::ZERO),
            last_census: Mutex::new(None),
        }
    }

    /// Registers `reconciler` for the `unknown` records of `operation` (the route identity the
    /// layer names records with: the explicit operation name, else method and route template).
    /// A second reconciler for the same operation replaces the first.
    pub fn reconciler(mut self, operation: impl Into<Arc<str>>, reconciler: impl Reconciler) -> Self {
        let operation = operation.into();
        self.reconcilers.retain(|(op, _)| *op != operation);
        self.reconcilers.push((operation, Arc::new(reconciler)));
        self
    }

    /// How many records one store call handles at most (default 500; at least 1).
    pub fn batch(mut self, records: usize) -> Self {
        self.batch = records.max(1);
        self
    }

    /// How many records one call of the purge takes at most (default: [`batch`](Self::batch);
    /// at least 1), apart from the batches of leases and reconciliation.
    ///
    /// On a PostgreSQL store on hash partitions each call first looks into every partition for
    /// rows due, one statement whatever the batch, so small batches pay it often: with 64
    /// partitions, deleting in calls of 500 cost PostgreSQL about 13 µs of CPU a record and in
    /// calls of 5,000 about 3 µs (`docs/scale.md`, "What a call of the purge costs on
    /// partitions"). A batch is one statement holding its rows' locks while it runs.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// use tower_idempotency::recovery::RecoveryWorker;
    ///
    /// let worker = RecoveryWorker::new(MemoryStore::new()).purge_batch(5_000);
    /// ```
    pub fn purge_batch(mut self, records: usize) -> Self {
        self.purge_batch = Some(records.max(1));
        self
    }

    /// The most records a second the purge takes (default: no limit, each call as soon as the
    /// one before has answered; at least 1). A call that purged `n` records holds the next back
    /// until `n / records_per_second` seconds after its own start, within a pass and from one
    /// pass to the next, so a backlog (the first pass after a deployment, a day's records
    /// reaching their retention at once) is worked off at this rate instead of flat out.
    ///
    /// Flat out, the purge takes all the database's CPU it can get from serving: on the 2-core
    /// machine of `docs/scale.md` ("Purge"), serving fell by 31 % to 64 % while it ran.
    /// Give a few times the rate at which records are created, and a
    /// [`purge_batch`](Self::purge_batch) that it divides into several calls a second.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// use tower_idempotency::recovery::RecoveryWorker;
    ///
    /// // Calls of 5,000 records, ten a second at most.
    /// let worker = RecoveryWorker::new(MemoryStore::new()).purge_batch(5_000).purge_rate(50_000);
    /// # let _ = worker;
    /// ```
    pub fn purge_rate(mut self, records_per_second: u32) -> Self {
        self.purge_pace = Some(Pace::new(records_per_second));
        self
    }

    /// How often [`run`](Self::run) makes a pass (default 60 s). A pass that finds nothing to
    /// do still sends its statements (the lease sweep, the purge's look for rows due, the
    /// counts: on 64 PostgreSQL partitions the purge's look alone costs the database 2–4 ms of
    /// CPU), so a short interval costs the database even when there is nothing to do. A pass
    /// that keeps finding whole batches does not end, so `every` does not slow a backlog; see
    /// [`purge_rate`](Self::purge_rate) for that.
    pub fn every(mut self, interval: Duration) -> Self {
        self.every = interval;
        self
    }

    /// The backoff between two looks at one `unknown` record (default 30 s doubling to 1 h).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How long a reconciled answer is replayed, and its tombstone kept (default: the default
    /// [`Retention`]). Give the routes' own retention.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// How long one reconciler call may take (default 30 s); one that takes longer counts as
    /// still unknown.
    pub fn reconcile_timeout(mut self, timeout: Duration) -> Self {
        self.reconcile_timeout = timeout;
        self
    }

    /// How many reconciler calls run at once (default 8; at least 1).
    pub fn concurrency(mut self, calls: usize) -> Self {
        self.concurrency = calls.max(1);
        self
    }

    /// How often a pass takes a census, counting every record by state ([`Admin::counts`])
    /// (default: every pass). The passes between count the open records alone
    /// ([`Admin::open_counts`]). The SQL stores' census reads the whole records table: on a
    /// table of hundreds of millions of records, give it hours, or see
    /// [`without_census`](Self::without_census).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::MemoryStore;
    /// use tower_idempotency::recovery::RecoveryWorker;
    ///
    /// let worker = RecoveryWorker::new(MemoryStore::new()).census_every(Duration::from_secs(6 * 3600));
    /// # let _ = worker;
    /// ```
    pub fn census_every(mut self, interval: Duration) -> Self {
        self.census_every = Some(interval);
        self
    }

    /// No census: every pass counts the open records alone ([`Admin::open_counts`]), and the
    /// `completed`, `failed` and `expired` gauges are never set (the database's own statistics
    /// tell the table's size).
    pub fn without_census(mut self) -> Self {
        self.census_every = None;
        self
    }

    /// The store the worker recovers.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// One pass: stale leases, reconciliation, purge, each in batches until it runs dry; then
    /// the store's counts. Stops at the first store error (the next pass starts over; every
    /// step is safe to repeat).
    pub async fn run_once(&self) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        loop {
            let sweep = self.store.sweep_leases(self.batch).await?;
            report.marked_unknown += sweep.marked_unknown;
            report.released += sweep.released;
            emit_actions(&[("marked_unknown", sweep.marked_unknown), ("released", sweep.released)]);
            if sweep.marked_unknown + sweep.released < self.batch {
                break;
            }
        }
        for (operation, reconciler) in &self.reconcilers {
            loop {
                let due = self.store.checkout_unknown(operation, self.batch, self.backoff).await?;
                let taken = due.len();
                self.reconcile(reconciler, due, &mut report).await?;
                if taken < self.batch {
                    break;
                }
            }
        }
        let purge_batch = self.purge_batch.unwrap_or(self.batch);
        loop {
            let paced = match &self.purge_pace {
                Some(pace) => Some((pace, pace.ready().await)),
                None => None,
            };
            let purged = self.store.purge(purge_batch).await?;
            if let Some((pace, started)) = paced {
                pace.spent(started, purged);
            }
            report.purged += purged;
            emit_actions(&[("purged", purged)]);
            if purged < purge_batch {
                break;
            }
        }
        let (counts, census) = self.count().await?;
        report.counts = Some(counts);
        report.census = census;
        Ok(report)
    }

    /// The counts that end a pass, and whether they are a census: every record's, if one is
    /// due, else the open records' with the other states as of the last census.
    async fn count(&self) -> Result<(StateCounts, bool), StoreError> {
        let last = *self.last_census.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let due = match (self.census_every, last) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(every), Some((at, _))) => at.elapsed() >= every,
        };
        if due {
            let counts = self.store.counts().await?;
            *self.last_census.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some((Instant::now(), counts));
            emit_counts(&counts, true);
            return Ok((counts, true));
        }
        let open = self.store.open_counts().await?;
        emit_counts(&open, false);
        let counted = last.map(|(_, counts)| counts).unwrap_or_default();
        Ok((counted.with_open_of(&open), false))
    }

    /// Passes every [`every`](Self::every) until `shutdown` resolves (between store calls: the
    /// pass in progress stops at once, and every step it left is safe to repeat). A pass that
    /// fails is logged and the next one tried. Returns the sum of what the passes did.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> RecoveryReport {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut total = RecoveryReport::default();
        loop {
            let pass = std::pin::pin!(self.run_once());
            match join::first(shutdown.as_mut(), pass).await {
                join::Either::Left(()) => return total,
                join::Either::Right(Ok(report)) => {
                    tracing::debug!(?report, "idempotency: recovery pass");
                    total.add(&report);
                }
                join::Either::Right(Err(error)) => {
                    tracing::warn!(%error, "idempotency: a recovery pass failed; trying again at the next");
                }
            }
            let pause = std::pin::pin!(tokio::time::sleep(self.every));
            if let join::Either::Left(()) = join::first(shutdown.as_mut(), pause).await {
                return total;
            }
        }
    }
}

/// Counts recovery actions (feature `metrics`; nothing otherwise).
fn emit_actions(actions: &[(&'static str, usize)]) {
    #[cfg(feature = "metrics")]
    metrics::actions(actions);
    #[cfg(not(feature = "metrics"))]
    let _ = actions;
}

/// Sets the record gauges (feature `metrics`; nothing otherwise): those of every state after a
/// `census`, else those of the open states.
fn emit_counts(counts: &StateCounts, census: bool) {
    #[cfg(feature = "metrics")]
    metrics::counts(counts, census);
    #[cfg(not(feature = "metrics"))]
    let _ = (counts, census);
}
