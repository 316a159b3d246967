//! With no `tracing` subscriber, the `idempotency` span still reaches a `log` logger that wants
//! `INFO` (through `tracing`'s `log` fallback, which sqlx and axum turn on): the layer only
//! leaves the span out when nothing would see it. A process of its own, since the logger is
//! global.

use std::sync::Mutex;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// Every record the logger was given: its target and message.
static SEEN: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

struct Remember;

impl log::Log for Remember {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }
    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            SEEN.lock().unwrap().push((record.target().to_owned(), record.args().to_string()));
        }
    }
    fn flush(&self) {}
}

#[tokio::test]
async fn the_span_reaches_a_log_logger_at_info_without_a_subscriber() {
    log::set_logger(&Remember).expect("the only logger");
    log::set_max_level(log::LevelFilter::Info);

    let handler = tower::service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, std::convert::Infallible>(
            Response::builder().status(StatusCode::CREATED).body(Full::new(Bytes::new())).unwrap(),
        )
    });
    let service = IdempotencyLayer::new(MemoryStore::new()).shared_scope("test").layer(handler);
    let request = Request::post("/orders")
        .header("idempotency-key", "log-fallback-1")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);

    let seen = SEEN.lock().unwrap();
    let span_lines: Vec<&String> = seen
        .iter()
        .filter(|(target, message)| target == "tower_idempotency::service" && message.starts_with("idempotency;"))
        .map(|(_, message)| message)
        .collect();
    assert!(
        span_lines.iter().any(|message| message.contains("result") && message.contains("executed")),
        "the span's result reaches the logger: {seen:?}"
    );
    assert!(span_lines.iter().any(|message| message.contains("operation")), "and its operation: {seen:?}");
}
