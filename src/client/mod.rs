//! The client half of the contract: retries that keep their key.
//!
//! A server that honours `Idempotency-Key` only helps a client that sends the **same** key on
//! every retry of one logical request. A generic retry layer that knows nothing of keys (or a
//! client that makes a new key per attempt) creates the duplicate anyway.
//! [`IdempotentRetryLayer`] wraps any HTTP client service (`Service<http::Request<Full<Bytes>>>`,
//! such as hyper-util's legacy client) and:
//!
//! - gives each request of a guarded method (POST and PATCH by default) an `Idempotency-Key`:
//!   the caller's own if the request has one (the header, or an [`IdempotencyKey`] in its
//!   extensions), else a fresh UUID v4, chosen once and sent on every retry;
//! - buffers the request body once (up to a limit, 1 MiB by default) and sends the same bytes on
//!   every attempt;
//! - retries only what the contract says is safe to retry ([`decide_http`], table below), waits
//!   with exponential backoff and full jitter or as long as `Retry-After` asks (seconds or an
//!   HTTP-date), gives each attempt its own timeout, and stops after a number of attempts or a
//!   total deadline ([`RetryPolicy`]);
//! - hands back the last answer with a [`RetryReport`] in its extensions (the key, how many
//!   attempts, why each retry, whether the answer was a replay), or a [`RetryError`] that says
//!   whether the request may have executed when no answer came at all.
//!
//! | answer | retried? | why |
//! |---|---|---|
//! | connection error, answer cut short | yes | the server may or may not have run it; the key makes resending safe |
//! | no answer within the attempt timeout | yes | the same |
//! | 409 `idempotency_request_in_flight` | yes | the first attempt still runs; its answer comes later |
//! | 409 `idempotency_outcome_unknown` | yes | an earlier attempt died; the server settles it |
//! | 503 `idempotency_store_unavailable` | yes | nothing ran (the server fails closed) |
//! | 503 `idempotency_commit_uncertain` | yes | the contract says a retry with the same key is safe |
//! | any other 503 with `Retry-After` | yes | the server asks for it |
//! | 429 | yes | rate limited: wait and resend |
//! | 2xx, 3xx (first answers and replays) | no | final |
//! | 422 `idempotency_key_reused`, `idempotency_key_expired` | no | definitive: a new request needs a new key |
//! | 400 (key invalid or missing), every other 4xx | no | definitive: resending cannot change it |
//! | 503 without code or `Retry-After`, every other 5xx | no | not known to be safe |
//!
//! With the `tonic` feature, [`GrpcIdempotentRetryLayer`] does the same for tonic clients: the
//! key in `idempotency-key` metadata, and [`decide_grpc`] maps gRPC statuses onto the same
//! rules (`ABORTED` for the 409s, `UNAVAILABLE` for the 503s, `DEADLINE_EXCEEDED` as a timeout,
//! `RESOURCE_EXHAUSTED` with `retry-after` for 429).
//!
//! Requests of methods the layer does not guard (GET, PUT, DELETE by default) are sent once,
//! without a key, and never retried.
//!
//! The layers run on Tokio: the backoff, the per-attempt timeout and the deadline use its
//! timer, so the runtime needs its time driver (`enable_time`, on in `#[tokio::main]`).
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower_idempotency::client::{IdempotentRetryLayer, RetryPolicy, RetryReason, RetryReport};
//! use tower_layer::Layer;
//! use tower_service::Service;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! // A server whose store is down for the first attempt.
//! let calls = Arc::new(AtomicU32::new(0));
//! let server = tower::service_fn(move |request: Request<Full<Bytes>>| {
//!     let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
//!     assert!(request.headers().contains_key("idempotency-key"));
//!     async move {
//!         let response = if first {
//!             Response::builder()
//!                 .status(StatusCode::SERVICE_UNAVAILABLE)
//!                 .header("content-type", "application/problem+json")
//!                 .body(Full::new(Bytes::from_static(br#"{"code":"idempotency_store_unavailable"}"#)))
//!         } else {
//!             Response::builder().status(StatusCode::CREATED).body(Full::new(Bytes::from_static(b"{}")))
//!         };
//!         Ok::<_, std::convert::Infallible>(response.unwrap())
//!     }
//! });
//! let layer = IdempotentRetryLayer::new()
//!     .policy(RetryPolicy::new().max_attempts(4).base_delay(Duration::from_millis(10)));
//! let mut client = layer.layer(server);
//!
//! let request = Request::post("/orders").body(Full::new(Bytes::from_static(b"{\"sku\":\"A\"}"))).unwrap();
//! let response = client.call(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let report = response.extensions().get::<RetryReport>().unwrap();
//! assert_eq!(report.attempts(), 2);
//! assert_eq!(report.retries(), [RetryReason::StoreUnavailable]);
//! assert!(report.key().is_some()); // a fresh UUID v4, the same on both attempts
//! assert!(!report.replayed());
//! # });
//! ```
//!
//! Dependencies of the `client` feature: `uuid` (v4 keys), `getrandom` (the jitter; `uuid`
//! already uses it), `httpdate` (`Retry-After` dates) and `serde_json` (the problem `code`).
//! With the `metrics` feature the layers count attempts, retries by reason and give-ups
//! through the `metrics` facade (names in [`telemetry`]); each retry is also a `tracing`
//! event at debug level.
//!
//! [`IdempotencyKey`]: crate::IdempotencyKey

mod attempts;
mod body;
#[cfg(feature = "tonic")]
mod grpc;
mod http;
mod key;
mod policy;
mod report;
mod retry_after;
pub mod telemetry;

pub use attempts::RetryFuture;
pub use body::ResponseBody;
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub use grpc::{GrpcIdempotentRetryLayer, GrpcIdempotentRetryService};
pub use http::{IdempotentRetryLayer, IdempotentRetryService};
pub use policy::{Decision, RetryPolicy, RetryReason, decide_grpc, decide_http};
pub use report::{RetryError, RetryErrorKind, RetryReport};
pub use retry_after::parse_retry_after;
