//! The crash test: the reference service runs as a child process on PostgreSQL; clients send
//! orders and retry with the same key on any failure; the server is SIGKILLed at random
//! moments and restarted, many times. Afterwards:
//! - at most one order per key;
//! - every key whose client saw a 201 has exactly one order;
//! - a final retry of every key replays the body the client saw.
//!
//! It runs again, with fewer kills, on a store whose answers are apart (`ORDERS_ANSWERS_APART`).
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite"))]

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use support::server::{Server, free_port, fresh_database, orders_per_operation, post_order};
use tower_idempotency::{IdempotencyKey, RecordId, Scope};

const CLIENTS: usize = 8;
const KILLS: usize = 30;
/// The service's environment for a store with its answers apart.
const ANSWERS_APART: &[(&str, &str)] = &[("ORDERS_ANSWERS_APART", "true")];
const ACCOUNT: &str = "crash-account";

/// What one client learned about one key.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// The first 201 body the client received, if any.
    acknowledged: Option<Vec<u8>>,
    /// Whether that 201 was a replay: the first attempt committed but its answer was lost.
    acknowledged_by_replay: bool,
    attempts: usize,
}

fn order_body(client: usize, n: usize) -> String {
    format!(
        "{{\"sku\":\"sku-{client}-{n}\",\"quantity\":{},\"amount_minor\":{},\"currency\":\"EUR\"}}",
        n + 1,
        1000 + n
    )
}

fn operation_id(key: &str) -> String {
    RecordId::new(&Scope::new(ACCOUNT), "orders.create", &IdempotencyKey::new(key).unwrap()).operation_id()
}

#[test]
fn orders_survive_sigkill_at_random_moments() {
    tower_idempotency::testkit::run(crash(KILLS, &[]));
}

#[test]
fn orders_survive_sigkill_with_answers_apart() {
    tower_idempotency::testkit::run(crash(KILLS / 2, ANSWERS_APART));
}

/// The crash test with `kills` kills, the service started with `env`.
async fn crash(kills_wanted: usize, env: &'static [(&'static str, &'static str)]) {
    let database_url = fresh_database("tidem_crash").await;
    let port = free_port();
    let server = Arc::new(std::sync::Mutex::new(Some(Server::start_with(&database_url, port, env))));
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));

    // The clients: each walks through new keys until the killing stops, retrying each key
    // until a 201 arrives.
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (stop, answered) = (stop.clone(), answered.clone());
        clients.push(tokio::spawn(async move {
            let mut seen: HashMap<String, Seen> = HashMap::new();
            for n in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let key = format!("crash-{client}-{n}-{}", std::process::id());
                let body = order_body(client, n);
                let entry = seen.entry(key.clone()).or_default();
                loop {
                    entry.attempts += 1;
                    match post_order(addr, ACCOUNT, &key, &body).await {
                        Ok(reply) if reply.status == 201 => {
                            entry.acknowledged_by_replay = reply.header("idempotent-replayed") == Some("true");
                            entry.acknowledged = Some(reply.body);
                            answered.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Ok(reply) => assert!(
                            matches!(reply.status, 409 | 503),
                            "a retry may only be told to wait (409, 503), got {} {}",
                            reply.status,
                            reply.text()
                        ),
                        Err(_transport) => {}
                    }
                    if stop.load(Ordering::Relaxed) && entry.attempts > 200 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            seen
        }));
    }

    // The killer: SIGKILL at random moments, restart at once on the same port.
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
    let mut kills = 0;
    while kills < kills_wanted {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(20 + rng % 180)).await;
        let old = server.lock().unwrap().take();
        if let Some(old) = old {
            old.kill();
        }
        kills += 1;
        let url = database_url.clone();
        let fresh = tokio::task::spawn_blocking(move || Server::start_with(&url, port, env)).await.unwrap();
        *server.lock().unwrap() = Some(fresh);
    }
    stop.store(true, Ordering::Relaxed);
    let mut seen = HashMap::new();
    for client in clients {
        seen.extend(client.await.expect("client"));
    }

    // The verdict, from the database and from a final retry of every key.
    let rows = orders_per_operation(&database_url).await;
    let orders: HashMap<String, i64> = rows.into_iter().collect();
    let mut acknowledged = 0;
    for (key, seen) in &seen {
        let count = orders.get(&operation_id(key)).copied().unwrap_or(0);
        assert!(count <= 1, "key {key} created {count} orders");
        let final_reply = post_order(addr, ACCOUNT, key, &order_body_for(key)).await.expect("final retry");
        if let Some(body) = &seen.acknowledged {
            acknowledged += 1;
            assert_eq!(count, 1, "key {key} was acknowledged with 201 but has no order");
            assert_eq!(final_reply.status, 201, "final retry of {key}: {}", final_reply.text());
            assert_eq!(final_reply.header("idempotent-replayed"), Some("true"));
            assert_eq!(&final_reply.body, body, "the final retry of {key} must replay the acknowledged body");
        }
    }
    assert!(acknowledged > 0, "no request ever succeeded: the test proved nothing");
    if !env.is_empty() {
        let (apart, inline) = support::server::answers_apart_and_inline(&database_url).await;
        assert!(apart >= acknowledged && inline == 0, "answers apart: {apart} apart, {inline} inline");
    }
    let total_orders: i64 = orders.values().sum();
    let retries: usize = seen.values().map(|s| s.attempts.saturating_sub(1)).sum();
    let lost_answers = seen.values().filter(|s| s.acknowledged_by_replay).count();
    println!(
        "crash: {kills} kills, {} keys, {acknowledged} acknowledged ({lost_answers} only by a replay after the \
             first answer was lost), {total_orders} orders, {retries} retries ({env:?})",
        seen.len(),
    );
}

/// The body a key was sent with (keys encode their client and index).
fn order_body_for(key: &str) -> String {
    let mut parts = key.split('-').skip(1);
    let client = parts.next().unwrap().parse().unwrap();
    let n = parts.next().unwrap().parse().unwrap();
    order_body(client, n)
}
