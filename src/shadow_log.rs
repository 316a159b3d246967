//! Shadow mode's log (see [`rollout`](crate::rollout)): what shadow mode records of its
//! requests is queued once their answers have been produced, and a writer task of the layer's
//! own records it in batches ([`Store::record_shadow`]), off the requests' path. Once a batch is
//! recorded, what enforce mode would have done with each of its requests is counted in
//! `idempotency_shadow_total` and logged at debug.
//!
//! - The writer gathers requests for the log's interval (1 s by default) after the first one
//!   arrives, then records them all with one call of the store: on the SQL stores one
//!   statement for up to 1,024 requests, so a thousand requests a second cost the database
//!   one write of a thousand records, off every request's path. On SQLite the batch holds the
//!   file's one write lock while it is written, and a request that needs the lock waits until
//!   it is done, unless the records go to a file of their own
//!   ([`IdempotencyLayer::shadow_store`](crate::IdempotencyLayer::shadow_store)): on one file,
//!   shadow mode's cost tends towards what a record's write costs against a request's, about
//!   a sixth with `synchronous = NORMAL` in the `rollout` benchmark, whose `off+records` set-up
//!   measures that floor (README, "Rolling it out", has the figures). Fewer, larger batches cost less per record: each commit writes the
//!   pages it changed once, however many of its records share them.
//! - Two requests with the same key in one batch are told apart here: the first is recorded,
//!   and the second is what enforce mode would have made of it (a replay of the first, or a
//!   reused key).
//! - The queue is bounded ([`IdempotencyLayer::shadow_log`](crate::IdempotencyLayer::shadow_log)):
//!   a request that finds it full, or no Tokio runtime to write from, is counted
//!   `store_unavailable` at once and not recorded. So is a batch the store fails to record.
//! - The writer ends once the layer and every service made from it are gone, after recording
//!   what is queued. Requests still queued when the process dies are not recorded: shadow mode
//!   measures, and a handful of lost records only lowers the hit rate it reports.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::Record;
use crate::store::{ShadowEntry, ShadowSeen, Store};
use crate::telemetry::{OperationMetrics, RequestResult};
use crate::verdict::{Verdict, same_request};

/// How long the writer gathers requests by default before it records them.
pub(crate) const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// How many requests may wait to be recorded by default.
pub(crate) const DEFAULT_CAPACITY: usize = 65_536;

/// The most requests one call of the store records.
const MAX_BATCH: usize = 1_024;

/// One request waiting to be recorded.
pub(crate) struct Queued {
    /// What the store records.
    pub(crate) entry: ShadowEntry,
    /// The request's fingerprint at the crate's other fingerprint version, to compare it with
    /// a record written at that version.
    pub(crate) earlier: Option<Fingerprint>,
    /// Where what enforce mode would have done is counted.
    pub(crate) metrics: OperationMetrics,
}

impl Queued {
    /// Whether `record` is this request's.
    fn same_as(&self, record: &Record) -> bool {
        same_request(&record.fingerprint, &self.entry.fingerprint, |version| {
            self.earlier.filter(|earlier| earlier.version() == version)
        })
    }

    /// Counts `result` and logs it.
    fn count(&self, result: RequestResult) {
        count(&self.metrics, Some(&self.entry.id), result);
    }
}

/// Counts in `idempotency_shadow_total` what enforce mode would have done with a request
/// (under the shadow identity `record`, once it is known), and logs it at debug.
pub(crate) fn count(metrics: &OperationMetrics, record: Option<&RecordId>, result: RequestResult) {
    metrics.shadow(result);
    match record {
        Some(record) => {
            tracing::debug!(%record, result = result.as_str(), "idempotency (shadow): what enforce mode would have done")
        }
        None => tracing::debug!(result = result.as_str(), "idempotency (shadow): what enforce mode would have done"),
    }
}

/// A layer's shadow log: its clones share one queue and one writer.
#[derive(Clone)]
pub(crate) struct ShadowLog(Arc<Owner>);

/// The layer's side of the log: when the last one goes, the writer records what is left and
/// ends.
struct Owner(Arc<Shared>);

/// What the layer and its writer share.
struct Shared {
    state: Mutex<State>,
    wake: Notify,
    interval: Duration,
    capacity: usize,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Queued>,
    /// Whether a writer task is running.
    writing: bool,
    /// Whether the layer is gone.
    closed: bool,
}

