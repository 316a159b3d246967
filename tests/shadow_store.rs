//! Where shadow mode records its requests ([`IdempotencyLayer::shadow_store`]), on the
//! in-memory store: in the shadow store a layer was given, and nowhere else, also for the
//! layer it was cloned from, which keeps recording in its own store.
#![cfg(feature = "axum")]

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RolloutMode, RolloutSwitch};

async fn send(app: &Router, key: &str) -> StatusCode {
    let request = Request::post("/orders").header("idempotency-key", key).body(Body::from("a")).unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

/// Waits, for at most 10 s, until `store` holds `records` records; how many it holds then.
async fn settled(store: &MemoryStore, records: usize) -> usize {
    for _ in 0..1_000 {
        if store.len() >= records {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    store.len()
}

#[tokio::test]
async fn each_layer_records_in_its_own_shadow_store_and_a_clone_keeps_the_one_it_came_from() {
    let (business, shadow) = (MemoryStore::new(), MemoryStore::new());
    let layer = IdempotencyLayer::new(business.clone())
        .operation("orders.create")
        .shared_scope("tenant")
        .rollout(RolloutSwitch::new(RolloutMode::Shadow))
        .shadow_log(Duration::from_millis(5), 64);
    let apart = layer.clone().shadow_store(shadow.clone());
    let handler = || async { StatusCode::CREATED };
    let app = Router::new().route("/orders", post(handler).layer(layer));
    let app_apart = Router::new().route("/orders", post(handler).layer(apart));

    // The clone with a shadow store records there first: the layer it came from must not
    // inherit that log's writer.
    assert_eq!(send(&app_apart, "k-apart").await, StatusCode::CREATED);
    assert_eq!(settled(&shadow, 1).await, 1, "the shadow store took the record");
    assert_eq!(send(&app, "k-own").await, StatusCode::CREATED);
    assert_eq!(settled(&business, 1).await, 1, "the layer without one records in its own store");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!((business.len(), shadow.len()), (1, 1), "each record in one store, once");
}
