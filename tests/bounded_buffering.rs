//! Request buffering is bounded in time and memory: a stalled body gets 408 at the body
//! deadline; a process-wide budget refuses, before reading, a body that would not fit while
//! others hold it, and admits again once they are done; a request cancelled at any await
//! point gives its share back.
#![cfg(feature = "axum")]

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::{Notify, mpsc};
use tower::ServiceExt;
use tower_idempotency::{BufferBudget, IdempotencyLayer, MemoryStore};

/// Generous bound for anything to happen at all (never a timing assertion).
const LIVENESS: Duration = Duration::from_secs(30);

/// A request body fed through a channel: it stalls while the sender is kept and sends
/// nothing, and ends when the sender is dropped. It records whether it was ever polled.
struct Fed {
    chunks: mpsc::UnboundedReceiver<Bytes>,
    polled: Arc<AtomicBool>,
}

impl http_body::Body for Fed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.polled.store(true, Ordering::SeqCst);
        self.chunks.poll_recv(cx).map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes))))
    }
}

/// A body under the test's control.
struct Feeder {
    sender: mpsc::UnboundedSender<Bytes>,
    polled: Arc<AtomicBool>,
}

fn fed() -> (Feeder, Body) {
    let (sender, chunks) = mpsc::unbounded_channel();
    let polled = Arc::new(AtomicBool::new(false));
    (Feeder { sender, polled: polled.clone() }, Body::new(Fed { chunks, polled }))
}

impl Feeder {
    fn send(&self, bytes: &'static [u8]) {
        self.sender.send(Bytes::from_static(bytes)).unwrap();
    }

    fn was_polled(&self) -> bool {
        self.polled.load(Ordering::SeqCst)
    }
}

/// The handler's side: how many ran, and a gate that holds them until opened.
#[derive(Clone, Default)]
struct Handler {
    executions: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    gate: Option<Arc<Notify>>,
}

fn app(layer: IdempotencyLayer<MemoryStore>, handler: Handler) -> Router {
    let run = move |body: Bytes| {
        let handler = handler.clone();
        async move {
            handler.executions.fetch_add(1, Ordering::SeqCst);
            handler.entered.notify_one();
            if let Some(gate) = &handler.gate {
                gate.notified().await;
            }
            (StatusCode::CREATED, format!("{} bytes", body.len()))
        }
    };
    Router::new().route("/orders", post(run).layer(layer.shared_scope("tenant")))
}

fn request(key: &str, content_length: Option<usize>, body: Body) -> Request<Body> {
    let mut request = Request::post("/orders").header("content-type", "text/plain").header("idempotency-key", key);
    if let Some(length) = content_length {
        request = request.header("content-length", length);
    }
    request.body(body).unwrap()
}

struct Answer {
    status: StatusCode,
    retry_after: Option<String>,
    body: String,
}

