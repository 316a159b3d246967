//! Atomic mode on the real PostgreSQL with the claim sent first, no read before it
//! (`ReadBeforeClaim::Never`, migration 8's `<table>_claim_first`): the store suites, the
//! duplicates released together, the HTTP storm, concurrent retries of a finished request and
//! one while the identity's lock is held, a dead lease taken over, and a database without
//! migration 8.
#![cfg(all(feature = "testkit", feature = "postgres"))]

mod support;

use std::time::Duration;

use tower_idempotency::store::postgres::ReadBeforeClaim;
use tower_idempotency::testkit::store::{answer, claim, existing, fingerprint, fresh_id};
use tower_idempotency::{
    Begin, BeginRequest, Claim, CouplingMode, Outcome, PostgresStore, RecordState, StaleLeasePolicy, Store,
};

/// A migrated store in a schema of its own that claims first.
async fn claim_first_store(mode: CouplingMode) -> PostgresStore {
    support::pg_store(mode).await.read_before_claim(ReadBeforeClaim::Never)
}

mod atomic {
    use tower_idempotency::CouplingMode;
    tower_idempotency::store_suite!(atomic, crate::claim_first_store(CouplingMode::Atomic));

    mod lifecycle {
        use tower_idempotency::CouplingMode;
        tower_idempotency::lifecycle_suite!(atomic, crate::claim_first_store(CouplingMode::Atomic));
    }

    #[cfg(feature = "axum")]
    mod http {
        use tower_idempotency::CouplingMode;
        tower_idempotency::http_contract_suite!(crate::claim_first_store(CouplingMode::Atomic));
    }
}

/// Identical begins released together, for several keys at once, on one table and on a hash
/// partitioned one: exactly one contender of each key claims it, every other one replays its
/// record (or is told it is in flight).
#[tokio::test]
async fn duplicates_released_together_claim_each_identity_once() {
    const KEYS: usize = 24;
    const DUPLICATES: usize = 16;
    for partitioned in [false, true] {
        let store = if partitioned {
            support::pg_partitioned_store(CouplingMode::Atomic).await
        } else {
            support::pg_store(CouplingMode::Atomic).await
        };
        let store = store.read_before_claim(ReadBeforeClaim::Never);
        support::each_identity_claimed_once(&store, KEYS, DUPLICATES, &format!("partitioned {partitioned}")).await;
        let records: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency_records").fetch_one(store.pool()).await.unwrap();
        assert_eq!(records, KEYS as i64, "partitioned {partitioned}: one record per key");
    }
}

/// The HTTP storm of `pg_storm.rs` with the claim first: one order row per key, every other
/// answer the identical replay or a 409.
#[cfg(feature = "axum")]
#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key() {
    const KEYS: usize = 60;
    const DUPLICATES: usize = 32;
    tower_idempotency::testkit::run(async {
        let store = claim_first_store(CouplingMode::Atomic).await;
        let conflicts = support::storm::pg_storm(&store, "fstorm", KEYS, DUPLICATES, 4).await;
        println!("claim-first storm: {KEYS} keys x {DUPLICATES} requests, {conflicts} answers were 409");
    });
}

/// A leased claim whose holder died, on a route that may run again: an atomic store that
/// claims first takes the identity over in its claim (deleting the dead lease under the lock)
/// when the request is the same, and leaves it for the stale-lease policy to answer when the
/// request differs.
#[tokio::test]
async fn a_dead_lease_is_taken_over_by_the_same_request_only() {
    let leased = support::pg_store(CouplingMode::Leased).await;
    let first = leased.clone().mode(CouplingMode::Atomic).read_before_claim(ReadBeforeClaim::Never);
    let (id, fp) = (fresh_id("dead-lease"), fingerprint(3));
    let lease = Duration::from_millis(200);
    let held = leased.begin(BeginRequest::new(&id, &fp).lease(lease)).await.expect("begin");
    let Begin::Claimed(dead) = held else { panic!("a new identity is claimed") };
    std::mem::forget(dead); // The holder dies: nothing releases or renews its lease.
    tokio::time::sleep(lease * 2).await;

    let other = fingerprint(4);
    let request = BeginRequest::new(&id, &other).stale_lease(StaleLeasePolicy::Reexecute);
    let refused = first.begin(request).await.expect("begin");
    assert!(!matches!(refused, Begin::Claimed(_)), "another request does not take a dead lease over");

    let request = BeginRequest::new(&id, &fp).stale_lease(StaleLeasePolicy::Reexecute);
    let Begin::Claimed(claim) = first.begin(request).await.expect("begin") else {
        panic!("the same request on a re-executable route takes the dead lease over")
    };
    claim.finish(Outcome::Complete(answer("again"))).await.expect("finish");
    let record = existing(&first, BeginRequest::new(&id, &fp)).await;
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.response.expect("the answer").body, "again");
}

