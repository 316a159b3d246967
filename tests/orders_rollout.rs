//! The reference service's rollout, as a child process on SQLite and on PostgreSQL:
//! `ORDERS_IDEMPOTENCY_MODE=off` (and `shadow`) takes the old path (every `POST /orders`
//! creates an order, 201 without `idempotent-replayed`), `orders_duplicate_effects` on
//! `GET /metrics` counts the keys that executed twice, `PUT /admin/idempotency/rollout` (behind
//! the operator token) turns enforcement on for the next request, and a cohort is enforced
//! while everyone else stays on the old path.
#![cfg(all(feature = "axum", feature = "sqlite", feature = "postgres", feature = "metrics"))]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::server::{Reply, get, orders_binary, post_order};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "rollout-test-admin-token";

/// The example server with `env`; killed on drop.
struct Orders {
    child: Child,
    addr: SocketAddr,
    admin: SocketAddr,
}

impl Orders {
    fn start(database_url: &str, env: &[(&str, &str)]) -> Orders {
        let mut command = Command::new(orders_binary());
        command
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("ORDERS_ADMIN_TOKEN", TOKEN)
            .env("ORDERS_AUDIT_SECS", "0.05")
            .env("DATABASE_URL", database_url)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (name, value) in env {
            // An empty value takes the variable away (the operator token, say).
            if value.is_empty() {
                command.env_remove(name);
            } else {
                command.env(name, value);
            }
        }
        let mut child = command.spawn().expect("start the orders example");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
        let mut address = |prefix: &str| {
            let mut line = String::new();
            lines.read_line(&mut line).expect("a line");
            line.trim()
                .strip_prefix(prefix)
                .unwrap_or_else(|| panic!("the server did not start: {line:?}"))
                .parse::<SocketAddr>()
                .expect("address")
        };
        let addr = address("listening on ");
        let admin = address("admin listening on ");
        Orders { child, addr, admin }
    }
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const ORDER: &str = "{\"sku\":\"book-1\",\"quantity\":1,\"amount_minor\":100,\"currency\":\"JPY\"}";

/// `PUT path` with a JSON body and `token` (if any) on the operator listener.
async fn put(admin: SocketAddr, token: Option<&str>, path: &str, body: &str) -> Reply {
    send(admin, "PUT", token, path, body).await
}

/// `method path` with a JSON body (if not empty) and `token` (if any, else no
/// `Authorization` field at all) on the operator listener.
async fn send(admin: SocketAddr, method: &str, token: Option<&str>, path: &str, body: &str) -> Reply {
    let auth = token.map(|token| format!("authorization: Bearer {token}\r\n")).unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {admin}\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(admin).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut raw)).await.expect("in time").expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status line");
    let body = text.split_once("\r\n\r\n").map(|(_, body)| body.as_bytes().to_vec()).unwrap_or_default();
    Reply { status, headers: Vec::new(), body }
}

