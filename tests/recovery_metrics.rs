//! The recovery worker's metrics through the `metrics` facade, read back from a recorder of the
//! test's own: `idempotency_recovery_total{action}`, `idempotency_records{state}` and
//! `idempotency_oldest_unknown_seconds`, with their published names.
#![cfg(all(feature = "metrics", feature = "testkit"))]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, CounterFn, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tower_idempotency::recovery::{OLDEST_UNKNOWN_SECONDS, RECORDS, RECOVERY_TOTAL, Reconciliation, RecoveryWorker};
use tower_idempotency::store::{Claim, Outcome, RecordInfo};
use tower_idempotency::testkit::lifecycle::{OPERATION, labelled, make_unknown};
use tower_idempotency::testkit::store::{answer, claim, fingerprint, fresh_id};
use tower_idempotency::{MemoryStore, Retention, StaleLeasePolicy};

/// Counters and gauges by name and labels (`name{label=value}`), gauges as f64 bits.
#[derive(Default)]
struct Values(Mutex<BTreeMap<String, Arc<Value>>>);

#[derive(Default)]
struct Value(AtomicU64);

impl CounterFn for Value {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

impl GaugeFn for Value {
    fn increment(&self, value: f64) {
        self.set(f64::from_bits(self.0.load(Ordering::Relaxed)) + value);
    }
    fn decrement(&self, value: f64) {
        GaugeFn::increment(self, -value);
    }
    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }
}

impl Values {
    fn entry(&self, key: &Key) -> Arc<Value> {
        let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        let name =
            if labels.is_empty() { key.name().to_owned() } else { format!("{}{{{}}}", key.name(), labels.join(",")) };
        self.0.lock().unwrap().entry(name).or_default().clone()
    }

    fn counter(&self, name: &str) -> u64 {
        self.0.lock().unwrap().get(name).map_or(0, |v| v.0.load(Ordering::Relaxed))
    }

    fn gauge(&self, name: &str) -> Option<f64> {
        self.0.lock().unwrap().get(name).map(|v| f64::from_bits(v.0.load(Ordering::Relaxed)))
    }
}

impl Recorder for Values {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.entry(key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.entry(key))
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[test]
fn a_pass_counts_what_it_did_and_sets_the_record_gauges() {
    assert_eq!(RECOVERY_TOTAL, "idempotency_recovery_total");
    assert_eq!(RECORDS, "idempotency_records");
    assert_eq!(OLDEST_UNKNOWN_SECONDS, "idempotency_oldest_unknown_seconds");
    let values = Values::default();
    metrics::with_local_recorder(&values, || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let store = MemoryStore::new();
            let fp = fingerprint(1);
            let short = Duration::from_millis(100);
            // Two crashed holders, one of a re-executable route; one answer past its tombstone;
            // one unknown outcome of an operation nobody reconciles.
            for _ in 0..2 {
                std::mem::forget(claim(&store, labelled(&fresh_id("crashed"), &fp).lease(short)).await);
            }
            let reexecutable = fresh_id("reexecutable");
            std::mem::forget(
                claim(&store, labelled(&reexecutable, &fp).lease(short).stale_lease(StaleLeasePolicy::Reexecute)).await,
            );
            let old = fresh_id("old");
            let brief = Retention { response: short, tombstone: short, ..Retention::default() };
            claim(&store, labelled(&old, &fp).retention(brief))
                .await
                .finish(Outcome::Complete(answer("old")))
                .await
                .unwrap();
            let orphan = fresh_id("orphan");
            make_unknown(&store, tower_idempotency::BeginRequest::new(&orphan, &fp)).await;
            tokio::time::sleep(Duration::from_millis(300)).await;

            let worker = RecoveryWorker::new(store)
                .reconciler(OPERATION, |_record: RecordInfo| async { Reconciliation::Completed(answer("reconciled")) });
            let report = worker.run_once().await.unwrap();
            assert_eq!((report.marked_unknown, report.released, report.reconciled, report.purged), (2, 1, 2, 1));
        });
    });
    for (action, expected) in [("marked_unknown", 2), ("released", 1), ("reconciled", 2), ("purged", 1)] {
        assert_eq!(values.counter(&format!("{RECOVERY_TOTAL}{{action={action}}}")), expected, "{action}");
    }
    for (state, expected) in
        [("processing", 0.0), ("completed", 2.0), ("failed", 0.0), ("unknown", 1.0), ("expired", 0.0)]
    {
        assert_eq!(values.gauge(&format!("{RECORDS}{{state={state}}}")), Some(expected), "{state}");
    }
    let oldest = values.gauge(OLDEST_UNKNOWN_SECONDS).expect("the gauge is set");
    assert!(oldest > 0.0, "the unlabelled orphan is the oldest unknown record: {oldest}");
}

/// Between censuses a pass sets the open states' gauges and leaves the settled states' as the
/// last census set them; without a census those are never set.
#[test]
fn between_censuses_only_the_open_gauges_move() {
    let values = Values::default();
    let gauge = |state: &str| values.gauge(&format!("{RECORDS}{{state={state}}}"));
    metrics::with_local_recorder(&values, || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let store = MemoryStore::new();
            let fp = fingerprint(2);
            let done = |name: &'static str| {
                let store = store.clone();
                async move {
                    claim(&store, labelled(&fresh_id(name), &fp)).await.finish(Outcome::Complete(answer(name))).await
                }
            };
            done("first").await.unwrap();
            let worker = RecoveryWorker::new(store.clone()).census_every(Duration::from_secs(3600));
            assert!(worker.run_once().await.unwrap().census);
            done("second").await.unwrap();
            make_unknown(&store, labelled(&fresh_id("orphan"), &fp)).await;
            assert!(!worker.run_once().await.unwrap().census);
        });
    });
    assert_eq!(gauge("completed"), Some(1.0), "as the census counted");
    assert_eq!(gauge("unknown"), Some(1.0), "counted at the pass");
    assert!(values.gauge(OLDEST_UNKNOWN_SECONDS).is_some_and(|age| age > 0.0));

    let values = Values::default();
    metrics::with_local_recorder(&values, || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let store = MemoryStore::new();
            make_unknown(&store, labelled(&fresh_id("orphan"), &fingerprint(3))).await;
            RecoveryWorker::new(store).without_census().run_once().await.unwrap();
        });
    });
    assert_eq!(values.gauge(&format!("{RECORDS}{{state=unknown}}")), Some(1.0));
    for state in ["completed", "failed", "expired"] {
        assert_eq!(values.gauge(&format!("{RECORDS}{{state={state}}}")), None, "{state} is never set");
    }
}
