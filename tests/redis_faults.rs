//! Redis faults under load. Clients create orders through the layer over PostgreSQL (atomic)
//! behind the fast path, on a `redis-server` each test starts on its own port; for every key
//! they send a burst of identical requests at once, then retry until they get the replay, and
//! retry an older key too.
//! Meanwhile Redis is killed and restarted, flushed (keys and scripts), or squeezed by a tiny
//! `maxmemory` with `allkeys-lru` so that cached answers and locks are evicted.
//!
//! Nothing may duplicate (exactly one order per key), and every answer must be right: the
//! order's 201 (first or replayed, always the same body) or 409 in flight; never a 5xx.
#![cfg(all(feature = "axum", feature = "postgres", feature = "redis"))]

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlx::Postgres;
use support::redis::RedisServer;
use tower::ServiceExt;
use tower_idempotency::{CouplingMode, FastPath, IdempotencyContext, IdempotencyLayer, PostgresStore, TxHandle};

const CLIENTS: usize = 4;
/// Identical requests sent at once for each key.
const BURST: usize = 8;

/// Writes the order through the claim's transaction; the answer carries `pad` bytes of padding
/// (big answers fill a small Redis quickly).
async fn create_order(
    State(pad): State<usize>,
    context: IdempotencyContext,
    tx: TxHandle<Postgres>,
    body: String,
) -> (StatusCode, String) {
    let order_id = support::storm::insert_order(&context, &tx, &body).await;
    (StatusCode::CREATED, format!("{{\"order_id\":\"{order_id}\",\"pad\":\"{}\"}}", "x".repeat(pad)))
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Per key: the body of its 201 answers (all must be equal).
    acknowledged: HashMap<String, String>,
    answers: usize,
    conflicts: usize,
    replays: usize,
}

/// Runs the clients until `stop`, then checks the orders and the answers.
async fn load(fast: FastPath<PostgresStore>, pad: usize, stop: Arc<AtomicBool>) -> Seen {
    let store = fast.inner().clone();
    sqlx::raw_sql(support::storm::CREATE_TABLE).execute(store.pool()).await.expect("orders table");
    let layer = IdempotencyLayer::new(fast).shared_scope("faults").operation("faults.create");
    let app = Router::new().route("/orders", post(create_order).layer(layer)).with_state(pad);
    let send = |app: Router, key: String| async move {
        let request = Request::post("/orders")
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(Body::from(format!("{{\"sku\":\"{key}\"}}")))
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, replayed, String::from_utf8_lossy(&body).into_owned())
    };

    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (app, stop) = (app.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut seen = Seen::default();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("fault-{client}-{n}");
                n += 1;
                let burst: Vec<_> = (0..BURST).map(|_| tokio::spawn(send(app.clone(), key.clone()))).collect();
                let mut answers = Vec::new();
                for answer in burst {
                    answers.push(answer.await.unwrap());
                }
                // Then retry until the replay (a lock left by a dying Redis may hold it off).
                let deadline = std::time::Instant::now() + Duration::from_secs(30);
                loop {
                    let answer = send(app.clone(), key.clone()).await;
                    let done = answer.0 == StatusCode::CREATED;
                    answers.push(answer);
                    if done {
                        break;
                    }
                    assert!(std::time::Instant::now() < deadline, "{key}: no 201 after 30 s of retries");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                // And a retry of an older key, whose cached answer may be long gone.
                if n > 2 {
                    let old = format!("fault-{client}-{}", n / 2);
                    let (status, replayed, body) = send(app.clone(), old.clone()).await;
                    assert_eq!((status, replayed), (StatusCode::CREATED, true), "{old}: a late retry replays: {body}");
                    assert_eq!(seen.acknowledged.get(&old), Some(&body), "{old}: a late retry gets the same order");
                    seen.answers += 1;
                    seen.replays += 1;
                }
                for (status, replayed, body) in answers {
                    seen.answers += 1;
                    match status {
                        StatusCode::CREATED => {
                            seen.replays += usize::from(replayed);
                            let first = seen.acknowledged.entry(key.clone()).or_insert_with(|| body.clone());
                            assert_eq!(*first, body, "{key}: every 201 must carry the same order");
                        }
                        StatusCode::CONFLICT => {
                            assert!(body.contains("idempotency_request_in_flight"), "{key}: {body}");
                            seen.conflicts += 1;
                        }
                        other => panic!("{key}: only 201 or 409 in flight are right answers, got {other}: {body}"),
                    }
                }
            }
            seen
        }));
    }
    let mut seen = Seen::default();
    for client in clients {
        let client = client.await.expect("client");
        seen.acknowledged.extend(client.acknowledged);
        seen.answers += client.answers;
        seen.conflicts += client.conflicts;
        seen.replays += client.replays;
    }

    let rows = support::storm::orders_per_operation(store.pool()).await;
    assert!(rows.iter().all(|(_, n)| *n == 1), "a key created more than one order: {rows:?}");
    assert_eq!(rows.len(), seen.acknowledged.len(), "every acknowledged key has exactly its one order");
    seen
}

