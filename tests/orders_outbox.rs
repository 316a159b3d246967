//! The orders service's outbox, as a child process: `order.created` enqueued once per order
//! with the id derived from its operation, `GET /admin/outbox/counts` behind the operator token,
//! and the refusal to start with a webhook URL but no secret.
#![cfg(all(feature = "axum", feature = "sqlite", feature = "outbox"))]

#[path = "support/outbox.rs"]
mod outbox_support;
mod support;

use std::process::{Command, Stdio};

use outbox_support::{ADMIN_TOKEN, Process, example_binary};
use serde_json::{Value, json};
use support::server::{free_port, get, post_order};
use tower_idempotency::outbox::EventId;
use tower_idempotency::{IdempotencyContext, IdempotencyKey, RecordId, Scope};

const ACCOUNT: &str = "acct_outbox";
const BODY: &str = r#"{"sku":"book-42","quantity":1,"amount_minor":9007199254740993,"currency":"JPY"}"#;

#[test]
fn the_service_refuses_to_start_with_a_webhook_url_but_no_secret() {
    let (path, _cleanup) = support::sqlite_path("tidem_outbox");
    let output = Command::new(example_binary("orders"))
        .env("ORDERS_ADDR", "127.0.0.1:0")
        .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
        .env("DATABASE_URL", format!("sqlite:{}", path.display()))
        .env("ORDERS_WEBHOOK_URL", "http://127.0.0.1:9/webhooks")
        .env_remove("ORDERS_WEBHOOK_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("run the orders example");
    assert!(!output.status.success(), "it must not start");
    assert!(output.stdout.is_empty(), "it never listened: {}", String::from_utf8_lossy(&output.stdout));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("ORDERS_WEBHOOK_SECRET"), "it says what is missing: {stderr}");
}

#[tokio::test]
async fn each_order_enqueues_one_order_created_event_with_its_operations_id_and_the_counts_say_so() {
    let (path, _cleanup) = support::sqlite_path("tidem_outbox");
    let database_url = format!("sqlite:{}", path.display());
    // No ORDERS_WEBHOOK_URL: events stay queued.
    let service = Process::orders(&database_url, free_port(), free_port(), None);
    let admin = service.admin.expect("the admin address");
    let mut orders = Vec::new();
    for key in ["outbox-key-1", "outbox-key-2"] {
        let first = post_order(service.addr, ACCOUNT, key, BODY).await.unwrap();
        assert_eq!(first.status, 201, "{}", first.text());
        let retry = post_order(service.addr, ACCOUNT, key, BODY).await.unwrap();
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "a retry replays and enqueues nothing");
        orders.push((key, serde_json::from_slice::<Value>(&first.body).unwrap()));
    }

    let refused = get(admin, "not-the-token-at-all", "/admin/outbox/counts").await.unwrap();
    assert_eq!(refused.status, 401, "{}", refused.text());
    let counts = get(admin, ADMIN_TOKEN, "/admin/outbox/counts").await.unwrap();
    assert_eq!(counts.status, 200, "{}", counts.text());
    let counts: Value = serde_json::from_slice(&counts.body).unwrap();
    assert_eq!(counts, json!({"pending": 2, "delivered": 0, "dead": 0}));

    let pool = sqlx::SqlitePool::connect(&database_url).await.unwrap();
    let rows: Vec<(String, String, Vec<u8>)> =
        sqlx::query_as("SELECT event_id, event_type, body FROM outbox_events").fetch_all(&pool).await.unwrap();
    pool.close().await;
    assert_eq!(rows.len(), 2);
    for (key, order) in orders {
        let id = RecordId::new(&Scope::new(ACCOUNT), "orders.create", &IdempotencyKey::new(key).unwrap());
        let expected = EventId::for_operation(&IdempotencyContext::new(id, "orders.create", None), "order.created");
        let (_, event_type, body) =
            rows.iter().find(|(id, ..)| id == expected.as_str()).expect("the event of the order");
        assert_eq!(event_type, "order.created");
        let body: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(body["type"], "order.created");
        assert!(body["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{body}");
        assert_eq!(body["data"], order, "the event's data is the order as answered");
    }
    // The amount stays exact in the event's bytes.
    assert!(String::from_utf8_lossy(&rows[0].2).contains("9007199254740993"));
}
