//! The reference service on PostgreSQL with its pool exhausted (issue 11, item 6): every
//! connection is held by an order creation blocked on a lock the test holds on the orders
//! table. A plain `GET`, a duplicate of a blocked creation, a replay of a finished one and a
//! new key are each answered 503 with `Retry-After` instead of waiting (the client gives up
//! after 20 s, a liveness bound, not a timing threshold). Once the lock goes, the blocked
//! creations finish, once each, and everything is answered as before.
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite"))]

mod support;

use std::time::Duration;

use sqlx::Connection;
use support::server::{Reply, Server, free_port, fresh_database, get, orders_per_operation, post_order};

/// The example's pool size (`max_connections` in its start-up).
const POOL: usize = 16;
const ACCOUNT: &str = "acct_pool";

fn order(n: usize) -> String {
    format!("{{\"sku\":\"pool-{n}\",\"quantity\":1,\"amount_minor\":{},\"currency\":\"USD\"}}", 100 + n)
}

fn code(reply: &Reply) -> Option<String> {
    let problem: serde_json::Value = serde_json::from_slice(&reply.body).ok()?;
    problem.get("code")?.as_str().map(str::to_owned)
}

fn assert_unavailable(what: &str, reply: &Result<Reply, String>, expected_code: &str) {
    let reply = reply.as_ref().unwrap_or_else(|e| panic!("{what}: no answer ({e}): the wait is not bounded"));
    assert_eq!(reply.status, 503, "{what}: {}", reply.text());
    assert_eq!(code(reply).as_deref(), Some(expected_code), "{what}: {}", reply.text());
    assert!(reply.header("retry-after").is_some(), "{what}: a 503 says when to retry");
}

#[tokio::test]
async fn an_exhausted_pool_answers_503_to_reads_replays_duplicates_and_new_keys() {
    let database_url = fresh_database("tidem_pool_orders").await;
    let port = free_port();
    let _server = Server::start(&database_url, port);
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();

    let done = post_order(addr, ACCOUNT, "done", &order(0)).await.expect("the first order");
    assert_eq!(done.status, 201, "{}", done.text());
    let body: serde_json::Value = serde_json::from_slice(&done.body).expect("an order");
    let order_path = format!("/orders/{}", body["order_id"].as_str().expect("order_id"));

    // Every order creation now blocks inside its transaction, holding its connection.
    let mut locker = sqlx::PgConnection::connect(&database_url).await.expect("connect");
    sqlx::raw_sql("BEGIN; LOCK TABLE orders IN ACCESS EXCLUSIVE MODE").execute(&mut locker).await.expect("lock");
    let blocked: Vec<_> = (1..=POOL)
        .map(|n| tokio::spawn(async move { post_order(addr, ACCOUNT, &format!("held-{n}"), &order(n)).await }))
        .collect();
    let mut watcher = sqlx::PgConnection::connect(&support::database_url()).await.expect("connect");
    let database = database_url.rsplit('/').next().unwrap().to_owned();
    let waiting = async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
            )
            .bind(&database)
            .fetch_one(&mut watcher)
            .await
            .expect("count the waiting backends");
            if waiting as usize >= POOL {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(15), waiting).await.expect("every connection of the pool is blocked");

    let (first, zeroth, new) = (order(1), order(0), order(99));
    let (read, duplicate, replay, fresh) = tokio::join!(
        get(addr, ACCOUNT, &order_path),
        post_order(addr, ACCOUNT, "held-1", &first),
        post_order(addr, ACCOUNT, "done", &zeroth),
        post_order(addr, ACCOUNT, "fresh", &new),
    );
    assert_unavailable("the plain GET", &read, "storage_unavailable");
    assert_unavailable("the duplicate", &duplicate, "idempotency_store_unavailable");
    assert_unavailable("the replay", &replay, "idempotency_store_unavailable");
    assert_unavailable("the new key", &fresh, "idempotency_store_unavailable");

    sqlx::raw_sql("ROLLBACK").execute(&mut locker).await.expect("unlock");
    for (n, reply) in blocked.into_iter().enumerate() {
        let reply = reply.await.expect("task").unwrap_or_else(|e| panic!("held-{}: {e}", n + 1));
        assert_eq!(reply.status, 201, "held-{}: {}", n + 1, reply.text());
    }
    let read = get(addr, ACCOUNT, &order_path).await.expect("the GET");
    assert_eq!(read.status, 200, "{}", read.text());
    let duplicate = post_order(addr, ACCOUNT, "held-1", &order(1)).await.expect("the duplicate");
    assert_eq!((duplicate.status, duplicate.header("idempotent-replayed")), (201, Some("true")));
    let fresh = post_order(addr, ACCOUNT, "fresh", &order(99)).await.expect("the new key");
    assert_eq!((fresh.status, fresh.header("idempotent-replayed")), (201, None), "{}", fresh.text());

    let per_operation = orders_per_operation(&database_url).await;
    assert_eq!(per_operation.len(), POOL + 2, "one order per key: {per_operation:?}");
    assert!(per_operation.iter().all(|(_, n)| *n == 1), "no key created two orders: {per_operation:?}");
    locker.close().await.ok();
    watcher.close().await.ok();
}
