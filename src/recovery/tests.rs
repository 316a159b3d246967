//! The limits a pass of the worker gives each store call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::RecoveryWorker;
use crate::fingerprint::{FINGERPRINT_VERSION, Fingerprint};
use crate::key::IdempotencyKey;
use crate::record::StoredResponse;
use crate::store::memory::MemoryStore;
use crate::store::{
    Admin, Backoff, Begin, BeginRequest, Claim, LeaseSweep, Outcome, RecordInfo, Retention, SettleError, SettleRequest,
    StateCounts, Store, StoreError,
};
use crate::{RecordId, Scope};

/// A [`MemoryStore`] that notes the limit of each purge and lease sweep it is asked for, and
/// when each purge was called.
#[derive(Clone, Debug, Default)]
struct Limits {
    store: MemoryStore,
    purges: Arc<Mutex<Vec<usize>>>,
    purged_at: Arc<Mutex<Vec<Instant>>>,
    sweeps: Arc<Mutex<Vec<usize>>>,
}

impl Store for Limits {
    type Claim = <MemoryStore as Store>::Claim;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<Self::Claim>, StoreError> {
        self.store.begin(request).await
    }

    async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        self.purges.lock().unwrap().push(limit);
        self.purged_at.lock().unwrap().push(Instant::now());
        self.store.purge(limit).await
    }
}

impl Admin for Limits {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        self.store.inspect(id).await
    }

    async fn inspect_operation(&self, scope: &Scope, operation_id: &str) -> Result<Option<RecordInfo>, StoreError> {
        self.store.inspect_operation(scope, operation_id).await
    }

    async fn list_unknown(&self, limit: usize) -> Result<Vec<RecordInfo>, StoreError> {
        self.store.list_unknown(limit).await
    }

    async fn counts(&self) -> Result<StateCounts, StoreError> {
        self.store.counts().await
    }

    async fn settle(&self, request: SettleRequest<'_>) -> Result<(), SettleError> {
        self.store.settle(request).await
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.store.evict(id).await
    }

    async fn sweep_leases(&self, limit: usize) -> Result<LeaseSweep, StoreError> {
        self.sweeps.lock().unwrap().push(limit);
        self.store.sweep_leases(limit).await
    }

    async fn checkout_unknown(
        &self,
        operation: &str,
        limit: usize,
        backoff: Backoff,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        self.store.checkout_unknown(operation, limit, backoff).await
    }
}

/// `records` completed records on `store` that are past their response retention and their
/// tombstone time at once: all due for the purge.
async fn due_records(store: &Limits, records: usize) {
    let forget_now = Retention { response: Duration::ZERO, tombstone: Duration::ZERO, ..Retention::default() };
    let fingerprint = Fingerprint::from_parts(FINGERPRINT_VERSION, [1; 32]);
    for n in 0..records {
        let key = IdempotencyKey::new(format!("due-{n}")).expect("a key");
        let id = RecordId::new(&Scope::new("recovery"), "POST /things", &key);
        let begun = store.begin(BeginRequest::new(&id, &fingerprint).retention(forget_now)).await.expect("begin");
        let Begin::Claimed(claim) = begun else { panic!("a new key is claimed") };
        claim.finish(Outcome::Complete(StoredResponse::new(http::StatusCode::CREATED, "made"))).await.expect("finish");
    }
}

#[tokio::test]
async fn the_purge_takes_its_own_batch_and_the_leases_the_worker_s() {
    let store = Limits::default();
    due_records(&store, 12).await;
    let worker = RecoveryWorker::new(store.clone()).batch(3).purge_batch(5);
    let report = worker.run_once().await.expect("a pass");
    assert_eq!(report.purged, 12, "{report:?}");
    assert_eq!(*store.purges.lock().unwrap(), [5, 5, 5], "calls of 5 until one takes fewer");
    assert_eq!(*store.sweeps.lock().unwrap(), [3], "the lease sweep keeps the worker's batch");
}

#[tokio::test]
async fn without_a_purge_batch_the_purge_takes_the_worker_s() {
    let store = Limits::default();
    due_records(&store, 7).await;
    let report = RecoveryWorker::new(store.clone()).batch(3).run_once().await.expect("a pass");
    assert_eq!(report.purged, 7, "{report:?}");
    assert_eq!(*store.purges.lock().unwrap(), [3, 3, 3]);
    assert_eq!(format!("{:?}", RecoveryWorker::new(store).batch(3)).matches("batch: 3").count(), 2);
}

/// When each purge call of `store` was made, in milliseconds after `began`.
fn purge_offsets(store: &Limits, began: Instant) -> Vec<u128> {
    store.purged_at.lock().unwrap().iter().map(|at| (*at - began).as_millis()).collect()
}

#[tokio::test(start_paused = true)]
async fn a_purge_rate_holds_each_call_to_its_share_within_a_pass_and_into_the_next() {
    let store = Limits::default();
    due_records(&store, 12).await;
    let worker = RecoveryWorker::new(store.clone()).purge_batch(5).purge_rate(10);
    let began = Instant::now();
    let report = worker.run_once().await.expect("a pass");
    assert_eq!(report.purged, 12, "{report:?}");
    assert_eq!(purge_offsets(&store, began), [0, 500, 1_000], "5 records at 10 a second: 500 ms");
    // The next pass's first call waits out the last call's share: 2 records, 200 ms.
    due_records(&store, 1).await;
    let report = worker.run_once().await.expect("a pass");
    assert_eq!(report.purged, 1, "{report:?}");
    assert_eq!(purge_offsets(&store, began), [0, 500, 1_000, 1_200]);
    assert!(format!("{worker:?}").contains("purge_rate: Some(10)"), "{worker:?}");
}

#[tokio::test(start_paused = true)]
async fn without_a_purge_rate_the_purge_calls_follow_each_other_at_once() {
    let store = Limits::default();
    due_records(&store, 12).await;
    let worker = RecoveryWorker::new(store.clone()).purge_batch(5);
    let began = Instant::now();
    assert_eq!(worker.run_once().await.expect("a pass").purged, 12);
    assert_eq!(purge_offsets(&store, began), [0, 0, 0]);
    assert!(format!("{worker:?}").contains("purge_rate: None"), "{worker:?}");
}
