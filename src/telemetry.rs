//! What the server half reports: metrics through the `metrics` facade (feature `metrics`: the
//! application installs the exporter it likes, `metrics-exporter-prometheus` say) and one
//! `tracing` span per guarded request. Without the feature no metric code is compiled in.
//!
//! # Metrics
//!
//! Names and labels are part of the public interface. Label values are bounded: `operation`
//! is the operation's name (the explicit name, axum's route template, or the gRPC method
//! path); raw keys, scopes and tenants never appear in labels. A layer keeps the handles of at
//! most 256 operations; further operations (a route without a name or template, whose
//! operation is its raw path) are counted under `operation="other"`.
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | `idempotency_requests_total` | counter | `operation`, `result` | one per enforced guarded request, by [`RequestResult`] |
//! | `idempotency_shadow_total` | counter | `operation`, `result` | what enforce mode would have done with a request seen in shadow mode, same `result` values (counted once the shadow log has recorded the request's batch: within its interval, 1 s by default, of the answer; at once for what is known before, such as a missing key) |
//! | `idempotency_overhead_seconds` | histogram | `operation` | the time the layer adds to an enforced request: everything but the inner service (key, body, fingerprint, store calls, buffering the answer) |
//! | `idempotency_store_seconds` | histogram | `operation`, `step` | store calls of enforced requests: `begin` (claim or look up), `finish` (store the outcome and commit, or release) |
//! | `idempotency_stored_bytes` | histogram | `operation` | the body size of each response stored for replay (complete or failed): the storage cost |
//! | `idempotency_fast_path_total` | counter | `result` | the Redis fast path's events, as `FastPath::stats()` counts them: `hit` (a replay from Redis), `miss` (no cached answer), `lock_acquired`, `lock_waited` (a duplicate waited on the lock), `degraded` (a Redis call failed or timed out: the request went to the store alone) |
//! | `idempotency_records` | gauge | `state` | records by state, set by the recovery worker from the store's counts |
//! | `idempotency_oldest_unknown_seconds` | gauge | — | the age of the oldest `unknown` record, set by the recovery worker |
//! | `idempotency_recovery_total` | counter | `action` | the recovery worker's actions: `marked_unknown`, `reconciled`, `released`, `purged` |
//!
//! The last three are emitted by the recovery worker
//! ([`RecoveryWorker`](crate::RecoveryWorker), on every pass), not by the layer; the same names
//! are [`recovery::RECORDS`](crate::recovery::RECORDS),
//! [`recovery::OLDEST_UNKNOWN_SECONDS`](crate::recovery::OLDEST_UNKNOWN_SECONDS) and
//! [`recovery::RECOVERY_TOTAL`](crate::recovery::RECOVERY_TOTAL).
//!
//! `result` values and what they mean (see [`RequestResult`]):
//!
//! | `result` | the request |
//! |---|---|
//! | `executed` | ran the handler, and its outcome was stored (complete or failed) |
//! | `replayed` | got a stored answer |
//! | `key_missing`, `key_invalid` | was refused for its key |
//! | `key_reused` | came with a key used for a different request |
//! | `in_flight` | found its original still in flight after the bounded wait |
//! | `key_expired` | found only a tombstone |
//! | `outcome_unknown` | found a record whose outcome is unknown |
//! | `body_too_large` | was refused for its body: over the limit, over the buffer budget, unreadable or late |
//! | `store_unavailable` | could not be claimed: the store failed (nothing ran) |
//! | `commit_uncertain` | ran, but its outcome could not be confirmed |
//! | `released` | ran, and its answer was not stored (the outcome was a release, or the answer's body failed): a retry runs again |
//! | `response_too_large` | ran, and its answer was too large to store (rolled back) |
//! | `handle_still_held` | ran, and its handler kept the transaction handle (rolled back) |
//! | `scope_missing` | had no scope |
//!
//! A request the layer passes through unguarded (another method, or an optional key that was
//! not sent) is not counted, and neither is a request in `Off` mode.
//!
//! Useful rates (PromQL):
//!
//! ```text
//! # Safe-retry success rate: replayed over all requests that found an existing record.
//! sum(rate(idempotency_requests_total{result="replayed"}[5m]))
//!   / sum(rate(idempotency_requests_total{result=~"replayed|key_reused|in_flight|key_expired|outcome_unknown"}[5m]))
//! # Conflict rate: refusals for a reused key or a request in flight, over all requests.
//! sum(rate(idempotency_requests_total{result=~"key_reused|in_flight"}[5m]))
//!   / sum(rate(idempotency_requests_total[5m]))
//! # P95 of the layer's own latency.
//! histogram_quantile(0.95, sum by (le) (rate(idempotency_overhead_seconds_bucket[5m])))
//! ```
//!
//! # Tracing
//!
//! Every guarded request runs inside an `INFO` span named `idempotency` with the fields
//! `operation`, `mode` (`enforce`, `shadow`, `off`), `record` (the identity's digest, never the
//! key), `result` (as above), `replayed` (bool) and `fencing_token` (leased claims); the
//! layer's own events and the inner service's spans are inside it. In shadow mode `result` is
//! not set on the span (nothing was enforced); the debug event
//! `idempotency (shadow): what enforce mode would have done` carries it. The span's target is
//! `tower_idempotency::service`. When no subscriber takes it and the `log` crate's level is
//! below `INFO` (so `tracing`'s `log` fallback would print none of it either), the layer does
//! not make it.

