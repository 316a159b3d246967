//! The outbox's claim, end to end: **an order's event is processed by its consumer exactly
//! once**, under crashes on both sides and duplicate deliveries, over an at-least-once relay.
//!
//! The orders service (a child process, its relay delivering to `ORDERS_WEBHOOK_URL`) creates
//! orders under concurrent clients and is SIGKILLed and restarted several times; the
//! `webhook_sink` example (a child process) fails 20% of deliveries with 500 and drops the
//! connection after processing 20% more, and is itself killed and restarted once. After the relay
//! drains: the `order.created` events the sink processed are exactly the orders in the database,
//! each processed once, and deliveries exceed events (duplicates happened, and were absorbed).
//! On PostgreSQL and on SQLite.
//!
//! The negative control runs the same sink, in process, with its deduplication off: the same
//! verdict then fails.
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite", feature = "outbox"))]

#[path = "support/outbox.rs"]
mod outbox_support;
mod support;

/// The sink's modules, for the negative control (run in process, deduplication off).
#[path = "../examples/webhook_sink"]
#[allow(dead_code)]
mod sink {
    pub mod app;
    pub mod db;
    pub mod serve;
}

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_support::{ADMIN_TOKEN, Process, SECRET, Tally, exactly_once};
use serde_json::Value;
use support::server::{free_port, fresh_database, get, post_order};

const CLIENTS: usize = 6;
const ORDER_KILLS: usize = 4;
const ACCOUNT: &str = "acct_outbox";
/// How long the relay may take to drain after the last kill: the 30 s lease of a killed relay's
/// batch, then a backoff capped at 30 s. A liveness bound, not a speed check.
const DRAIN_LIMIT: Duration = Duration::from_secs(240);

fn body(client: usize, n: usize) -> String {
    format!("{{\"sku\":\"sku-{client}-{n}\",\"quantity\":1,\"amount_minor\":{},\"currency\":\"EUR\"}}", 100 + n)
}

/// Clients creating orders until `stop`, each key retried until it gets its 201.
fn spawn_clients(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    created: Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|client| {
            let (stop, created) = (stop.clone(), created.clone());
            tokio::spawn(async move {
                for n in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let key = format!("outbox-{client}-{n}-{}", std::process::id());
                    for _attempt in 0..400 {
                        match post_order(addr, ACCOUNT, &key, &body(client, n)).await {
                            Ok(reply) if reply.status == 201 => {
                                created.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Ok(reply) => {
                                assert!(matches!(reply.status, 409 | 503), "{} {}", reply.status, reply.text())
                            }
                            Err(_transport) => {}
                        }
                        tokio::time::sleep(Duration::from_millis(25)).await;
                    }
                }
            })
        })
        .collect()
}

