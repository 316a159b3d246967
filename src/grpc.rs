//! gRPC on tonic (feature `tonic`): the same layer and the same promise for the gRPC methods
//! you name.
//!
//! ## Set-up
//!
//! Name the guarded methods with [`grpc_methods`](crate::IdempotencyLayer::grpc_methods), put
//! an authentication layer that inserts a [`Scope`](crate::Scope) *before* the idempotency
//! layer, and give the layer to the server with
//! [`into_tonic`](crate::IdempotencyLayer::into_tonic):
//!
//! ```ignore
//! let idempotency = IdempotencyLayer::new(PostgresStore::new(pool))
//!     .grpc_methods(["/orders.v1.Orders/CreateOrder"]);
//! Server::builder()
//!     .layer(tonic::service::InterceptorLayer::new(authenticate)) // inserts a `Scope`
//!     .layer(idempotency.into_tonic())
//!     .add_service(OrdersServer::new(orders))
//!     .serve(addr)
//!     .await?;
//! ```
//!
//! The handler finds its [`IdempotencyContext`](crate::IdempotencyContext), and in atomic mode
//! the claim's transaction as a `TxHandle`, in the request's extensions. It writes through the
//! transaction and lets go of the handle (and of the request, which holds a clone) before it
//! answers, as it does when it returns:
//!
//! ```ignore
//! async fn create_order(&self, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
//!     let context = request.extensions().get::<IdempotencyContext>().cloned();
//!     let tx = request.extensions().get::<TxHandle<sqlx::Postgres>>().cloned();
//!     // ... INSERT through `tx.acquire().await` ...
//! }
//! ```
//!
//! `examples/grpc_orders.rs` is a complete service.
//!
//! ## What the layer does with a gRPC call ([contract §3](crate::contract#3-answers), gRPC column)
//!
//! - **Which calls.** A request whose path is named in `grpc_methods` is guarded as a gRPC
//!   call, whatever its content type. A gRPC call to another method (content type
//!   `application/grpc`, `application/grpc+…` or `application/grpc-…`, [`is_grpc`]) passes
//!   through the [`TonicLayer`] untouched. The plain layer (bodies that are `From<Bytes>`, on
//!   axum routes) never lets a content type decide: a request with a gRPC content type on a
//!   path not named in `grpc_methods` is judged by the HTTP method rule (`methods`) like any
//!   other request, so a client cannot take a guarded HTTP route out of the layer by sending
//!   `Content-Type: application/grpc`. Put the plain layer on the routes it guards, not around
//!   a nested tonic service whose other methods must pass through (or give that layer
//!   `methods([])`).
//! - **The key** is the `idempotency-key` metadata (or the name given to
//!   [`header`](crate::IdempotencyLayer::header)), under the same rules as the HTTP header (an
//!   sf-string or a bare token, 1 to 255 visible ASCII characters, exactly one).
//! - **The operation** is the method path, `/package.Service/Method`.
//! - **The fingerprint** covers the method path, the content type, the metadata declared with
//!   [`FingerprintSpec::include_header`](crate::FingerprintSpec::include_header), and the request
//!   body **as sent on the wire**: the gRPC-framed messages (a compression flag byte, a 4-byte
//!   length, the message bytes, for each message). A retry must send the same bytes, which a
//!   client does when it serialises the same message with the same library and the same
//!   compression setting; a compressed and an uncompressed copy of one message differ.
//! - **Success** is judged by `grpc-status`, never by the HTTP status (200 for gRPC errors): from
//!   the response headers of a trailers-only answer (what tonic sends for `Err(Status)`), else
//!   from the trailers once the body is read; an answer without a `grpc-status` counts as
//!   `UNKNOWN`. By default `OK` completes and every other code releases (the next attempt
//!   executes afresh). A handler stores a business rejection with [`reject`]; a route
//!   keys its own rule on the code with
//!   [`classify_grpc_with`](crate::IdempotencyLayer::classify_grpc_with). An
//!   [`OutcomeClass`](crate::OutcomeClass) in the `http::Response` extensions (a tower service, or a
//!   `tonic::Response` with it in its extensions) wins over both.
//! - **What is stored**: the headers of the allow-list (`content-type`, and what
//!   [`store_header`](crate::IdempotencyLayer::store_header) adds: name your custom response
//!   metadata there), every `grpc-*` header (`grpc-encoding` of a compressed answer, the
//!   `grpc-status`, `grpc-message` and `grpc-status-details-bin` of a trailers-only answer),
//!   the body, and the trailers (status and trailing metadata), less what is never stored
//!   (credentials, cookies, hop-by-hop fields).
//! - **A replay** carries the stored metadata, messages and trailers, plus
//!   `idempotent-replayed: true` metadata.
//! - **Refusals** are trailers-only statuses ([`Problem::to_grpc`](crate::problem::Problem::to_grpc)):
//!   `grpc-status`, a percent-encoded `grpc-message`, the stable code as `idempotency-code`
//!   metadata and, where the HTTP answer has `Retry-After`, `retry-after` metadata:
//!
//! | situation | status | `idempotency-code` |
//! |---|---|---|
//! | missing key | `INVALID_ARGUMENT` | `idempotency_key_missing` |
//! | invalid key | `INVALID_ARGUMENT` | `idempotency_key_invalid` |
//! | same key, different request | `FAILED_PRECONDITION` | `idempotency_key_reused` |
//! | key past its retention | `FAILED_PRECONDITION` | `idempotency_key_expired` |
//! | original still in flight after the bounded wait | `ABORTED` | `idempotency_request_in_flight` |
//! | an earlier attempt's outcome is unknown | `ABORTED` | `idempotency_outcome_unknown` |
//! | request over the buffer limit | `RESOURCE_EXHAUSTED` | `idempotency_body_too_large` |
//! | request not complete within the body deadline | `DEADLINE_EXCEEDED` | `idempotency_body_timeout` |
//! | buffer budget spent (refused before reading) | `UNAVAILABLE` | `idempotency_buffer_budget_exhausted` |
//! | store unreachable, or commit uncertain | `UNAVAILABLE` | `idempotency_store_unavailable`, `idempotency_commit_uncertain` |
//! | answer too large to store, handle kept, answer failed | `INTERNAL` | `idempotency_response_too_large`, … |
//! | no scope | `UNAUTHENTICATED` | `idempotency_scope_missing` |
//!
//! ## Limits
//!
//! - The layer buffers the whole request before the handler runs and the whole answer before
//!   it leaves (both within the layer's limits). Name unary methods, or client- and
//!   server-streaming ones with small bounded streams; a bidirectional method whose client waits
//!   for answers before it finishes sending would never start.
//! - A duplicate of a call still in flight waits up to
//!   [`in_flight_wait`](crate::IdempotencyLayer::in_flight_wait) (2 s by default) before
//!   `ABORTED`; keep it below your clients' deadlines, or they see `DEADLINE_EXCEEDED` instead.
//! - gRPC-Web is recognised as gRPC, but its status travels inside the body, which the layer
//!   does not parse: put tonic-web's layer *before* this one, so it sees plain gRPC. Otherwise
//!   a named gRPC-Web method finds no `grpc-status` and is never stored (always released).
//!
//! ## Example without a network
//!
//! ```
//! use bytes::Bytes;
//! use http::{HeaderMap, Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//! use tower_layer::Layer;
//! use tower_service::Service;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! // A stand-in for a generated tonic server: one framed message, then `grpc-status: 0`.
//! let handler = tower::service_fn(|_request: Request<tonic::body::Body>| async {
//!     let mut trailers = HeaderMap::new();
//!     trailers.insert("grpc-status", "0".parse().unwrap());
//!     let body = Full::new(Bytes::from_static(b"\0\0\0\0\x02\x08\x01"))
//!         .with_trailers(async move { Some(Ok(trailers)) });
//!     let mut response = Response::new(tonic::body::Body::new(body));
//!     response.headers_mut().insert("content-type", "application/grpc".parse().unwrap());
//!     Ok::<_, std::convert::Infallible>(response)
//! });
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .shared_scope("example") // single-tenant example only: use your authentication's Scope
//!     .grpc_methods(["/orders.v1.Orders/CreateOrder"]);
//! let mut service = layer.into_tonic().layer(handler);
//!
//! let call = || {
//!     Request::post("/orders.v1.Orders/CreateOrder")
//!         .header("content-type", "application/grpc")
//!         .header("idempotency-key", "8e0c3c3a-4b7f-4a53-9d0e-1f6c2b8a7d11")
//!         .body(tonic::body::Body::new(Full::new(Bytes::from_static(b"\0\0\0\0\x02\x08\x2a"))))
//!         .unwrap()
//! };
//! let first = service.call(call()).await.unwrap();
//! assert!(first.headers().get("idempotent-replayed").is_none());
//! let retry = service.call(call()).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let retry = retry.into_body().collect().await.unwrap();
//! assert_eq!(retry.trailers().unwrap()["grpc-status"], "0");
//! assert_eq!(retry.to_bytes(), Bytes::from_static(b"\0\0\0\0\x02\x08\x01"));
//! # });
//! ```

