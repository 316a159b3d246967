//! `POST /orders` on PostgreSQL under concurrent load, in one run, through real sockets:
//!
//! - `no layer`: the handler writes the order in its own transaction, no idempotency;
//! - `atomic`: the layer in atomic mode; the handler writes through the claim's transaction;
//! - `leased`: the layer in leased mode; the handler writes in its own transaction;
//! - `replay`: the layer in atomic mode, every request a retry of a completed key.
//!
//! Each scenario gets a warm-up, then `ROUNDS` measuring windows with `CONCURRENCY` keep-alive
//! clients, one window per scenario per round, the order rotated each round. It prints
//! throughput, p50 and p99 latency over all windows, and the ratios the project tracks: overall,
//! and the median and range of the per-round ratios (windows of one round run minutes apart at
//! most, so they share the machine's mood). `PG_ORDERS_ROUNDS` overrides the number of rounds.
//! Run with `cargo bench --bench pg_orders --all-features` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server, default `postgres://postgres@127.0.0.1:5432/test`).

#[path = "support/http_load.rs"]
mod http_load;

use http_load::KeyOf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use http::{Request, StatusCode};
use sqlx::{PgPool, Postgres};
use tower_idempotency::{CouplingMode, IdempotencyContext, IdempotencyLayer, PostgresStore, Scope, TxHandle};

const CONCURRENCY: usize = 32;
const WARM_UP: Duration = Duration::from_secs(2);
/// One measured window; each scenario gets one per round.
const MEASURE: Duration = Duration::from_secs(3);
/// Rounds, unless `PG_ORDERS_ROUNDS` says otherwise.
const ROUNDS: usize = 5;
const POOL: u32 = 40;

const BODY: &str = "{\"sku\":\"book-42\",\"quantity\":1,\"amount_minor\":129900,\"currency\":\"EUR\"}";

