//! The fault test: while clients create orders through the reference service (a child process
//! on PostgreSQL), the server's database backends are killed mid-request with
//! `pg_terminate_backend`. No key may create two orders, and every answer a client gets is
//! either the stored one (201, first or replayed) or a retryable 503. It runs again, with fewer
//! keys, on a store whose answers are apart (`ORDERS_ANSWERS_APART`).
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite"))]

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use support::server::{Server, free_port, fresh_database, orders_per_operation, post_order};
use tower_idempotency::{IdempotencyKey, RecordId, Scope};

const CLIENTS: usize = 6;
const KEYS_PER_CLIENT: usize = 40;
const ACCOUNT: &str = "fault-account";

fn order_body(client: usize, n: usize) -> String {
    format!("{{\"sku\":\"f-{client}-{n}\",\"quantity\":1,\"amount_minor\":{},\"currency\":\"USD\"}}", 500 + n)
}

#[test]
fn terminated_database_backends_never_duplicate_an_order() {
    tower_idempotency::testkit::run(faults(KEYS_PER_CLIENT, &[]));
}

#[test]
fn terminated_database_backends_never_duplicate_an_order_with_answers_apart() {
    tower_idempotency::testkit::run(faults(KEYS_PER_CLIENT / 2, &[("ORDERS_ANSWERS_APART", "true")]));
}

/// The fault test with `keys_per_client` keys for each client, the service started with `env`.
async fn faults(keys_per_client: usize, env: &[(&str, &str)]) {
    let database_url = fresh_database("tidem_fault").await;
    let database = database_url.rsplit('/').next().unwrap().to_owned();
    let port = free_port();
    let _server = Server::start_with(&database_url, port, env);
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let admin = sqlx::PgPool::connect(&support::database_url()).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let unavailable = Arc::new(AtomicUsize::new(0));

    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let unavailable = unavailable.clone();
        clients.push(tokio::spawn(async move {
            let mut acknowledged: HashMap<String, Vec<u8>> = HashMap::new();
            for n in 0..keys_per_client {
                let key = format!("fault-{client}-{n}-{}", std::process::id());
                loop {
                    let reply = post_order(addr, ACCOUNT, &key, &order_body(client, n))
                        .await
                        .expect("the server stays up: a dead backend must become an answer, not a dropped connection");
                    match reply.status {
                        201 => {
                            acknowledged.insert(key.clone(), reply.body);
                            break;
                        }
                        503 => {
                            assert!(reply.header("retry-after").is_some(), "503 without Retry-After");
                            unavailable.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        other => panic!(
                            "only the stored answer or a retryable 503 are allowed, got {other} {}",
                            reply.text()
                        ),
                    }
                }
            }
            acknowledged
        }));
    }

    // The attacker: terminates every backend of the service's database, over and over.
    let killer = {
        let (stop, admin, database) = (stop.clone(), admin.clone(), database.clone());
        tokio::spawn(async move {
            let mut rounds = 0;
            let mut terminated = 0;
            while !stop.load(Ordering::Relaxed) {
                let killed: Vec<(bool,)> = sqlx::query_as(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE datname = $1 AND pid <> pg_backend_pid()",
                )
                .bind(&database)
                .fetch_all(&admin)
                .await
                .unwrap();
                terminated += killed.len();
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(15 + (rounds * 37) % 60)).await;
            }
            (rounds, terminated)
        })
    };

    let mut acknowledged = HashMap::new();
    for client in clients {
        acknowledged.extend(client.await.expect("client"));
    }
    stop.store(true, Ordering::Relaxed);
    let (rounds, terminated) = killer.await.unwrap();

    let rows = orders_per_operation(&database_url).await;
    assert!(rows.iter().all(|(_, n)| *n == 1), "a key created more than one order: {rows:?}");
    assert_eq!(rows.len(), CLIENTS * keys_per_client, "every acknowledged key has its order");
    for (key, body) in &acknowledged {
        let operation_id =
            RecordId::new(&Scope::new(ACCOUNT), "orders.create", &IdempotencyKey::new(key.as_str()).unwrap())
                .operation_id();
        assert!(rows.iter().any(|(op, _)| *op == operation_id), "{key} acknowledged without an order");
        let mut parts = key.split('-').skip(1);
        let (client, n) = (parts.next().unwrap().parse().unwrap(), parts.next().unwrap().parse().unwrap());
        let replay = post_order(addr, ACCOUNT, key, &order_body(client, n)).await.unwrap();
        assert_eq!((replay.status, &replay.body), (201, body), "the retry of {key} must replay what was acknowledged");
    }
    assert!(terminated > 0, "no backend was ever terminated: the test proved nothing");
    if !env.is_empty() {
        let (apart, inline) = support::server::answers_apart_and_inline(&database_url).await;
        assert!(apart >= rows.len() as i64 && inline == 0, "answers apart: {apart} apart, {inline} inline");
    }
    println!(
        "faults: {rounds} rounds, {terminated} backends terminated, {} retryable 503s, {} orders",
        unavailable.load(Ordering::Relaxed),
        rows.len()
    );
    admin.close().await;
}
