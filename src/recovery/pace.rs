//! The purge's pace: how many records a second the worker's purge calls may take at most, held
//! across calls and across passes.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// A rate of records a second, and when the next purge call may start.
///
/// A call that purged `n` records spends `n / rate` seconds of the pace from its start; the next
/// call waits until they have passed. A call that took longer than its share starts the next at
/// once: the pace bounds the rate, it never makes up for lost time.
#[derive(Debug)]
pub(super) struct Pace {
    records_per_second: u32,
    next: Mutex<Option<Instant>>,
}

impl Pace {
    /// A pace of `records_per_second` (at least 1).
    pub(super) fn new(records_per_second: u32) -> Self {
        Self { records_per_second: records_per_second.max(1), next: Mutex::new(None) }
    }

    /// The rate, records a second.
    pub(super) fn records_per_second(&self) -> u32 {
        self.records_per_second
    }

    /// Waits until the next call may start, and returns when it starts.
    pub(super) async fn ready(&self) -> Instant {
        let next = *self.next.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(next) = next {
            tokio::time::sleep_until(next).await;
        }
        Instant::now()
    }

    /// A call that started at `started` purged `records`: the next waits for their share of the
    /// pace.
    pub(super) fn spent(&self, started: Instant, records: usize) {
        let share = Duration::from_secs_f64(records as f64 / f64::from(self.records_per_second));
        *self.next.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(started + share);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_call_waits_for_the_share_of_the_one_before_from_its_start() {
        let pace = Pace::new(1_000);
        let first = pace.ready().await;
        pace.spent(first, 500);
        tokio::time::advance(Duration::from_millis(100)).await;
        let second = pace.ready().await;
        assert_eq!(second - first, Duration::from_millis(500), "500 records at 1,000 a second");
        // A call slower than its share: the next starts at once.
        pace.spent(second, 10);
        tokio::time::advance(Duration::from_millis(300)).await;
        let third = pace.ready().await;
        assert_eq!(third - second, Duration::from_millis(300));
        // Nothing purged: nothing to wait for.
        pace.spent(third, 0);
        assert_eq!(pace.ready().await, third);
    }

    #[test]
    fn a_rate_of_zero_is_one_a_second() {
        assert_eq!(Pace::new(0).records_per_second(), 1);
    }
}
