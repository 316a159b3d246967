//! The reference service with `REDIS_URL` set: the orders example as a child process on
//! PostgreSQL, with the fast path on a `redis-server` this test starts. Its answers are cached in
//! Redis (under digests only); with Redis killed it keeps answering right, on its database alone.
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite", feature = "redis"))]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use support::redis::RedisServer;
use support::server::{exchange, fresh_database, orders_binary, orders_per_operation, post_order};

const ACCOUNT: &str = "acct_redis";

/// The example server with `REDIS_URL`, killed on drop.
struct Orders {
    child: Child,
    addr: SocketAddr,
    admin_addr: SocketAddr,
}

const ADMIN_TOKEN: &str = "redis-operator-token-0123";

impl Orders {
    fn start(database_url: &str, redis_url: &str) -> Orders {
        let mut child = Command::new(orders_binary())
            .env("ORDERS_ADDR", "127.0.0.1:0")
            // A port of its own: servers of tests running at once must not share one.
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", database_url)
            .env("REDIS_URL", redis_url)
            .env("ORDERS_ADMIN_TOKEN", ADMIN_TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the orders example");
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        stdout.read_line(&mut line).expect("first line");
        let mut admin_line = String::new();
        stdout.read_line(&mut admin_line).expect("second line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the server did not start: {line:?} (run `cargo test --all-features`)"))
            .parse()
            .expect("address");
        let admin_addr = admin_line
            .trim()
            .strip_prefix("admin listening on ")
            .unwrap_or_else(|| panic!("no operator listener: {admin_line:?}"))
            .parse()
            .expect("admin address");
        Orders { child, addr, admin_addr }
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

#[test]
fn a_record_evicted_through_the_operator_routes_is_not_replayed_from_redis() {
    tower_idempotency::testkit::run(async {
        let redis = RedisServer::start();
        let database_url = fresh_database("tidem_revict").await;
        let orders = Orders::start(&database_url, &redis.url());
        let key = format!("redis-evict-{}", std::process::id());

        let first = post_order(orders.addr, ACCOUNT, &key, &body(3)).await.unwrap();
        assert_eq!(first.status, 201, "{}", first.text());
        let replay = post_order(orders.addr, ACCOUNT, &key, &body(3)).await.unwrap();
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(redis.cli(&["--scan", "--pattern", "*:c"]).lines().count(), 1, "the answer is cached in Redis");

        // The operator evicts the record: the fast path forgets its cached copy with it.
        let evict = format!(
            "DELETE /admin/idempotency/record?account={ACCOUNT}&operation=orders.create&key={key} HTTP/1.1\r\n\
             host: {}\r\nauthorization: Bearer {ADMIN_TOKEN}\r\nconnection: close\r\n\r\n",
            orders.admin_addr
        );
        let evicted = exchange(orders.admin_addr, evict).await.unwrap();
        assert_eq!(evicted.status, 204, "{}", evicted.text());

        // So the key executes afresh, instead of replaying the evicted answer from Redis.
        let again = post_order(orders.addr, ACCOUNT, &key, &body(3)).await.unwrap();
        assert_eq!(again.status, 201, "{}", again.text());
        assert_eq!(again.header("idempotent-replayed"), None, "an evicted record must not be replayed");
        assert_ne!(again.body, first.body);
        let rows = orders_per_operation(&database_url).await;
        assert_eq!(rows.iter().map(|(_, n)| n).sum::<i64>(), 2, "{rows:?}");
    });
}
