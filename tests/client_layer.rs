//! The client layers against a scripted server in process: what each attempt carries, what is
//! retried, what is handed back.
#![cfg(feature = "client")]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;
use tower_idempotency::IdempotencyKey;
use tower_idempotency::client::{
    IdempotentRetryLayer, ResponseBody, RetryErrorKind, RetryPolicy, RetryReason, RetryReport,
};
use tower_layer::Layer;

/// What the scripted server does with one attempt.
#[derive(Clone)]
enum Step {
    Answer(u16, &'static [(&'static str, &'static str)], &'static str),
    Fail(std::io::ErrorKind),
    Hang,
}

fn problem(status: u16, code: &'static str) -> Step {
    let body: &'static str = Box::leak(format!("{{\"status\":{status},\"code\":\"{code}\"}}").into_boxed_str());
    Step::Answer(status, &[("content-type", "application/problem+json"), ("retry-after", "0")], body)
}

/// The attempts the server saw: (method, key header, body).
type Seen = Arc<Mutex<Vec<(String, Option<String>, Bytes)>>>;

/// A server that plays `steps` in order (the last one again when they run out).
fn scripted(
    steps: Vec<Step>,
) -> (
    impl tower_service::Service<
        Request<Full<Bytes>>,
        Response = Response<Full<Bytes>>,
        Error = std::io::Error,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    Seen,
) {
    let seen: Seen = Arc::default();
    let steps = Arc::new(Mutex::new(VecDeque::from(steps)));
    let log = seen.clone();
    let service = tower::service_fn(move |request: Request<Full<Bytes>>| {
        let (log, steps) = (log.clone(), steps.clone());
        async move {
            let key = request.headers().get("idempotency-key").map(|v| v.to_str().unwrap().to_owned());
            let method = request.method().to_string();
            let body = request.into_body().collect().await.unwrap().to_bytes();
            log.lock().unwrap().push((method, key, body));
            let step = {
                let mut steps = steps.lock().unwrap();
                if steps.len() > 1 { steps.pop_front().unwrap() } else { steps[0].clone() }
            };
            match step {
                Step::Answer(status, headers, body) => {
                    let mut response = Response::builder().status(status);
                    for (name, value) in headers {
                        response = response.header(*name, *value);
                    }
                    Ok(response.body(Full::new(Bytes::from_static(body.as_bytes()))).unwrap())
                }
                Step::Fail(kind) => Err(std::io::Error::new(kind, "scripted failure")),
                Step::Hang => std::future::pending().await,
            }
        }
    });
    (service, seen)
}

fn quick() -> RetryPolicy {
    RetryPolicy::new()
        .max_attempts(6)
        .base_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(20))
        .attempt_timeout(Duration::from_millis(500))
        .deadline(Duration::from_secs(10))
}

fn order() -> Request<Full<Bytes>> {
    Request::post("http://orders.test/orders")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"A\",\"amount_minor\":100}")))
        .unwrap()
}

