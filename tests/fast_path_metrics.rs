//! `idempotency_fast_path_total{result}` through a real Redis in front of PostgreSQL: a new key
//! is a miss that takes the lock, its retry a hit, and with Redis stopped a request is
//! degraded (it goes down the durable path). Each series reads what `FastPath::stats()` counts.
#![cfg(all(feature = "axum", feature = "postgres", feature = "redis", feature = "metrics"))]

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlx::Postgres;
use support::recorder::Recorded;
use support::redis::RedisServer;
use tower::ServiceExt;
use tower_idempotency::telemetry::FAST_PATH;
use tower_idempotency::{CouplingMode, IdempotencyContext, IdempotencyLayer, TxHandle};

async fn create_order(context: IdempotencyContext, tx: TxHandle<Postgres>, body: String) -> (StatusCode, String) {
    let order_id = support::storm::insert_order(&context, &tx, &body).await;
    (StatusCode::CREATED, order_id.to_string())
}

fn series(result: &str) -> String {
    format!("{FAST_PATH}{{result={result}}}")
}

#[tokio::test]
async fn the_fast_path_counts_reach_the_recorder() {
    let recorded = Arc::new(Recorded::default());
    let _guard = metrics::set_default_local_recorder(&*recorded);
    let mut redis = RedisServer::start();
    let fast = support::redis::fast_path(support::pg_store(CouplingMode::Atomic).await, &redis.url());
    sqlx::raw_sql(support::storm::CREATE_TABLE).execute(fast.inner().pool()).await.expect("orders table");
    let layer = IdempotencyLayer::new(fast.clone()).shared_scope("metrics").operation("orders.create");
    let app = Router::new().route("/orders", post(create_order).layer(layer));
    let send = |key: &str| {
        let request = Request::post("/orders")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(format!("{{\"sku\":\"{key}\"}}")))
            .unwrap();
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await.unwrap();
            let (status, replayed) = (response.status(), response.headers().contains_key("idempotent-replayed"));
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, body)
        }
    };

    let (status, replayed, order) = send("k-1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    // The answer is cached after the response: retry until Redis answers it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while fast.stats().hits == 0 {
        assert!(std::time::Instant::now() < deadline, "no hit from Redis: {:?}", fast.stats());
        let (status, replayed, body) = send("k-1").await;
        assert_eq!((status, replayed, &body), (StatusCode::CREATED, true, &order), "the same order, replayed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    redis.stop();
    assert_eq!(send("k-2").await.0, StatusCode::CREATED, "the durable path answers without Redis");

    let stats = fast.stats();
    assert!(stats.misses >= 1 && stats.locks >= 1 && stats.hits >= 1 && stats.degraded >= 1, "{stats:?}");
    for (result, counted) in [
        ("hit", stats.hits),
        ("miss", stats.misses),
        ("lock_acquired", stats.locks),
        ("lock_waited", stats.waits),
        ("degraded", stats.degraded),
    ] {
        assert_eq!(recorded.get(&series(result)), counted, "{result}: {:?}", recorded.names());
    }
    let rows = support::storm::orders_per_operation(fast.inner().pool()).await;
    assert_eq!(rows.len(), 2, "one order per key: {rows:?}");
    assert!(rows.iter().all(|(_, n)| *n == 1), "{rows:?}");
}
