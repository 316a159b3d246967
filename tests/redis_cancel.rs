//! The fast path is cancel-safe: a request dropped at any await point (its client gone) leaves
//! no Redis lock behind, so its retry is not held up by a lock nobody owns. Against a real
//! `redis-server`; locks live ten minutes here, so a lock left behind would still be there.
#![cfg(all(feature = "testkit", feature = "postgres", feature = "redis"))]

mod support;

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use support::redis::{GatedProxy, eventually, find_key, shared_server, unique_prefix};
use tower_idempotency::store::{Begin, BeginRequest, Claim, Outcome, Store};
use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
use tower_idempotency::{CouplingMode, FastPath, MemoryStore, RecordId};

/// Long enough that no lock in these tests goes away by itself.
const LOCK_TTL: Duration = Duration::from_secs(600);
/// The bound on how long a released lock may take to go (a liveness bound).
const GONE_WITHIN: Duration = Duration::from_secs(10);

/// Whether the lock of `id` under `prefix` is in Redis.
fn locked(prefix: &str, id: &RecordId) -> bool {
    find_key(shared_server(), prefix, id, 'l').is_some()
}

/// Polls `future` up to `polls` times (yielding to the runtime in between, so its I/O moves on)
/// and drops it if it is not done by then: a client that goes away at that point.
async fn poll_then_drop<F: Future>(future: F, polls: usize) -> Option<F::Output> {
    let mut future = pin!(future);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await;
        if let Poll::Ready(output) = polled {
            return Some(output);
        }
        tokio::task::yield_now().await;
    }
    None
}

#[test]
fn cancelled_while_the_acquire_script_is_in_flight_leaves_no_lock() {
    tower_idempotency::testkit::run(async {
        const ROUNDS: usize = 5;
        let proxy = GatedProxy::start(shared_server().port).await;
        let prefix = unique_prefix();
        // A call bound far longer than the test: the request is cancelled, never timed out.
        let fast = FastPath::connect(MemoryStore::new(), &proxy.url())
            .expect("redis URL")
            .prefix(&prefix)
            .expect("prefix")
            .timeout(Duration::from_secs(60))
            .lock_ttl(LOCK_TTL);
        let fp = fingerprint(1);
        // Connect and load the script while replies pass.
        let warm = fresh_id("warm");
        let Begin::Claimed(claim) = fast.begin(BeginRequest::new(&warm, &fp)).await.expect("begin") else {
            panic!("a fresh identity is claimed")
        };
        claim.finish(Outcome::Release).await.expect("finish");

        proxy.hold();
        let mut ids = Vec::new();
        for _ in 0..ROUNDS {
            let id = fresh_id("in-flight");
            let request = {
                let fast = fast.clone();
                tokio::spawn(async move {
                    let fp = fingerprint(1);
                    let _ = fast.begin(BeginRequest::new(&id, &fp)).await;
                })
            };
            // The script ran (the lock is in Redis); its answer is held back.
            eventually(Duration::from_secs(30), "the acquire script took the lock", || locked(&prefix, &id)).await;
            request.abort();
            assert!(request.await.expect_err("cancelled").is_cancelled());
            eventually(GONE_WITHIN, "the cancelled request's lock was released", || !locked(&prefix, &id)).await;
            ids.push(id);
        }
        proxy.release();

        // Each retry gets through at once: nothing to wait for.
        for id in &ids {
            let begun = fast.begin(BeginRequest::new(id, &fp)).await.expect("begin");
            let Begin::Claimed(claim) = begun else { panic!("the retry must be claimed at once") };
            claim.finish(Outcome::Complete(answer("retried"))).await.expect("finish");
        }
        let stats = fast.stats();
        assert_eq!((stats.waits, stats.in_flight, stats.handed_over), (0, 0, 0), "{stats:?}");
    });
}

#[test]
fn cancelled_at_every_await_point_leaves_no_lock() {
    tower_idempotency::testkit::run(async {
        // Enough polls to pass every await point of a begin and of a finish on this machine.
        const MOST_POLLS: usize = 60;
        let prefix = unique_prefix();
        let store = support::pg_store(CouplingMode::Atomic).await;
        let fast = FastPath::connect(store, &shared_server().url())
            .expect("redis URL")
            .prefix(&prefix)
            .expect("prefix")
            .timeout(Duration::from_secs(60))
            .lock_ttl(LOCK_TTL);
        let fp = fingerprint(2);
        let (mut begins_cut, mut finishes_cut) = (0, 0);
        let mut ids = Vec::new();
        for polls in 0..=MOST_POLLS {
            // Cancelled within the begin.
            let id = fresh_id("cut-begin");
            match poll_then_drop(fast.begin(BeginRequest::new(&id, &fp)), polls).await {
                None => begins_cut += 1,
                Some(begun) => {
                    let Begin::Claimed(claim) = begun.expect("begin") else { panic!("a fresh identity is claimed") };
                    drop(claim);
                }
            }
            ids.push(id);

            // Claimed, then cancelled within the finish.
            let id = fresh_id("cut-finish");
            let Begin::Claimed(claim) = fast.begin(BeginRequest::new(&id, &fp)).await.expect("begin") else {
                panic!("a fresh identity is claimed")
            };
            if poll_then_drop(claim.finish(Outcome::Complete(answer("cut"))), polls).await.is_none() {
                finishes_cut += 1;
            }
            ids.push(id);
        }
        assert!(begins_cut > 1 && finishes_cut > 1, "cut {begins_cut} begins and {finishes_cut} finishes");

        for id in &ids {
            eventually(GONE_WITHIN, "every cancelled request's lock was released", || !locked(&prefix, id)).await;
        }
        // Every retry finds no lock: it claims (a rolled-back claim), or replays a committed one.
        let before = fast.stats();
        for id in &ids {
            match fast.begin(BeginRequest::new(id, &fp).wait(Duration::from_secs(5))).await.expect("begin") {
                Begin::Claimed(claim) => claim.finish(Outcome::Release).await.expect("finish"),
                Begin::Existing(record) => assert_eq!(record.response, Some(answer("cut"))),
                Begin::InFlight { .. } => panic!("a retry found its identity in flight"),
            }
        }
        let after = fast.stats();
        assert_eq!(after.waits, before.waits, "no retry waited on a lock: {after:?}");
    });
}
