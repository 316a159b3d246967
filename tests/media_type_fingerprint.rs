//! Media-type parameters in the fingerprint (version 2), as a client sees them: the same JSON
//! request with or without `charset=utf-8`, in any case, is the same request; records stored
//! under fingerprint version 1 are still compared at version 1, on every store.
#![cfg(feature = "axum")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::fingerprint::{FingerprintSpec, fingerprint_with_version};
use tower_idempotency::{
    Begin, BeginRequest, Claim, IdempotencyKey, IdempotencyLayer, MemoryStore, Outcome, RecordId, Scope, Store,
    StoredResponse,
};

const BODY: &str = r#"{"amount":10,"currency":"EUR"}"#;

fn app<St: Store>(store: St, executions: Arc<AtomicUsize>) -> Router {
    let layer = IdempotencyLayer::new(store).shared_scope("tenant");
    let handler = move || {
        let executions = executions.clone();
        async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("{{\"order\":{n}}}"))
        }
    };
    Router::new().route("/orders", post(handler).layer(layer))
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    body: String,
}

async fn send(app: &Router, key: &str, content_type: &str, body: &str) -> Answer {
    let request = Request::post("/orders")
        .header("content-type", content_type)
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        replayed: parts.headers.get("idempotent-replayed").is_some_and(|v| v == "true"),
        body: String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

/// The first request, then each retry under another content type: every retry replays.
async fn retries_replay(first: &str, retries: &[&str]) {
    let executions = Arc::new(AtomicUsize::new(0));
    let app = app(MemoryStore::new(), executions.clone());
    let original = send(&app, "k", first, BODY).await;
    assert_eq!(original.status, StatusCode::CREATED, "{}", original.body);
    for retry in retries {
        let answer = send(&app, "k", retry, BODY).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{first} then {retry}: {}", answer.body);
        assert!(answer.replayed, "{first} then {retry}: replayed");
        assert_eq!(answer.body, original.body, "{first} then {retry}");
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1, "executed once");
}

#[tokio::test]
async fn json_without_then_with_charset_utf_8_replays() {
    retries_replay(
        "application/json",
        &["application/json; charset=utf-8", "application/json;charset=UTF-8", "Application/JSON; Charset=\"utf-8\""],
    )
    .await;
}

#[tokio::test]
async fn charset_values_are_case_insensitive() {
    retries_replay("application/json; charset=utf-8", &["application/json; charset=UTF-8", "application/json"]).await;
    retries_replay("text/plain; charset=utf-8", &["text/plain; charset=UTF-8", "TEXT/PLAIN ;CHARSET=Utf-8"]).await;
}

#[tokio::test]
async fn other_parameters_still_make_another_request() {
    let executions = Arc::new(AtomicUsize::new(0));
    let app = app(MemoryStore::new(), executions.clone());
    assert_eq!(send(&app, "k", "application/json", BODY).await.status, StatusCode::CREATED);
    let latin1 = send(&app, "k", "application/json; charset=latin1", BODY).await;
    assert_eq!(latin1.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", latin1.body);
    assert!(latin1.body.contains("\"code\":\"idempotency_key_reused\""), "{}", latin1.body);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// Stores, through the `Store` trait, the answer of a request as a release before version 2
/// did: under its version-1 fingerprint.
async fn store_version_1_record<St: Store>(store: &St, key: &str, content_type: &'static str) {
    let id = RecordId::new(&Scope::new("tenant"), "POST /orders", &IdempotencyKey::new(key).unwrap());
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static(content_type));
    let fingerprint = fingerprint_with_version(
        1,
        &Method::POST,
        &"/orders".parse().unwrap(),
        &headers,
        BODY.as_bytes(),
        &FingerprintSpec::new(),
    )
    .unwrap();
    assert_eq!(fingerprint.version(), 1);
    let Begin::Claimed(claim) = store.begin(BeginRequest::new(&id, &fingerprint)).await.unwrap() else {
        panic!("a fresh identity is claimed");
    };
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        trailers: Vec::new(),
        body: Bytes::from_static(b"{\"order\":\"from version 1\"}"),
    };
    claim.finish(Outcome::Complete(response)).await.unwrap();
}

/// A version-1 record is replayed for the same request and refused for another, and the
/// handler never runs.
async fn version_1_records_are_compared_at_version_1<St: Store>(store: St) {
    let content_type = "application/json; charset=utf-8";
    store_version_1_record(&store, "old", content_type).await;
    let executions = Arc::new(AtomicUsize::new(0));
    let app = app(store, executions.clone());

    let same = send(&app, "old", content_type, BODY).await;
    assert_eq!(same.status, StatusCode::CREATED, "{}", same.body);
    assert!(same.replayed);
    assert_eq!(same.body, "{\"order\":\"from version 1\"}");

    let other = send(&app, "old", content_type, r#"{"amount":11,"currency":"EUR"}"#).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", other.body);
    assert!(other.body.contains("\"code\":\"idempotency_key_reused\""), "{}", other.body);
    assert_eq!(executions.load(Ordering::SeqCst), 0, "nothing executed");
}

#[tokio::test]
async fn version_1_records_are_still_compared_correctly_in_memory() {
    version_1_records_are_compared_at_version_1(MemoryStore::new()).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn version_1_records_are_still_compared_correctly_on_sqlite() {
    for mode in [tower_idempotency::CouplingMode::Leased, tower_idempotency::CouplingMode::Atomic] {
        version_1_records_are_compared_at_version_1(support::sqlite_store(mode).await).await;
    }
}