impl ShadowLog {
    /// A log whose writer gathers requests for `interval` and which holds at most `capacity`.
    pub(crate) fn new(interval: Duration, capacity: usize) -> Self {
        let shared = Shared { state: Mutex::default(), wake: Notify::new(), interval, capacity: capacity.max(1) };
        Self(Arc::new(Owner(Arc::new(shared))))
    }

    /// A log of its own (its own queue and writer) with this one's interval and capacity: for
    /// a layer whose shadow records go to another store than the clones it was made from.
    pub(crate) fn fresh(&self) -> Self {
        let shared = &(self.0).0;
        Self::new(shared.interval, shared.capacity)
    }

    /// Queues `queued` to be recorded on `store` (starting the writer on the current Tokio
    /// runtime if none runs). A full queue, or no runtime, counts it `store_unavailable` at
    /// once.
    pub(crate) fn record<St: Store>(&self, store: &St, queued: Queued) {
        let shared = &(self.0).0;
        let mut state = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.queue.len() >= shared.capacity {
            drop(state);
            tracing::debug!("idempotency (shadow): the log is full; the request is not recorded");
            return queued.count(RequestResult::StoreUnavailable);
        }
        if !state.writing {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                drop(state);
                tracing::debug!("idempotency (shadow): no Tokio runtime to record from; the request is not recorded");
                return queued.count(RequestResult::StoreUnavailable);
            };
            state.writing = true;
            runtime.spawn(write(Writing(shared.clone()), store.clone()));
        }
        state.queue.push_back(queued);
        drop(state);
        shared.wake.notify_one();
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
        self.0.wake.notify_one();
    }
}

/// The writer's hold on the log: however the writer ends (its runtime shut down), the next
/// request starts another.
struct Writing(Arc<Shared>);

impl Drop for Writing {
    fn drop(&mut self) {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner).writing = false;
    }
}

/// The writer: waits for a request, gathers more for the interval, records them in batches of
/// at most [`MAX_BATCH`]; ends once the layer is gone and nothing is left. Requests that arrive
/// while a batch is written wait for the next interval, so that the writes stay few and large.
async fn write<St: Store>(writing: Writing, store: St) {
    let shared = &writing.0;
    loop {
        shared.wake.notified().await;
        if !shared.state.lock().unwrap_or_else(PoisonError::into_inner).closed {
            tokio::time::sleep(shared.interval).await;
        }
        loop {
            let (batch, closed) = {
                let mut state = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
                let take = state.queue.len().min(MAX_BATCH);
                (state.queue.drain(..take).collect::<Vec<_>>(), state.closed)
            };
            let full = batch.len() == MAX_BATCH;
            if batch.is_empty() && closed {
                return;
            }
            if !batch.is_empty() {
                record_batch(&store, batch).await;
            }
            // A full batch may have left more behind; else what arrived meanwhile is gathered
            // for the next interval (its arrival left a wake-up).
            if !full && !closed {
                break;
            }
        }
    }
}

