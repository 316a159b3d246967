//! When a failed delivery is tried again: exponential backoff with full jitter, up to a
//! deadline after which the event is parked as `dead`.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// The relay's timing: leases, batches, backoff and the deadline.
///
/// The defaults let a backlog drain within a minute after a receiver's outage ends: a lease and a
/// backoff cap of 30 s, so no event waits longer than that for its next attempt, and a batch of
/// 64 delivered 16 at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayConfig {
    /// How long a relay holds the events it claimed (default 30 s). Another relay claims them
    /// only after it ran out; a delivery is cut off a second before it (see `send_timeout`).
    pub lease: Duration,
    /// Events claimed in one batch (default 64).
    pub batch: usize,
    /// Deliveries of one batch in flight at once (default 16).
    pub concurrency: usize,
    /// How long the relay sleeps when nothing was due (default 250 ms).
    pub idle_poll: Duration,
    /// The first retry's backoff ceiling (default 1 s); it doubles with each failed attempt.
    pub backoff_base: Duration,
    /// The backoff ceiling's cap (default 30 s).
    pub backoff_cap: Duration,
    /// How long after it was enqueued an event that keeps failing is parked as `dead`
    /// (default 24 h).
    pub deadline: Duration,
    /// The longest one delivery may take (default 10 s; never more than the lease less 1 s).
    pub send_timeout: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            batch: 64,
            concurrency: 16,
            idle_poll: Duration::from_millis(250),
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(30),
            deadline: Duration::from_secs(24 * 3600),
            send_timeout: Duration::from_secs(10),
        }
    }
}

impl RelayConfig {
    /// The ceiling of the backoff after failed attempt number `attempt` (1 for the first):
    /// `min(cap, base * 2^(attempt - 1))`.
    pub fn backoff_ceiling(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(30);
        self.backoff_base.saturating_mul(1 << doublings).min(self.backoff_cap)
    }

    /// The wait before the next attempt after failed attempt `attempt`: "full jitter", uniform
    /// in `[0, ceiling]`, so relays retrying together after an outage spread out.
    pub fn backoff(&self, attempt: u32) -> Duration {
        self.backoff_ceiling(attempt).mul_f64(unit_random())
    }

    /// The timeout a delivery runs under: `send_timeout`, but at least 1 s inside the lease, so
    /// an attempt never outlives the lease it was claimed under.
    pub(crate) fn effective_send_timeout(&self) -> Duration {
        self.send_timeout.min(self.lease.saturating_sub(Duration::from_secs(1))).max(Duration::from_millis(100))
    }
}

/// A uniform number in `[0, 1)`, from the standard library's randomly keyed hasher (enough for
/// jitter, which needs spread, not secrecy).
pub(crate) fn unit_random() -> f64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_doubles_from_the_base_up_to_the_cap() {
        let config = RelayConfig::default();
        let ceilings: Vec<u64> = (1..=7).map(|a| config.backoff_ceiling(a).as_secs()).collect();
        assert_eq!(ceilings, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(config.backoff_ceiling(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn full_jitter_stays_within_zero_and_the_ceiling_and_spreads() {
        let config = RelayConfig::default();
        let waits: Vec<Duration> = (0..200).map(|_| config.backoff(4)).collect();
        assert!(waits.iter().all(|w| *w <= Duration::from_secs(8)), "{waits:?}");
        let low = waits.iter().filter(|w| **w < Duration::from_secs(4)).count();
        assert!((40..=160).contains(&low), "about half the waits fall below half the ceiling: {low} of 200");
    }

    #[test]
    fn the_defaults_drain_a_backlog_within_a_minute_and_give_up_after_a_day() {
        let config = RelayConfig::default();
        assert!(config.lease <= Duration::from_secs(30) && config.backoff_cap <= Duration::from_secs(30));
        assert_eq!(config.deadline, Duration::from_secs(86_400));
        assert!(config.effective_send_timeout() < config.lease);
    }
}
