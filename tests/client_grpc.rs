//! The tonic client layer against a scripted gRPC server in process: the key in
//! `idempotency-key` metadata, the same on every retry, and gRPC statuses judged by the shared
//! policy.
#![cfg(all(feature = "client", feature = "tonic"))]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;
use tower_idempotency::client::{GrpcIdempotentRetryLayer, RetryPolicy, RetryReason, RetryReport};
use tower_layer::Layer;

const CREATE: &str = "/orders.v1.Orders/CreateOrder";

/// A trailers-only answer with these headers (`grpc-status` among them), or an OK answer with a
/// message when `headers` is empty.
type Step = &'static [(&'static str, &'static str)];

/// The attempts the server saw: (path, key metadata, message bytes).
type Seen = Arc<Mutex<Vec<(String, Option<String>, Bytes)>>>;

fn scripted(
    steps: Vec<Step>,
) -> (
    impl tower_service::Service<
        Request<tonic::body::Body>,
        Response = Response<Full<Bytes>>,
        Error = std::convert::Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    Seen,
) {
    let seen: Seen = Arc::default();
    let steps = Arc::new(Mutex::new(VecDeque::from(steps)));
    let log = seen.clone();
    let service = tower::service_fn(move |request: Request<tonic::body::Body>| {
        let (log, steps) = (log.clone(), steps.clone());
        async move {
            let key = request.headers().get("idempotency-key").map(|v| v.to_str().unwrap().to_owned());
            let path = request.uri().path().to_owned();
            let message = request.into_body().collect().await.unwrap().to_bytes();
            log.lock().unwrap().push((path, key, message));
            let step = {
                let mut steps = steps.lock().unwrap();
                if steps.len() > 1 { steps.pop_front().unwrap() } else { steps[0] }
            };
            let mut response = Response::builder().header("content-type", "application/grpc");
            for (name, value) in step {
                response = response.header(*name, *value);
            }
            let body = if step.is_empty() { Bytes::from_static(b"\0\0\0\0\x02ok") } else { Bytes::new() };
            Ok(response.body(Full::new(body)).unwrap())
        }
    });
    (service, seen)
}

const IN_FLIGHT: Step =
    &[("grpc-status", "10"), ("idempotency-code", "idempotency_request_in_flight"), ("retry-after", "0")];
const UNAVAILABLE: Step = &[("grpc-status", "14")];
const KEY_REUSED: Step = &[("grpc-status", "9"), ("idempotency-code", "idempotency_key_reused")];
const OK: Step = &[];

fn call(path: &str) -> Request<tonic::body::Body> {
    let message = Bytes::from_static(b"\0\0\0\0\x03abc");
    Request::post(format!("http://orders.test{path}"))
        .header("content-type", "application/grpc")
        .body(tonic::body::Body::new(Full::new(message)))
        .unwrap()
}

fn layer() -> GrpcIdempotentRetryLayer {
    GrpcIdempotentRetryLayer::new().policy(RetryPolicy::new().base_delay(Duration::from_millis(5)))
}

#[tokio::test]
async fn retryable_statuses_are_retried_with_the_same_key_and_message() {
    let (server, seen) = scripted(vec![IN_FLIGHT, UNAVAILABLE, OK]);
    let response = layer().layer(server).oneshot(call(CREATE)).await.unwrap();
    let report = response.extensions().get::<RetryReport>().cloned().unwrap();
    assert_eq!(report.retries(), [RetryReason::InFlight, RetryReason::Unavailable]);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"\0\0\0\0\x02ok");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    for (_, key, message) in seen.iter() {
        assert_eq!(key.as_deref(), report.key());
        assert_eq!(&message[..], b"\0\0\0\0\x03abc");
    }
}

#[tokio::test]
async fn definitive_statuses_are_handed_back_at_once() {
    let (server, seen) = scripted(vec![KEY_REUSED]);
    let response = layer().layer(server).oneshot(call(CREATE)).await.unwrap();
    assert_eq!(response.headers()["grpc-status"], "9");
    assert_eq!(response.extensions().get::<RetryReport>().unwrap().attempts(), 1);
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn methods_not_named_pass_through_untouched() {
    let (server, seen) = scripted(vec![UNAVAILABLE]);
    let response = layer().methods([CREATE]).layer(server).oneshot(call("/orders.v1.Orders/GetOrder")).await.unwrap();
    assert_eq!(response.headers()["grpc-status"], "14");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].1, None, "no key on a method the layer does not guard");
}
