//! `POST /orders` on PostgreSQL under concurrent load, in one run, through real sockets:
//!
//! - `no layer`: the handler writes the order in its own transaction, no idempotency;
//! - `atomic`: the layer in atomic mode; the handler writes through the claim's transaction;
//! - `leased`: the layer in leased mode; the handler writes in its own transaction;
//! - `replay`: the layer in atomic mode, every request a retry of a completed key.
//!
//! Each scenario gets a warm-up, then a fixed measuring window with `CONCURRENCY` keep-alive
//! clients. It prints throughput, p50 and p99 latency, and the ratios the project tracks.
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
const MEASURE: Duration = Duration::from_secs(8);
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

struct Measured {
    name: &'static str,
    requests: usize,
    elapsed: Duration,
    p50: Duration,
    p99: Duration,
}

impl Measured {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// Drives `addr` with `CONCURRENCY` clients, a warm-up and then the measured window;
/// `key_of(n)` names the key of request `n`.
async fn load(name: &'static str, addr: std::net::SocketAddr, key_of: KeyOf) -> Measured {
    let counter = Arc::new(AtomicU64::new(0));
    http_load::post_orders(name, addr, CONCURRENCY, BODY, counter.clone(), key_of.clone(), WARM_UP).await;
    let started = Instant::now();
    let latencies = http_load::post_orders(name, addr, CONCURRENCY, BODY, counter, key_of, MEASURE).await;
    let elapsed = started.elapsed();
    let (p50, p99) = (http_load::quantile(&latencies, 0.50), http_load::quantile(&latencies, 0.99));
    Measured { name, requests: latencies.len(), elapsed, p50, p99 }
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

        let mut results = vec![
            load("no layer", bare, unique("bare")).await,
            load("atomic", with_atomic, unique("atomic")).await,
            load("leased", with_leased, unique("leased")).await,
        ];
        // Replays: retries of 1000 keys the atomic scenario completed.
        results.push(load("replay", with_atomic, Arc::new(|n| format!("atomic-{}", n % 1000))).await);

        println!("\nPOST /orders on PostgreSQL, {CONCURRENCY} concurrent keep-alive clients, {MEASURE:?} each");
        println!("{:<10} {:>10} {:>12} {:>10} {:>10}", "scenario", "requests", "req/s", "p50", "p99");
        for m in &results {
            println!("{:<10} {:>10} {:>12.0} {:>10.2?} {:>10.2?}", m.name, m.requests, m.throughput(), m.p50, m.p99);
        }
        let get = |name: &str| results.iter().find(|m| m.name == name).unwrap().throughput();
        println!("atomic / no layer : {:.2}x (aim >= 0.75x)", get("atomic") / get("no layer"));
        println!("atomic / leased   : {:.2}x (aim >= 1.2x)", get("atomic") / get("leased"));
        println!("replay / atomic   : {:.2}x (aim >= 2x)", get("replay") / get("atomic"));

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
