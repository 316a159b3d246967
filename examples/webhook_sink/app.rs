//! The sink's routes: the signature check, the faults, deduplication by `webhook-id`, and the
//! handler that processes an event.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode, header::CONTENT_TYPE};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use sqlx::{Sqlite, SqlitePool};
use tower_idempotency::outbox::{VerifyError, WebhookSecret, WebhookVerifier};
use tower_idempotency::{BoxError, IdempotencyLayer, Scope, SqliteStore, TxHandle};

use super::db;

/// The largest delivery read.
const MAX_BODY: usize = 1 << 20;
/// The one sender's scope: deliveries of different senders would never share records.
const SENDER_SCOPE: &str = "sender:orders";

/// How the sink behaves.
#[derive(Clone, Debug)]
pub(crate) struct SinkConfig {
    /// The sender's signing secret.
    pub(crate) secret: WebhookSecret,
    /// The share of verified deliveries answered 500 without processing.
    pub(crate) fail_rate: f64,
    /// The share of verified deliveries processed and committed, then left unanswered.
    pub(crate) ambiguous_rate: f64,
    /// Whether deliveries are deduplicated by `webhook-id` (always, in the example; tests turn it
    /// off to show what the deduplication prevents).
    pub(crate) dedup: bool,
}

#[derive(Clone)]
struct Sink {
    pool: SqlitePool,
    verifier: WebhookVerifier,
    fail_rate: f64,
    ambiguous_rate: f64,
}

/// Marks a response whose connection is to be dropped instead of answered (see `serve.rs`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DropConnection;

/// The sink's router.
pub(crate) async fn app(pool: SqlitePool, config: SinkConfig) -> Result<Router, BoxError> {
    let sink = Sink {
        pool: pool.clone(),
        verifier: WebhookVerifier::new(config.secret),
        fail_rate: config.fail_rate,
        ambiguous_rate: config.ambiguous_rate,
    };
    let receive = post(receive);
    let receive = if config.dedup {
        // Keyed on webhook-id; the scope is the sender's, set by `verified` after the check.
        let dedup = IdempotencyLayer::new(SqliteStore::new(pool))
            .header(HeaderName::from_static("webhook-id"))
            .operation("webhooks.receive");
        receive.layer(dedup)
    } else {
        receive
    };
    Ok(Router::new()
        .route("/webhooks", receive)
        // Before the route's layer: nothing unverified reaches the deduplication.
        .route_layer(middleware::from_fn_with_state(sink.clone(), verified))
        .route("/events", get(events))
        .with_state(sink))
}

/// Checks the signature and the timestamp, counts the delivery, injects the faults, and hands
/// the delivery, scoped by its sender, to the deduplication and the handler.
async fn verified(State(sink): State<Sink>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return problem(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "a delivery is at most 1 MiB");
    };
    let webhook = match sink.verifier.verify(&parts.headers, &body) {
        Ok(webhook) => webhook,
        Err(VerifyError::Stale) => {
            return problem(
                StatusCode::UNAUTHORIZED,
                "stale_timestamp",
                "webhook-timestamp is more than 5 minutes off",
            );
        }
        Err(error) => return problem(StatusCode::UNAUTHORIZED, "invalid_signature", &error.to_string()),
    };
    let Some((event_type, order_id)) = describe(&body) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "invalid_event",
            "the body is not {\"type\", \"timestamp\", \"data\"}",
        );
    };
    if let Err(error) = db::count_delivery(&sink.pool, &webhook.id, &event_type, order_id.as_deref()).await {
        eprintln!("webhook_sink: counting a delivery failed: {error}");
        return problem(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", "try again");
    }
    if roll(sink.fail_rate) {
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "injected_failure", "SINK_FAIL_RATE");
    }
    let mut request = Request::from_parts(parts, Body::from(body));
    request.extensions_mut().insert(Scope::new(SENDER_SCOPE));
    let mut response = next.run(request).await;
    // Processed and committed (the layer answers only after COMMIT), then never answered.
    if response.status().is_success() && roll(sink.ambiguous_rate) {
        response.extensions_mut().insert(DropConnection);
    }
    response
}

/// `POST /webhooks` past the check and the deduplication: processes the event, in the layer's
/// transaction (so the record of it and the answer that replays commit together).
async fn receive(State(sink): State<Sink>, tx: Option<TxHandle<Sqlite>>, headers: HeaderMap) -> Response {
    let Some(id) = headers.get("webhook-id").and_then(|id| id.to_str().ok()) else {
        return problem(StatusCode::BAD_REQUEST, "invalid_event", "no webhook-id");
    };
    let processed = match tx {
        Some(tx) => match tx.acquire().await {
            Ok(mut conn) => db::process(&mut conn, id).await,
            Err(_) => return problem(StatusCode::INTERNAL_SERVER_ERROR, "internal", "transaction finished"),
        },
        // Without deduplication: a transaction of its own.
        None => {
            async {
                let mut own = sink.pool.begin().await?;
                db::process(&mut own, id).await?;
                own.commit().await
            }
            .await
        }
    };
    match processed {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(error) => {
            eprintln!("webhook_sink: processing failed: {error}");
            problem(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", "try again")
        }
    }
}

/// `GET /events`.
async fn events(State(sink): State<Sink>) -> Response {
    match db::events(&sink.pool).await {
        Ok(events) => Json(json!({ "events": events })).into_response(),
        Err(error) => {
            eprintln!("webhook_sink: reading events failed: {error}");
            problem(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", "try again")
        }
    }
}

/// The event's type and, if it has one, its order's id.
fn describe(body: &Bytes) -> Option<(String, Option<String>)> {
    let event: Value = serde_json::from_slice(body).ok()?;
    let event_type = event.get("type")?.as_str()?.to_owned();
    let order_id = event.get("data").and_then(|data| data.get("order_id")).and_then(Value::as_str).map(str::to_owned);
    Some((event_type, order_id))
}

/// True with probability `rate`.
fn roll(rate: f64) -> bool {
    rate > 0.0 && uuid::Uuid::new_v4().as_u128() as f64 / u128::MAX as f64 <= rate
}

/// A problem+json answer.
fn problem(status: StatusCode, code: &'static str, detail: &str) -> Response {
    let body = json!({"type": format!("urn:webhook-sink:problem:{code}"), "title": code, "status": status.as_u16(),
        "detail": detail, "code": code});
    (status, [(CONTENT_TYPE, "application/problem+json")], body.to_string()).into_response()
}
