//! What the fast path counts: each counter is declared once, below, and yields both the live
//! atomic counter and the field of the public snapshot, [`FastPathStats`].

use std::sync::atomic::{AtomicU64, Ordering};

/// One event counter, shared by a fast path's clones and its claims. A counter with a
/// `result` label is mirrored to `idempotency_fast_path_total{result}` (feature `metrics`),
/// through a handle resolved on its first bump.
#[derive(Debug, Default)]
pub(super) struct Counter {
    count: AtomicU64,
    #[cfg(feature = "metrics")]
    metric: Option<(&'static str, std::sync::OnceLock<metrics::Counter>)>,
}

impl Counter {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn labelled(result: Option<&'static str>) -> Self {
        Self {
            count: AtomicU64::new(0),
            #[cfg(feature = "metrics")]
            metric: result.map(|result| (result, std::sync::OnceLock::new())),
        }
    }

    /// Counts one more.
    pub(super) fn bump(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        if let Some((result, handle)) = &self.metric {
            handle.get_or_init(|| metrics::counter!(crate::telemetry::FAST_PATH, "result" => *result)).increment(1);
        }
    }

    fn get(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// Declares [`FastPathStats`] (the snapshot) and `Counters` (the live counters) from one list
/// of fields, so that the two cannot drift apart.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident $(=> $result:literal)?,)*) => {
        /// What the fast path has done since it was made; shared by its clones.
        ///
        /// Every Redis failure is in `degraded`: the request went down the durable path instead.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct FastPathStats {
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        /// The live counters behind [`FastPathStats`].
        #[derive(Debug)]
        pub(super) struct Counters {
            $($(#[doc = $doc])* pub(super) $name: Counter,)*
        }

        impl Default for Counters {
            fn default() -> Self {
                Self { $($name: Counter::labelled(None $(.or(Some($result)))?),)* }
            }
        }

        impl Counters {
            /// The counts so far.
            pub(super) fn snapshot(&self) -> FastPathStats {
                FastPathStats { $($name: self.$name.get(),)* }
            }
        }
    };
}

counters! {
    /// Begins answered from the cached response, without the durable store (duplicates that
    /// waited for it included).
    hits => "hit",
    /// Begins whose first look found no cached response.
    misses => "miss",
    /// Locks taken (each followed by the durable store's begin).
    locks => "lock_acquired",
    /// Begins that found the lock held by a duplicate and waited.
    waits => "lock_waited",
    /// Waits that ran out with the lock still held: the durable store decided (in flight only
    /// if it knows of a live claim).
    in_flight,
    /// Begins that went to the durable store without the lock because the lock's holder has
    /// another fingerprint, the lock was not one of the fast path's, or the cached value was
    /// not trusted (the store decides).
    handed_over,
    /// Cached values whose MAC verified but that could not be read (a format this build does
    /// not know): misses.
    corrupt,
    /// Cached values that did not verify (altered, another identity's or another deployment's,
    /// or written without a MAC): never replayed, misses.
    unverified,
    /// Locks found without an expiry or not of the fast path's shape: never waited on.
    foreign_locks,
    /// Begins that skipped Redis because the deployment has no secret (see `FastPath::secret`).
    unkeyed,
    /// Responses cached after their commit.
    cached,
    /// Redis calls that failed or timed out; the request went down the durable path.
    degraded => "degraded",
    /// Begins that skipped Redis during the cool-down after a failure.
    bypassed,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snapshot_shows_each_counter_in_its_own_field() {
        let counters = Counters::default();
        counters.hits.bump();
        counters.hits.bump();
        counters.bypassed.bump();
        let stats = counters.snapshot();
        assert_eq!((stats.hits, stats.bypassed, stats.misses), (2, 1, 0));
        assert_eq!(FastPathStats { hits: 0, bypassed: 0, ..stats }, FastPathStats::default());
    }

    /// The counters of `idempotency_fast_path_total{result}` are mirrored; the others are not.
    #[cfg(feature = "metrics")]
    #[test]
    fn the_mirrored_counters_reach_the_recorder_with_their_result_label() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let counters = Counters::default();
            for counter in [&counters.hits, &counters.misses, &counters.locks, &counters.waits, &counters.degraded] {
                counter.bump();
            }
            counters.hits.bump();
            counters.bypassed.bump();
        });
        let text = handle.render();
        for (result, count) in [("hit", 2), ("miss", 1), ("lock_acquired", 1), ("lock_waited", 1), ("degraded", 1)] {
            let line = format!("idempotency_fast_path_total{{result=\"{result}\"}} {count}");
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert_eq!(text.matches("idempotency_fast_path_total{").count(), 5, "{text}");
    }
}
