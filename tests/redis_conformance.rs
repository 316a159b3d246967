//! The conformance suites with the Redis fast path in front of PostgreSQL (atomic and leased),
//! on a `redis-server` this test binary starts on a free loopback port; and what the fast path
//! itself promises: replays without the database, duplicates that wait without a database
//! connection, locks released and bounded, and every Redis failure a quiet fall-back.
#![cfg(all(feature = "testkit", feature = "postgres", feature = "redis"))]

mod support;

use std::time::Duration;

use support::redis::{RedisServer, find_key, free_port, shared_server, unique_prefix};
use tower_idempotency::fast_path::FastPathStats;
use tower_idempotency::testkit::store::{answer, claim, existing, fingerprint, fresh_id};
use tower_idempotency::{BeginRequest, Claim, CouplingMode, FastPath, Outcome, PostgresStore, RecordState, Retention};

/// A fresh PostgreSQL store behind the fast path, on the shared Redis, with a prefix of its own.
async fn fast(mode: CouplingMode) -> FastPath<PostgresStore> {
    support::redis::fast_path(support::pg_store(mode).await, &shared_server().url())
}

support::suites_in_both_modes!(crate::fast);

/// The Redis key of `id`'s cached response or lock under `prefix` (it must exist).
fn key(prefix: &str, id: &tower_idempotency::RecordId, kind: char) -> String {
    find_key(shared_server(), prefix, id, kind).unwrap_or_else(|| panic!("no {kind} key for {id:?} under {prefix}"))
}

/// Whether `id` has a cached response or lock under `prefix`.
fn exists(prefix: &str, id: &tower_idempotency::RecordId, kind: char) -> bool {
    find_key(shared_server(), prefix, id, kind).is_some()
}

#[test]
fn replays_are_answered_from_redis_without_the_database() {
    tower_idempotency::testkit::run(async {
        let store = support::pg_store(CouplingMode::Atomic).await;
        let fast = support::redis::fast_path(store.clone(), &shared_server().url());
        let (id, fp) = (fresh_id("redis-hit"), fingerprint(1));
        claim(&fast, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("once"))).await.unwrap();
        // From here on the database is gone: only Redis can answer.
        store.pool().close().await;
        let record = existing(&fast, BeginRequest::new(&id, &fp)).await;
        assert_eq!(record.state, RecordState::Completed);
        assert_eq!(record.response, Some(answer("once")), "the cached response must come back byte for byte");
        let other = fingerprint(2);
        let mismatch = existing(&fast, BeginRequest::new(&id, &other)).await;
        assert_eq!(mismatch.fingerprint, fp, "a retry of another request gets the record's own fingerprint");
        let stats = fast.stats();
        assert_eq!((stats.hits, stats.cached, stats.degraded), (2, 1, 0), "{stats:?}");
    });
}