use std::fmt;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_layer::Layer;
use tower_service::Service;

use crate::BoxError;
use crate::body::IdempotencyBody;
use crate::future::ResponseFuture;
use crate::layer::IdempotencyLayer;
use crate::protocol::UnnamedGrpc;
pub use crate::protocol::grpc::{
    GRPC_STATUS, GrpcClassifier, grpc_status, is_grpc, is_outcome_unknown, is_rejection, outcome_unknown, reject,
};
use crate::service::IdempotencyService;
use crate::store::Store;

impl<St: Store> IdempotencyLayer<St> {
    /// This layer for a tonic server: `Server::builder().layer(layer.into_tonic())`. Feature
    /// `tonic`.
    ///
    /// tonic hands its layers requests with its own body type, which the plain
    /// [`IdempotencyService`] cannot rebuild after buffering it; [`TonicLayer`] does.
    /// Everything else is this layer.
    pub fn into_tonic(self) -> TonicLayer<St> {
        TonicLayer::new(self)
    }
}

/// [`IdempotencyLayer`] for a tonic server, made by
/// [`IdempotencyLayer::into_tonic`]: `Server::builder().layer(layer.into_tonic())`.
#[derive(Clone)]
pub struct TonicLayer<St> {
    layer: IdempotencyLayer<St>,
}

