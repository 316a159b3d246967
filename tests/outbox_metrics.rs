//! The relay's metrics through the `metrics` facade, read back from a recorder of the test's
//! own: `outbox_events_total{result}` per attempt's end and `outbox_oldest_pending_seconds`.
#![cfg(all(feature = "sqlite", feature = "outbox", feature = "metrics"))]

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use metrics::{Counter, CounterFn, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tower_idempotency::TxHandle;
use tower_idempotency::outbox::{
    EventId, NewEvent, OutboxStore, PendingEvent, Relay, RelayConfig, SendError, Sender, SqliteOutbox,
};

/// Counters and gauges by `name{label=value}`.
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
    fn increment(&self, _: f64) {}
    fn decrement(&self, _: f64) {}
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

    fn get(&self, name: &str) -> Option<u64> {
        self.0.lock().unwrap().get(name).map(|value| value.0.load(Ordering::Relaxed))
    }
}

impl Recorder for &'static Values {
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

/// Fails the events whose id ends in `_fail`.
struct Picky;

impl Sender for Picky {
    async fn send(&self, event: &PendingEvent) -> Result<(), SendError> {
        if event.id.as_str().ends_with("_fail") { Err(SendError::Transport("refused".into())) } else { Ok(()) }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_counts_each_attempts_end_and_publishes_the_oldest_pending_age() {
    let values: &'static Values = Box::leak(Box::default());
    metrics::set_global_recorder(values).expect("the only recorder of this test binary");

    let (path, cleanup) = support::sqlite_path("tidem_outbox");
    cleanup.until_test_ends();
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(path).create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let outbox = SqliteOutbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    let handle = TxHandle::new(pool.begin().await.unwrap());
    for id in ["evt_1", "evt_2", "evt_3_fail"] {
        let data = serde_json::json!({});
        let event = NewEvent::new(EventId::new(id).unwrap(), "order.created", &data, SystemTime::now()).unwrap();
        outbox.enqueue(&handle, &event).await.unwrap();
    }
    handle.take().await.unwrap().commit().await.unwrap();

    // The retry's wait is drawn uniformly up to the ceiling (full jitter): a ceiling of ten
    // days, not the default 30 s cap, so that the failed event is not due again within this
    // run but once in a million runs.
    let ten_days = Duration::from_secs(10 * 86_400);
    let config = RelayConfig { backoff_base: ten_days, backoff_cap: ten_days, ..RelayConfig::default() };
    Relay::new(outbox.clone(), Picky, config).run(tokio::time::sleep(Duration::from_millis(500))).await;
    assert_eq!(values.get("outbox_events_total{result=delivered}"), Some(2));
    assert_eq!(values.get("outbox_events_total{result=failed}"), Some(1));
    let oldest = values.get("outbox_oldest_pending_seconds").map(f64::from_bits);
    assert!(oldest.is_some_and(|age| age >= 0.0), "the gauge is set while an event is pending: {oldest:?}");

    // Past the deadline, the next failure parks it.
    let hopeless = RelayConfig { deadline: Duration::ZERO, ..RelayConfig::default() };
    sqlx::query("UPDATE outbox_events SET available_at = 0").execute(&pool).await.unwrap();
    Relay::new(outbox.clone(), Picky, hopeless).run_once().await.unwrap();
    assert_eq!(values.get("outbox_events_total{result=dead}"), Some(1));
    assert_eq!(outbox.counts().await.unwrap().dead, 1);
}
