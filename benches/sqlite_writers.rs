//! Concurrent writers on one SQLite file: `POST /orders` from many clients at once, with fresh
//! keys, against the same handler without the layer, in one run: what `pg_orders` measures on
//! PostgreSQL.
//!
//! SQLite has one write lock, taken by every `BEGIN IMMEDIATE`. A request that finds it held
//! sleeps in SQLite's busy handler (1 ms, then 2, 5, 10 ms and longer steps) and tries again,
//! so the waiters are not served in order: the p99 shows the unlucky ones. In atomic mode the
//! lock is held from the claim through the handler to the stored answer's COMMIT.
//!
//! Three set-ups, each the same handler inserting one order:
//! - `no layer`: the handler's own `BEGIN IMMEDIATE` transaction on the pool;
//! - `atomic`: the layer in `Enforce`, the order written through the claim's `TxHandle`;
//! - `off`: the layer in `Off`, the order written through the store's plain transaction (the
//!   old path of the kill switch).
//!
//! `SQLITE_WRITERS_CLIENTS` clients (default 16) send requests one after another for 2 s per
//! set-up, in rotated rounds (`SQLITE_WRITERS_ROUNDS`, default 5), on a file in WAL mode with
//! `synchronous = NORMAL`, then `FULL`. It prints each set-up's throughput, p50 and p99, the
//! answers other than 201, and the median and range of the per-round throughput ratios to
//! `no layer`. Run with `cargo bench --all-features --bench sqlite_writers`.

#[path = "support/sqlite_file.rs"]
mod sqlite_file;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlite_file::SqliteFile;
use sqlx::SqlitePool;
use sqlx::sqlite::SqliteSynchronous;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, RolloutMode, RolloutSwitch, SqliteStore, TxHandle};

const WARM_UP: Duration = Duration::from_secs(1);
const WINDOW: Duration = Duration::from_secs(2);
const BODY: &str = "{\"sku\":\"SKU-000123\",\"quantity\":2,\"amount_minor\":129900,\"currency\":\"EUR\"}";

/// `no layer`: the handler's own write transaction.
async fn create_alone(State(pool): State<SqlitePool>, body: String) -> StatusCode {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.expect("begin");
    sqlx::query("INSERT INTO orders (body) VALUES (?1)").bind(body).execute(&mut *tx).await.expect("insert");
    tx.commit().await.expect("commit");
    StatusCode::CREATED
}

/// `atomic` and `off`: the order through the layer's transaction.
async fn create(tx: TxHandle<sqlx::Sqlite>, body: String) -> StatusCode {
    let mut conn = tx.acquire().await.expect("open");
    sqlx::query("INSERT INTO orders (body) VALUES (?1)").bind(body).execute(&mut *conn).await.expect("insert");
    StatusCode::CREATED
}

/// What one set-up saw in one window: latencies of its 201s, and how many other answers.
#[derive(Default)]
struct Seen {
    took: Vec<Duration>,
    other: u64,
    window: Duration,
}

impl Seen {
    fn throughput(&self) -> f64 {
        self.took.len() as f64 / self.window.as_secs_f64()
    }

    /// The `q` quantile of the latencies, sorted first.
    fn quantile(&mut self, q: f64) -> f64 {
        self.took.sort_unstable();
        self.took[((self.took.len() - 1) as f64 * q) as usize].as_secs_f64()
    }
}

/// `clients` clients sending requests one after another to `app` for `window`.
async fn measure(app: &Router, keys: &Arc<AtomicU64>, clients: usize, window: Duration) -> Seen {
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (app, keys) = (app.clone(), keys.clone());
            tokio::spawn(async move {
                let mut seen = Seen::default();
                while started.elapsed() < window {
                    let key = format!("key-{}", keys.fetch_add(1, Ordering::Relaxed));
                    let request = Request::post("/orders")
                        .header("idempotency-key", key)
                        .header("content-type", "application/json")
                        .body(Body::from(BODY))
                        .expect("request");
                    let sent = Instant::now();
                    let response = app.clone().oneshot(request).await.expect("answer");
                    let status = response.status();
                    let _ = response.into_body().collect().await.expect("body");
                    if status == StatusCode::CREATED {
                        seen.took.push(sent.elapsed());
                    } else {
                        seen.other += 1;
                    }
                }
                seen
            })
        })
        .collect();
    let mut all = Seen::default();
    for task in tasks {
        let seen = task.await.expect("client");
        all.took.extend(seen.took);
        all.other += seen.other;
    }
    all.window = started.elapsed();
    all
}