/// The value of the metric line that starts with `series` on `GET /metrics`.
async fn metric(admin: SocketAddr, series: &str) -> Option<f64> {
    let text = get(admin, "anyone", "/metrics").await.expect("GET /metrics").text();
    text.lines().find(|line| line.starts_with(series)).and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

/// Waits (bounded) until the metric reads `value`: the audit runs on its own clock.
async fn metric_reaches(admin: SocketAddr, series: &str, value: f64) -> Option<f64> {
    for _ in 0..400 {
        if metric(admin, series).await == Some(value) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    metric(admin, series).await
}

async fn rollout_end_to_end(database_url: &str) {
    let server = Orders::start(database_url, &[("ORDERS_IDEMPOTENCY_MODE", "off")]);
    assert_eq!(metric_reaches(server.admin, "orders_duplicate_effects", 0.0).await, Some(0.0), "0 at start");

    // Off: the old path. A duplicate creates a second order, answered 201 as before.
    for _ in 0..2 {
        let reply = post_order(server.addr, "acct_1", "k-off", ORDER).await.expect("POST");
        assert_eq!(reply.status, 201, "{}", reply.text());
        assert_eq!(reply.header("idempotent-replayed"), None, "the old path never replays");
    }
    let page = get(server.addr, "acct_1", "/orders").await.expect("GET /orders").text();
    assert_eq!(page.matches("\"order_id\"").count(), 2, "two orders: {page}");
    assert_eq!(
        metric_reaches(server.admin, "orders_duplicate_effects", 1.0).await,
        Some(1.0),
        "one key executed twice"
    );

    // The rollout routes are behind the token.
    assert_eq!(get(server.admin, "wrong-token-0000000", "/admin/idempotency/rollout").await.unwrap().status, 401);
    assert_eq!(put(server.admin, None, "/admin/idempotency/rollout", "{\"mode\":\"enforce\"}").await.status, 401);
    let shown = get(server.admin, TOKEN, "/admin/idempotency/rollout").await.unwrap();
    assert_eq!(shown.status, 200);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&shown.body).unwrap(),
        serde_json::json!({"mode": "off", "cohort": null})
    );
    assert_eq!(put(server.admin, Some(TOKEN), "/admin/idempotency/rollout", "{\"mode\":\"on\"}").await.status, 422);

    // A cohort: acct_2 is enforced, everyone else stays off.
    let body = "{\"mode\":\"off\",\"cohort\":[\"acct_2\"]}";
    let changed = put(server.admin, Some(TOKEN), "/admin/idempotency/rollout", body).await;
    assert_eq!(changed.status, 200, "{}", changed.text());
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&changed.body).unwrap()["cohort"],
        serde_json::json!(["acct_2"])
    );
    post_order(server.addr, "acct_2", "k-cohort", ORDER).await.expect("POST");
    let retry = post_order(server.addr, "acct_2", "k-cohort", ORDER).await.expect("POST");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"), "the cohort is enforced");
    let outside = post_order(server.addr, "acct_3", "k-cohort", ORDER).await.expect("POST");
    let outside_again = post_order(server.addr, "acct_3", "k-cohort", ORDER).await.expect("POST");
    assert_eq!((outside.status, outside_again.header("idempotent-replayed")), (201, None));

    // Enforce for everyone, from the next request on.
    let changed =
        put(server.admin, Some(TOKEN), "/admin/idempotency/rollout", "{\"mode\":\"enforce\",\"cohort\":null}").await;
    assert_eq!(changed.status, 200);
    post_order(server.addr, "acct_1", "k-enforce", ORDER).await.expect("POST");
    let retry = post_order(server.addr, "acct_1", "k-enforce", ORDER).await.expect("POST");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        metric_reaches(server.admin, "orders_duplicate_effects", 2.0).await,
        Some(2.0),
        "k-off and acct_3's k-cohort"
    );

    // The layer's own metrics are on /metrics too, labelled by operation and result.
    let executed = "idempotency_requests_total{operation=\"orders.create\",result=\"executed\"}";
    let replayed = "idempotency_requests_total{operation=\"orders.create\",result=\"replayed\"}";
    assert_eq!(metric(server.admin, executed).await, Some(2.0), "acct_2's and acct_1's first requests");
    assert_eq!(metric(server.admin, replayed).await, Some(2.0));
    let text = get(server.admin, "anyone", "/metrics").await.unwrap().text();
    assert!(text.contains("idempotency_overhead_seconds_bucket{operation=\"orders.create\""), "{text}");
    assert!(!text.contains("acct_") && !text.contains("k-enforce"), "no account or key in a label: {text}");
}

#[tokio::test]
async fn sqlite_off_cohort_and_enforce_through_the_operator_listener() {
    let (path, _cleanup) = support::sqlite_path("tidem_rollout");
    rollout_end_to_end(&format!("sqlite:{}?mode=rwc", path.display())).await;
}

#[tokio::test]
async fn postgres_off_cohort_and_enforce_through_the_operator_listener() {
    let url = support::server::fresh_database("tidem_rollout").await;
    rollout_end_to_end(&url).await;
}