async fn body_of(response: Response<ResponseBody<Full<Bytes>>>) -> String {
    String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

#[tokio::test]
async fn every_retry_carries_the_same_key_and_the_same_bytes() {
    let (server, seen) = scripted(vec![
        Step::Fail(std::io::ErrorKind::ConnectionReset),
        problem(409, "idempotency_request_in_flight"),
        problem(409, "idempotency_outcome_unknown"),
        problem(503, "idempotency_store_unavailable"),
        problem(503, "idempotency_commit_uncertain"),
        Step::Answer(201, &[("idempotent-replayed", "true")], "{\"order_id\":\"o-1\"}"),
    ]);
    let response = IdempotentRetryLayer::new().policy(quick()).layer(server).oneshot(order()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let report = response.extensions().get::<RetryReport>().cloned().unwrap();
    assert_eq!(report.attempts(), 6);
    assert_eq!(
        report.retries(),
        [
            RetryReason::ConnectionFailed,
            RetryReason::InFlight,
            RetryReason::OutcomeUnknown,
            RetryReason::StoreUnavailable,
            RetryReason::CommitUncertain,
        ]
    );
    assert!(report.replayed());
    assert!(!report.gave_up());
    assert_eq!(body_of(response).await, "{\"order_id\":\"o-1\"}");

    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 6);
    let key = report.key().unwrap();
    assert_eq!(uuid::Uuid::parse_str(key).unwrap().get_version_num(), 4);
    for (_, attempt_key, body) in seen.iter() {
        assert_eq!(attempt_key.as_deref(), Some(key));
        assert_eq!(&body[..], b"{\"sku\":\"A\",\"amount_minor\":100}");
    }
}

#[tokio::test]
async fn each_logical_request_gets_its_own_key_and_the_callers_key_is_kept() {
    let (server, seen) = scripted(vec![Step::Answer(201, &[], "{}")]);
    let client = IdempotentRetryLayer::new().policy(quick()).layer(server);
    client.clone().oneshot(order()).await.unwrap();
    client.clone().oneshot(order()).await.unwrap();
    let mut own_header = order();
    own_header.headers_mut().insert("idempotency-key", "caller-header-key".parse().unwrap());
    client.clone().oneshot(own_header).await.unwrap();
    let mut own_extension = order();
    own_extension.extensions_mut().insert(IdempotencyKey::new("caller-extension-key").unwrap());
    let response = client.clone().oneshot(own_extension).await.unwrap();
    assert_eq!(response.extensions().get::<RetryReport>().unwrap().key(), Some("caller-extension-key"));

    let keys: Vec<Option<String>> = seen.lock().unwrap().iter().map(|(_, key, _)| key.clone()).collect();
    assert_ne!(keys[0], keys[1], "two logical requests, two keys");
    assert_eq!(keys[2].as_deref(), Some("caller-header-key"));
    assert_eq!(keys[3].as_deref(), Some("caller-extension-key"));
}

#[tokio::test]
async fn definitive_answers_are_handed_back_after_one_attempt_with_their_body() {
    let definitive = [
        (problem(422, "idempotency_key_reused"), 422),
        (problem(422, "idempotency_key_expired"), 422),
        (problem(400, "idempotency_key_invalid"), 400),
        (problem(409, "some_business_conflict"), 409),
        (Step::Answer(503, &[], "down"), 503),
        (Step::Answer(500, &[("retry-after", "1")], "boom"), 500),
        (Step::Answer(200, &[], "fine"), 200),
    ];
    for (step, status) in definitive {
        let expected_body = match &step {
            Step::Answer(_, _, body) => *body,
            _ => unreachable!(),
        };
        let (server, seen) = scripted(vec![step]);
        let response = IdempotentRetryLayer::new().policy(quick()).layer(server).oneshot(order()).await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        let report = response.extensions().get::<RetryReport>().cloned().unwrap();
        assert_eq!((report.attempts(), report.gave_up()), (1, false), "{status}");
        assert_eq!(body_of(response).await, expected_body, "the body the layer read is handed back whole");
        assert_eq!(seen.lock().unwrap().len(), 1);
    }
}

#[tokio::test]
async fn a_problem_body_too_large_to_read_is_final_and_handed_back_whole() {
    let big: &'static str = Box::leak(
        format!("{{\"code\":\"idempotency_request_in_flight\",\"pad\":\"{}\"}}", "x".repeat(40_000)).into_boxed_str(),
    );
    let (server, _) = scripted(vec![Step::Answer(409, &[], big)]);
    let response = IdempotentRetryLayer::new().policy(quick()).layer(server).oneshot(order()).await.unwrap();
    assert_eq!(response.extensions().get::<RetryReport>().unwrap().attempts(), 1);
    assert_eq!(body_of(response).await, big);
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let (server, _) = scripted(vec![Step::Answer(429, &[("retry-after", "1")], ""), Step::Answer(201, &[], "{}")]);
    let started = std::time::Instant::now();
    let response = IdempotentRetryLayer::new().policy(quick()).layer(server).oneshot(order()).await.unwrap();
    assert!(started.elapsed() >= Duration::from_secs(1), "waited {:?}", started.elapsed());
    assert_eq!(response.extensions().get::<RetryReport>().unwrap().retries(), [RetryReason::RateLimited]);
}