/// Records `batch` with one call of `store` (the first request of each identity; the others
/// are judged against it) and counts what enforce mode would have done with each request.
async fn record_batch<St: Store>(store: &St, batch: Vec<Queued>) {
    let mut first_of: BTreeMap<RecordId, usize> = BTreeMap::new();
    let (mut firsts, mut repeats) = (Vec::with_capacity(batch.len()), Vec::new());
    for queued in batch {
        match first_of.get(&queued.entry.id) {
            Some(&first) => repeats.push((first, queued)),
            None => {
                first_of.insert(queued.entry.id, firsts.len());
                firsts.push(queued);
            }
        }
    }
    let seen = match store.record_shadow(firsts.iter().map(|queued| queued.entry).collect()).await {
        Ok(seen) if seen.len() == firsts.len() => seen,
        Ok(_) => {
            tracing::warn!("idempotency (shadow): the store answered for another number of records than it was given");
            return count_unrecorded(firsts, repeats);
        }
        Err(error) => {
            tracing::debug!(%error, "idempotency (shadow): recording failed");
            return count_unrecorded(firsts, repeats);
        }
    };
    let results: Vec<RequestResult> = firsts
        .iter()
        .zip(&seen)
        .map(|(queued, seen)| match seen {
            ShadowSeen::Recorded => RequestResult::Executed,
            ShadowSeen::Existing(record) => Verdict::of(record, queued.same_as(record)).result(),
            ShadowSeen::InFlight => RequestResult::InFlight,
            ShadowSeen::NotRecorded(error) => {
                if let Some(error) = error {
                    tracing::debug!(%error, "idempotency (shadow): recording failed");
                }
                RequestResult::StoreUnavailable
            }
        })
        .collect();
    for (first, queued) in &repeats {
        // What enforce mode would have found: the first request's record.
        let result = match &seen[*first] {
            ShadowSeen::Recorded if queued.entry.fingerprint == firsts[*first].entry.fingerprint => {
                RequestResult::Replayed
            }
            ShadowSeen::Recorded => RequestResult::KeyReused,
            ShadowSeen::Existing(record) => Verdict::of(record, queued.same_as(record)).result(),
            ShadowSeen::InFlight => RequestResult::InFlight,
            ShadowSeen::NotRecorded(_) => RequestResult::StoreUnavailable,
        };
        queued.count(result);
    }
    for (queued, result) in firsts.iter().zip(results) {
        queued.count(result);
    }
}

/// Counts every request of a batch that was not recorded `store_unavailable`.
fn count_unrecorded(firsts: Vec<Queued>, repeats: Vec<(usize, Queued)>) {
    for queued in firsts.iter().chain(repeats.iter().map(|(_, queued)| queued)) {
        queued.count(RequestResult::StoreUnavailable);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Retention;
    use crate::{IdempotencyKey, MemoryStore, Scope};
    use http::StatusCode;

    fn queued(key: &str, digest: u8) -> Queued {
        let key = IdempotencyKey::new(key).unwrap();
        let id = RecordId::new(&Scope::new("tenant"), "orders.create", &key).shadow();
        let fingerprint = Fingerprint::from_parts(2, [digest; 32]);
        let entry = ShadowEntry::new(id, fingerprint, StatusCode::CREATED, Retention::default());
        let metrics = crate::telemetry::Telemetry::default().operation(&Arc::from("orders.create"));
        Queued { entry, earlier: None, metrics }
    }

    #[tokio::test]
    async fn a_batch_records_each_identity_once_and_judges_repeats_against_the_first() {
        let store = MemoryStore::new();
        record_batch(&store, vec![queued("a", 1), queued("a", 1), queued("a", 2), queued("b", 1)]).await;
        // Both identities are recorded, once each: a later batch finds them.
        let again = store.record_shadow(vec![queued("a", 1).entry, queued("b", 3).entry]).await.unwrap();
        assert!(
            matches!(&again[0], ShadowSeen::Existing(record) if record.fingerprint == queued("a", 1).entry.fingerprint)
        );
        assert!(
            matches!(&again[1], ShadowSeen::Existing(record) if record.fingerprint == queued("b", 1).entry.fingerprint)
        );
    }

    #[tokio::test]
    async fn the_writer_records_what_is_queued_and_ends_with_the_layer() {
        let store = MemoryStore::new();
        let log = ShadowLog::new(Duration::from_millis(1), 8);
        log.record(&store, queued("a", 1));
        log.record(&store, queued("b", 1));
        let shared = (log.0).0.clone();
        drop(log);
        // The writer records what was queued, then ends.
        tokio::time::timeout(Duration::from_secs(10), async {
            while shared.state.lock().unwrap().writing {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the writer ends once the layer is gone");
        assert!(shared.state.lock().unwrap().queue.is_empty());
        let seen = store.record_shadow(vec![queued("a", 1).entry, queued("b", 1).entry]).await.unwrap();
        assert!(seen.iter().all(|seen| matches!(seen, ShadowSeen::Existing(_))), "{seen:?}");
    }

    #[tokio::test]
    async fn a_full_log_turns_requests_away_without_waiting() {
        let store = MemoryStore::new();
        let log = ShadowLog::new(Duration::from_secs(3600), 2);
        for key in ["a", "b", "c", "d"] {
            log.record(&store, queued(key, 1));
        }
        assert_eq!((log.0).0.state.lock().unwrap().queue.len(), 2, "the queue holds no more than its capacity");
    }
}
