//! [`IdempotencyLayer`]: the configuration builder and `tower::Layer`.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};
use tower_layer::Layer;

use crate::budget::BufferBudget;
use crate::config::{Config, ScopeSource};
use crate::fingerprint::FingerprintSpec;
use crate::key::Scope;
use crate::outcome::OutcomeClass;
use crate::rollout::RolloutSwitch;
use crate::service::IdempotencyService;
use crate::store::{Retention, StaleLeasePolicy, Store};

/// The idempotency middleware's layer: a cheap-to-clone configuration builder.
///
/// Apply it to the routes that create things (axum: `post(handler).layer(layer)` or
/// `Router::route_layer`), and leave reads unguarded.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .operation("orders.create")
///     .scope_with(|parts| {
///         parts.headers.get("x-account").and_then(|v| v.to_str().ok()).map(Scope::new)
///     })
///     .in_flight_wait(Duration::from_millis(500))
///     .mismatch_status(http::StatusCode::CONFLICT);
/// # drop(layer);
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer<St> {
    store: St,
    /// Where shadow mode records its requests, when not in `store` (see [`Self::shadow_store`]).
    shadow_store: Option<St>,
    config: Config,
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer over `store` with the defaults: key required in `Idempotency-Key` on POST and
    /// PATCH; scope from a [`Scope`] request extension; operation from the explicit name, else
    /// axum's `MatchedPath`, else method and path; 1 MiB body limits; 2 s in-flight wait;
    /// 24 h retention, 7 day tombstones; 422 on mismatch.
    pub fn new(store: St) -> Self {
        Self { store, shadow_store: None, config: Config::default() }
    }

    /// The store behind this layer.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// The header that carries the key (default `Idempotency-Key`).
    pub fn header(mut self, name: HeaderName) -> Self {
        self.config.header = name;
        self
    }

    /// Whether a guarded request must carry a key (default true). When false, a request with
    /// no key passes through unguarded.
    pub fn key_required(mut self, required: bool) -> Self {
        self.config.key_required = required;
        self
    }

    /// The methods guarded (default POST and PATCH); others pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Takes the scope from the application's function (from its authentication's request
    /// extension, typically). A request for which it returns `None` is refused with 401.
    pub fn scope_with<F>(mut self, scope: F) -> Self
    where
        F: Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    {
        self.config.scope = ScopeSource::With(Arc::new(scope));
        self
    }

    /// Uses one scope for every caller. Only for single-tenant services: with it, any caller
    /// who knows another's key gets that caller's answer.
    pub fn shared_scope(mut self, scope: impl Into<String>) -> Self {
        let scope = Scope::new(scope.into());
        // Hashed here, once: every request's clone of it carries the digest.
        scope.digest();
        self.config.scope = ScopeSource::Shared(scope);
        self
    }

    /// Names the operation explicitly (the route's stable identity across refactors). HTTP
    /// only: a gRPC method's operation is always its method path.
    pub fn operation(mut self, name: impl Into<Arc<str>>) -> Self {
        self.config.operation = Some(name.into());
        self
    }

    /// What goes into the request fingerprint beyond method, path, query, content type and
    /// body (declared headers, ignored JSON members).
    pub fn fingerprint(mut self, spec: FingerprintSpec) -> Self {
        self.config.fingerprint = spec;
        self
    }

    /// The largest request body buffered, in bytes (default 1 MiB); larger answers 413.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// The deadline for reading a guarded request's whole body, from the moment the layer starts
    /// reading it (default 30 s). A body still incomplete then is answered with 408
    /// `idempotency_body_timeout` (gRPC `DEADLINE_EXCEEDED`), and nothing is claimed.
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.config.body_timeout = timeout;
        self
    }

    /// The budget of request-body bytes this layer may buffer at once, shared with every layer
    /// given the same budget (default: [`BufferBudget::process`], 64 MiB, shared by every layer
    /// of the process). A request whose body does not fit is refused before it is read, with
    /// 503 `idempotency_buffer_budget_exhausted` and `Retry-After`; see [`BufferBudget`] for
    /// what a request is charged.
    pub fn buffer_budget(mut self, budget: BufferBudget) -> Self {
        self.config.buffer_budget = budget;
        self
    }

    /// The largest response stored, in bytes (default 1 MiB); a larger one is rolled back and
    /// answered with 500 `idempotency_response_too_large`.
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config.max_response_body = bytes;
        self
    }

    /// How long a duplicate waits for the original's outcome before 409 (default 2 s).
    pub fn in_flight_wait(mut self, wait: Duration) -> Self {
        self.config.in_flight_wait = wait;
        self
    }

    /// The `Retry-After` given with 503 answers (default 1 s).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.config.retry_after = after;
        self
    }

    /// The lease of a leased claim (default 30 s). While the handler runs, the heartbeat
    /// renews it every third of the lease (see [`heartbeat`](Self::heartbeat)), so the lease
    /// bounds how long a dead process keeps its key, not how long a handler may take.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// Whether a leased claim's lease is renewed, fenced by its token, every third of the lease
    /// while the handler runs (default on). Off, a handler that outlives its lease loses its
    /// claim: its duplicates apply the stale-lease policy and its outcome is refused.
    pub fn heartbeat(mut self, enabled: bool) -> Self {
        self.config.heartbeat = enabled;
        self
    }

    /// What a retry does when it finds an expired lease (default: mark `unknown`).
    pub fn stale_lease(mut self, policy: StaleLeasePolicy) -> Self {
        self.config.stale_lease = policy;
        self
    }

    /// How long answers, unsettled records and tombstones are kept (default 24 h, 30 days and
    /// 7 days).
    pub fn retention(mut self, retention: Retention) -> Self {
        self.config.retention = retention;
        self
    }

    /// The status for a key reused with a different request: 422 (default) or 409. HTTP only:
    /// gRPC answers `FAILED_PRECONDITION`.
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.config.mismatch_status = status;
        self
    }

    /// The route's own rule for classifying HTTP responses (a handler's marker still wins).
    /// gRPC answers are judged by their `grpc-status`, never by this rule: see
    /// `classify_grpc_with` (feature `tonic`).
    pub fn classify_with<F>(mut self, rule: F) -> Self
    where
        F: Fn(&http::response::Parts) -> OutcomeClass + Send + Sync + 'static,
    {
        self.config.classifier = Some(Arc::new(rule));
        self
    }

    /// Adds a response header to the stored allow-list. Credentials, cookies, proxy and
    /// hop-by-hop headers are never stored, whatever is added.
    pub fn store_header(mut self, name: HeaderName) -> Self {
        self.config.stored_headers.push(name);
        self
    }

    /// The prefix of problem `type` URIs (default `urn:tower-idempotency:problem:`); the code
    /// is appended.
    pub fn problem_type_base(mut self, base: impl Into<Arc<str>>) -> Self {
        self.config.problem_type_base = base.into();
        self
    }

    /// Shares a run-time [`RolloutSwitch`] (enforce, or off as a kill switch).
    pub fn rollout(mut self, switch: RolloutSwitch) -> Self {
        self.config.rollout = switch;
        self
    }

    /// How shadow mode records its requests (see [`rollout`](crate::rollout)): once their
    /// answers have been produced, they wait in a queue of at most `capacity` (default 65,536)
    /// while a writer task gathers them for `interval` (default 1 s), then records them all
    /// with one call of the store (up to 1,024 a call). A request that finds the queue full is
    /// not recorded (it counts as `store_unavailable` in `idempotency_shadow_total`); a longer
    /// interval makes fewer, larger writes, and counts later what enforce mode would have done.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, RolloutMode, RolloutSwitch};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .rollout(RolloutSwitch::new(RolloutMode::Shadow))
    ///     .shadow_log(Duration::from_millis(250), 16_384);
    /// ```
    pub fn shadow_log(mut self, interval: Duration, capacity: usize) -> Self {
        self.config.shadow_log = crate::shadow_log::ShadowLog::new(interval, capacity);
        self
    }

    /// Where shadow mode records its requests (see [`rollout`](crate::rollout)): `store`, a
    /// store of the same kind over another database, instead of the layer's own. The old path
    /// (the handler's plain transaction, in `Off` and `Shadow`) and enforce mode stay on the
    /// layer's store.
    ///
    /// It matters where the database has one writer. On SQLite, shadow mode's batches take the
    /// database's write lock, which every business write of the old path also needs, so a
    /// request that arrives while a batch is written waits for it; with shadow records in a
    /// database file of their own, the two never wait for each other. Elsewhere it keeps the
    /// validation's writes off the business database altogether.
    ///
    /// The shadow store is the caller's to migrate, and to purge (a
    /// [`RecoveryWorker`](crate::recovery::RecoveryWorker) over it, or
    /// [`Store::purge`](crate::store::Store::purge)), as the layer's own store is. Turning
    /// enforcement on later never replays what shadow mode saw, wherever its records are: they
    /// are kept under shadow identities ([`RecordId::shadow`](crate::RecordId::shadow)).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{IdempotencyLayer, RolloutMode, RolloutSwitch, SqliteStore};
    ///
    /// let business = SqliteStore::new(sqlx::SqlitePool::connect("sqlite:app.db?mode=rwc").await?);
    /// let shadow = SqliteStore::new(sqlx::SqlitePool::connect("sqlite:app-shadow.db?mode=rwc").await?);
    /// business.migrate().await?;
    /// shadow.migrate().await?;
    /// let layer = IdempotencyLayer::new(business)
    ///     .rollout(RolloutSwitch::new(RolloutMode::Shadow))
    ///     .shadow_store(shadow);
    /// # drop(layer); Ok(()) }
    /// ```
    pub fn shadow_store(mut self, store: St) -> Self {
        self.shadow_store = Some(store);
        // A log's writer records on one store: the clones this layer was made from keep theirs.
        self.config.shadow_log = self.config.shadow_log.fresh();
        self
    }

    /// The gRPC methods this layer guards, by path: `/package.Service/Method` (a missing
    /// leading `/` is added). Feature `tonic`.
    ///
    /// A request to a path named here is guarded as a gRPC call, whatever its content type
    /// and whatever [`methods`](Self::methods) says. A gRPC call (content type
    /// `application/grpc`, `application/grpc+…`, `application/grpc-…`) to another method
    /// passes through the tonic adapter ([`into_tonic`](Self::into_tonic)) untouched; the plain
    /// layer judges it by [`methods`](Self::methods) like any request, so a content type is
    /// never a way around a guarded route. Name unary
    /// (or client-streaming) methods only: the layer buffers the whole request and the whole
    /// answer, which a bidirectional stream cannot wait for. See [`grpc`](crate::grpc).
    #[cfg(feature = "tonic")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
    pub fn grpc_methods<I>(mut self, methods: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        for method in methods {
            let method = method.as_ref();
            let path = if method.starts_with('/') { Arc::from(method) } else { Arc::from(format!("/{method}")) };
            self.config.grpc_methods.push(path);
        }
        self
    }

    /// The route's own rule for gRPC answers, keyed on the answer's `grpc-status` (a handler's
    /// marker still wins). Feature `tonic`.
    ///
    /// The default completes `OK` and releases everything else. This rule, for example, stores
    /// `FAILED_PRECONDITION` (a business rejection that a retry must get again):
    ///
    /// ```
    /// use tonic::Code;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, OutcomeClass};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .grpc_methods(["/payments.v1.Payments/Charge"])
    ///     .classify_grpc_with(|code| match code {
    ///         Code::Ok => OutcomeClass::Complete,
    ///         Code::FailedPrecondition => OutcomeClass::Reject,
    ///         _ => OutcomeClass::Release,
    ///     });
    /// # drop(layer);
    /// ```
    #[cfg(feature = "tonic")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
    pub fn classify_grpc_with<F>(mut self, rule: F) -> Self
    where
        F: Fn(tonic::Code) -> OutcomeClass + Send + Sync + 'static,
    {
        self.config.grpc_classifier = Some(Arc::new(rule));
        self
    }
}

impl<S, St: Store> Layer<S> for IdempotencyLayer<St> {
    type Service = IdempotencyService<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        let (store, shadow_store, config) =
            (self.store.clone(), self.shadow_store.clone(), Arc::new(self.config.clone()));
        IdempotencyService::new(inner, store, shadow_store, config, self.config.protocols())
    }
}

impl<St> std::fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer").field("operation", &self.config.operation).finish_non_exhaustive()
    }
}