/// Waits until the outbox has nothing pending; its counts then.
async fn drained(admin: SocketAddr) -> Value {
    let started = Instant::now();
    loop {
        if let Ok(reply) = get(admin, ADMIN_TOKEN, "/admin/outbox/counts").await {
            assert_eq!(reply.status, 200, "{}", reply.text());
            let counts: Value = serde_json::from_slice(&reply.body).expect("JSON counts");
            if counts["pending"] == 0 {
                return counts;
            }
            assert!(started.elapsed() < DRAIN_LIMIT, "the relay did not drain: {counts}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The orders in the service's database.
async fn orders_in(database_url: &str) -> BTreeSet<String> {
    if database_url.starts_with("sqlite:") {
        let pool = sqlx::SqlitePool::connect(database_url).await.expect("open the orders file");
        let ids: Vec<String> =
            sqlx::query_scalar("SELECT order_id FROM orders").fetch_all(&pool).await.expect("orders");
        pool.close().await;
        ids.into_iter().collect()
    } else {
        let pool = sqlx::PgPool::connect(database_url).await.expect("connect to the orders database");
        let ids: Vec<String> =
            sqlx::query_scalar("SELECT order_id::text FROM orders").fetch_all(&pool).await.expect("orders");
        pool.close().await;
        ids.into_iter().collect()
    }
}

async fn events_of(sink: SocketAddr) -> Value {
    let reply = get(sink, "-", "/events").await.expect("GET /events");
    assert_eq!(reply.status, 200, "{}", reply.text());
    serde_json::from_slice(&reply.body).expect("JSON events")
}

/// The chaos run on the database `database_url` names.
async fn chaos(database_url: String) {
    let (sink_db, _sink_cleanup) = support::sqlite_path("tidem_sink");
    let sink_port = free_port();
    let webhook = format!("http://127.0.0.1:{sink_port}/webhooks");
    let mut sink = Some(Process::sink(sink_port, &sink_db, 0.2, 0.2));
    let (port, admin_port) = (free_port(), free_port());
    let start_orders = {
        let (url, webhook) = (database_url.clone(), webhook.clone());
        move || Process::orders(&url, port, admin_port, Some(&webhook))
    };
    let mut orders = Some(start_orders());
    let addr = orders.as_ref().unwrap().addr;

    let (stop, created) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let clients = spawn_clients(addr, stop.clone(), created.clone());
    for kill in 0..ORDER_KILLS {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        if kill == 1 {
            sink.take().unwrap().kill();
            tokio::time::sleep(Duration::from_millis(1000)).await;
            sink = Some(Process::sink(sink_port, &sink_db, 0.2, 0.2));
        }
        orders.take().unwrap().kill();
        let start = start_orders.clone();
        orders = Some(tokio::task::spawn_blocking(start).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.expect("a client");
    }

    let counts = drained(orders.as_ref().unwrap().admin.unwrap()).await;
    let in_db = orders_in(&database_url).await;
    let events = events_of(sink.as_ref().unwrap().addr).await;
    let tally = exactly_once(&in_db, &events).unwrap_or_else(|failure| panic!("{failure}"));
    let Tally { events: processed, deliveries } = tally;
    eprintln!(
        "outbox chaos on {}: {} orders ({} acknowledged), {ORDER_KILLS} service kills and 1 sink kill, {deliveries} \
         deliveries, {} duplicates absorbed, counts {counts}",
        if database_url.starts_with("sqlite:") { "SQLite" } else { "PostgreSQL" },
        in_db.len(),
        created.load(Ordering::Relaxed),
        deliveries - processed as u64
    );
    assert!(processed > 50, "too few orders to mean anything: {processed}");
    assert_eq!(counts["dead"], 0, "no event may be given up: {counts}");
    assert_eq!(counts["delivered"], processed as u64, "{counts}");
    assert!(
        deliveries > processed as u64,
        "duplicates must have happened: {deliveries} deliveries of {processed} events"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_every_order_event_is_processed_exactly_once_through_crashes_and_faults() {
    chaos(fresh_database("tidem_outbox").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_every_order_event_is_processed_exactly_once_through_crashes_and_faults() {
    let (path, _cleanup) = support::sqlite_path("tidem_outbox");
    chaos(format!("sqlite:{}", path.display())).await;
}

/// The negative control: the same faults, the same service, a sink without its deduplication.
/// The verdict of the chaos tests must then fail, or it proves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_deduplication_the_same_verdict_fails() {
    let (sink_db, _sink_cleanup) = support::sqlite_path("tidem_sink");
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&sink_db);
    let pool = sink::db::open(options).await.expect("the sink's database");
    let secret = tower_idempotency::outbox::WebhookSecret::parse(SECRET).unwrap();
    let config = sink::app::SinkConfig { secret, fail_rate: 0.2, ambiguous_rate: 0.2, dedup: false };
    let router = sink::app::app(pool, config).await.expect("the sink");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sink_addr = listener.local_addr().unwrap();
    let sink = tokio::spawn(sink::serve::serve(listener, router));

    let (path, _cleanup) = support::sqlite_path("tidem_outbox");
    let database_url = format!("sqlite:{}", path.display());
    let webhook = format!("http://{sink_addr}/webhooks");
    let orders = Process::orders(&database_url, free_port(), free_port(), Some(&webhook));
    for n in 0..60 {
        let reply = post_order(orders.addr, ACCOUNT, &format!("control-{n}"), &body(0, n)).await.expect("create");
        assert_eq!(reply.status, 201, "{}", reply.text());
    }
    drained(orders.admin.unwrap()).await;
    let verdict = exactly_once(&orders_in(&database_url).await, &events_of(sink_addr).await);
    sink.abort();
    let failure = verdict.expect_err("without deduplication, redeliveries must be processed again");
    eprintln!("outbox negative control: {failure}");
    assert!(failure.contains("processed more than once"), "{failure}");
}