/// The one handler of every scenario: writes the order through the claim's transaction when
/// the layer hands one out, else in a transaction of its own.
async fn create_order(
    State(pool): State<PgPool>,
    context: Option<IdempotencyContext>,
    tx: Option<TxHandle<Postgres>>,
    body: String,
) -> (StatusCode, [(&'static str, String); 2], String) {
    let order_id = uuid::Uuid::new_v4();
    let operation_id = context.as_ref().map_or("", |c| c.operation_id()).to_owned();
    let insert = sqlx::query("INSERT INTO bench_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
        .bind(order_id.to_string())
        .bind(operation_id)
        .bind(&body);
    match tx {
        Some(tx) => {
            let mut conn = tx.acquire().await.expect("claim transaction");
            insert.execute(&mut *conn).await.expect("insert");
        }
        None => {
            let mut own = pool.begin().await.expect("begin");
            insert.execute(&mut *own).await.expect("insert");
            own.commit().await.expect("commit");
        }
    }
    let json = format!("{{\"order_id\":\"{order_id}\",\"body\":{body}}}");
    (
        StatusCode::CREATED,
        [("content-type", "application/json".to_owned()), ("location", format!("/orders/{order_id}"))],
        json,
    )
}

async fn authenticate(mut request: Request<Body>, next: axum::middleware::Next) -> axum::response::Response {
    request.extensions_mut().insert(Scope::new("bench-account"));
    next.run(request).await
}

fn router(pool: PgPool, layer: Option<IdempotencyLayer<PostgresStore>>) -> Router {
    let route = match layer {
        Some(layer) => post(create_order).layer(layer),
        None => post(create_order),
    };
    Router::new().route("/orders", route).layer(axum::middleware::from_fn(authenticate)).with_state(pool)
}

async fn serve(app: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// One scenario's runs, over all rounds.
struct Measured {
    name: &'static str,
    runs: Vec<Run>,
}

/// One measured window of one scenario.
struct Run {
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

impl Run {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

impl Measured {
    fn requests(&self) -> usize {
        self.runs.iter().map(|r| r.requests).sum()
    }

    fn throughput(&self) -> f64 {
        let elapsed: Duration = self.runs.iter().map(|r| r.elapsed).sum();
        self.requests() as f64 / elapsed.as_secs_f64()
    }

    fn quantile(&self, q: f64) -> Duration {
        let mut all: Vec<Duration> = self.runs.iter().flat_map(|r| r.latencies.iter().copied()).collect();
        all.sort_unstable();
        http_load::quantile(&all, q)
    }
}

/// A scenario's server and the keys its requests carry.
struct Scenario {
    name: &'static str,
    addr: std::net::SocketAddr,
    key_of: KeyOf,
    counter: Arc<AtomicU64>,
}

impl Scenario {
    fn new(name: &'static str, addr: std::net::SocketAddr, key_of: KeyOf) -> Self {
        Self { name, addr, key_of, counter: Arc::new(AtomicU64::new(0)) }
    }

    async fn drive(&self, window: Duration) -> Vec<Duration> {
        let (counter, key_of) = (self.counter.clone(), self.key_of.clone());
        http_load::post_orders(self.name, self.addr, CONCURRENCY, BODY, counter, key_of, window).await
    }

    async fn measure(&self) -> Run {
        let started = Instant::now();
        let latencies = self.drive(MEASURE).await;
        Run { requests: latencies.len(), elapsed: started.elapsed(), latencies }
    }
}

/// The median and range of `numerator / denominator` over the rounds.
fn ratio_over_rounds(numerator: &Measured, denominator: &Measured) -> (f64, f64, f64) {
    let mut ratios: Vec<f64> =
        numerator.runs.iter().zip(&denominator.runs).map(|(n, d)| n.throughput() / d.throughput()).collect();
    ratios.sort_by(f64::total_cmp);
    (ratios[ratios.len() / 2], ratios[0], ratios[ratios.len() - 1])
}

async fn fresh_pool() -> (PgPool, String) {
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let name = format!("tidem_bench_{}", std::process::id());
    let admin = PgPool::connect(&base).await.expect("PostgreSQL must be running");
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{name}\""))).execute(&admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\""))).execute(&admin).await.unwrap();
    let url = format!("{}/{name}", &base[..base.rfind('/').unwrap()]);
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(POOL).connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE bench_orders (order_id text PRIMARY KEY, operation_id text NOT NULL, body text NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    (pool, name)
}

fn main() {
    let rounds: usize = std::env::var("PG_ORDERS_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(ROUNDS);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (pool, database) = fresh_pool().await;
        let atomic = PostgresStore::new(pool.clone()).mode(CouplingMode::Atomic);
        atomic.migrate().await.unwrap();
        let leased = atomic.clone().leased();
        let unique = |prefix: &'static str| -> KeyOf { Arc::new(move |n| format!("{prefix}-{n}")) };

        let bare = serve(router(pool.clone(), None)).await;
        let with_atomic = serve(router(pool.clone(), Some(IdempotencyLayer::new(atomic.clone())))).await;
        let with_leased = serve(router(pool.clone(), Some(IdempotencyLayer::new(leased)))).await;
        let scenarios = [
            Scenario::new("no layer", bare, unique("bare")),
            Scenario::new("atomic", with_atomic, unique("atomic")),
            Scenario::new("leased", with_leased, unique("leased")),
            // Retries of 1000 keys the atomic scenario completed in its warm-up.
            Scenario::new("replay", with_atomic, Arc::new(|n| format!("atomic-{}", n % 1000))),
        ];
        for scenario in &scenarios {
            scenario.drive(WARM_UP).await;
        }
        // Rounds of one window per scenario, the order rotated each round, so that a slow
        // stretch of this shared machine falls on every scenario alike.
        let mut results: Vec<Measured> = scenarios.iter().map(|s| Measured { name: s.name, runs: vec![] }).collect();
        for round in 0..rounds {
            for i in 0..scenarios.len() {
                let index = (i + round) % scenarios.len();
                let run = scenarios[index].measure().await;
                results[index].runs.push(run);
            }
        }

        println!(
            "\nPOST /orders on PostgreSQL, {CONCURRENCY} concurrent keep-alive clients, \
             {rounds} rounds of {MEASURE:?} per scenario"
        );
        println!("{:<10} {:>10} {:>12} {:>10} {:>10}", "scenario", "requests", "req/s", "p50", "p99");
        for m in &results {
            let (throughput, p50, p99) = (m.throughput(), m.quantile(0.50), m.quantile(0.99));
            println!("{:<10} {:>10} {throughput:>12.0} {p50:>10.2?} {p99:>10.2?}", m.name, m.requests());
        }
        let [bare, atomic, leased, replay] = &results[..] else { unreachable!("four scenarios") };
        for (label, numerator, denominator, aim) in [
            ("atomic / no layer", atomic, bare, 0.75),
            ("atomic / leased  ", atomic, leased, 1.2),
            ("replay / atomic  ", replay, atomic, 2.0),
        ] {
            let overall = numerator.throughput() / denominator.throughput();
            let (median, low, high) = ratio_over_rounds(numerator, denominator);
            println!(
                "{label} : {overall:.2}x overall; per round median {median:.2}x, \
                 range {low:.2}x..{high:.2}x (aim >= {aim}x)"
            );
        }

        pool.close().await;
        let admin = PgPool::connect(
            &std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        )
        .await
        .unwrap();
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)")))
            .execute(&admin)
            .await;
    });
}
