//! The lease-lost signal of one leased execution: raised by the heartbeat when the claim is
//! found gone (or could not be renewed before its lease ran out), read by the handler through
//! [`IdempotencyContext`](crate::IdempotencyContext).
//!
//! A flag and a [`Notify`]. It lives in the execution's context, which the heartbeat and the
//! handler share, so a leased request pays no allocation of its own for it, and nothing when
//! it is dropped unraised.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// One execution's lease-lost signal.
#[derive(Default)]
pub(crate) struct LeaseLost {
    raised: AtomicBool,
    notify: Notify,
}

impl LeaseLost {
    /// Raises the signal and wakes everyone waiting in [`raised`](Self::raised).
    pub(crate) fn raise(&self) {
        self.raised.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Whether the signal has been raised.
    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// Resolves once the signal is raised; never, if it is not.
    pub(crate) async fn raised(&self) {
        loop {
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the flag is read, so a raise in between is not missed.
            notified.as_mut().enable();
            if self.is_raised() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::LeaseLost;

    #[tokio::test]
    async fn a_raise_wakes_a_waiter_and_an_unraised_signal_never_resolves() {
        let signal = Arc::new(LeaseLost::default());
        let waiter = tokio::spawn({
            let signal = signal.clone();
            async move { signal.raised().await }
        });
        tokio::task::yield_now().await;
        assert!(!signal.is_raised());
        signal.raise();
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("woken").expect("no panic");
        assert!(signal.is_raised());
        // Raised before anyone waits: resolves at once.
        signal.raised().await;

        let quiet = LeaseLost::default();
        let waited = tokio::time::timeout(Duration::from_millis(50), quiet.raised()).await;
        assert!(waited.is_err(), "an unraised signal does not resolve");
    }
}
