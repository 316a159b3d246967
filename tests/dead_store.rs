//! A dead store: the layer fails closed. The handler never runs without a durable claim, and
//! the client gets 503 `idempotency_store_unavailable` with `Retry-After`.
#![cfg(all(feature = "axum", feature = "postgres"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, PostgresStore};

#[tokio::test]
async fn unreachable_postgres_answers_503_and_never_runs_the_handler() {
    // Nothing listens on port 1: every connection attempt is refused.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = post(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async { StatusCode::CREATED }
    });
    let app = Router::new()
        .route("/orders", handler.layer(IdempotencyLayer::new(PostgresStore::new(pool)).shared_scope("dead")));
    for store_mode_request in 0..3 {
        let request = Request::post("/orders")
            .header("idempotency-key", format!("dead-{store_mode_request}"))
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(response.headers().contains_key("retry-after"), "503 needs Retry-After");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains("\"code\":\"idempotency_store_unavailable\""), "{body}");
        assert!(
            !body.contains("127.0.0.1") && !body.contains("refused"),
            "no database error text in the answer: {body}"
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the handler must never run without a durable claim");
}