impl<St> TonicLayer<St> {
    /// Serves `layer` on tonic's request body type.
    pub fn new(layer: IdempotencyLayer<St>) -> Self {
        Self { layer }
    }
}

impl<S, St: Store> Layer<S> for TonicLayer<St> {
    type Service = TonicService<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        TonicService { service: self.layer.layer(inner) }
    }
}

impl<St> fmt::Debug for TonicLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TonicLayer").field("layer", &self.layer).finish()
    }
}

/// [`IdempotencyService`] on tonic's request body type ([`tonic::body::Body`]), which it
/// rebuilds from the buffered bytes for the handler. Made by [`TonicLayer`].
pub struct TonicService<S, St> {
    service: IdempotencyService<S, St>,
}

impl<S: Clone, St: Clone> Clone for TonicService<S, St> {
    fn clone(&self) -> Self {
        Self { service: self.service.clone() }
    }
}

impl<S, St> fmt::Debug for TonicService<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TonicService").finish_non_exhaustive()
    }
}

impl<S, St> TonicService<S, St> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        self.service.get_ref()
    }
}

impl<S, St, ResBody> Service<Request<tonic::body::Body>> for TonicService<S, St>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.service.poll_inner_ready(cx)
    }

    fn call(&mut self, request: Request<tonic::body::Body>) -> Self::Future {
        self.service.call_with(
            request,
            |bytes| tonic::body::Body::new(http_body_util::Full::new(bytes)),
            UnnamedGrpc::PassThrough,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Problem, ProblemCode};
    use http::HeaderMap;
    use http::header::CONTENT_TYPE;
    use tonic::{Code, Status};

    /// The plain layer (bodies that are `From<Bytes>`) recognises gRPC too: a named method is
    /// guarded whatever the HTTP method rule says; an unnamed one is judged by the HTTP method
    /// rule (here PATCH only, so a POST passes through).
    #[tokio::test]
    async fn plain_layer_guards_named_grpc_methods_only_whatever_the_http_method_rule() {
        use http_body_util::{BodyExt, Full};
        use tower::ServiceExt;

        let handler = tower::service_fn(|_request: Request<Full<Bytes>>| async {
            let mut trailers = HeaderMap::new();
            trailers.insert(GRPC_STATUS, http::HeaderValue::from_static("0"));
            let body = Full::new(Bytes::from_static(b"\0\0\0\0\0")).with_trailers(async move { Some(Ok(trailers)) });
            Ok::<_, std::convert::Infallible>(Response::new(body))
        });
        let layer = IdempotencyLayer::new(crate::MemoryStore::new())
            .shared_scope("test")
            .methods([http::Method::PATCH])
            .grpc_methods(["pkg.Svc/Create"]);
        let service = layer.layer(handler);
        let call = |path: &str, key: Option<&str>| {
            let mut request = Request::post(path).header(CONTENT_TYPE, "application/grpc");
            if let Some(key) = key {
                request = request.header("idempotency-key", key);
            }
            request.body(Full::new(Bytes::from_static(b"\0\0\0\0\0"))).unwrap()
        };

        let first = service.clone().oneshot(call("/pkg.Svc/Create", Some("k"))).await.unwrap();
        assert!(first.headers().get("idempotent-replayed").is_none());
        first.into_body().collect().await.unwrap();
        let retry = service.clone().oneshot(call("/pkg.Svc/Create", Some("k"))).await.unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        let missing = service.clone().oneshot(call("/pkg.Svc/Create", None)).await.unwrap();
        assert_eq!(missing.headers()["grpc-status"], "3", "a named method requires the key");

        let other = service.clone().oneshot(call("/pkg.Svc/Other", None)).await.unwrap();
        assert!(other.headers().get("grpc-status").is_none(), "an unnamed method passes through");
        let other = other.into_body().collect().await.unwrap();
        assert_eq!(other.trailers().unwrap()[GRPC_STATUS], "0");
    }

    #[test]
    fn refusals_decode_as_the_same_status_in_tonic() {
        let detail = "clé 100% \"reused\" <with> `odd` {chars}?\n";
        let response = Problem::new(ProblemCode::KeyReused, detail).to_grpc();
        let status = Status::from_header_map(response.headers()).expect("a gRPC status in the headers");
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(status.message(), detail);
        assert_eq!(response.headers()["idempotency-code"], "idempotency_key_reused");

        let in_flight = Problem::new(ProblemCode::RequestInFlight, "later")
            .retry_after(std::time::Duration::from_millis(1500))
            .to_grpc();
        assert_eq!(Status::from_header_map(in_flight.headers()).map(|s| s.code()), Some(Code::Aborted));
        assert_eq!(in_flight.headers()["retry-after"], "2");
    }
}