/// Median and range of `ratios`.
fn spread(ratios: &mut [f64]) -> String {
    ratios.sort_by(f64::total_cmp);
    format!("median {:.3} (range {:.3}–{:.3})", ratios[ratios.len() / 2], ratios[0], ratios[ratios.len() - 1])
}

/// The set-ups in rotated order, `rounds` times; prints each one's throughput, p50, p99 and
/// other answers, and per round its throughput ratio to the first (`no layer`).
async fn compare(name: &str, apps: Vec<(&str, Router)>, clients: usize, rounds: usize) {
    let keys = Arc::new(AtomicU64::new(0));
    for (_, app) in &apps {
        measure(app, &keys, clients, WARM_UP).await;
    }
    let n = apps.len();
    let mut all: Vec<Seen> = (0..n).map(|_| Seen::default()).collect();
    let mut ratios = vec![Vec::new(); n];
    for round in 0..rounds {
        let mut this_round: Vec<f64> = vec![0.0; n];
        for step in 0..n {
            let index = (step + round) % n;
            let seen = measure(&apps[index].1, &keys, clients, WINDOW).await;
            this_round[index] = seen.throughput();
            all[index].took.extend(seen.took);
            all[index].other += seen.other;
            all[index].window += seen.window;
        }
        for (index, throughput) in this_round.iter().enumerate() {
            ratios[index].push(throughput / this_round[0]);
        }
    }
    let lines: Vec<String> = apps
        .iter()
        .zip(&mut all)
        .map(|((label, _), seen)| {
            format!(
                "{label} {:.0}/s, p50 {:.0} µs, p99 {:.0} µs, {} answers other than 201",
                seen.throughput(),
                seen.quantile(0.5) * 1e6,
                seen.quantile(0.99) * 1e6,
                seen.other
            )
        })
        .collect();
    let per_round: Vec<String> = apps
        .iter()
        .zip(&mut ratios)
        .skip(1)
        .map(|((label, _), ratios)| format!("{label}/no layer {}", spread(ratios)))
        .collect();
    println!(
        "{name}, {clients} clients: {}; throughput per round, {} ({rounds} rounds)",
        lines.join(", "),
        per_round.join(", ")
    );
}

fn layer(store: SqliteStore, mode: RolloutMode) -> IdempotencyLayer<SqliteStore> {
    IdempotencyLayer::new(store).operation("orders.create").shared_scope("bench").rollout(RolloutSwitch::new(mode))
}

/// The three set-ups on a fresh SQLite file with `synchronous`.
async fn compare_sqlite(name: &str, synchronous: SqliteSynchronous, clients: usize, rounds: usize) {
    let connections = u32::try_from(clients).unwrap_or(u32::MAX).saturating_add(4);
    let file = SqliteFile::create("tidem_bench_writers", synchronous, connections).await;
    let pool = file.pool.clone();
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        .execute(&pool)
        .await
        .expect("orders");
    let apps = vec![
        ("no layer", Router::new().route("/orders", post(create_alone)).with_state(pool)),
        ("atomic", Router::new().route("/orders", post(create).layer(layer(store.clone(), RolloutMode::Enforce)))),
        ("off", Router::new().route("/orders", post(create).layer(layer(store, RolloutMode::Off)))),
    ];
    compare(name, apps, clients, rounds).await;
    file.remove().await;
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|value| value.parse().ok()).unwrap_or(default)
}

fn main() {
    let (clients, rounds) = (env("SQLITE_WRITERS_CLIENTS", 16), env("SQLITE_WRITERS_ROUNDS", 5));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(async {
        for (name, synchronous) in [
            ("sqlite, synchronous = NORMAL", SqliteSynchronous::Normal),
            ("sqlite, synchronous = FULL", SqliteSynchronous::Full),
        ] {
            compare_sqlite(name, synchronous, clients, rounds).await;
        }
    });
}
