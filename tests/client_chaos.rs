//! The client half under fire: the reference service runs as a child process on a fresh
//! PostgreSQL database and is SIGKILLed and restarted again and again while clients create a
//! few hundred orders through hyper-util's client, each logical request retried until it
//! succeeds.
//!
//! - With [`IdempotentRetryLayer`]: every logical request has exactly one order (by its
//!   operation id), and its final answer carries that order.
//! - The negative control, a plain `tower::retry` that makes a new key for every attempt,
//!   sends the same orders through the same storm and counts the duplicates it creates.
#![cfg(all(feature = "client", feature = "axum", feature = "postgres", feature = "sqlite"))]

mod support;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use support::server::{Server, free_port, fresh_database};
use tower::ServiceExt;
use tower_idempotency::client::{IdempotentRetryLayer, RetryPolicy, RetryReport};
use tower_idempotency::{IdempotencyKey, RecordId, Scope};
use tower_layer::Layer;

const CLIENTS: usize = 8;
const ORDERS_PER_CLIENT: usize = 30;
/// A storm kills the server at least this often, however fast the orders go through: on a quick
/// machine 240 orders can be done between two kills, and a storm of one kill proves nothing.
const MIN_KILLS: usize = 15;
/// A storm ends after this long even if its condition has not come true.
const STORM_LIMIT: Duration = Duration::from_secs(120);
const ACCOUNT: &str = "client-chaos";

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn order_request(addr: SocketAddr, sku: &str) -> Request<Full<Bytes>> {
    let body = format!("{{\"sku\":\"{sku}\",\"quantity\":1,\"amount_minor\":1250,\"currency\":\"EUR\"}}");
    Request::post(format!("http://{addr}/orders"))
        .header("authorization", format!("Bearer {ACCOUNT}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// The final answer of one logical request, as its client saw it.
struct Final {
    sku: String,
    order_id: String,
    key: String,
    attempts: u32,
    replayed: bool,
}

/// Runs the orders service on a fresh database, SIGKILLs and restarts it at random moments
/// while `CLIENTS` clients send logical requests through `create`, and returns the final
/// answers, the kills and the database's URL.
///
/// Each client sends at least `ORDERS_PER_CLIENT` logical requests, and goes on until the
/// server has been killed `MIN_KILLS` times and `enough` (asked with the database's URL after
/// each restart) holds, or until `STORM_LIMIT` has passed.
async fn storm<F, Fut, E, EFut>(prefix: &'static str, create: F, enough: E) -> (Vec<Final>, usize, String)
where
    F: Fn(SocketAddr, String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Final> + Send,
    E: Fn(String) -> EFut,
    EFut: Future<Output = bool>,
{
    let database_url = fresh_database(prefix).await;
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let url = database_url.clone();
    let mut server = Some(tokio::task::spawn_blocking(move || Server::start(&url, port)).await.unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));

    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let create = create.clone();
        let stop = stop.clone();
        clients.push(tokio::spawn(async move {
            let mut finals = Vec::new();
            let mut n = 0;
            while n < ORDERS_PER_CLIENT || !stop.load(Ordering::Relaxed) {
                finals.push(create(addr, format!("{prefix}-{client}-{n}")).await);
                n += 1;
            }
            finals
        }));
    }
    let all_done = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut finals = Vec::new();
            for client in clients {
                finals.extend(client.await.expect("client"));
            }
            done.store(true, Ordering::Relaxed);
            finals
        })
    };

    let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
    let mut kills = 0;
    let started = std::time::Instant::now();
    while !done.load(Ordering::Relaxed) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(30 + rng % 200)).await;
        if done.load(Ordering::Relaxed) {
            break;
        }
        if let Some(old) = server.take() {
            old.kill();
        }
        kills += 1;
        let url = database_url.clone();
        server = Some(tokio::task::spawn_blocking(move || Server::start(&url, port)).await.unwrap());
        if !stop.load(Ordering::Relaxed)
            && ((kills >= MIN_KILLS && enough(database_url.clone()).await) || started.elapsed() > STORM_LIMIT)
        {
            stop.store(true, Ordering::Relaxed);
        }
    }
    let finals = all_done.await.expect("clients");
    drop(server);
    (finals, kills, database_url)
}

/// Every order in the example's database: (operation id, order id, sku).
async fn orders(database_url: &str) -> Vec<(String, String, String)> {
    let pool = sqlx::PgPool::connect(database_url).await.expect("connect to the example's database");
    let rows = sqlx::query_as("SELECT idempotency_operation_id, order_id::text, sku FROM orders")
        .fetch_all(&pool)
        .await
        .expect("read the orders");
    pool.close().await;
    rows
}

/// How many orders each sku has in the example's database.
async fn orders_per_sku(database_url: &str) -> HashMap<String, usize> {
    let mut per_sku: HashMap<String, usize> = HashMap::new();
    for (_, _, sku) in orders(database_url).await {
        *per_sku.entry(sku).or_default() += 1;
    }
    per_sku
}

/// Orders beyond the first for a sku: the duplicates a retry created.
async fn duplicates(database_url: &str) -> usize {
    orders_per_sku(database_url).await.values().map(|n| n - 1).sum()
}

fn operation_id(key: &str) -> String {
    RecordId::new(&Scope::new(ACCOUNT), "orders.create", &IdempotencyKey::new(key).unwrap()).operation_id()
}