async fn fast_path(redis: &RedisServer) -> FastPath<PostgresStore> {
    support::redis::fast_path(support::pg_store(CouplingMode::Atomic).await, &redis.url())
}

fn report(name: &str, seen: &Seen, fast: &FastPath<PostgresStore>) {
    println!(
        "{name}: {} keys, {} answers ({} replays, {} 409s); fast path {:?}",
        seen.acknowledged.len(),
        seen.answers,
        seen.replays,
        seen.conflicts,
        fast.stats()
    );
}

#[test]
fn redis_killed_mid_load_and_restarted_loses_nothing() {
    tower_idempotency::testkit::run(async {
        let mut redis = RedisServer::start();
        let fast = fast_path(&redis).await;
        let stop = Arc::new(AtomicBool::new(false));
        let running = tokio::spawn(load(fast.clone(), 64, stop.clone()));
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let before = fast.stats();
        redis.stop();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let down = fast.stats();
        redis.restart();
        let restarted = fast.stats();
        // Keep the load on until Redis serves replays again (the cool-down and the reconnection
        // take a second or two), and a little longer.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while fast.stats().hits <= restarted.hits && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        let seen = running.await.unwrap();
        report("killed and restarted", &seen, &fast);
        let after = fast.stats();
        assert!(before.hits > 0, "before the kill Redis served replays: {before:?}");
        assert!(down.degraded > before.degraded, "the dead Redis must have been noticed: {down:?}");
        assert!(down.bypassed > before.bypassed, "while it is down the fast path leaves it alone: {down:?}");
        assert!(after.hits > restarted.hits, "after the restart Redis serves replays again: {after:?}");
    });
}

#[test]
fn flushall_and_script_flush_mid_load_lose_nothing() {
    tower_idempotency::testkit::run(async {
        let redis = RedisServer::start();
        let fast = fast_path(&redis).await;
        let stop = Arc::new(AtomicBool::new(false));
        let running = tokio::spawn(load(fast.clone(), 64, stop.clone()));
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(redis.cli(&["flushall"]).trim(), "OK");
            assert_eq!(redis.cli(&["script", "flush"]).trim(), "OK");
        }
        stop.store(true, Ordering::Relaxed);
        let seen = running.await.unwrap();
        report("flushed", &seen, &fast);
        let stats = fast.stats();
        assert!(stats.hits > 0, "between flushes Redis still serves replays: {stats:?}");
        assert_eq!(stats.degraded, 0, "a flush is a miss, not a failure (scripts are reloaded): {stats:?}");
    });
}

#[test]
fn eviction_under_a_tiny_maxmemory_loses_nothing() {
    tower_idempotency::testkit::run(async {
        let redis = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
        // A little room above what the empty server uses: a couple of hundred 4 KiB answers.
        let info = redis.cli(&["info", "memory"]);
        let used: u64 = info
            .lines()
            .find_map(|line| line.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory");
        assert_eq!(redis.cli(&["config", "set", "maxmemory", &(used + 1_000_000).to_string()]).trim(), "OK");
        let fast = fast_path(&redis).await;
        let stop = Arc::new(AtomicBool::new(false));
        let running = tokio::spawn(load(fast.clone(), 4096, stop.clone()));
        let evicted_keys = || -> u64 {
            redis
                .cli(&["info", "stats"])
                .lines()
                .find_map(|line| line.strip_prefix("evicted_keys:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("evicted_keys")
        };
        // At least 4 s of load, and on a slow (shared) machine as long as it takes Redis to evict,
        // up to a generous bound: the load's pace is the machine's, not the test's.
        tokio::time::sleep(Duration::from_secs(4)).await;
        for _ in 0..60 {
            if evicted_keys() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let seen = running.await.unwrap();
        report("evicted", &seen, &fast);
        let evicted = evicted_keys();
        println!("evicted: {evicted} keys evicted");
        assert!(evicted > 0, "nothing was evicted: the test proved nothing");
        let stats = fast.stats();
        assert!(stats.hits > 0, "Redis still serves some replays: {stats:?}");
        assert!(
            stats.locks > seen.acknowledged.len() as u64,
            "some retries must have missed evicted answers and gone to the store: {stats:?}"
        );
    });
}