async fn call(app: &Router, request: Request<Body>) -> Answer {
    let response = tokio::time::timeout(LIVENESS, app.clone().oneshot(request)).await.expect("answered").unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        retry_after: parts.headers.get("retry-after").map(|v| v.to_str().unwrap().to_owned()),
        body: String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

fn assert_problem(answer: &Answer, status: StatusCode, code: &str) {
    assert_eq!(answer.status, status, "{}", answer.body);
    assert!(answer.body.contains(&format!("\"code\":\"{code}\"")), "{}", answer.body);
}

/// Waits (within the liveness bound) until `budget` holds exactly `bytes`.
async fn until_in_use(budget: &BufferBudget, bytes: usize) {
    let waited = tokio::time::timeout(LIVENESS, async {
        while budget.in_use() != bytes {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the budget holds {} bytes, not {bytes}", budget.in_use());
}

#[tokio::test]
async fn a_stalled_body_gets_408_at_the_deadline_and_nothing_runs() {
    let budget = BufferBudget::new(1 << 20);
    let handler = Handler::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .body_timeout(Duration::from_millis(200))
        .buffer_budget(budget.clone());
    let app = app(layer, handler.clone());

    // All but the last byte, then silence (the sender stays alive).
    let (feeder, body) = fed();
    feeder.send(b"123456789");
    let answer = call(&app, request("stalled", Some(10), body)).await;
    assert_problem(&answer, StatusCode::REQUEST_TIMEOUT, "idempotency_body_timeout");
    assert_eq!(handler.executions.load(Ordering::SeqCst), 0);
    assert_eq!(budget.in_use(), 0, "the reservation is given back");

    // No claim was made: the same key, sent whole, executes.
    let (feeder2, body) = fed();
    feeder2.send(b"1234567890");
    drop(feeder2);
    let answer = call(&app, request("stalled", Some(10), body)).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
    drop(feeder);
}

#[tokio::test]
async fn the_budget_refuses_before_reading_while_it_is_held_and_admits_once_released() {
    let budget = BufferBudget::new(100);
    let handler = Handler::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).max_request_body(100).buffer_budget(budget.clone());
    let app = app(layer, handler.clone());

    // A slow client holds 60 bytes of the budget.
    let (slow, body) = fed();
    slow.send(b"0123456789");
    let held = tokio::spawn({
        let app = app.clone();
        async move { call(&app, request("slow", Some(60), body)).await }
    });
    until_in_use(&budget, 60).await;

    // 50 more do not fit: refused at once, the body never touched.
    let (refused, body) = fed();
    let answer = call(&app, request("second", Some(50), body)).await;
    assert_problem(&answer, StatusCode::SERVICE_UNAVAILABLE, "idempotency_buffer_budget_exhausted");
    assert!(answer.retry_after.is_some(), "503 with Retry-After");
    assert!(!refused.was_polled(), "refused before it was read");

    // A body without Content-Length is charged as it arrives: refused once it would not fit.
    let (chunked, body) = fed();
    chunked.send(b"0123456789");
    chunked.send(&[b'c'; 40]);
    let answer = call(&app, request("chunked", None, body)).await;
    assert_problem(&answer, StatusCode::SERVICE_UNAVAILABLE, "idempotency_buffer_budget_exhausted");
    assert_eq!(budget.in_use(), 60, "what it had read is given back");
    drop(chunked);

    // 40 fit beside the 60.
    let answer = call(&app, request("fits", Some(40), Body::from(vec![b'x'; 40]))).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
    assert_eq!(budget.in_use(), 60, "the finished request gave its 40 back");

    // The slow client finishes: everything is given back and the refused request now runs.
    slow.send(&[b'y'; 50]);
    drop(slow);
    let answer = held.await.unwrap();
    assert_eq!((answer.status, answer.body.as_str()), (StatusCode::CREATED, "60 bytes"));
    assert_eq!(budget.in_use(), 0);
    let answer = call(&app, request("second", Some(50), Body::from(vec![b'z'; 50]))).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
    let (chunked, body) = fed();
    chunked.send(b"abc");
    drop(chunked);
    let answer = call(&app, request("chunked", None, body)).await;
    assert_eq!((answer.status, answer.body.as_str()), (StatusCode::CREATED, "3 bytes"));
    assert_eq!(budget.in_use(), 0);
    assert_eq!(handler.executions.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_body_without_content_length_holds_only_its_length_once_read() {
    let budget = BufferBudget::new(1000);
    let gate = Arc::new(Notify::new());
    let handler = Handler { gate: Some(gate.clone()), ..Handler::default() };
    let layer = IdempotencyLayer::new(MemoryStore::new()).max_request_body(500).buffer_budget(budget.clone());
    let app = app(layer, handler.clone());

    let (feeder, body) = fed();
    feeder.send(b"abcd");
    feeder.send(b"efg");
    drop(feeder);
    let running = tokio::spawn({
        let app = app.clone();
        async move { call(&app, request("chunked", None, body)).await }
    });
    tokio::time::timeout(LIVENESS, handler.entered.notified()).await.expect("the handler runs");
    assert_eq!(budget.in_use(), 7, "charged as it arrived: 7 bytes");
    gate.notify_one();
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(budget.in_use(), 0);
}

#[tokio::test]
async fn a_request_cancelled_while_its_body_is_read_or_its_handler_runs_gives_its_share_back() {
    let budget = BufferBudget::new(1000);
    let gate = Arc::new(Notify::new());
    let handler = Handler { gate: Some(gate), ..Handler::default() };
    let layer = IdempotencyLayer::new(MemoryStore::new()).buffer_budget(budget.clone());
    let app = app(layer, handler.clone());

    // Cancelled mid-read.
    let (feeder, body) = fed();
    feeder.send(b"half");
    let reading = tokio::spawn({
        let app = app.clone();
        async move { app.oneshot(request("mid-read", Some(8), body)).await }
    });
    until_in_use(&budget, 8).await;
    reading.abort();
    assert!(reading.await.unwrap_err().is_cancelled());
    assert_eq!(budget.in_use(), 0, "given back on cancellation mid-read");

    // Cancelled while the handler runs (the body is buffered and held).
    let running = tokio::spawn({
        let app = app.clone();
        async move { app.oneshot(request("in-handler", Some(5), Body::from("12345"))).await }
    });
    tokio::time::timeout(LIVENESS, handler.entered.notified()).await.expect("the handler runs");
    assert_eq!(budget.in_use(), 5);
    running.abort();
    assert!(running.await.unwrap_err().is_cancelled());
    assert_eq!(budget.in_use(), 0, "given back on cancellation in the handler");
    drop(feeder);
}

#[tokio::test]
async fn layers_share_the_process_budget_unless_given_their_own() {
    let process = BufferBudget::process();
    assert_eq!(process.capacity(), BufferBudget::DEFAULT_CAPACITY);
    // A layer without a budget of its own charges the process's budget.
    let gate = Arc::new(Notify::new());
    let handler = Handler { gate: Some(gate.clone()), ..Handler::default() };
    let app = app(IdempotencyLayer::new(MemoryStore::new()), handler.clone());
    let length = 123_457; // unlikely to be what another test of this binary holds
    let running = tokio::spawn({
        let app = app.clone();
        async move { call(&app, request("process", Some(length), Body::from(vec![b'p'; length]))).await }
    });
    tokio::time::timeout(LIVENESS, handler.entered.notified()).await.expect("the handler runs");
    assert!(process.in_use() >= length, "charged to the process budget: {}", process.in_use());
    gate.notify_one();
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
}