#[tokio::test]
async fn a_retry_after_past_the_deadline_hands_back_the_answer() {
    let in_flight = "{\"code\":\"idempotency_request_in_flight\"}";
    let (server, seen) = scripted(vec![Step::Answer(409, &[("retry-after", "3600")], in_flight)]);
    let policy = quick().deadline(Duration::from_secs(2));
    let response = IdempotentRetryLayer::new().policy(policy).layer(server).oneshot(order()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let report = response.extensions().get::<RetryReport>().cloned().unwrap();
    assert!(report.gave_up());
    assert_eq!(report.attempts(), 1);
    assert_eq!(seen.lock().unwrap().len(), 1, "the next attempt could not start before the deadline");
}

#[tokio::test]
async fn a_hanging_attempt_times_out_and_is_retried() {
    let (server, _) = scripted(vec![Step::Hang, Step::Answer(201, &[], "{}")]);
    let policy = quick().attempt_timeout(Duration::from_millis(100));
    let response = IdempotentRetryLayer::new().policy(policy).layer(server).oneshot(order()).await.unwrap();
    assert_eq!(response.extensions().get::<RetryReport>().unwrap().retries(), [RetryReason::TimedOut]);
}

#[tokio::test]
async fn giving_up_says_whether_the_request_may_have_executed() {
    let (server, seen) = scripted(vec![Step::Fail(std::io::ErrorKind::ConnectionRefused)]);
    let error =
        IdempotentRetryLayer::new().policy(quick().max_attempts(3)).layer(server).oneshot(order()).await.unwrap_err();
    assert_eq!(error.kind(), RetryErrorKind::GaveUp);
    assert_eq!(error.attempts(), 3);
    assert!(!error.may_have_executed(), "every connection was refused: nothing was sent");
    assert_eq!(seen.lock().unwrap().len(), 3);

    let (server, _) = scripted(vec![
        Step::Fail(std::io::ErrorKind::ConnectionRefused),
        Step::Fail(std::io::ErrorKind::ConnectionReset),
    ]);
    let error =
        IdempotentRetryLayer::new().policy(quick().max_attempts(3)).layer(server).oneshot(order()).await.unwrap_err();
    assert!(error.may_have_executed(), "a reset connection may have carried the request");
    assert!(error.key().is_some(), "the key to retry with later");
    assert_eq!(error.retries().len(), 3);
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_before_anything_is_sent() {
    let (server, seen) = scripted(vec![Step::Answer(201, &[], "{}")]);
    let error = IdempotentRetryLayer::new().body_limit(8).layer(server).oneshot(order()).await.unwrap_err();
    assert_eq!(error.kind(), RetryErrorKind::BodyTooLarge);
    assert!(!error.may_have_executed());
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn unguarded_methods_are_sent_once_without_a_key() {
    let (server, seen) = scripted(vec![problem(503, "idempotency_store_unavailable")]);
    let request = Request::get("http://orders.test/orders").body(Full::new(Bytes::new())).unwrap();
    let response = IdempotentRetryLayer::new().policy(quick()).layer(server).oneshot(request).await.unwrap();
    assert_eq!(response.extensions().get::<RetryReport>().unwrap().key(), None);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!((seen[0].0.as_str(), seen[0].1.as_deref()), ("GET", None));
}

#[tokio::test]
async fn hyper_clients_refused_connections_are_known_not_to_have_run() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let http =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = Request::post(format!("http://127.0.0.1:{port}/orders")).body(Full::new(Bytes::new())).unwrap();
    let error =
        IdempotentRetryLayer::new().policy(quick().max_attempts(2)).layer(http).oneshot(request).await.unwrap_err();
    assert_eq!((error.kind(), error.attempts()), (RetryErrorKind::GaveUp, 2));
    assert_eq!(error.retries(), [RetryReason::ConnectionFailed, RetryReason::ConnectionFailed]);
    assert!(!error.may_have_executed(), "{error}");
}
