//! The layer for HTTP clients: any `Service<http::Request<Full<Bytes>>>`.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::Full;
use tower_layer::Layer;
use tower_service::Service;

use super::attempts::{Judged, LogicalRequest, RetryFuture, Wire, buffered, run};
use super::body::ResponseBody;
use super::key::attach_key;
use super::policy::{RetryPolicy, decide_http};
use super::report::RetryError;
use super::retry_after::retry_after_of;
use crate::BoxError;

/// Request bodies up to this size are buffered by default (1 MiB).
const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// How much of a 409 or 503 body the layer reads to find its problem `code` (16 KiB).
const PROBLEM_READ_LIMIT: usize = 16 * 1024;

/// A Tower layer for HTTP clients that makes their retries of writes safe: one
/// `Idempotency-Key` per logical request, the same key and bytes on every retry, and retries
/// only of the answers the idempotency contract says are safe to retry. See the
/// [module docs](crate::client).
#[derive(Debug, Clone)]
pub struct IdempotentRetryLayer {
    settings: Arc<Settings>,
}

#[derive(Debug, Clone)]
struct Settings {
    policy: RetryPolicy,
    methods: Vec<Method>,
    body_limit: usize,
}

impl Default for IdempotentRetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentRetryLayer {
    /// The layer with the default [`RetryPolicy`], guarding POST and PATCH, buffering request
    /// bodies up to 1 MiB.
    pub fn new() -> Self {
        Self {
            settings: Arc::new(Settings {
                policy: RetryPolicy::default(),
                methods: vec![Method::POST, Method::PATCH],
                body_limit: DEFAULT_BODY_LIMIT,
            }),
        }
    }

    /// How often and how long to retry.
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        Arc::make_mut(&mut self.settings).policy = policy;
        self
    }

    /// The methods that get a key and retries (default POST and PATCH). Requests with other
    /// methods are sent once, without a key.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        Arc::make_mut(&mut self.settings).methods = methods.into_iter().collect();
        self
    }

    /// The largest request body the layer buffers for resending; a larger one fails with
    /// [`RetryErrorKind::BodyTooLarge`](super::report::RetryErrorKind::BodyTooLarge) before anything is sent.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.settings).body_limit = bytes;
        self
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = IdempotentRetryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentRetryService { inner, settings: self.settings.clone() }
    }
}

/// The service of [`IdempotentRetryLayer`]. It is always ready: each call waits for the
/// readiness of its own clone of the inner service, once per attempt.
#[derive(Debug, Clone)]
pub struct IdempotentRetryService<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S, B, RB> Service<Request<B>> for IdempotentRetryService<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = RetryError;
    type Future = RetryFuture<RB>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let settings = self.settings.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let key =
                settings.methods.contains(&parts.method).then(|| attach_key(&mut parts.headers, &parts.extensions));
            let body = buffered(body, settings.body_limit, key.as_deref()).await?;
            run::<Http, _, _>(inner, settings.policy, LogicalRequest { parts, body, key }).await
        })
    }
}

/// HTTP answers: the status, `Retry-After`, and for 409 and 503 the problem `code` of the body.
struct Http;

impl Wire for Http {
    type RequestBody = Full<Bytes>;

    fn request_body(bytes: Bytes) -> Full<Bytes> {
        Full::new(bytes)
    }

    async fn judge<B>(response: Response<B>, now: SystemTime) -> Result<Judged<B>, BoxError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let retry_after = retry_after_of(response.headers(), now);
        let (parts, body) = response.into_parts();
        let (body, code) = if matches!(parts.status, StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE) {
            let (body, peeked) = ResponseBody::read_prefix(body, PROBLEM_READ_LIMIT).await?;
            (body, peeked.problem_code())
        } else {
            (ResponseBody::streaming(body), None)
        };
        let decision = decide_http(parts.status, code.as_deref(), retry_after.is_some());
        Ok(Judged { response: Response::from_parts(parts, body), decision, retry_after })
    }
}