async fn order_id_of(response: Response<impl http_body::Body<Data = Bytes, Error: std::fmt::Debug>>) -> String {
    let body = response.into_body().collect().await.expect("the final answer's body").to_bytes();
    let order: serde_json::Value = serde_json::from_slice(&body).expect("an order as JSON");
    order["order_id"].as_str().expect("order_id").to_owned()
}

#[test]
fn a_layer_that_keeps_its_key_creates_each_order_once_while_the_server_is_killed() {
    tower_idempotency::testkit::run(async {
        // With the layer: one key per logical request, kept on every retry.
        let policy = RetryPolicy::new()
            .max_attempts(10_000)
            .base_delay(Duration::from_millis(10))
            .max_delay(Duration::from_millis(200))
            .attempt_timeout(Duration::from_secs(10))
            .deadline(Duration::from_secs(120));
        let layer = IdempotentRetryLayer::new().policy(policy);
        let shared = http_client();
        let (finals, kills, database_url) = storm(
            "tidem_client_layer",
            move |addr, sku| {
                let client = layer.layer(shared.clone());
                async move {
                    let response = client.oneshot(order_request(addr, &sku)).await.expect("the layer gave up");
                    assert_eq!(response.status(), StatusCode::CREATED, "{sku}: a definitive answer");
                    let report = response.extensions().get::<RetryReport>().cloned().expect("a report");
                    let key = report.key().expect("a key").to_owned();
                    Final {
                        sku,
                        order_id: order_id_of(response).await,
                        key,
                        attempts: report.attempts(),
                        replayed: report.replayed(),
                    }
                }
            },
            |_| async { true },
        )
        .await;

        let rows = orders(&database_url).await;
        let mut by_operation: HashMap<&str, Vec<&str>> = HashMap::new();
        for (operation, order_id, _) in &rows {
            by_operation.entry(operation).or_default().push(order_id);
        }
        for last in &finals {
            let created = by_operation.get(operation_id(&last.key).as_str()).cloned().unwrap_or_default();
            assert_eq!(created.len(), 1, "{}: {} orders for one logical request", last.sku, created.len());
            assert_eq!(created[0], last.order_id, "{}: the final answer carries another order", last.sku);
        }
        assert_eq!(rows.len(), finals.len(), "orders that no logical request accounts for");
        let attempts: u32 = finals.iter().map(|f| f.attempts).sum();
        let replays = finals.iter().filter(|f| f.replayed).count();

        // The control: the same storm through a plain `tower::retry` with a new key per attempt.
        let shared = http_client();
        let (control, control_kills, control_url) = storm(
            "tidem_client_plain",
            move |addr, sku| {
                let client = tower::retry::Retry::new(NewKeyEachAttempt, shared.clone());
                async move {
                    let mut request = order_request(addr, &sku);
                    request.headers_mut().insert("idempotency-key", uuid::Uuid::new_v4().to_string().parse().unwrap());
                    let response = client.oneshot(request).await.expect("the plain retry never gives up");
                    assert_eq!(response.status(), StatusCode::CREATED, "{sku}: a definitive answer");
                    Final {
                        sku,
                        order_id: order_id_of(response).await,
                        key: String::new(),
                        attempts: 0,
                        replayed: false,
                    }
                }
            },
            |url| async move { duplicates(&url).await > 0 },
        )
        .await;
        let per_sku = orders_per_sku(&control_url).await;
        assert!(control.iter().all(|f| per_sku.get(&f.sku).copied().unwrap_or(0) >= 1));
        let duplicated: usize = per_sku.values().map(|n| n - 1).sum();
        // Kills land between a COMMIT and its answer (the layer's run answers as many by a
        // replay): a test that cannot see the duplicates they cause would prove nothing. The
        // control's storm goes on until it has made one, for up to `STORM_LIMIT`.
        assert!(duplicated > 0, "the control created no duplicate: the storm is too weak to show anything");
        println!(
            "client chaos: with the layer, {} logical requests, {attempts} attempts, {replays} answered by a replay, \
             {kills} kills, 0 duplicates; with a new key per attempt, {} logical requests, {control_kills} kills, \
             {duplicated} duplicates",
            finals.len(),
            control.len(),
        );
    });
}

/// The negative control's policy: retry every failure and every 409, 429 and 5xx, as a generic
/// retry layer would, but give every attempt a key of its own.
#[derive(Clone)]
struct NewKeyEachAttempt;

type HyperResult = Result<Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>;

impl tower::retry::Policy<Request<Full<Bytes>>, Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>
    for NewKeyEachAttempt
{
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(&mut self, _request: &mut Request<Full<Bytes>>, result: &mut HyperResult) -> Option<Self::Future> {
        let again = match result {
            Ok(response) => matches!(response.status().as_u16(), 409 | 429 | 500..=599),
            Err(_) => true,
        };
        again.then(|| Box::pin(tokio::time::sleep(Duration::from_millis(20))) as Self::Future)
    }

    fn clone_request(&mut self, request: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut copy =
            Request::builder().method(request.method()).uri(request.uri()).body(request.body().clone()).unwrap();
        *copy.headers_mut() = request.headers().clone();
        copy.headers_mut().insert("idempotency-key", uuid::Uuid::new_v4().to_string().parse().unwrap());
        Some(copy)
    }
}
