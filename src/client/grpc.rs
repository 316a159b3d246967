//! The layer for tonic clients: a tonic `Channel` or anything else that serves
//! `http::Request<tonic::body::Body>`.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower_layer::Layer;
use tower_service::Service;

use super::attempts::{Judged, LogicalRequest, RetryFuture, Wire, buffered, pass_through, run};
use super::body::ResponseBody;
use super::key::attach_key;
use super::policy::{Decision, RetryPolicy, decide_grpc};
use super::report::RetryError;
use super::retry_after::retry_after_of;
use crate::BoxError;

/// Request messages up to this size are buffered by default (1 MiB).
const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// The tonic twin of [`IdempotentRetryLayer`](super::IdempotentRetryLayer): the key in
/// `idempotency-key` metadata, one per logical call and the same on every retry, and the
/// [same policy](super::decide_grpc) applied to gRPC statuses.
///
/// Put it between a tonic `Channel` and the generated client
/// (`OrdersClient::new(GrpcIdempotentRetryLayer::new().layer(channel))`). It is meant for
/// unary methods: the request message is buffered whole. A status is judged when it comes as a
/// trailers-only answer, which is how tonic servers send `Err(Status)` and how this crate's
/// server layer sends its refusals; a status in the trailers after a streamed answer is final.
#[derive(Debug, Clone)]
pub struct GrpcIdempotentRetryLayer {
    settings: Arc<GrpcSettings>,
}

#[derive(Debug, Clone)]
struct GrpcSettings {
    policy: RetryPolicy,
    /// `None`: every method.
    methods: Option<Vec<String>>,
    body_limit: usize,
}

impl Default for GrpcIdempotentRetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl GrpcIdempotentRetryLayer {
    /// The layer with the default [`RetryPolicy`], guarding every method, buffering request
    /// messages up to 1 MiB.
    pub fn new() -> Self {
        Self {
            settings: Arc::new(GrpcSettings {
                policy: RetryPolicy::default(),
                methods: None,
                body_limit: DEFAULT_BODY_LIMIT,
            }),
        }
    }

    /// How often and how long to retry.
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        Arc::make_mut(&mut self.settings).policy = policy;
        self
    }

    /// Only these methods (paths such as `/orders.v1.Orders/CreateOrder`) get a key and
    /// retries; calls of the others pass through untouched.
    pub fn methods<I: Into<String>>(mut self, paths: impl IntoIterator<Item = I>) -> Self {
        Arc::make_mut(&mut self.settings).methods = Some(paths.into_iter().map(Into::into).collect());
        self
    }

    /// The largest request message (as framed on the wire) the layer buffers for resending.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.settings).body_limit = bytes;
        self
    }
}

impl<S> Layer<S> for GrpcIdempotentRetryLayer {
    type Service = GrpcIdempotentRetryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcIdempotentRetryService { inner, settings: self.settings.clone() }
    }
}

/// The service of [`GrpcIdempotentRetryLayer`]. It is always ready: each call waits for the
/// readiness of its own clone of the inner service, once per attempt.
#[derive(Debug, Clone)]
pub struct GrpcIdempotentRetryService<S> {
    inner: S,
    settings: Arc<GrpcSettings>,
}

impl<S, RB> Service<Request<tonic::body::Body>> for GrpcIdempotentRetryService<S>
where
    S: Service<Request<tonic::body::Body>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = RetryError;
    type Future = RetryFuture<RB>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<tonic::body::Body>) -> Self::Future {
        let inner = self.inner.clone();
        let settings = self.settings.clone();
        Box::pin(async move {
            let guarded = settings.methods.as_ref().is_none_or(|paths| paths.iter().any(|p| p == request.uri().path()));
            let (mut parts, body) = request.into_parts();
            if !guarded {
                return pass_through(inner, Request::from_parts(parts, body)).await;
            }
            let key = attach_key(&mut parts.headers, &parts.extensions);
            let body = buffered(body, settings.body_limit, Some(&key)).await?;
            run::<Grpc, _, _>(inner, settings.policy, LogicalRequest { parts, body, key: Some(key) }).await
        })
    }
}

/// gRPC answers: `grpc-status`, `idempotency-code` and `retry-after` of a trailers-only answer.
struct Grpc;

impl Wire for Grpc {
    type RequestBody = tonic::body::Body;

    fn request_body(bytes: Bytes) -> tonic::body::Body {
        tonic::body::Body::new(Full::new(bytes))
    }

    async fn judge<B>(response: Response<B>, now: SystemTime) -> Result<Judged<B>, BoxError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let headers = response.headers();
        let retry_after = retry_after_of(headers, now);
        let status = headers.get("grpc-status").and_then(|v| v.to_str().ok()?.parse().ok());
        let code = headers.get("idempotency-code").and_then(|v| v.to_str().ok());
        let decision = match status {
            Some(status) => decide_grpc(status, code, retry_after.is_some()),
            None => Decision::Stop,
        };
        Ok(Judged { response: response.map(ResponseBody::streaming), decision, retry_after })
    }
}
