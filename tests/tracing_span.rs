//! One `idempotency` span per guarded request, with its fields, around the handler: read back
//! with a subscriber of the test's own.
#![cfg(feature = "axum")]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::Request;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// A span's or an event's fields, by name.
type FieldMap = BTreeMap<String, String>;

/// Spans by id: their name and fields; and, for each event, the span it happened in.
#[derive(Default)]
struct Seen {
    spans: Mutex<BTreeMap<u64, (String, FieldMap)>>,
    stack: Mutex<Vec<u64>>,
    events: Mutex<Vec<(String, Option<u64>)>>,
    next: AtomicU64,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}").trim_matches('"').to_owned());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

#[derive(Clone, Default)]
struct Collect(Arc<Seen>);

impl Subscriber for Collect {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.0.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut fields = BTreeMap::new();
        span.record(&mut Fields(&mut fields));
        self.0.spans.lock().unwrap().insert(id, (span.metadata().name().to_owned(), fields));
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some((_, fields)) = self.0.spans.lock().unwrap().get_mut(&span.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let current = self.0.stack.lock().unwrap().last().copied();
        self.0.events.lock().unwrap().push((fields.remove("message").unwrap_or_default(), current));
    }
    fn enter(&self, span: &Id) {
        self.0.stack.lock().unwrap().push(span.into_u64());
    }
    fn exit(&self, _: &Id) {
        self.0.stack.lock().unwrap().pop();
    }
}

async fn handler() -> (http::StatusCode, &'static str) {
    tracing::info!("the handler ran");
    (http::StatusCode::CREATED, "created")
}

#[tokio::test]
async fn each_guarded_request_has_an_idempotency_span_around_its_handler() {
    let collect = Collect::default();
    let _default = tracing::subscriber::set_default(collect.clone());
    let layer = IdempotencyLayer::new(MemoryStore::new()).shared_scope("tenant").operation("orders.create");
    let app = Router::new().route("/orders", post(handler).layer(layer));
    let key = "a-secret-client-key";
    for _ in 0..2 {
        let request = Request::post("/orders").header("idempotency-key", key).body(Body::from("{}")).unwrap();
        let _ = app.clone().oneshot(request).await.unwrap();
    }

    let spans = collect.0.spans.lock().unwrap();
    let ours: Vec<(&u64, &BTreeMap<String, String>)> =
        spans.iter().filter(|(_, (name, _))| name == "idempotency").map(|(id, (_, fields))| (id, fields)).collect();
    assert_eq!(ours.len(), 2, "one span per guarded request");
    let (first_id, first) = ours[0];
    let (_, second) = ours[1];
    assert_eq!(first.get("operation").map(String::as_str), Some("orders.create"));
    assert_eq!(first.get("mode").map(String::as_str), Some("enforce"));
    assert_eq!((first["result"].as_str(), first["replayed"].as_str()), ("executed", "false"));
    assert_eq!((second["result"].as_str(), second["replayed"].as_str()), ("replayed", "true"));
    assert_eq!(first.get("record").map(String::len), Some(64), "the digest in hex: {first:?}");
    assert_eq!(second.get("record"), first.get("record"), "the same identity");
    // The claim's fencing token (`MemoryStore` fences its claims); a replay claims nothing.
    let token: u64 = first.get("fencing_token").and_then(|token| token.parse().ok()).expect("a fencing token");
    assert!(token >= 1, "{first:?}");
    assert_eq!(second.get("fencing_token"), None, "a replay has no claim: {second:?}");
    assert!(first.values().all(|value| !value.contains(key)), "never the key: {first:?}");
    let events = collect.0.events.lock().unwrap();
    let ran: Vec<&Option<u64>> =
        events.iter().filter(|(message, _)| message == "the handler ran").map(|(_, s)| s).collect();
    assert_eq!(ran.len(), 1, "the handler ran once: {events:?}");
    assert_eq!(*ran[0], Some(*first_id), "the handler's event is inside the idempotency span");
}
