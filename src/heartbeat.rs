//! The heartbeat of a leased claim: while the handler runs, the lease is renewed (fenced by the
//! claim's token) every third of the lease, so a handler that is alive never loses its claim
//! however long it takes, and a dead process's lease runs out as before.
//!
//! A renewal that finds the claim gone ([`Renewal::Lost`]), or renewals that keep failing
//! until the lease has run out, raise the execution's lease-lost signal, which the handler
//! sees through [`IdempotencyContext::lease_lost`](crate::IdempotencyContext::lease_lost). The
//! handler is not cancelled (it may be mid-way through something it must finish or undo); its
//! outcome then goes to the fenced finish, which refuses it when the claim is truly gone, and
//! the client gets 503 `idempotency_commit_uncertain`.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use tokio::time::Instant;

use crate::context::IdempotencyContext;
use crate::join::{Either, first};
use crate::store::{Claim, Renewal};

/// The shortest interval between renewals, whatever the lease.
const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// Whether `claim` gets a heartbeat: a leased claim with the heartbeat on. Not claims without
/// a lease (atomic), nor any with the heartbeat off.
pub(crate) fn beats<C: Claim>(claim: &C, enabled: bool) -> bool {
    enabled && claim.fencing_token().is_some()
}

/// Runs `handler` to its end while renewing `claim`'s lease (of `lease`) beside it, and hands
/// the claim back with the handler's output; a lost lease raises the signal of `lost`, the
/// execution's context, which the handler shares. Without `lost`, only runs the handler.
pub(crate) async fn beside<C: Claim, F: Future>(
    claim: C,
    lease: Duration,
    lost: Option<IdempotencyContext>,
    handler: F,
) -> (C, F::Output) {
    let Some(lost) = lost else {
        return (claim, handler.await);
    };
    let interval = (lease / 3).max(MIN_INTERVAL);
    let mut handler = pin!(handler);
    // The lease the claim began with runs from no later than now (one clock reading for both).
    let started = Instant::now();
    let mut held_until = started + lease;
    let mut next_beat = started + interval;
    loop {
        let tick = tokio::time::sleep_until(next_beat);
        if let Either::Left(output) = first(handler.as_mut(), pin!(tick)).await {
            return (claim, output);
        }
        let sent = Instant::now();
        // Bounded, so that a store that hangs does not stop the beat; the next tick tries again.
        let renewal = tokio::time::timeout(interval, claim.renew(lease));
        let renewed = match first(handler.as_mut(), pin!(renewal)).await {
            Either::Left(output) => return (claim, output),
            Either::Right(renewed) => renewed,
        };
        next_beat = Instant::now() + interval;
        match renewed {
            Ok(Ok(Renewal::Renewed)) => held_until = sent + lease,
            Ok(Ok(Renewal::NotLeased)) => return (claim, handler.await),
            Ok(Ok(Renewal::Lost)) => return (claim, lose(&lost, handler).await),
            // The store failed or was slow: the lease still holds until `held_until`.
            Ok(Err(error)) => {
                tracing::debug!(%error, "idempotency: renewing a lease failed; trying again");
                if Instant::now() >= held_until {
                    return (claim, lose(&lost, handler).await);
                }
            }
            Err(_elapsed) if Instant::now() >= held_until => return (claim, lose(&lost, handler).await),
            Err(_elapsed) => {}
        }
    }
}

/// Raises the lease-lost signal, then waits for the handler to answer.
async fn lose<F: Future>(lost: &IdempotencyContext, handler: std::pin::Pin<&mut F>) -> F::Output {
    tracing::warn!("idempotency: the lease of a running handler was lost; its outcome will not be stored");
    lost.raise_lease_lost();
    handler.await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MemoryStore;
    use crate::fingerprint::Fingerprint;
    use crate::key::{IdempotencyKey, RecordId, Scope};
    use crate::store::{Begin, BeginRequest, Store};

    async fn leased(store: &MemoryStore, id: &RecordId, lease: Duration) -> crate::store::memory::MemoryClaim {
        let fp = Fingerprint::from_parts(1, [1; 32]);
        match store.begin(BeginRequest::new(id, &fp).lease(lease)).await.unwrap() {
            Begin::Claimed(claim) => claim,
            other => panic!("expected a claim, got {other:?}"),
        }
    }

    fn id(key: &str) -> RecordId {
        RecordId::new(&Scope::new("t"), "op", &IdempotencyKey::new(key).unwrap())
    }

    /// The context a leased execution of `id` gets, with its lease-lost signal.
    fn context(id: &RecordId) -> IdempotencyContext {
        IdempotencyContext::with_lease_signal(*id, "op", Some(1), true)
    }

    #[tokio::test]
    async fn a_handler_outliving_its_lease_keeps_it_and_a_lost_one_is_signalled() {
        let store = MemoryStore::new();
        let lease = Duration::from_millis(200);
        let (alive, fp) = (id("alive"), Fingerprint::from_parts(1, [1; 32]));
        let claim = leased(&store, &alive, lease).await;
        assert!(beats(&claim, true), "a leased claim has a heartbeat");
        assert!(!beats(&claim, false), "unless the heartbeat is off");
        let lost = context(&alive);
        let (claim, ()) = beside(claim, lease, Some(lost.clone()), tokio::time::sleep(lease * 3)).await;
        assert!(!lost.lease_lost(), "a live handler keeps its lease");
        // A duplicate still finds it in flight: the lease was extended past three lease lengths.
        assert!(matches!(store.begin(BeginRequest::new(&alive, &fp)).await.unwrap(), Begin::InFlight { .. }));
        drop(claim);

        // Negative control: without the heartbeat the same handler's lease runs out.
        let (dead, fp) = (id("no-heartbeat"), Fingerprint::from_parts(1, [1; 32]));
        let claim = leased(&store, &dead, lease).await;
        let (_claim, ()) = beside(claim, lease, None, tokio::time::sleep(lease * 3)).await;
        assert!(matches!(store.begin(BeginRequest::new(&dead, &fp)).await.unwrap(), Begin::Existing(_)));

        // A record evicted under a running handler: the next beat raises the signal.
        let evicted = id("evicted");
        let claim = leased(&store, &evicted, lease).await;
        let lost = context(&evicted);
        let evict = async {
            tokio::time::sleep(lease / 2).await;
            crate::store::Admin::evict(&store, &evicted).await.unwrap();
            tokio::time::sleep(lease * 2).await;
        };
        let (_claim, ()) = beside(claim, lease, Some(lost.clone()), evict).await;
        assert!(lost.lease_lost(), "the heartbeat finds the lease lost");
    }
}
