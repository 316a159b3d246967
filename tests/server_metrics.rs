//! The layer's metrics through the `metrics` facade, read back from a recorder of the test's
//! own: `idempotency_requests_total` for enforced requests, `idempotency_shadow_total` for what
//! shadow mode saw, the histograms, cohorts switched at run time, and no key or scope in any
//! label.
#![cfg(all(feature = "axum", feature = "metrics"))]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::telemetry::{OVERHEAD, REQUESTS, RequestResult, SHADOW, STORE, STORED_BYTES};
use tower_idempotency::{
    Cohort, IdempotencyLayer, MemoryStore, OutcomeClass, Retention, RolloutMode, RolloutSwitch, Scope,
};

use support::recorder::{Recorded, eventually};

/// The app: `POST /orders` counts its executions and answers 201 (or 422 for the body `bad`);
/// the scope is the `x-tenant` header.
fn app(switch: RolloutSwitch, executions: Arc<AtomicU64>) -> Router {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .operation("orders.create")
        .scope_with(|parts| parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()).map(Scope::new))
        .rollout(switch);
    let handler = move |body: String| {
        let executions = executions.clone();
        async move {
            executions.fetch_add(1, Ordering::Relaxed);
            if body == "bad" {
                return Ok::<_, Infallible>((StatusCode::UNPROCESSABLE_ENTITY, "bad".to_owned()));
            }
            Ok((StatusCode::CREATED, format!("created {body}")))
        }
    };
    Router::new().route("/orders", post(handler).layer(layer))
}

/// Sends `body` for `tenant` with `key`; the status and whether it was a replay.
async fn send(app: &Router, tenant: Option<&str>, key: Option<&str>, body: &str) -> (StatusCode, bool) {
    let mut request = Request::post("/orders").header("content-type", "text/plain");
    if let Some(tenant) = tenant {
        request = request.header("x-tenant", tenant);
    }
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = app.clone().oneshot(request.body(Body::from(body.to_owned())).unwrap()).await.unwrap();
    let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let status = response.status();
    let _ = response.into_body().collect().await.unwrap();
    (status, replayed)
}

fn requests(result: &str) -> String {
    format!("{REQUESTS}{{operation=orders.create,result={result}}}")
}

fn shadow(result: &str) -> String {
    format!("{SHADOW}{{operation=orders.create,result={result}}}")
}