/// Retries of one finished request at once, with no wait (`BeginRequest::new`'s default): each
/// claim first finds the record under the lock, and a retry that finds the lock held by another
/// such retry is answered from the record too, never told the finished request is in flight.
#[tokio::test]
async fn concurrent_retries_of_a_finished_request_all_replay_without_a_wait() {
    const RETRIES: usize = 8;
    const ROUNDS: usize = 50;
    let store = claim_first_store(CouplingMode::Atomic).await;
    let (id, fp) = (fresh_id("retries"), fingerprint(5));
    claim(&store, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("done"))).await.expect("finish");
    for round in 0..ROUNDS {
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(RETRIES));
        let retries: Vec<_> = (0..RETRIES)
            .map(|_| {
                let (store, barrier) = (store.clone(), barrier.clone());
                tokio::spawn(async move {
                    let fp = fingerprint(5);
                    barrier.wait().await;
                    store.begin(BeginRequest::new(&id, &fp)).await.expect("begin")
                })
            })
            .collect();
        for retry in retries {
            match retry.await.expect("retry") {
                Begin::Existing(record) => assert_eq!(record.response.expect("the answer").body, "done"),
                other => panic!("round {round}: a retry of a finished request got {other:?}"),
            }
        }
    }
}

/// A retry of a finished request is refused by the claim before it takes the identity's lock,
/// so it does not wait for whoever holds that lock: here another session holds it throughout,
/// and the retry, allowed to wait ten minutes, is answered from the record at once.
#[tokio::test]
async fn a_retry_of_a_finished_request_does_not_wait_for_the_lock() {
    let store = claim_first_store(CouplingMode::Atomic).await;
    let (id, fp) = (fresh_id("unlocked"), fingerprint(6));
    claim(&store, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("done"))).await.expect("finish");
    // The claim's advisory lock key: the first eight bytes of the identity's digest.
    let lock_key = u64::from_str_radix(&id.to_hex()[..16], 16).expect("hex") as i64;
    let mut holder = store.pool().acquire().await.expect("a connection");
    sqlx::query("SELECT pg_advisory_lock($1)").bind(lock_key).execute(&mut *holder).await.expect("hold the lock");

    let retry = store.begin(BeginRequest::new(&id, &fp).wait(Duration::from_secs(600)));
    let answered = tokio::time::timeout(Duration::from_secs(60), retry).await;
    let Ok(Ok(Begin::Existing(record))) = answered else {
        panic!("a retry of a finished request waited for the lock or was not replayed: {answered:?}")
    };
    assert_eq!(record.response.expect("the answer").body, "done");
    sqlx::query("SELECT pg_advisory_unlock($1)").bind(lock_key).execute(&mut *holder).await.expect("unlock");
}

/// A database whose records table lacks migration 8: the first request that would claim first
/// is answered `Unavailable`, and from then on the store reads first and claims as before.
#[tokio::test]
async fn without_migration_8_the_store_falls_back_to_reading_first() {
    let store = claim_first_store(CouplingMode::Atomic).await;
    sqlx::raw_sql("DROP FUNCTION idempotency_records_claim_first").execute(store.pool()).await.unwrap();
    let (id, fp) = (fresh_id("unmigrated"), fingerprint(5));
    let refused = store.begin(BeginRequest::new(&id, &fp)).await;
    assert!(refused.is_err(), "the missing function is a store failure, not a claim");
    for _ in 0..3 {
        let Begin::Claimed(claim) = store.begin(BeginRequest::new(&id, &fp)).await.expect("begin") else {
            panic!("reading first, the identity is claimed")
        };
        // Rolled back, and awaited: the identity is free before the next claim. (A dropped
        // claim rolls back too, but in the background: the next claim could find it not yet
        // rolled back and be answered in flight.)
        claim.finish(Outcome::Release).await.expect("release");
    }
    let claim = claim(&store, BeginRequest::new(&id, &fp)).await;
    claim.finish(Outcome::Complete(answer("read first"))).await.expect("finish");
    let record = existing(&store, BeginRequest::new(&id, &fp)).await;
    assert_eq!(record.response.expect("the answer").body, "read first");
}
