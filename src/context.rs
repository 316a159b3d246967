//! What the handler learns about its idempotent execution: the scoped identity, a stable
//! operation id and derived downstream keys ([contract §6](crate::contract#6-coupling-to-the-business-write)).
//!
//! The layer inserts an [`IdempotencyContext`] into the request's extensions before it calls
//! the inner service. Tower users read it from there; axum handlers take it as an extractor
//! (feature `axum`), or as `Option<IdempotencyContext>` on routes where the key is optional.
//!
//! ```
//! use tower_idempotency::IdempotencyContext;
//!
//! fn charge(request: &http::Request<()>) -> Option<String> {
//!     let context = request.extensions().get::<IdempotencyContext>()?;
//!     // The payment provider sees the same key on every retry of this request.
//!     Some(context.downstream_key("payment-provider/charge"))
//! }
//! # assert_eq!(charge(&http::Request::new(())), None);
//! ```

use std::sync::{Arc, OnceLock};

use crate::key::RecordId;
use crate::lease_lost::LeaseLost;

/// The handler's view of its idempotent execution.
#[derive(Clone)]
pub struct IdempotencyContext {
    inner: Arc<Inner>,
}

struct Inner {
    id: RecordId,
    operation: Arc<str>,
    operation_id: OnceLock<String>,
    fencing_token: Option<u64>,
    /// Turns `true` when the layer's heartbeat finds the lease lost; `None`: never.
    lease_lost: Option<LeaseLost>,
}

impl IdempotencyContext {
    /// A context for `id`, as the layer builds it (public so handlers can be unit-tested).
    pub fn new(id: RecordId, operation: impl Into<Arc<str>>, fencing_token: Option<u64>) -> Self {
        Self::with_lease_signal(id, operation, fencing_token, false)
    }

    /// A context with a lease-lost signal when `leased` (an execution whose lease a heartbeat
    /// renews), which [`raise_lease_lost`](Self::raise_lease_lost) raises.
    pub(crate) fn with_lease_signal(
        id: RecordId,
        operation: impl Into<Arc<str>>,
        fencing_token: Option<u64>,
        leased: bool,
    ) -> Self {
        let lease_lost = leased.then(LeaseLost::default);
        let inner = Inner { id, operation: operation.into(), operation_id: OnceLock::new(), fencing_token, lease_lost };
        Self { inner: Arc::new(inner) }
    }

    /// Raises the lease-lost signal (the heartbeat's side), if this context has one.
    pub(crate) fn raise_lease_lost(&self) {
        if let Some(signal) = &self.inner.lease_lost {
            signal.raise();
        }
    }

    /// Whether the layer's heartbeat found this execution's lease lost (taken over, or not
    /// renewable before it ran out): its outcome will not be stored, and the client gets 503
    /// `idempotency_commit_uncertain`. A handler that checks it before its side effect can stop
    /// there. Always `false` in atomic mode, where the transaction fences the handler.
    pub fn lease_lost(&self) -> bool {
        self.inner.lease_lost.as_ref().is_some_and(LeaseLost::is_raised)
    }

    /// Resolves when the lease is found lost ([`lease_lost`](Self::lease_lost)); never, if it
    /// is not (race it against the handler's work with `tokio::select!`).
    pub async fn lease_lost_signal(&self) {
        match &self.inner.lease_lost {
            Some(signal) => signal.raised().await,
            None => std::future::pending().await,
        }
    }

    /// The scoped identity (a digest: safe to log).
    pub fn record_id(&self) -> &RecordId {
        &self.inner.id
    }

    /// The operation (route identity) this execution belongs to.
    pub fn operation(&self) -> &str {
        &self.inner.operation
    }

    /// A stable, UUID-shaped id for this (scope, operation, key): the same on every retry.
    /// Store it with the business write to link the two.
    pub fn operation_id(&self) -> &str {
        self.inner.operation_id.get_or_init(|| self.inner.id.operation_id())
    }

    /// A key for a downstream call, stable for this identity and `purpose`.
    pub fn downstream_key(&self, purpose: &str) -> String {
        self.inner.id.downstream_key(purpose)
    }

    /// A leased claim's fencing token: strictly greater than any earlier claim's on this
    /// identity. Pass it to downstream writes that can check it, so a late, superseded attempt
    /// is refused. `None` in atomic mode, where the database transaction fences the handler.
    pub fn fencing_token(&self) -> Option<u64> {
        self.inner.fencing_token
    }
}

impl std::fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyContext")
            .field("record_id", &self.inner.id)
            .field("operation", &self.inner.operation)
            .field("operation_id", &self.operation_id())
            .field("fencing_token", &self.inner.fencing_token)
            .field("lease_lost", &self.lease_lost())
            .finish()
    }
}

#[cfg(feature = "axum")]
mod axum_extract {
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::request::Parts;

    use super::IdempotencyContext;
    use crate::problem::{Problem, ProblemCode};

    /// The rejection when a handler asks for an [`IdempotencyContext`] on a route the
    /// idempotency layer does not guard: 500 problem+json, code `idempotency_context_missing`.
    #[derive(Debug, Clone, Copy)]
    pub struct MissingContext;

    impl IntoResponse for MissingContext {
        fn into_response(self) -> Response {
            Problem::new(
                ProblemCode::ContextMissing,
                "this handler needs IdempotencyContext, but the route is not wrapped by IdempotencyLayer \
                 (or the request carried no key on an optional route); use Option<IdempotencyContext> there",
            )
            .into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
        type Rejection = MissingContext;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
            parts.extensions.get::<IdempotencyContext>().cloned().ok_or(MissingContext)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<IdempotencyContext>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use axum_extract::MissingContext;

#[cfg(all(test, feature = "axum"))]
mod tests {
    use axum::response::IntoResponse;

    use super::MissingContext;

    #[tokio::test]
    async fn a_missing_context_is_refused_with_a_problem_that_has_a_code() {
        let response = MissingContext.into_response();
        assert_eq!(response.status(), 500);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("the body");
        let problem: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(problem["code"], "idempotency_context_missing");
        assert_eq!(problem["type"], "urn:tower-idempotency:problem:idempotency_context_missing");
        assert_eq!(problem["status"], 500);
    }
}
