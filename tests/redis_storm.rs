//! The storm with the Redis fast path: 64 identical requests released together, for each of 200
//! keys (4 keys at a time), against the real PostgreSQL in atomic mode behind the fast path on a
//! `redis-server` this test starts. Exactly one order row per key; every other answer is the
//! identical replay or a 409.
//!
//! And what the fast path is for: the peak number of PostgreSQL connections in use stays at
//! about the number of distinct keys in flight (4), not the number of duplicates (256). The same
//! storm without the fast path is run first, for comparison; both peaks are printed, measured
//! two ways: the pool's checked-out connections (sampled every 100 µs) and the server's
//! non-idle backends of this pool (`pg_stat_activity`, sampled every 2 ms).
#![cfg(all(feature = "axum", feature = "postgres", feature = "redis"))]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use sqlx::PgPool;
use tower_idempotency::{IdempotencyLayer, PostgresStore, Store};

const KEYS: usize = 200;
/// Keys of the comparison storm without the fast path (it only needs to show its peak).
const BASELINE_KEYS: usize = 24;
const DUPLICATES: usize = 64;
const KEYS_AT_ONCE: usize = 4;
/// Room for every request of a batch: the pool is not what bounds the baseline's peak.
const POOL: u32 = 64;

/// A migrated atomic store in a schema of its own, on a pool whose connections carry
/// `application_name`, so the server's view of them can be counted.
async fn store(application_name: &str) -> PostgresStore {
    let schema = support::unique_name("tidem_rstorm");
    let options: sqlx::postgres::PgConnectOptions = support::database_url().parse().expect("DATABASE_URL");
    support::pg_schema(&schema).await.until_test_ends();
    let options = options.options([("search_path", schema.as_str())]).application_name(application_name);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(POOL)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("connect");
    let store = PostgresStore::new(pool).schema(&schema).unwrap();
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(support::storm::CREATE_TABLE).execute(store.pool()).await.expect("orders table");
    store
}

/// The highest number of connections in use seen while the storm ran.
struct Peaks {
    pool: usize,
    server: i64,
}

/// Samples the pool (from a thread of its own) and `pg_stat_activity` (from a connection of
/// its own) until `stop`.
fn watch(pool: PgPool, application_name: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Peaks> {
    let pool_peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (pool, stop, peak) = (pool.clone(), stop.clone(), pool_peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let in_use = (pool.size() as usize).saturating_sub(pool.num_idle());
                peak.fetch_max(in_use, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(100));
            }
        })
    };
    tokio::spawn(async move {
        let admin = PgPool::connect(&support::database_url()).await.unwrap();
        let mut server = 0;
        while !stop.load(Ordering::Relaxed) {
            let (active,): (i64,) =
                sqlx::query_as("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state <> 'idle'")
                    .bind(&application_name)
                    .fetch_one(&admin)
                    .await
                    .unwrap();
            server = server.max(active);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        admin.close().await;
        sampler.join().unwrap();
        Peaks { pool: pool_peak.load(Ordering::Relaxed), server }
    })
}

/// Storms `keys` keys through the layer over `layer_store`; checks exactly one order per key and
/// the answers; returns the peaks and how many answers were 409.
async fn storm<St: Store>(label: &str, orders: &PostgresStore, layer_store: St, keys: usize) -> (Peaks, usize) {
    let application_name = orders.pool().connect_options().get_application_name().unwrap().to_owned();
    let layer = IdempotencyLayer::new(layer_store).shared_scope("storm").operation("storm.create");
    let app = Router::new().route("/orders", post(support::storm::create_order).layer(layer));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch(orders.pool().clone(), application_name, stop.clone());
    let answers = support::storm::storm(&app, label, keys, DUPLICATES, KEYS_AT_ONCE).await;
    stop.store(true, Ordering::Relaxed);
    let peaks = watcher.await.unwrap();

    let rows = support::storm::orders_per_operation(orders.pool()).await;
    assert_eq!(rows.len(), keys, "{label}: every key must have created an order");
    assert!(rows.iter().all(|(_, n)| *n == 1), "{label}: some key created more than one order: {rows:?}");
    let conflicts = support::storm::check_answers(&answers, DUPLICATES);
    (peaks, conflicts)
}

#[test]
fn storm_with_the_fast_path_creates_one_order_per_key_on_a_connection_per_key() {
    tower_idempotency::testkit::run(async {
        let redis = support::redis::RedisServer::start();

        let plain = store(&support::unique_name("tidem_rstorm_plain")).await;
        let (baseline, _) = storm("plain", &plain, plain.clone(), BASELINE_KEYS).await;
        plain.pool().close().await;

        let orders = store(&support::unique_name("tidem_rstorm_fast")).await;
        let fast = support::redis::fast_path(orders.clone(), &redis.url());
        let (peaks, conflicts) = storm("fast", &orders, fast.clone(), KEYS).await;
        let stats = fast.stats();
        orders.pool().close().await;

        println!(
            "storm: {KEYS} keys x {DUPLICATES} requests ({KEYS_AT_ONCE} keys at a time) behind the fast path: \
             {KEYS} orders, {conflicts} answers were 409"
        );
        println!(
            "peak PostgreSQL connections in use, {} duplicates in flight: without the fast path {} (pool) / {} \
             (server); with it {} (pool) / {} (server)",
            KEYS_AT_ONCE * DUPLICATES,
            baseline.pool,
            baseline.server,
            peaks.pool,
            peaks.server
        );
        println!("fast path: {stats:?}");
        assert_eq!(stats.degraded, 0, "Redis was up the whole time: {stats:?}");
        assert_eq!(stats.locks, KEYS as u64, "one lock, so one durable claim, per key: {stats:?}");
        // Per key in flight: the lock holder's claim transaction, on the server; in the pool, for
        // a moment, also the connection of its read-first lookup, which sqlx hands back to the
        // pool from a task of its own. A little slack for the sampling's timing.
        assert!(
            peaks.server <= KEYS_AT_ONCE as i64 + 2 && peaks.pool <= 2 * KEYS_AT_ONCE + 2,
            "with the fast path the connections in use must stay about the {KEYS_AT_ONCE} keys in flight, not the \
             {} duplicates: pool {}, server {}",
            KEYS_AT_ONCE * DUPLICATES,
            peaks.pool,
            peaks.server
        );
        assert!(
            baseline.pool > 2 * KEYS_AT_ONCE,
            "without the fast path the duplicates should take connections (else this test shows nothing): {}",
            baseline.pool
        );
    });
}
