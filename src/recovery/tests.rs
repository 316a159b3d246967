//! The limits a pass of the worker gives each store call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// A [`MemoryStore`] that notes the limit of each purge and lease sweep it is asked for.
#[derive(Clone, Debug, Default)]
struct Limits {
    store: MemoryStore,
    purges: Arc<Mutex<Vec<usize>>>,
    sweeps: Arc<Mutex<Vec<usize>>>,
}

impl Store for Limits {
    type Claim = <MemoryStore as Store>::Claim;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<Self::Claim>, StoreError> {
        self.store.begin(request).await
    }

    async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        self.purges.lock().unwrap().push(limit);
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
