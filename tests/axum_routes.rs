//! The layer on axum routes: per-route opt-in, the operation from `MatchedPath`, the handler
//! context extractor, and the problem answers as a client sees them.
#![cfg(feature = "axum")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::{get, post};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, MemoryStore, Scope};

#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

async fn create(State(counter): State<Counter>, context: IdempotencyContext) -> (StatusCode, String) {
    let n = counter.0.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!("{{\"n\":{n},\"operation\":\"{}\",\"op_id\":\"{}\"}}", context.operation(), context.operation_id()),
    )
}

async fn optional(context: Option<IdempotencyContext>) -> String {
    format!("guarded={}", context.is_some())
}

fn app(store: MemoryStore, counter: Counter) -> Router {
    let layer = IdempotencyLayer::new(store);
    Router::new()
        .route("/items/{id}/copies", post(create).layer(layer.clone()))
        .route("/unguarded", post(create_unguarded))
        .route("/optional", post(optional).layer(layer.clone().key_required(false)))
        .route("/read", get(|| async { "read" }))
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(counter)
}

async fn create_unguarded(context: Option<IdempotencyContext>) -> String {
    format!("guarded={}", context.is_some())
}

/// A stand-in for the application's authentication: `x-tenant` names the scope.
async fn authenticate(mut request: Request<Body>, next: axum::middleware::Next) -> axum::response::Response {
    if let Some(tenant) = request.headers().get("x-tenant").and_then(|v| v.to_str().ok()) {
        let scope = Scope::new(tenant);
        request.extensions_mut().insert(scope);
    }
    next.run(request).await
}

async fn send(
    app: &Router,
    path: &str,
    key: Option<&str>,
    tenant: Option<&str>,
) -> (StatusCode, http::HeaderMap, String) {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    if let Some(tenant) = tenant {
        request = request.header("x-tenant", tenant);
    }
    let response = app.clone().oneshot(request.body(Body::from("{\"a\":1}")).unwrap()).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap();
    (parts.status, parts.headers, body)
}

#[tokio::test]
async fn operation_is_the_matched_route_template_so_paths_of_one_route_share_keys() {
    let counter = Counter::default();
    let app = app(MemoryStore::new(), counter.clone());
    let (status, _, body) = send(&app, "/items/1/copies", Some("k1"), Some("t")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(body.contains("\"operation\":\"POST /items/{id}/copies\""), "operation from MatchedPath: {body}");
    // Another path of the same route with the same key is a different request (the path is
    // fingerprinted), not a second execution.
    let (status, headers, body) = send(&app, "/items/2/copies", Some("k1"), Some("t")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(counter.0.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn operation_id_is_stable_across_retries() {
    let app = app(MemoryStore::new(), Counter::default());
    let (_, _, first) = send(&app, "/items/1/copies", Some("k2"), Some("t")).await;
    let (_, headers, replay) = send(&app, "/items/1/copies", Some("k2"), Some("t")).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(first, replay);
    let other_tenant = send(&app, "/items/1/copies", Some("k2"), Some("u")).await.2;
    let op_id = |body: &str| body.split("\"op_id\":\"").nth(1).unwrap()[..36].to_owned();
    assert_ne!(op_id(&first), op_id(&other_tenant), "operation ids are per scope");
}

#[tokio::test]
async fn routes_without_the_layer_are_untouched() {
    let app = app(MemoryStore::new(), Counter::default());
    let (status, headers, body) = send(&app, "/unguarded", None, Some("t")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "guarded=false"));
    assert!(!headers.contains_key("idempotent-replayed"));
}

#[tokio::test]
async fn optional_key_route_passes_requests_without_a_key_through() {
    let app = app(MemoryStore::new(), Counter::default());
    assert_eq!(send(&app, "/optional", None, Some("t")).await.2, "guarded=false");
    assert_eq!(send(&app, "/optional", Some("k"), Some("t")).await.2, "guarded=true");
    let (_, headers, body) = send(&app, "/optional", Some("k"), Some("t")).await;
    assert_eq!((headers["idempotent-replayed"].to_str().unwrap(), body.as_str()), ("true", "guarded=true"));
}

#[tokio::test]
async fn request_without_a_scope_is_refused_before_the_handler() {
    let counter = Counter::default();
    let app = app(MemoryStore::new(), counter.clone());
    let (status, _, body) = send(&app, "/items/1/copies", Some("k3"), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(body.contains("\"code\":\"idempotency_scope_missing\""), "{body}");
    assert_eq!(counter.0.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn handler_asking_for_a_context_on_an_unguarded_route_gets_a_clear_500() {
    let app = Router::new().route("/x", post(create)).with_state(Counter::default());
    let (status, _, body) = send(&app, "/x", None, None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body.contains("not wrapped by IdempotencyLayer"), "{body}");
}

#[tokio::test]
async fn kill_switch_turns_the_layer_off_at_run_time() {
    use tower_idempotency::{RolloutMode, RolloutSwitch};
    let switch = RolloutSwitch::new(RolloutMode::Enforce);
    let counter = Counter::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).shared_scope("single").rollout(switch.clone());
    let app = Router::new().route("/c", post(optional).layer(layer)).with_state(counter);
    assert_eq!(send(&app, "/c", Some("k"), None).await.2, "guarded=true");
    switch.set(RolloutMode::Off);
    let (_, headers, body) = send(&app, "/c", Some("k"), None).await;
    // The old path: the handler runs again (no replay), still with its context, so a handler
    // written for the layer keeps working.
    assert_eq!(body, "guarded=true", "with the layer off the handler still gets its context");
    assert!(!headers.contains_key("idempotent-replayed"), "with the layer off nothing is replayed");
    switch.set(RolloutMode::Enforce);
    let (_, headers, _) = send(&app, "/c", Some("k"), None).await;
    assert_eq!(headers["idempotent-replayed"], "true");
}