#[test]
fn a_waiting_duplicate_holds_no_database_connection() {
    tower_idempotency::testkit::run(async {
        const DUPLICATES: usize = 8;
        let store = support::pg_store(CouplingMode::Atomic).await;
        let fast = support::redis::fast_path(store.clone(), &shared_server().url());
        let (id, fp) = (fresh_id("redis-wait"), fingerprint(3));
        let holder = claim(&fast, BeginRequest::new(&id, &fp)).await;
        let mut waiters = Vec::new();
        for _ in 0..DUPLICATES {
            let fast = fast.clone();
            waiters.push(tokio::spawn(async move {
                let record = existing(&fast, BeginRequest::new(&id, &fp).wait(Duration::from_secs(20))).await;
                record.response
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let pool = store.pool();
        let in_use = pool.size() as usize - pool.num_idle();
        assert_eq!(in_use, 1, "only the holder's transaction may hold a connection while {DUPLICATES} duplicates wait");
        assert_eq!(fast.stats().waits, DUPLICATES as u64);
        holder.finish(Outcome::Complete(answer("awaited"))).await.unwrap();
        for waiter in waiters {
            assert_eq!(waiter.await.unwrap(), Some(answer("awaited")));
        }
        assert_eq!(fast.stats().hits, DUPLICATES as u64, "every duplicate is answered from the cache");
    });
}

#[test]
fn a_duplicate_of_another_request_is_handed_to_the_store_at_once() {
    tower_idempotency::testkit::run(async {
        let fast = fast(CouplingMode::Leased).await;
        let (id, first, other) = (fresh_id("redis-handover"), fingerprint(4), fingerprint(5));
        let holder = claim(&fast, BeginRequest::new(&id, &first)).await;
        let started = std::time::Instant::now();
        let record = existing(&fast, BeginRequest::new(&id, &other).wait(Duration::from_secs(5))).await;
        assert_eq!(record.fingerprint, first, "the leased store reports the first request's fingerprint");
        assert!(started.elapsed() < Duration::from_secs(2), "a mismatch must not wait out the lock");
        assert_eq!(fast.stats().handed_over, 1);
        holder.finish(Outcome::Release).await.unwrap();
    });
}

#[test]
fn locks_are_released_and_bounded_and_the_cache_ttl_is_within_retention() {
    tower_idempotency::testkit::run(async {
        let server = shared_server();
        let prefix = unique_prefix();
        let store = support::pg_store(CouplingMode::Leased).await;
        let fast = FastPath::connect(store, &server.url())
            .unwrap()
            .prefix(&prefix)
            .unwrap()
            .timeout(support::redis::TEST_TIMEOUT);
        let (id, fp) = (fresh_id("redis-ttl"), fingerprint(6));
        let retention =
            Retention { response: Duration::from_secs(5), tombstone: Duration::from_secs(60), ..Retention::default() };
        let request = || BeginRequest::new(&id, &fp).lease(Duration::from_millis(700)).retention(retention);

        let holder = claim(&fast, request()).await;
        let lock_ttl: i64 = server.cli(&["pttl", &key(&prefix, &id, 'l')]).trim().parse().unwrap();
        assert!((1..=700).contains(&lock_ttl), "the lock must not outlive the 700 ms lease: {lock_ttl} ms");
        holder.finish(Outcome::Complete(answer("ttl"))).await.unwrap();
        assert!(!exists(&prefix, &id, 'l'), "finish releases the lock");
        let cache_ttl: i64 = server.cli(&["pttl", &key(&prefix, &id, 'c')]).trim().parse().unwrap();
        assert!((1..=5000).contains(&cache_ttl), "the cached response must expire within retention: {cache_ttl} ms");

        // A claim dropped unfinished gives its lock back (in the background).
        let (dropped_id, dropped_fp) = (fresh_id("redis-drop"), fingerprint(7));
        drop(claim(&fast, BeginRequest::new(&dropped_id, &dropped_fp)).await);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while exists(&prefix, &dropped_id, 'l') {
            assert!(std::time::Instant::now() < deadline, "a dropped claim's lock was never released");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The store's answer without a claim (here `unknown`) releases the lock at once.
        let record = existing(&fast, BeginRequest::new(&dropped_id, &dropped_fp).wait(Duration::from_secs(5))).await;
        assert_eq!(record.state, RecordState::Unknown);
        assert!(!exists(&prefix, &dropped_id, 'l'));
        assert!(!exists(&prefix, &dropped_id, 'c'), "unknown is never cached");
        // The keys hold the digest, never the key or the scope.
        let keys = server.cli(&["--scan", "--pattern", &format!("{prefix}:*")]);
        assert!(!keys.contains("testkit") && !keys.contains("redis-ttl") && keys.contains(&id.to_hex()), "{keys}");
    });
}

#[test]
fn a_corrupt_or_foreign_cached_value_is_a_miss() {
    tower_idempotency::testkit::run(async {
        let server = shared_server();
        let prefix = unique_prefix();
        let fast = FastPath::connect(support::pg_store(CouplingMode::Atomic).await, &server.url())
            .unwrap()
            .prefix(&prefix)
            .unwrap()
            .timeout(support::redis::TEST_TIMEOUT);
        let (id, fp) = (fresh_id("redis-corrupt"), fingerprint(8));
        claim(&fast, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("real"))).await.unwrap();
        for garbage in ["garbage", "\u{2}newer-format"] {
            server.cli(&["set", &key(&prefix, &id, 'c'), garbage]);
            let record = existing(&fast, BeginRequest::new(&id, &fp)).await;
            assert_eq!(record.response, Some(answer("real")), "the store answers when the cache cannot");
        }
        assert_eq!(fast.stats().unverified, 2, "neither value carries this deployment's MAC");
        assert_eq!(fast.stats().hits, 0);
    });
}

#[test]
fn scripts_are_reloaded_after_script_flush() {
    tower_idempotency::testkit::run(async {
        let server = RedisServer::start();
        let fast = support::redis::fast_path(support::pg_store(CouplingMode::Atomic).await, &server.url());
        let (id, fp) = (fresh_id("redis-noscript"), fingerprint(9));
        claim(&fast, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("kept"))).await.unwrap();
        assert_eq!(server.cli(&["script", "flush"]).trim(), "OK");
        assert_eq!(existing(&fast, BeginRequest::new(&id, &fp)).await.response, Some(answer("kept")));
        let stats = fast.stats();
        assert_eq!((stats.hits, stats.degraded), (1, 0), "NOSCRIPT must be answered by loading the script: {stats:?}");
    });
}

#[test]
fn without_redis_everything_goes_through_the_store() {
    tower_idempotency::testkit::run(async {
        // Nothing listens on this port.
        let url = format!("redis://127.0.0.1:{}/", free_port());
        let fast = support::redis::fast_path(support::pg_store(CouplingMode::Atomic).await, &url);
        let (id, fp) = (fresh_id("redis-absent"), fingerprint(10));
        claim(&fast, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("durable"))).await.unwrap();
        assert_eq!(existing(&fast, BeginRequest::new(&id, &fp)).await.response, Some(answer("durable")));
        let stats: FastPathStats = fast.stats();
        assert_eq!(stats.hits, 0);
        assert!(stats.degraded >= 1, "the failure must be counted: {stats:?}");
        assert!(stats.bypassed >= 1, "the cool-down must keep later requests off Redis: {stats:?}");
    });
}