/// `idempotency_requests_total{operation, result}`.
pub const REQUESTS: &str = "idempotency_requests_total";
/// `idempotency_shadow_total{operation, result}`.
pub const SHADOW: &str = "idempotency_shadow_total";
/// `idempotency_overhead_seconds{operation}`.
pub const OVERHEAD: &str = "idempotency_overhead_seconds";
/// `idempotency_store_seconds{operation, step}`.
pub const STORE: &str = "idempotency_store_seconds";
/// `idempotency_stored_bytes{operation}`.
pub const STORED_BYTES: &str = "idempotency_stored_bytes";
/// `idempotency_fast_path_total{result}`.
pub const FAST_PATH: &str = "idempotency_fast_path_total";
/// `idempotency_records{state}`, set by the recovery worker.
pub const RECORDS: &str = crate::recovery::RECORDS;
/// `idempotency_oldest_unknown_seconds`, set by the recovery worker.
pub const OLDEST_UNKNOWN: &str = crate::recovery::OLDEST_UNKNOWN_SECONDS;
/// `idempotency_recovery_total{action}`, counted by the recovery worker.
pub const RECOVERY: &str = crate::recovery::RECOVERY_TOTAL;

/// Histogram buckets for the layer's `_seconds` histograms ([`OVERHEAD`], [`STORE`]): 250 µs
/// to 10 s. The layer records samples only; buckets are the exporter's setting. Give it these
/// (or your own) so that `histogram_quantile` over `_bucket` series works, as the reference
/// service does:
///
/// ```
/// use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
/// use tower_idempotency::telemetry::{BYTES_BUCKETS, SECONDS_BUCKETS};
///
/// let recorder = PrometheusBuilder::new()
///     .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)?
///     .set_buckets_for_metric(Matcher::Suffix("_bytes".into()), &BYTES_BUCKETS)?
///     .build_recorder();
/// # drop(recorder);
/// # Ok::<(), metrics_exporter_prometheus::BuildError>(())
/// ```
pub const SECONDS_BUCKETS: [f64; 14] =
    [0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Histogram buckets for [`STORED_BYTES`]: 64 bytes to 4 MiB (see [`SECONDS_BUCKETS`]).
pub const BYTES_BUCKETS: [f64; 9] = [64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0];

use crate::problem::ProblemCode;

/// What became of a guarded request: the `result` label of `idempotency_requests_total` and
/// `idempotency_shadow_total`, and the `result` field of the `idempotency` span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestResult {
    /// `executed`.
    Executed,
    /// `replayed`.
    Replayed,
    /// `key_missing`.
    KeyMissing,
    /// `key_invalid`.
    KeyInvalid,
    /// `key_reused`.
    KeyReused,
    /// `in_flight`.
    InFlight,
    /// `key_expired`.
    KeyExpired,
    /// `outcome_unknown`.
    OutcomeUnknown,
    /// `body_too_large`.
    BodyTooLarge,
    /// `store_unavailable`.
    StoreUnavailable,
    /// `commit_uncertain`.
    CommitUncertain,
    /// `released`.
    Released,
    /// `response_too_large`.
    ResponseTooLarge,
    /// `handle_still_held`.
    HandleStillHeld,
    /// `scope_missing`.
    ScopeMissing,
}

