//! The recovery worker's metrics, through the `metrics` facade (feature `metrics`). The names
//! and labels are a published interface: see the [module docs](super).

use crate::store::StateCounts;

/// `idempotency_recovery_total{action}`, by what the worker did.
pub(super) fn actions(actions: &[(&'static str, usize)]) {
    for &(action, n) in actions {
        if n > 0 {
            metrics::counter!(super::RECOVERY_TOTAL, "action" => action).increment(n as u64);
        }
    }
}

/// `idempotency_records{state}` and `idempotency_oldest_unknown_seconds`, from the store's counts:
/// every state's after a `census`, else the open states' (the others keep the last census's).
pub(super) fn counts(counts: &StateCounts, census: bool) {
    let open = [("processing", counts.processing), ("unknown", counts.unknown)];
    let settled = [("completed", counts.completed), ("failed", counts.failed), ("expired", counts.expired)];
    for (state, n) in open.into_iter().chain(settled.into_iter().filter(|_| census)) {
        metrics::gauge!(super::RECORDS, "state" => state).set(n as f64);
    }
    let oldest = counts.oldest_unknown.map_or(0.0, |age| age.as_secs_f64());
    metrics::gauge!(super::OLDEST_UNKNOWN_SECONDS).set(oldest);
}