#[tokio::test]
async fn shadow_mode_answers_as_the_old_path_and_counts_what_enforce_would_have_done() {
    let (path, _cleanup) = support::sqlite_path("tidem_shadow");
    let server =
        Orders::start(&format!("sqlite:{}?mode=rwc", path.display()), &[("ORDERS_IDEMPOTENCY_MODE", "shadow")]);
    for _ in 0..2 {
        let reply = post_order(server.addr, "acct_1", "k-shadow", ORDER).await.expect("POST");
        assert_eq!((reply.status, reply.header("idempotent-replayed")), (201, None));
    }
    let replayed = "idempotency_shadow_total{operation=\"orders.create\",result=\"replayed\"}";
    assert_eq!(metric_reaches(server.admin, replayed, 1.0).await, Some(1.0), "enforce would have replayed the second");
    assert_eq!(metric_reaches(server.admin, "orders_duplicate_effects", 1.0).await, Some(1.0));
    let text = get(server.admin, "anyone", "/metrics").await.unwrap().text();
    assert!(!text.contains("idempotency_requests_total"), "nothing was enforced: {text}");
}

/// `GET /metrics` needs no `Authorization` at all; without `ORDERS_ADMIN_TOKEN` the rollout
/// routes do not exist (404, whatever the request carries) while `/metrics` stays; a cohort
/// from the environment with no mode set is enforced inside `enforce`, the default.
#[tokio::test]
async fn metrics_are_open_and_without_a_token_the_rollout_routes_are_not_there() {
    let (path, _cleanup) = support::sqlite_path("tidem_notoken");
    let url = format!("sqlite:{}?mode=rwc", path.display());

    let with_token = Orders::start(&url, &[("ORDERS_IDEMPOTENCY_COHORT", "acct_1,acct_2")]);
    let metrics = send(with_token.admin, "GET", None, "/metrics", "").await;
    assert_eq!(metrics.status, 200, "{}", metrics.text());
    assert!(metrics.text().contains("orders_duplicate_effects"), "{}", metrics.text());
    let shown = get(with_token.admin, TOKEN, "/admin/idempotency/rollout").await.unwrap();
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&shown.body).unwrap(),
        serde_json::json!({"mode": "enforce", "cohort": ["acct_1", "acct_2"]})
    );
    drop(with_token);

    let without_token = Orders::start(&url, &[("ORDERS_ADMIN_TOKEN", "")]);
    for token in [None, Some(TOKEN)] {
        let shown = send(without_token.admin, "GET", token, "/admin/idempotency/rollout", "").await;
        assert_eq!(shown.status, 404, "{}", shown.text());
        let body = "{\"mode\":\"off\",\"cohort\":null}";
        assert_eq!(send(without_token.admin, "PUT", token, "/admin/idempotency/rollout", body).await.status, 404);
    }
    let metrics = send(without_token.admin, "GET", None, "/metrics", "").await;
    assert_eq!(metrics.status, 200, "{}", metrics.text());
    // Still enforced: the switch was never reachable.
    post_order(without_token.addr, "acct_1", "k-1", ORDER).await.expect("POST");
    let retry = post_order(without_token.addr, "acct_1", "k-1", ORDER).await.expect("POST");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
}

#[test]
fn a_bad_mode_or_cohort_stops_the_start() {
    for (name, value) in
        [("ORDERS_IDEMPOTENCY_MODE", "on"), ("ORDERS_IDEMPOTENCY_COHORT", "acct 1"), ("ORDERS_AUDIT_SECS", "0")]
    {
        let (path, _cleanup) = support::sqlite_path("tidem_badenv");
        let output = Command::new(orders_binary())
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", format!("sqlite:{}?mode=rwc", path.display()))
            .env(name, value)
            .output()
            .expect("run");
        assert!(!output.status.success(), "{name}={value} must stop the start");
        assert!(String::from_utf8_lossy(&output.stderr).contains(name), "the error names {name}");
    }
}