#[tokio::test]
async fn enforced_requests_are_counted_by_result_with_their_histograms() {
    let recorded = Arc::new(Recorded::default());
    let _guard = metrics::set_default_local_recorder(&*recorded);
    let app = app(RolloutSwitch::new(RolloutMode::Enforce), Arc::default());
    let key = "secret-key-value-1";
    assert_eq!(send(&app, Some("tenant-a"), Some(key), "a").await, (StatusCode::CREATED, false));
    assert_eq!(send(&app, Some("tenant-a"), Some(key), "a").await, (StatusCode::CREATED, true));
    assert_eq!(send(&app, Some("tenant-a"), Some(key), "other").await.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(send(&app, Some("tenant-a"), None, "a").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(send(&app, Some("tenant-a"), Some("\"a\", \"b\""), "a").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(send(&app, None, Some("k2"), "a").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(send(&app, Some("tenant-a"), Some("k3"), "bad").await.0, StatusCode::UNPROCESSABLE_ENTITY);

    for (result, expected) in [
        ("executed", 1),
        ("replayed", 1),
        ("key_reused", 1),
        ("key_missing", 1),
        ("scope_missing", 1),
        ("released", 1),
        ("key_invalid", 1),
    ] {
        assert_eq!(recorded.get(&requests(result)), expected, "{result}: {:?}", recorded.names());
    }
    assert_eq!(recorded.get(&format!("{OVERHEAD}{{operation=orders.create}}")), 7, "one overhead sample each");
    assert_eq!(recorded.get(&format!("{STORE}{{operation=orders.create,step=begin}}")), 4, "four claims or look-ups");
    assert_eq!(recorded.get(&format!("{STORE}{{operation=orders.create,step=finish}}")), 2, "a complete and a release");
    assert_eq!(recorded.get(&format!("{STORED_BYTES}{{operation=orders.create}}")), 1, "one answer stored");
    assert_eq!(recorded.get(&shadow("executed")), 0, "enforced requests are not shadow counts");
    for name in recorded.names() {
        assert!(!name.contains(key) && !name.contains("tenant-a"), "a key or scope in a label: {name}");
    }
}

#[tokio::test]
async fn shadow_mode_counts_what_enforce_would_have_done_and_never_changes_an_answer() {
    let recorded = Arc::new(Recorded::default());
    let _guard = metrics::set_default_local_recorder(&*recorded);
    let switch = RolloutSwitch::new(RolloutMode::Shadow);
    let executions = Arc::new(AtomicU64::new(0));
    let app = app(switch.clone(), executions.clone());

    assert_eq!(send(&app, Some("t"), Some("k"), "a").await, (StatusCode::CREATED, false));
    assert_eq!(eventually(&recorded, &shadow("executed"), 1).await, 1);
    assert_eq!(send(&app, Some("t"), Some("k"), "a").await, (StatusCode::CREATED, false), "never replayed");
    assert_eq!(eventually(&recorded, &shadow("replayed"), 1).await, 1);
    assert_eq!(send(&app, Some("t"), Some("k"), "b").await, (StatusCode::CREATED, false), "never refused");
    assert_eq!(eventually(&recorded, &shadow("key_reused"), 1).await, 1);
    assert_eq!(send(&app, Some("t"), None, "a").await, (StatusCode::CREATED, false));
    assert_eq!(recorded.get(&shadow("key_missing")), 1, "counted before the handler runs");
    assert_eq!(executions.load(Ordering::Relaxed), 4, "the handler ran every time");
    assert!(recorded.names().iter().all(|name| !name.starts_with(REQUESTS)), "{:?}", recorded.names());

    // Enforcement on: the shadow record is apart, so the key executes once more, then replays.
    switch.set(RolloutMode::Enforce);
    assert_eq!(send(&app, Some("t"), Some("k"), "a").await, (StatusCode::CREATED, false));
    assert_eq!(send(&app, Some("t"), Some("k"), "a").await, (StatusCode::CREATED, true));
    assert_eq!(executions.load(Ordering::Relaxed), 5);
    assert_eq!((recorded.get(&requests("executed")), recorded.get(&requests("replayed"))), (1, 1));
}

#[tokio::test]
async fn a_cohort_is_enforced_and_can_be_changed_at_run_time() {
    let switch = RolloutSwitch::new(RolloutMode::Off);
    let executions = Arc::new(AtomicU64::new(0));
    let app = app(switch.clone(), executions.clone());
    switch.set_cohort(Some(Cohort::scopes(["in"])));
    assert_eq!(send(&app, Some("in"), Some("k"), "a").await, (StatusCode::CREATED, false));
    assert_eq!(send(&app, Some("in"), Some("k"), "a").await, (StatusCode::CREATED, true), "the cohort is enforced");
    assert_eq!(send(&app, Some("out"), Some("k"), "a").await, (StatusCode::CREATED, false));
    assert_eq!(send(&app, Some("out"), Some("k"), "a").await, (StatusCode::CREATED, false), "outside: off");
    assert_eq!(send(&app, Some("out"), None, "a").await.0, StatusCode::CREATED, "off refuses nothing");
    assert_eq!(executions.load(Ordering::Relaxed), 4);
    // The cohort changes for the next request.
    switch.set_cohort(Some(Cohort::scopes(["out"])));
    assert_eq!(send(&app, Some("out"), Some("k2"), "a").await, (StatusCode::CREATED, false));
    assert_eq!(send(&app, Some("out"), Some("k2"), "a").await, (StatusCode::CREATED, true));
    assert_eq!(send(&app, Some("in"), Some("k"), "a").await, (StatusCode::CREATED, false), "no longer enforced");
    assert_eq!(executions.load(Ordering::Relaxed), 6);
}

/// The layer's other refusals on `MemoryStore`, each counted under its own `result`: a body
/// over the limit, an answer over the limit, a duplicate still in flight, a key past its
/// replay time, and a record whose handler marked its outcome unknown.
#[tokio::test]
async fn each_refusal_is_counted_under_its_result() {
    let recorded = Arc::new(Recorded::default());
    let _guard = metrics::set_default_local_recorder(&*recorded);
    let (entered, release) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
    let handler = {
        let (entered, release) = (entered.clone(), release.clone());
        move |body: String| {
            let (entered, release) = (entered.clone(), release.clone());
            async move {
                match body.as_str() {
                    "large answer" => (StatusCode::CREATED, "x".repeat(4096)).into_response(),
                    "unknown" => {
                        let mut response = (StatusCode::ACCEPTED, "sent, outcome unknown").into_response();
                        response.extensions_mut().insert(OutcomeClass::Unknown);
                        response
                    }
                    "slow" => {
                        entered.notify_one();
                        release.notified().await;
                        (StatusCode::CREATED, "slow").into_response()
                    }
                    _ => (StatusCode::CREATED, body).into_response(),
                }
            }
        }
    };
    let retention = Retention { response: Duration::from_millis(50), ..Retention::default() };
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .operation("orders.create")
        .shared_scope("tenant")
        .max_request_body(64)
        .max_response_body(1024)
        .in_flight_wait(Duration::ZERO)
        .retention(retention);
    let app = Router::new().route("/orders", post(handler).layer(layer));

    let too_large = "y".repeat(65);
    assert_eq!(send(&app, None, Some("k-body"), &too_large).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(send(&app, None, Some("k-answer"), "large answer").await.0, StatusCode::INTERNAL_SERVER_ERROR);

    let slow = tokio::spawn({
        let app = app.clone();
        async move { send(&app, None, Some("k-slow"), "slow").await }
    });
    entered.notified().await;
    assert_eq!(send(&app, None, Some("k-slow"), "slow").await.0, StatusCode::CONFLICT);
    release.notify_one();
    assert_eq!(slow.await.unwrap().0, StatusCode::CREATED);

    assert_eq!(send(&app, None, Some("k-unknown"), "unknown").await.0, StatusCode::ACCEPTED);
    assert_eq!(send(&app, None, Some("k-unknown"), "unknown").await.0, StatusCode::CONFLICT);

    assert_eq!(send(&app, None, Some("k-old"), "a").await, (StatusCode::CREATED, false));
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(send(&app, None, Some("k-old"), "a").await.0, StatusCode::UNPROCESSABLE_ENTITY);

    for (result, expected) in [
        ("body_too_large", 1),
        ("response_too_large", 1),
        ("in_flight", 1),
        ("outcome_unknown", 1),
        ("key_expired", 1),
        ("executed", 3),
    ] {
        assert_eq!(recorded.get(&requests(result)), expected, "{result}: {:?}", recorded.names());
    }
}

/// The `result` label's values are a published interface: exactly these, in this order.
#[test]
fn the_result_values_are_the_published_ones() {
    let published = [
        "executed",
        "replayed",
        "key_missing",
        "key_invalid",
        "key_reused",
        "in_flight",
        "key_expired",
        "outcome_unknown",
        "body_too_large",
        "store_unavailable",
        "commit_uncertain",
        "released",
        "response_too_large",
        "handle_still_held",
        "scope_missing",
    ];
    assert_eq!(RequestResult::ALL.map(RequestResult::as_str), published);
}
