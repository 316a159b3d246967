//! The smallest guarded route: `POST /orders` behind the idempotency layer, on the in-process
//! `MemoryStore`.
//!
//! ```text
//! cargo run --example axum_memory
//! curl -i http://127.0.0.1:3001/orders -H 'idempotency-key: key-1' -H 'content-type: application/json' -d '{"sku":"book-42"}'
//! ```
//!
//! Send the same request again: the same answer, marked `idempotent-replayed: true`, and the
//! handler does not run again (the order number stays). The same key with another body is a
//! 422 `idempotency_key_reused`; no key at all is a 400.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};
use tower_idempotency::{BoxError, IdempotencyContext, IdempotencyLayer, MemoryStore};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // One scope for every caller: fine for a single-tenant example only. A real service puts
    // each caller's `Scope` into the request's extensions in its authentication middleware.
    let idempotency = IdempotencyLayer::new(MemoryStore::new()).shared_scope("example");
    let app = Router::new()
        // Only this route is guarded; routes without the layer are untouched.
        .route("/orders", post(create_order).layer(idempotency))
        .with_state(Arc::new(AtomicU64::new(0)));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    let addr = listener.local_addr()?;
    println!("listening on {addr}; try, twice:");
    println!(
        "curl -i http://{addr}/orders -H 'idempotency-key: key-1' -H 'content-type: application/json' \
         -d '{{\"sku\":\"book-42\"}}'"
    );
    axum::serve(listener, app).await?;
    Ok(())
}

/// Runs once per key: a retry gets this answer back without calling it again.
async fn create_order(State(orders): State<Arc<AtomicU64>>, context: IdempotencyContext) -> (StatusCode, Json<Value>) {
    let number = orders.fetch_add(1, Ordering::SeqCst) + 1;
    // The operation id is the same on every retry of this request: a stable id for the order.
    (StatusCode::CREATED, Json(json!({ "order": number, "operation_id": context.operation_id() })))
}