impl RequestResult {
    /// Every result, in the order of the table above.
    pub const ALL: [RequestResult; 15] = [
        RequestResult::Executed,
        RequestResult::Replayed,
        RequestResult::KeyMissing,
        RequestResult::KeyInvalid,
        RequestResult::KeyReused,
        RequestResult::InFlight,
        RequestResult::KeyExpired,
        RequestResult::OutcomeUnknown,
        RequestResult::BodyTooLarge,
        RequestResult::StoreUnavailable,
        RequestResult::CommitUncertain,
        RequestResult::Released,
        RequestResult::ResponseTooLarge,
        RequestResult::HandleStillHeld,
        RequestResult::ScopeMissing,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            RequestResult::Executed => "executed",
            RequestResult::Replayed => "replayed",
            RequestResult::KeyMissing => "key_missing",
            RequestResult::KeyInvalid => "key_invalid",
            RequestResult::KeyReused => "key_reused",
            RequestResult::InFlight => "in_flight",
            RequestResult::KeyExpired => "key_expired",
            RequestResult::OutcomeUnknown => "outcome_unknown",
            RequestResult::BodyTooLarge => "body_too_large",
            RequestResult::StoreUnavailable => "store_unavailable",
            RequestResult::CommitUncertain => "commit_uncertain",
            RequestResult::Released => "released",
            RequestResult::ResponseTooLarge => "response_too_large",
            RequestResult::HandleStillHeld => "handle_still_held",
            RequestResult::ScopeMissing => "scope_missing",
        }
    }

    /// The result of a request the layer answered with `code`.
    pub(crate) fn of_problem(code: ProblemCode) -> Self {
        match code {
            ProblemCode::KeyInvalid => RequestResult::KeyInvalid,
            ProblemCode::KeyMissing => RequestResult::KeyMissing,
            ProblemCode::KeyReused => RequestResult::KeyReused,
            ProblemCode::RequestInFlight => RequestResult::InFlight,
            ProblemCode::KeyExpired => RequestResult::KeyExpired,
            ProblemCode::OutcomeUnknown => RequestResult::OutcomeUnknown,
            ProblemCode::BodyTooLarge
            | ProblemCode::BodyUnreadable
            | ProblemCode::BodyTimeout
            | ProblemCode::BufferBudgetExhausted => RequestResult::BodyTooLarge,
            ProblemCode::StoreUnavailable => RequestResult::StoreUnavailable,
            ProblemCode::CommitUncertain => RequestResult::CommitUncertain,
            ProblemCode::ResponseTooLarge => RequestResult::ResponseTooLarge,
            ProblemCode::HandleStillHeld => RequestResult::HandleStillHeld,
            ProblemCode::ScopeMissing => RequestResult::ScopeMissing,
            // The answer's body failed: nothing was stored, a retry runs again.
            ProblemCode::HandlerFailed => RequestResult::Released,
            // Not answers of the layer (extractor rejections); never reached from it.
            ProblemCode::ContextMissing | ProblemCode::TransactionMissing => RequestResult::Released,
        }
    }
}

pub(crate) use imp::{OperationMetrics, Telemetry, Timer};

/// The `idempotency` span of one guarded request, its fields to be filled in on the way.
///
/// When no subscriber takes the span and the `log` crate would print none of it (its level is
/// below `INFO`), this is [`Span::none`](tracing::Span::none), which records, enters and exits
/// for nothing. A disabled span still hands each field record, enter and exit to `tracing`'s
/// `log` fallback (which sqlx and axum turn on), only for it to find that the logger wants none
/// of them: 1,279 instructions of a new key's 58,980 (`benches/instructions.rs`). Either way,
/// nothing is seen that the span would have shown. Its target is `tower_idempotency::service`,
/// where it was made before.
pub(crate) fn request_span() -> tracing::Span {
    let span = tracing::info_span!(
        target: "tower_idempotency::service",
        "idempotency",
        operation = tracing::field::Empty,
        mode = tracing::field::Empty,
        record = tracing::field::Empty,
        result = tracing::field::Empty,
        replayed = tracing::field::Empty,
        fencing_token = tracing::field::Empty,
    );
    if span.is_disabled() && log::max_level() < log::LevelFilter::Info { tracing::Span::none() } else { span }
}

