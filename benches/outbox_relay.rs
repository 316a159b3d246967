//! The outbox, measured on PostgreSQL in one run, through real sockets:
//!
//! - **Relay throughput**: `relay` enqueues `EVENTS` committed events, then one relay (the
//!   default [`RelayConfig`]: batches of 64, 16 deliveries in flight) delivers them as signed
//!   webhooks to a local sink (a loopback HTTP/1.1 server that checks each signature and answers
//!   204), timed until the outbox is drained; `direct` sends the same number of signed webhooks
//!   to the same sink with the same sender and concurrency, without the outbox. Events per second,
//!   and `relay / direct`: what the claim and the two writes per event cost.
//! - **The enqueue's cost on `POST /orders`**: the same handler behind the idempotency layer in
//!   atomic mode, inserting the order through the claim's transaction, `with outbox` also
//!   enqueuing `order.created` in it, `without` not; `CONCURRENCY` keep-alive clients for a
//!   window each. Requests per second, and `with / without`.
//!
//! Each pair runs once per round, in alternating order; the ratios are reported overall and as
//! the median and range of the per-round ratios. `OUTBOX_ROUNDS` overrides the number of rounds.
//! Run with `cargo bench --bench outbox_relay --all-features` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server, default `postgres://postgres@127.0.0.1:5432/test`).

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/http_load.rs"]
#[allow(dead_code, reason = "the latency quantiles are the other benchmarks' business")]
mod http_load;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bench_db::BenchDatabase;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use sqlx::{PgPool, Postgres};
use tower_idempotency::outbox::{
    EventId, NewEvent, OutboxStore, PendingEvent, PostgresOutbox, Relay, RelayConfig, Sender, WebhookSecret,
    WebhookSender, WebhookVerifier,
};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, PostgresStore, TxHandle};

const EVENTS: usize = 3000;
const CONCURRENCY: usize = 16;
const WARM_UP: Duration = Duration::from_secs(2);
const MEASURE: Duration = Duration::from_secs(3);
const ROUNDS: usize = 5;
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const BODY: &str = "{\"sku\":\"book-42\",\"quantity\":1,\"amount_minor\":129900,\"currency\":\"EUR\"}";

fn main() {
    let rounds = std::env::var("OUTBOX_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(ROUNDS);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    runtime.block_on(async move {
        let db = BenchDatabase::create("tidem_bench_outbox", 48).await;
        relay_throughput(&db.pool, rounds).await;
        enqueue_cost(&db.pool, rounds).await;
        db.drop().await;
    });
}

/// Events per second of each round, for `relay` and `direct`.
async fn relay_throughput(pool: &PgPool, rounds: usize) {
    let outbox = PostgresOutbox::new(pool.clone()).schema("bench_outbox").expect("schema");
    outbox.migrate().await.expect("migrate the outbox");
    let sink = sink().await;
    let sender = || WebhookSender::new(sink.parse().expect("url"), WebhookSecret::parse(SECRET).expect("secret"));
    let (mut relay, mut direct) = (Vec::new(), Vec::new());
    for round in 0..=rounds {
        let measure = async |relayed: bool| {
            let events = events(round, relayed);
            if relayed {
                through_relay(pool, &outbox, events, sender()).await
            } else {
                directly(events, sender()).await
            }
        };
        // Round 0 warms up both.
        let (r, d) = if round % 2 == 0 {
            let r = measure(true).await;
            (r, measure(false).await)
        } else {
            let d = measure(false).await;
            (measure(true).await, d)
        };
        if round > 0 {
            relay.push(r);
            direct.push(d);
        }
    }
    report("relay throughput (events/s)", "relay", &relay, "direct", &direct);
}

fn events(round: usize, relayed: bool) -> Vec<NewEvent> {
    (0..EVENTS)
        .map(|i| {
            let id = EventId::new(format!("evt_{round}_{relayed}_{i}")).expect("id");
            let data = serde_json::json!({"order_id": format!("order-{i}"), "amount_minor": 129900});
            NewEvent::new(id, "order.created", &data, SystemTime::now()).expect("event")
        })
        .collect()
}

/// Enqueues `events` (committed, untimed), then times one relay draining them.
async fn through_relay(pool: &PgPool, outbox: &PostgresOutbox, events: Vec<NewEvent>, sender: WebhookSender) -> f64 {
    let handle = TxHandle::new(pool.begin().await.expect("begin"));
    for event in &events {
        outbox.enqueue(&handle, event).await.expect("enqueue");
    }
    handle.take().await.expect("open").commit().await.expect("commit");
    let relay = Relay::new(outbox.clone(), sender, RelayConfig::default());
    let started = Instant::now();
    let mut delivered = 0;
    while delivered < events.len() {
        let report = relay.run_once().await.expect("a batch");
        assert_eq!(report.delivered, report.claimed, "every delivery succeeds: {report:?}");
        delivered += report.delivered;
    }
    let rate = delivered as f64 / started.elapsed().as_secs_f64();
    assert_eq!(outbox.counts().await.expect("counts").pending, 0);
    rate
}

