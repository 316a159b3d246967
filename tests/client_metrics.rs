//! The client layer's counters through the `metrics` facade: attempts, retries by reason and
//! give-ups, read back from a recorder of the test's own.
#![cfg(all(feature = "client", feature = "metrics"))]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use metrics::{Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tower::ServiceExt;
use tower_idempotency::client::telemetry::{ATTEMPTS, GIVE_UPS, RETRIES};
use tower_idempotency::client::{IdempotentRetryLayer, RetryPolicy};
use tower_layer::Layer;

/// Counters by name and labels (`name{label=value}`).
#[derive(Default)]
struct Counters(Mutex<BTreeMap<String, Arc<Count>>>);

#[derive(Default)]
struct Count(AtomicU64);

impl CounterFn for Count {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

impl Counters {
    fn get(&self, name: &str) -> u64 {
        self.0.lock().unwrap().get(name).map_or(0, |count| count.0.load(Ordering::Relaxed))
    }
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        let name =
            if labels.is_empty() { key.name().to_owned() } else { format!("{}{{{}}}", key.name(), labels.join(",")) };
        Counter::from_arc(self.0.lock().unwrap().entry(name).or_default().clone())
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[test]
fn attempts_retries_by_reason_and_give_ups_are_counted() {
    let counters = Counters::default();
    let calls = Arc::new(AtomicU64::new(0));
    // Unavailable with Retry-After twice, then 201; then 429 forever.
    let server = tower::service_fn(move |_request: Request<Full<Bytes>>| {
        let call = calls.fetch_add(1, Ordering::SeqCst);
        async move {
            let status = match call {
                0 | 1 => 503,
                2 => 201,
                _ => 429,
            };
            let response = Response::builder().status(status).header("retry-after", "0");
            Ok::<_, std::convert::Infallible>(response.body(Full::new(Bytes::new())).unwrap())
        }
    });
    let policy = RetryPolicy::new().max_attempts(3).base_delay(Duration::from_millis(1));
    let client = IdempotentRetryLayer::new().policy(policy).layer(server);
    let order = || Request::post("http://orders.test/orders").body(Full::new(Bytes::from_static(b"{}"))).unwrap();
    let get = || Request::get("http://orders.test/orders").body(Full::new(Bytes::new())).unwrap();

    metrics::with_local_recorder(&counters, || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            assert_eq!(client.clone().oneshot(order()).await.unwrap().status(), 201);
            assert_eq!(client.clone().oneshot(order()).await.unwrap().status(), 429);
            // Not guarded: not counted.
            client.clone().oneshot(get()).await.unwrap();
        });
    });

    assert_eq!(counters.get(ATTEMPTS), 6);
    assert_eq!(counters.get(&format!("{RETRIES}{{reason=unavailable}}")), 2);
    assert_eq!(counters.get(&format!("{RETRIES}{{reason=rate_limited}}")), 2);
    assert_eq!(counters.get(&format!("{GIVE_UPS}{{reason=rate_limited}}")), 1);
    assert_eq!(counters.get(&format!("{GIVE_UPS}{{reason=unavailable}}")), 0);
}