/// The step label of `idempotency_store_seconds`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StoreStep {
    Begin,
    Finish,
}

#[cfg(feature = "metrics")]
mod imp {
    use std::collections::HashMap;
    use std::sync::{Arc, OnceLock, RwLock};
    use std::time::Duration;

    use metrics::{Counter, Histogram};

    use super::{OVERHEAD, REQUESTS, RequestResult, SHADOW, STORE, STORED_BYTES, StoreStep};

    /// The most operations whose handles a layer keeps.
    const MAX_OPERATIONS: usize = 256;

    /// A layer's metric handles, per operation, resolved once (shared by the layer's clones).
    #[derive(Default)]
    pub(crate) struct Telemetry {
        operations: RwLock<HashMap<Arc<str>, OperationMetrics>>,
    }

    impl Telemetry {
        /// The handles of `operation`.
        pub(crate) fn operation(&self, operation: &Arc<str>) -> OperationMetrics {
            let read = self.operations.read().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(metrics) = read.get(operation) {
                return metrics.clone();
            }
            drop(read);
            let mut write = self.operations.write().unwrap_or_else(|poisoned| poisoned.into_inner());
            let label: Arc<str> = if write.len() < MAX_OPERATIONS { operation.clone() } else { Arc::from("other") };
            write.entry(operation.clone()).or_insert_with(|| OperationMetrics::new(label)).clone()
        }
    }

    /// One operation's handles, each resolved on its first use.
    #[derive(Clone)]
    pub(crate) struct OperationMetrics(Arc<Handles>);

    struct Handles {
        operation: Arc<str>,
        requests: [OnceLock<Counter>; 15],
        shadow: [OnceLock<Counter>; 15],
        overhead: OnceLock<Histogram>,
        store: [OnceLock<Histogram>; 2],
        stored_bytes: OnceLock<Histogram>,
    }

    fn index(result: RequestResult) -> usize {
        RequestResult::ALL.iter().position(|r| *r == result).unwrap_or(0)
    }

    impl OperationMetrics {
        fn new(operation: Arc<str>) -> Self {
            Self(Arc::new(Handles {
                operation,
                requests: Default::default(),
                shadow: Default::default(),
                overhead: OnceLock::new(),
                store: Default::default(),
                stored_bytes: OnceLock::new(),
            }))
        }

        fn label(&self) -> String {
            self.0.operation.to_string()
        }

        /// Counts an enforced request.
        pub(crate) fn request(&self, result: RequestResult) {
            self.0.requests[index(result)]
                .get_or_init(|| metrics::counter!(REQUESTS, "operation" => self.label(), "result" => result.as_str()))
                .increment(1);
        }

        /// Counts what shadow mode saw.
        pub(crate) fn shadow(&self, result: RequestResult) {
            self.0.shadow[index(result)]
                .get_or_init(|| metrics::counter!(SHADOW, "operation" => self.label(), "result" => result.as_str()))
                .increment(1);
        }

        /// The layer's own time on an enforced request.
        pub(crate) fn overhead(&self, overhead: Duration) {
            self.0.overhead.get_or_init(|| metrics::histogram!(OVERHEAD, "operation" => self.label())).record(overhead);
        }

        /// A store call's time.
        pub(crate) fn store(&self, step: StoreStep, took: Duration) {
            let (slot, name) = match step {
                StoreStep::Begin => (0, "begin"),
                StoreStep::Finish => (1, "finish"),
            };
            self.0.store[slot]
                .get_or_init(|| metrics::histogram!(STORE, "operation" => self.label(), "step" => name))
                .record(took);
        }

        /// A stored response's body size.
        pub(crate) fn stored_bytes(&self, bytes: usize) {
            self.0
                .stored_bytes
                .get_or_init(|| metrics::histogram!(STORED_BYTES, "operation" => self.label()))
                .record(bytes as f64);
        }
    }