/// The same webhooks, sent with the same sender and concurrency, with no outbox.
async fn directly(events: Vec<NewEvent>, sender: WebhookSender) -> f64 {
    let pending: Vec<PendingEvent> = events
        .into_iter()
        .map(|e| PendingEvent {
            id: e.id().clone(),
            event_type: e.event_type().to_owned(),
            body: e.body().clone(),
            attempt: 1,
            age: Duration::ZERO,
        })
        .collect();
    let count = pending.len();
    let (sender, queue) = (Arc::new(sender), Arc::new(std::sync::Mutex::new(pending)));
    let started = Instant::now();
    let workers: Vec<_> = (0..RelayConfig::default().concurrency)
        .map(|_| {
            let (sender, queue) = (sender.clone(), queue.clone());
            tokio::spawn(async move {
                loop {
                    let Some(event) = queue.lock().expect("queue").pop() else { return };
                    sender.send(&event).await.expect("a delivery");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker");
    }
    count as f64 / started.elapsed().as_secs_f64()
}

/// A local sink: checks each delivery's signature, answers 204 (401 if it fails).
async fn sink() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/webhooks", listener.local_addr().expect("addr"));
    let verifier = WebhookVerifier::new(WebhookSecret::parse(SECRET).expect("secret"));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let verifier = verifier.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let verifier = verifier.clone();
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await?.to_bytes();
                        let status = if verifier.verify(&parts.headers, &body).is_ok() { 204 } else { 401 };
                        let response =
                            http::Response::builder().status(status).body(http_body_util::Empty::<Bytes>::new());
                        Ok::<_, hyper::Error>(response.expect("response"))
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    url
}

/// What `POST /orders` handlers share.
#[derive(Clone)]
struct App {
    outbox: Option<PostgresOutbox>,
}

/// Inserts the order through the claim's transaction and, with an outbox, enqueues
/// `order.created` in it.
async fn create_order(
    State(app): State<App>,
    context: IdempotencyContext,
    tx: TxHandle<Postgres>,
    body: String,
) -> (StatusCode, String) {
    let order_id = uuid::Uuid::new_v4().to_string();
    let order = format!("{{\"order_id\":\"{order_id}\",\"body\":{body}}}");
    {
        let mut conn = tx.acquire().await.expect("claim transaction");
        sqlx::query("INSERT INTO bench_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
            .bind(&order_id)
            .bind(context.operation_id())
            .bind(&body)
            .execute(&mut *conn)
            .await
            .expect("insert");
        if let Some(outbox) = &app.outbox {
            let data: &serde_json::value::RawValue = serde_json::from_str(&order).expect("JSON");
            let event = NewEvent::for_operation(&context, "order.created", data).expect("event");
            outbox.enqueue_on(&mut conn, &event).await.expect("enqueue");
        }
    }
    drop(tx);
    (StatusCode::CREATED, order)
}

async fn serve_orders(pool: &PgPool, outbox: Option<PostgresOutbox>) -> std::net::SocketAddr {
    let store = PostgresStore::new(pool.clone()).schema("bench_idem").expect("schema");
    store.migrate().await.expect("migrate the records");
    let layer = IdempotencyLayer::new(store).shared_scope("bench").operation("orders.create");
    let router = Router::new().route("/orders", post(create_order).layer(layer)).with_state(App { outbox });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    addr
}

/// Requests per second of each round, `with outbox` and `without`.
async fn enqueue_cost(pool: &PgPool, rounds: usize) {
    sqlx::raw_sql(
        "CREATE TABLE bench_orders (order_id text PRIMARY KEY, operation_id text NOT NULL, body text NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await
    .expect("create bench_orders");
    let outbox = PostgresOutbox::new(pool.clone()).schema("bench_outbox").expect("schema");
    let with = serve_orders(pool, Some(outbox)).await;
    let without = serve_orders(pool, None).await;
    let counter = Arc::new(AtomicU64::new(0));
    let key_of: http_load::KeyOf = Arc::new(|n| format!("bench-key-{n}"));
    let drive = async |name: &str, addr, window| {
        let latencies =
            http_load::post_orders(name, addr, CONCURRENCY, BODY, counter.clone(), key_of.clone(), window).await;
        latencies.len() as f64 / window.as_secs_f64()
    };
    drive("with outbox", with, WARM_UP).await;
    drive("without", without, WARM_UP).await;
    let (mut with_rates, mut without_rates) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            with_rates.push(drive("with outbox", with, MEASURE).await);
            without_rates.push(drive("without", without, MEASURE).await);
        } else {
            without_rates.push(drive("without", without, MEASURE).await);
            with_rates.push(drive("with outbox", with, MEASURE).await);
        }
    }
    report("POST /orders (requests/s)", "with outbox", &with_rates, "without", &without_rates);
}

/// Prints both series and `numerator / denominator`: overall, and the median and range of the
/// per-round ratios.
fn report(title: &str, a: &str, a_rates: &[f64], b: &str, b_rates: &[f64]) {
    let mean = |rates: &[f64]| rates.iter().sum::<f64>() / rates.len() as f64;
    let mut ratios: Vec<f64> = a_rates.iter().zip(b_rates).map(|(x, y)| x / y).collect();
    ratios.sort_by(f64::total_cmp);
    println!("{title}");
    println!("  {a:>12}: {:>9.0}/s  rounds {:?}", mean(a_rates), a_rates.iter().map(|r| r.round()).collect::<Vec<_>>());
    println!("  {b:>12}: {:>9.0}/s  rounds {:?}", mean(b_rates), b_rates.iter().map(|r| r.round()).collect::<Vec<_>>());
    println!(
        "  {a} / {b}: {:.2}x overall; per round median {:.2}x, range {:.2}x to {:.2}x over {} rounds",
        mean(a_rates) / mean(b_rates),
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        ratios.len()
    );
}
