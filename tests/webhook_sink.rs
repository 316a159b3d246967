//! The `webhook_sink` example's front door, in process: what a delivery with a bad signature, a
//! stale timestamp, or a reused id with another body gets, and that none of them is processed;
//! and that a genuine redelivery replays the first answer without processing again.
#![cfg(all(feature = "axum", feature = "sqlite", feature = "outbox"))]

mod support;

#[path = "../examples/webhook_sink"]
#[allow(dead_code)]
mod sink {
    pub mod app;
    pub mod db;
}

use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;
use tower_idempotency::outbox::WebhookSecret;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const ID: &str = "evt_0123456789abcdef0123456789abcdef01234567";
const BODY: &str = r#"{"type":"order.created","timestamp":"2026-12-01T06:00:00.000Z","data":{"order_id":"o-1"}}"#;

struct Sink {
    router: Router,
    _cleanup: support::Cleanup,
}

async fn sink(dedup: bool) -> Sink {
    let (path, cleanup) = support::sqlite_path("tidem_sink");
    let pool = sink::db::open(sqlx::sqlite::SqliteConnectOptions::new().filename(&path)).await.expect("sink db");
    let config = sink::app::SinkConfig { secret: secret(), fail_rate: 0.0, ambiguous_rate: 0.0, dedup };
    Sink { router: sink::app::app(pool, config).await.expect("sink"), _cleanup: cleanup }
}

fn secret() -> WebhookSecret {
    WebhookSecret::parse(SECRET).unwrap()
}

fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64
}

/// A delivery of `body` as `id` at `timestamp`, signed with `signature` (or correctly).
fn delivery(id: &str, timestamp: i64, body: &str, signature: Option<&str>) -> Request<Body> {
    let signature = signature.map_or_else(|| secret().sign(id, timestamp, body.as_bytes()), str::to_owned);
    Request::post("/webhooks")
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

impl Sink {
    async fn send(&self, request: Request<Body>) -> (StatusCode, http::HeaderMap, Value) {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        let json = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("JSON") };
        (parts.status, parts.headers, json)
    }

    async fn events(&self) -> Vec<Value> {
        let (status, _, body) = self.send(Request::get("/events").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        body["events"].as_array().expect("events").clone()
    }
}

#[tokio::test]
async fn a_bad_or_missing_signature_is_refused_with_401_and_nothing_is_processed() {
    let sink = sink(true).await;
    let forged = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    let (status, _, problem) = sink.send(delivery(ID, now(), BODY, Some(forged))).await;
    assert_eq!((status, problem["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("invalid_signature")));

    // Signed with another secret.
    let other = WebhookSecret::parse("whsec_c2Vjb25kLXNlY3JldC0xMjM0NTY3OA==").unwrap();
    let signed_by_other = other.sign(ID, now(), BODY.as_bytes());
    let (status, _, problem) = sink.send(delivery(ID, now(), BODY, Some(&signed_by_other))).await;
    assert_eq!((status, problem["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("invalid_signature")));

    let unsigned = Request::post("/webhooks").header("webhook-id", ID).body(Body::from(BODY)).unwrap();
    let (status, _, problem) = sink.send(unsigned).await;
    assert_eq!((status, problem["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("invalid_signature")));
    assert!(sink.events().await.is_empty(), "nothing is recorded for a delivery that failed the check");
}

#[tokio::test]
async fn a_stale_timestamp_is_refused_with_401_even_when_correctly_signed() {
    let sink = sink(true).await;
    for timestamp in [now() - 301, now() + 301] {
        let (status, _, problem) = sink.send(delivery(ID, timestamp, BODY, None)).await;
        assert_eq!((status, problem["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("stale_timestamp")));
    }
    assert!(sink.events().await.is_empty());
    // Within the window it passes.
    let (status, _, _) = sink.send(delivery(ID, now() - 240, BODY, None)).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn a_redelivery_replays_the_first_answer_without_processing_again() {
    let sink = sink(true).await;
    let (first, headers, _) = sink.send(delivery(ID, now(), BODY, None)).await;
    assert_eq!(first, StatusCode::NO_CONTENT);
    assert!(headers.get("idempotent-replayed").is_none());
    // A redelivery: the same id and body, a later attempt's timestamp and signature.
    let (again, headers, _) = sink.send(delivery(ID, now() + 1, BODY, None)).await;
    assert_eq!(again, StatusCode::NO_CONTENT);
    assert_eq!(headers["idempotent-replayed"], "true");
    let events = sink.events().await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["id"], ID);
    assert_eq!(events[0]["type"], "order.created");
    assert_eq!(events[0]["order_id"], "o-1");
    assert_eq!((events[0]["processed"].as_i64(), events[0]["deliveries"].as_i64()), (Some(1), Some(2)));
}

#[tokio::test]
async fn a_reused_id_with_another_body_is_refused_with_422_and_not_processed() {
    let sink = sink(true).await;
    assert_eq!(sink.send(delivery(ID, now(), BODY, None)).await.0, StatusCode::NO_CONTENT);
    let changed = BODY.replace("o-1", "o-2");
    let (status, _, problem) = sink.send(delivery(ID, now(), &changed, None)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert_eq!(problem["code"], "idempotency_key_reused");
    let events = sink.events().await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["order_id"], "o-1", "the first delivery's event is kept");
    assert_eq!(events[0]["processed"], 1, "the changed body was not processed");
    assert_eq!(events[0]["deliveries"], 2, "it was received, validly signed");
}

/// The control of the replay test: without the deduplication a redelivery is processed again.
#[tokio::test]
async fn without_deduplication_a_redelivery_is_processed_again() {
    let sink = sink(false).await;
    for offset in 0..2 {
        assert_eq!(sink.send(delivery(ID, now() + offset, BODY, None)).await.0, StatusCode::NO_CONTENT);
    }
    assert_eq!(sink.events().await[0]["processed"], 2);
}
