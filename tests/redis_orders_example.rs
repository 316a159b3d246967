//! The reference service with `REDIS_URL` set: the orders example as a child process on
//! PostgreSQL, with the fast path on a `redis-server` this test starts. Its answers are cached in
//! Redis (under digests only); with Redis killed it keeps answering right, on its database alone.
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite", feature = "redis"))]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use support::redis::RedisServer;
use support::server::{fresh_database, orders_binary, orders_per_operation, post_order};

const ACCOUNT: &str = "acct_redis";

/// The example server with `REDIS_URL`, killed on drop.
struct Orders {
    child: Child,
    addr: SocketAddr,
}

impl Orders {
    fn start(database_url: &str, redis_url: &str) -> Orders {
        let mut child = Command::new(orders_binary())
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", database_url)
            .env("REDIS_URL", redis_url)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the orders example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("first line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the server did not start: {line:?} (run `cargo test --all-features`)"))
            .parse()
            .expect("address");
        Orders { child, addr }
    }
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn body(n: u32) -> String {
    format!("{{\"sku\":\"r-{n}\",\"quantity\":1,\"amount_minor\":{},\"currency\":\"EUR\"}}", 100 + n)
}

#[test]
fn the_orders_service_uses_the_fast_path_when_redis_url_is_set() {
    tower_idempotency::testkit::run(async {
        let mut redis = RedisServer::start();
        let database_url = fresh_database("tidem_rorders").await;
        let orders = Orders::start(&database_url, &redis.url());
        let key = |n: u32| format!("redis-example-{n}-{}", std::process::id());

        let first = post_order(orders.addr, ACCOUNT, &key(1), &body(1)).await.unwrap();
        assert_eq!(first.status, 201, "{}", first.text());
        let retry = post_order(orders.addr, ACCOUNT, &key(1), &body(1)).await.unwrap();
        assert_eq!((retry.status, retry.header("idempotent-replayed")), (201, Some("true")));
        assert_eq!(retry.body, first.body);
        // The answer is cached in Redis, under the identity's digest: never the key or account.
        let cached = redis.cli(&["--scan", "--pattern", "*:c"]);
        assert_eq!(cached.lines().count(), 1, "one cached answer expected, found: {cached}");
        assert!(!cached.contains("redis-example") && !cached.contains(ACCOUNT), "{cached}");

        // Redis dies: the service answers on its database alone, and answers right.
        redis.stop();
        let replay = post_order(orders.addr, ACCOUNT, &key(1), &body(1)).await.unwrap();
        assert_eq!((replay.status, &replay.body), (201, &first.body), "{}", replay.text());
        let mut burst = Vec::new();
        for _ in 0..16 {
            let (addr, key) = (orders.addr, key(2));
            burst.push(tokio::spawn(async move { post_order(addr, ACCOUNT, &key, &body(2)).await }));
        }
        let mut bodies = Vec::new();
        for answer in burst {
            let answer = answer.await.unwrap().expect("an answer, not a dropped connection");
            match answer.status {
                201 => bodies.push(answer.body),
                409 => assert!(answer.text().contains("idempotency_request_in_flight"), "{}", answer.text()),
                other => panic!("only 201 or 409 in flight while Redis is down, got {other}: {}", answer.text()),
            }
        }
        assert!(!bodies.is_empty() && bodies.iter().all(|b| *b == bodies[0]), "one order, replayed to every 201");

        let rows = orders_per_operation(&database_url).await;
        assert_eq!(rows.len(), 2, "two keys, two orders: {rows:?}");
        assert!(rows.iter().all(|(_, n)| *n == 1), "{rows:?}");
    });
}