    /// The clock the timings read: the CPU's time-stamp counter where it is invariant (a
    /// register read, a few nanoseconds), else the operating system's monotonic clock. The
    /// counter is calibrated against the monotonic clock once per process, on first use.
    fn clock() -> &'static quanta::Clock {
        static CLOCK: OnceLock<quanta::Clock> = OnceLock::new();
        CLOCK.get_or_init(quanta::Clock::new)
    }

    /// A reading of [`clock`]: raw ticks, turned into time only when a step's length is taken.
    #[derive(Clone, Copy)]
    pub(crate) struct Tick(u64);

    /// Measures the layer's own time: the whole guarded path less the inner service's.
    pub(crate) struct Timer {
        start: Tick,
        inner: Duration,
    }

    impl Timer {
        pub(crate) fn start() -> Self {
            Self { start: Tick(clock().raw()), inner: Duration::ZERO }
        }

        /// Now, to time a step.
        pub(crate) fn now(&self) -> Option<Tick> {
            Some(Tick(clock().raw()))
        }

        /// The time since `since` (from [`now`](Self::now)).
        pub(crate) fn since(since: Option<Tick>) -> Duration {
            since.map_or(Duration::ZERO, |Tick(since)| {
                let clock = clock();
                clock.delta(since, clock.raw())
            })
        }

        /// The inner service took `took`.
        pub(crate) fn inner_took(&mut self, took: Duration) {
            self.inner += took;
        }

        /// The layer's own time so far.
        pub(crate) fn overhead(&self) -> Duration {
            Self::since(Some(self.start)).saturating_sub(self.inner)
        }
    }
}

#[cfg(not(feature = "metrics"))]
mod imp {
    //! Without the `metrics` feature: the same surface, doing nothing.
    use std::sync::Arc;
    use std::time::Duration;

    use super::{RequestResult, StoreStep};

    #[derive(Default)]
    pub(crate) struct Telemetry;

    impl Telemetry {
        #[inline(always)]
        pub(crate) fn operation(&self, _: &Arc<str>) -> OperationMetrics {
            OperationMetrics
        }
    }

    #[derive(Clone)]
    pub(crate) struct OperationMetrics;

    impl OperationMetrics {
        #[inline(always)]
        pub(crate) fn request(&self, _: RequestResult) {}
        #[inline(always)]
        pub(crate) fn shadow(&self, _: RequestResult) {}
        #[inline(always)]
        pub(crate) fn overhead(&self, _: Duration) {}
        #[inline(always)]
        pub(crate) fn store(&self, _: StoreStep, _: Duration) {}
        #[inline(always)]
        pub(crate) fn stored_bytes(&self, _: usize) {}
    }

    pub(crate) struct Timer;

    impl Timer {
        #[inline(always)]
        pub(crate) fn start() -> Self {
            Timer
        }
        #[inline(always)]
        pub(crate) fn now(&self) -> Option<std::convert::Infallible> {
            None
        }
        #[inline(always)]
        pub(crate) fn since(_: Option<std::convert::Infallible>) -> Duration {
            Duration::ZERO
        }
        #[inline(always)]
        pub(crate) fn inner_took(&mut self, _: Duration) {}
        #[inline(always)]
        pub(crate) fn overhead(&self) -> Duration {
            Duration::ZERO
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RequestResult;
    use crate::problem::ProblemCode;

    /// Every refusal the layer answers is counted under its own result (the ones a test of
    /// `MemoryStore` cannot provoke included: a dead store, an uncertain commit, a handle kept
    /// past the handler).
    #[test]
    fn each_refusal_maps_to_its_result() {
        for (code, result) in [
            (ProblemCode::KeyInvalid, "key_invalid"),
            (ProblemCode::KeyMissing, "key_missing"),
            (ProblemCode::KeyReused, "key_reused"),
            (ProblemCode::RequestInFlight, "in_flight"),
            (ProblemCode::KeyExpired, "key_expired"),
            (ProblemCode::OutcomeUnknown, "outcome_unknown"),
            (ProblemCode::BodyTooLarge, "body_too_large"),
            (ProblemCode::BodyUnreadable, "body_too_large"),
            (ProblemCode::BodyTimeout, "body_too_large"),
            (ProblemCode::BufferBudgetExhausted, "body_too_large"),
            (ProblemCode::StoreUnavailable, "store_unavailable"),
            (ProblemCode::CommitUncertain, "commit_uncertain"),
            (ProblemCode::ResponseTooLarge, "response_too_large"),
            (ProblemCode::HandleStillHeld, "handle_still_held"),
            (ProblemCode::ScopeMissing, "scope_missing"),
            (ProblemCode::HandlerFailed, "released"),
        ] {
            assert_eq!(RequestResult::of_problem(code).as_str(), result, "{code:?}");
        }
    }
}
