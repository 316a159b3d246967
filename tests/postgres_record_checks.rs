//! The records table without its CHECK constraints (migration 12): what they guarded still
//! holds on the real PostgreSQL, on one table and on partitions with the answers apart, in
//! both modes. A row the store would never write (a state it does not know, a completed record
//! without its answer) is taken by the table now, and the layer still never replays it nor runs
//! the handler for its key: the store reads it as corrupt, and the request is answered 503.
#![cfg(all(feature = "axum", feature = "postgres"))]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlx::PgPool;
use tower::ServiceExt;
use tower_idempotency::{CouplingMode, IdempotencyLayer, PostgresStore};

/// One table and partitions (their answers apart when `apart`), each in both modes.
async fn stores(apart: bool) -> Vec<(&'static str, PostgresStore)> {
    let mut stores = Vec::new();
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        stores.push(("one table", support::pg_store(mode).await));
        stores.push(match apart {
            true => ("partitions, answers apart", support::pg_partitioned_apart_store(mode).await),
            false => ("partitions", support::pg_partitioned_store(mode).await),
        });
    }
    stores
}

/// `POST /orders` behind the layer, counting the handler's runs.
fn app(store: &PostgresStore, runs: &Arc<AtomicUsize>) -> Router {
    let runs = runs.clone();
    let handler = post(move || {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "created")
        }
    });
    Router::new().route("/orders", handler.layer(IdempotencyLayer::new(store.clone()).shared_scope("checks")))
}

async fn send(app: &Router, key: &str) -> (StatusCode, String, bool) {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned(), replayed)
}

/// The CHECK constraints left on the records table and its partitions.
async fn checks(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint WHERE contype = 'c' AND conrelid IN \
           (SELECT 'idempotency_records'::regclass UNION ALL \
            SELECT inhrelid FROM pg_inherits WHERE inhparent = 'idempotency_records'::regclass) \
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Changes the one record in the table by hand.
async fn rewrite(pool: &PgPool, set: &str) {
    let changed = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("UPDATE idempotency_records SET {set}")))
        .execute(pool)
        .await
        .expect("the table takes the row without its checks");
    assert_eq!(changed.rows_affected(), 1);
}

/// Executes `key` once and replays it, rewrites its record by hand with `set`, and checks that
/// the next retry is refused as a corrupt record (503, nothing replayed) without running the
/// handler again.
async fn refused_once_rewritten(layout: &str, store: &PostgresStore, key: &str, set: &str) {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(store, &runs);
    assert_eq!(send(&app, key).await.0, StatusCode::CREATED, "{layout}");
    let (status, body, replayed) = send(&app, key).await;
    assert_eq!((status, body.as_str(), replayed), (StatusCode::CREATED, "created", true), "{layout}: a replay");
    rewrite(store.pool(), set).await;
    let (status, body, replayed) = send(&app, key).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{layout}: {body}");
    assert!(body.contains("idempotency_store_unavailable"), "{layout}: {body}");
    assert!(!replayed, "{layout}: nothing replayed");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{layout}: the handler ran once, for the first request");
}

/// A record whose state the store does not know is refused as corrupt: 503, the handler not
/// run, and nothing replayed.
#[tokio::test]
async fn a_state_the_store_does_not_know_is_refused_not_replayed() {
    for (layout, store) in stores(true).await {
        assert_eq!(checks(store.pool()).await, Vec::<String>::new(), "{layout}: no CHECK constraint left");
        refused_once_rewritten(layout, &store, "odd-state", "state = 'settled'").await;
    }
}

/// A completed record that lost its answer is not replayed empty: it is refused as corrupt (503),
/// and the handler does not run again. (With the answers apart, a record whose answer row is
/// gone is a tombstone by design: `postgres_answers_apart.rs` proves that.)
#[tokio::test]
async fn a_completed_record_without_its_answer_is_not_replayed() {
    for (layout, store) in stores(false).await {
        let set = "response_status = NULL, response_headers = NULL, response_body = NULL";
        refused_once_rewritten(layout, &store, "no-answer", set).await;
    }
}
