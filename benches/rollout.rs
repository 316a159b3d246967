//! Shadow mode's added latency against `off`, on SQLite and on PostgreSQL, in one run.
//!
//! The route is an atomic handler: it takes the `TxHandle` and inserts an order through it. In
//! `off` it gets the store's plain transaction; in `shadow` it gets the transaction of the
//! request's shadow claim, and the layer also buffers the body, computes the fingerprint, looks
//! the shadow identity up and stores the shadow record before the COMMIT. Each request has a
//! fresh key. One client sends requests one after another through the router (no sockets).
//!
//! Each round measures both modes for `WINDOW` each, the order alternating per round; it
//! prints the mean latency of each mode and the per-round ratios `shadow / off` (median and
//! range). Run with `cargo bench --all-features --bench rollout` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server). `ROLLOUT_ROUNDS` sets the rounds (default 5).

#[path = "support/bench_db.rs"]
mod bench_db;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, PostgresStore, RolloutMode, RolloutSwitch, SqliteStore, TxHandle};

const WARM_UP: Duration = Duration::from_secs(1);
const WINDOW: Duration = Duration::from_secs(2);
const BODY: &str = "{\"sku\":\"SKU-000123\",\"quantity\":2,\"amount_minor\":129900,\"currency\":\"EUR\"}";

async fn create_sqlite(tx: TxHandle<sqlx::Sqlite>, body: String) -> StatusCode {
    let mut conn = tx.acquire().await.expect("open");
    sqlx::query("INSERT INTO orders (body) VALUES (?1)").bind(body).execute(&mut *conn).await.expect("insert");
    StatusCode::CREATED
}

async fn create_pg(tx: TxHandle<sqlx::Postgres>, body: String) -> StatusCode {
    let mut conn = tx.acquire().await.expect("open");
    sqlx::query("INSERT INTO orders (body) VALUES ($1)").bind(body).execute(&mut *conn).await.expect("insert");
    StatusCode::CREATED
}

/// Requests one after another for `window`: how many, and how long they took in all.
async fn measure(app: &Router, keys: &AtomicU64, window: Duration) -> (u64, Duration) {
    let started = Instant::now();
    let mut count = 0;
    while started.elapsed() < window {
        let key = format!("key-{}", keys.fetch_add(1, Ordering::Relaxed));
        let request = Request::post("/orders")
            .header("idempotency-key", key)
            .header("x-tenant", "bench")
            .header("content-type", "application/json")
            .body(Body::from(BODY))
            .expect("request");
        let response = app.clone().oneshot(request).await.expect("answer");
        assert_eq!(response.status(), StatusCode::CREATED);
        let _ = response.into_body().collect().await.expect("body");
        count += 1;
    }
    (count, started.elapsed())
}

/// Both modes on `app` in alternating order, `rounds` times; prints the result.
async fn compare(name: &str, app: Router, switch: RolloutSwitch, rounds: usize) {
    let keys = AtomicU64::new(0);
    for mode in [RolloutMode::Off, RolloutMode::Shadow] {
        switch.set(mode);
        measure(&app, &keys, WARM_UP).await;
    }
    let mut totals = [(0u64, Duration::ZERO); 2];
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let mut means = [0.0f64; 2];
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for index in order {
            switch.set([RolloutMode::Off, RolloutMode::Shadow][index]);
            let (count, took) = measure(&app, &keys, WINDOW).await;
            means[index] = took.as_secs_f64() / count as f64;
            totals[index].0 += count;
            totals[index].1 += took;
        }
        ratios.push(means[1] / means[0]);
    }
    ratios.sort_by(f64::total_cmp);
    let mean = |(count, took): (u64, Duration)| took.as_secs_f64() * 1e6 / count as f64;
    println!(
        "{name}: off {:.1} µs/request, shadow {:.1} µs/request; shadow/off per round: median {:.3} (range {:.3}–{:.3}, {rounds} rounds)",
        mean(totals[0]),
        mean(totals[1]),
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
    );
}

fn layer<St: tower_idempotency::Store>(store: St, switch: &RolloutSwitch) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
        .operation("orders.create")
        .scope_with(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(tower_idempotency::Scope::new))
        .rollout(switch.clone())
}

fn main() {
    let rounds = std::env::var("ROLLOUT_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(async {
        // SQLite: a file of the benchmark's own, WAL, as the reference service runs it.
        let path = std::env::temp_dir().join(format!("tidem_bench_rollout_{}.db", std::process::id()));
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await.expect("sqlite");
        let store = SqliteStore::new(pool.clone());
        store.migrate().await.expect("migrate");
        sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .execute(&pool)
            .await
            .expect("orders");
        let switch = RolloutSwitch::new(RolloutMode::Off);
        let app = Router::new().route("/orders", post(create_sqlite).layer(layer(store, &switch)));
        compare("sqlite", app, switch, rounds).await;
        pool.close().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }

        let db = bench_db::BenchDatabase::create("tidem_bench_rollout", 16).await;
        let store = PostgresStore::new(db.pool.clone());
        store.migrate().await.expect("migrate");
        sqlx::raw_sql("CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL)")
            .execute(&db.pool)
            .await
            .expect("orders");
        let switch = RolloutSwitch::new(RolloutMode::Off);
        let app = Router::new().route("/orders", post(create_pg).layer(layer(store, &switch)));
        compare("postgres", app, switch, rounds).await;
        db.drop().await;
    });
}
