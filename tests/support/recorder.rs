//! A `metrics` recorder of a test's own: counters and histogram sample counts by
//! `name{label=value,...}`, read back by the test.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// Counters and histogram sample counts by `name{label=value,...}`.
#[derive(Default)]
pub struct Recorded(Mutex<BTreeMap<String, Arc<Count>>>);

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

impl HistogramFn for Count {
    fn record(&self, _value: f64) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl Recorded {
    pub fn get(&self, name: &str) -> u64 {
        self.0.lock().unwrap().get(name).map_or(0, |count| count.0.load(Ordering::Relaxed))
    }

    pub fn names(&self) -> Vec<String> {
        self.0.lock().unwrap().keys().cloned().collect()
    }

    fn entry(&self, key: &Key) -> Arc<Count> {
        let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        let name =
            if labels.is_empty() { key.name().to_owned() } else { format!("{}{{{}}}", key.name(), labels.join(",")) };
        self.0.lock().unwrap().entry(name).or_default().clone()
    }
}

impl Recorder for Recorded {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.entry(key))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.entry(key))
    }
}

/// Waits (bounded) until `name` reaches `at_least` in `recorded`: shadow counts arrive once the
/// answer is produced. Its count then.
pub async fn eventually(recorded: &Recorded, name: &str, at_least: u64) -> u64 {
    for _ in 0..500 {
        if recorded.get(name) >= at_least {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    recorded.get(name)
}
