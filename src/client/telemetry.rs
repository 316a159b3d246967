//! The client layers' counters, through the `metrics` facade (feature `metrics`); without the
//! feature every function here does nothing.
//!
//! | metric | labels | counts |
//! |---|---|---|
//! | `idempotency_client_attempts_total` | — | attempts sent for guarded requests, first attempts included |
//! | `idempotency_client_retries_total` | `reason` | retries, by [`RetryReason::as_str`] |
//! | `idempotency_client_give_ups_total` | `reason` | logical requests whose last answer still said "later" (or failed) when the attempts or the deadline ran out, by the reason of that last answer |

use super::policy::RetryReason;

/// Attempts sent for guarded requests.
pub const ATTEMPTS: &str = "idempotency_client_attempts_total";
/// Retries, labelled with `reason`.
pub const RETRIES: &str = "idempotency_client_retries_total";
/// Give-ups, labelled with `reason`.
pub const GIVE_UPS: &str = "idempotency_client_give_ups_total";

/// One attempt is about to be sent.
pub(crate) fn attempt() {
    #[cfg(feature = "metrics")]
    metrics::counter!(ATTEMPTS).increment(1);
}

/// A retry is about to be made, for `reason`.
pub(crate) fn retry(reason: RetryReason) {
    #[cfg(feature = "metrics")]
    metrics::counter!(RETRIES, "reason" => reason.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = reason;
}

/// The layer gives up, the last answer having said `reason`.
pub(crate) fn give_up(reason: RetryReason) {
    #[cfg(feature = "metrics")]
    metrics::counter!(GIVE_UPS, "reason" => reason.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = reason;
}
