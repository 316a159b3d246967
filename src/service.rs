//! [`IdempotencyService`]: the whole path of a guarded request, top to bottom: its mode is
//! decided in `call_with` (no waiting needed), then the enforced path runs in [`enforce`] (the
//! shadow and old paths in their own modules). Each step is a call into the module that owns
//! it; everything that depends on whether the request is HTTP or gRPC is a question to its
//! [`Protocol`].

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::BoxError;
use crate::body::IdempotencyBody;
use crate::buffer::{self, ReadError};
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::fingerprint;
use crate::future::ResponseFuture;
use crate::guarded::Guarded;
use crate::heartbeat;
use crate::key::{IdempotencyKey, RecordId, Scope};
use crate::outcome::OutcomeClass;
use crate::problem::{Problem, ProblemCode};
use crate::protocol::{Classified, Protocol, Protocols, UnnamedGrpc};
use crate::record::{Record, StoredResponse};
use crate::request_body::buffer_request_body;
use crate::rollout::RolloutMode;
use crate::store::{Begin, BeginRequest, Claim, FinishError, Outcome, Store, StoreError};
use crate::telemetry::{self, OperationMetrics, RequestResult, StoreStep, Timer};
use crate::verdict::{Verdict, same_request};
use crate::{old_path, shadow};

/// The header that marks a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The idempotency middleware around an inner service. Built by
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<S, St> {
    inner: S,
    store: St,
    /// Where shadow mode records its requests, when not in `store`
    /// ([`IdempotencyLayer::shadow_store`](crate::IdempotencyLayer::shadow_store)).
    shadow_store: Option<St>,
    config: Arc<Config>,
    protocols: Protocols,
}

impl<S, St> IdempotencyService<S, St> {
    pub(crate) fn new(
        inner: S,
        store: St,
        shadow_store: Option<St>,
        config: Arc<Config>,
        protocols: Protocols,
    ) -> Self {
        Self { inner, store, shadow_store, config, protocols }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, St: Clone> Clone for IdempotencyService<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.clone(),
            shadow_store: self.shadow_store.clone(),
            config: self.config.clone(),
            protocols: self.protocols.clone(),
        }
    }
}

impl<S, St> std::fmt::Debug for IdempotencyService<S, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService").finish_non_exhaustive()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        self.call_with(request, ReqBody::from, UnnamedGrpc::HttpRules)
    }
}

impl<S, St> IdempotencyService<S, St> {
    /// The wrapped service's readiness (for the tonic adapter's service).
    #[cfg(feature = "tonic")]
    pub(crate) fn poll_inner_ready<R>(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>>
    where
        S: Service<R>,
    {
        self.inner.poll_ready(cx)
    }

    /// The service's `call`, for any request body that `rebuild` can make again from the
    /// buffered bytes (`From<Bytes>` for the plain service; tonic's body for the tonic
    /// adapter's service).
    pub(crate) fn call_with<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
        rebuild: fn(Bytes) -> ReqBody,
        unnamed_grpc: UnnamedGrpc,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        St: Store,
        ReqBody: Body + Send + 'static,
        ReqBody::Data: Send,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let Some(protocol) = self.protocols.guard(&request, unnamed_grpc) else {
            return ResponseFuture::passthrough(self.inner.call(request));
        };
        let timer = Timer::start();
        // The service that was made ready goes into the future; a fresh clone stays behind.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = telemetry::request_span();
        // What decides the request's path needs no waiting: it is done here, so that only the
        // path taken becomes a future (each path's future is allocated once per request, and
        // its size is copied: none carries the others' states).
        let (parts, body) = request.into_parts();
        let operation = protocol.operation(&parts);
        span.record("operation", &*operation);
        let key = protocol.read_key(&parts.headers);
        let scope = self.config.scope.scope(&parts);
        let mode = self.config.rollout.mode_for(scope.as_ref());
        span.record("mode", mode.as_str());
        let metrics = self.config.telemetry.operation(&operation);
        let (store, config) = (self.store.clone(), self.config.clone());
        let guarded = Guarded { inner, store, config, protocol, operation, metrics, span: span.clone() };
        ResponseFuture::guarded(match mode {
            RolloutMode::Enforce => {
                Box::pin(enforced(guarded, timer, parts, body, key, scope, rebuild).instrument(span))
            }
            RolloutMode::Shadow => {
                let records = self.shadow_store.clone().unwrap_or_else(|| guarded.store.clone());
                let log = (self.config.shadow_log.clone(), records);
                Box::pin(shadow::shadow(guarded, log, parts, body, key, scope, rebuild).instrument(span))
            }
            _ => Box::pin(old(guarded, parts, body, key, scope).instrument(span)),
        })
    }
}

/// The enforced path of one request, and what it counts and records of it.
///
/// A plain function around an `async move` block, not an `async fn`: the block keeps what it
/// captures in one place, where an `async fn` would keep a second copy of each argument it
/// binds `mut` (the request head among them) for the whole of the request.
#[allow(clippy::manual_async_fn, reason = "an async fn would double the future's request head")]
fn enforced<S, St, ReqBody, ResBody>(
    mut guarded: Guarded<S, St>,
    mut timer: Timer,
    mut parts: http::request::Parts,
    body: ReqBody,
    key: Result<Option<IdempotencyKey>, Problem>,
    scope: Option<Scope>,
    rebuild: fn(Bytes) -> ReqBody,
) -> impl Future<Output = Result<Response<IdempotencyBody<ResBody>>, S::Error>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    async move {
        let (answer, result) = enforce(&mut guarded, &mut timer, &mut parts, body, key, scope, rebuild).await;
        if let Some(result) = result {
            guarded.metrics.request(result);
            guarded.metrics.overhead(timer.overhead());
            guarded.span.record("result", result.as_str());
            guarded.span.record("replayed", result == RequestResult::Replayed);
        }
        answer
    }
}

/// The old path of one request (rollout `off`, or outside the enforced cohort), with the
/// context a handler reads when the request has a key and a scope.
async fn old<S, St, ReqBody, ResBody>(
    mut guarded: Guarded<S, St>,
    parts: http::request::Parts,
    body: ReqBody,
    key: Result<Option<IdempotencyKey>, Problem>,
    scope: Option<Scope>,
) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let context = match (key, scope) {
        (Ok(Some(key)), Some(scope)) => {
            let id = RecordId::new(&scope, &guarded.operation, &key);
            Some(IdempotencyContext::new(id, guarded.operation.clone(), None))
        }
        _ => None,
    };
    old_path::old_path(&mut guarded, Request::from_parts(parts, body), context).await.map(|(answer, ..)| answer)
}

/// Takes the request head out of `parts` (which keeps an empty one): the handler's request is
/// built from it, while the path's future keeps one place for the head, not two.
fn take_parts(parts: &mut http::request::Parts) -> http::request::Parts {
    let (mut taken, ()) = Request::new(()).into_parts();
    std::mem::swap(&mut taken, parts);
    taken
}

/// The answer of the enforced path, and what became of the request (`None`: it passed through
/// unguarded).
type Enforced<B, E> = (Result<Response<IdempotencyBody<B>>, E>, Option<RequestResult>);

/// The enforced path of one request: the contract.
async fn enforce<S, St, ReqBody, ResBody>(
    guarded: &mut Guarded<S, St>,
    timer: &mut Timer,
    parts: &mut http::request::Parts,
    body: ReqBody,
    key: Result<Option<IdempotencyKey>, Problem>,
    scope: Option<Scope>,
    rebuild: fn(Bytes) -> ReqBody,
) -> Enforced<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let Guarded { inner, store, config, protocol, operation, metrics, span } = guarded;
    let refuse = |problem: Problem| {
        let result = RequestResult::of_problem(problem.code());
        (Ok(protocol.refuse(problem)), Some(result))
    };

    // 1. Key, scope and operation.
    let key = match key {
        Ok(Some(key)) => key,
        Ok(None) if !config.key_required => {
            let response = inner.call(Request::from_parts(take_parts(parts), body)).await;
            return (response.map(|response| response.map(IdempotencyBody::inner)), None);
        }
        Ok(None) => return refuse(protocol.key_missing()),
        Err(problem) => return refuse(problem),
    };
    let Some(scope) = scope else {
        return refuse(Problem::new(ProblemCode::ScopeMissing, "the request has no authenticated scope"));
    };
    let id = RecordId::new(&scope, operation, &key);
    span.record("record", tracing::field::display(&id));

    // 2. Buffer the body within the limit, the budget and the deadline, and fingerprint the
    //    request. The reservation is held until the handler has answered.
    let (body, reservation) = match buffer_request_body(&parts.headers, body, config).await {
        Ok(buffered) => buffered,
        Err(problem) => return refuse(problem),
    };
    let fingerprint = fingerprint::fingerprint(&parts.method, &parts.uri, &parts.headers, &body, &config.fingerprint);

    // 3. Claim the identity, or answer from what is already there.
    let begin = BeginRequest::new(&id, &fingerprint)
        .labels(&scope, operation)
        .wait(config.in_flight_wait)
        .lease(config.lease)
        .stale_lease(config.stale_lease)
        .retention(config.retention);
    let began = timer.now();
    // In a block of its own, so that what the claim leaves of `begun` is dropped here and takes
    // no room in the future while the handler runs.
    let claim = {
        let begun = store.begin(begin).await;
        metrics.store(StoreStep::Begin, Timer::since(began));
        match begun {
            Ok(Begin::Claimed(claim)) => claim,
            Ok(Begin::Existing(record)) => {
                let same = same_request(&record.fingerprint, &fingerprint, |version| {
                    fingerprint::fingerprint_with_version(
                        version,
                        &parts.method,
                        &parts.uri,
                        &parts.headers,
                        &body,
                        &config.fingerprint,
                    )
                });
                let (response, result) = answer_existing(config, protocol, &id, same, record);
                return (Ok(response), Some(result));
            }
            Ok(Begin::InFlight { retry_after }) => {
                tracing::debug!(record = %id, "idempotency: duplicate still in flight after the bounded wait");
                return refuse(
                    Problem::new(
                        ProblemCode::RequestInFlight,
                        "a request with this key is still being processed; retry later",
                    )
                    .retry_after(retry_after.max(config.retry_after)),
                );
            }
            Err(error) => return refuse(store_unavailable(config, &id, &error)),
        }
    };

    // 4. Run the handler with the context and the claim's handle, renewing a leased claim's
    //    lease beside it.
    let fencing_token = claim.fencing_token();
    if let Some(token) = fencing_token {
        span.record("fencing_token", token);
    }
    let beats = heartbeat::beats(&claim, config.heartbeat);
    let context = IdempotencyContext::with_lease_signal(id, operation.clone(), fencing_token, beats);
    // The heartbeat raises the handler's lease-lost signal through the context they share.
    let lease_lost = beats.then(|| context.clone());
    parts.extensions.insert(context);
    if let Some(handle) = claim.handle() {
        parts.extensions.insert(handle);
    }
    let called = timer.now();
    // Pinned here and lent to the heartbeat: the handler's future has one place in this one.
    let handler = std::pin::pin!(inner.call(Request::from_parts(take_parts(parts), rebuild(body))));
    let (claim, response) = heartbeat::beside(claim, config.lease, lease_lost, handler).await;
    timer.inner_took(Timer::since(called));
    drop(reservation);
    let (response_parts, response_body) = match response {
        Ok(response) => response.into_parts(),
        // The claim is dropped unfinished: rolled back, or left to the stale-lease policy.
        Err(error) => return (Err(error), Some(RequestResult::Released)),
    };

    // 5. Classify the response (from its head, or else from its trailers once it is read),
    //    store it with the claim, and answer only once it is settled.
    let classified = protocol.classify(&response_parts);
    if let Classified::Ready(OutcomeClass::Release) = classified {
        release(claim, &id, metrics, timer).await;
        let response = Response::from_parts(response_parts, IdempotencyBody::inner(response_body));
        return (Ok(response), Some(RequestResult::Released));
    }
    let (body, trailers) = match buffer::read_to_end(response_body, config.max_response_body).await {
        Ok(read) => read,
        Err(error) => {
            release(claim, &id, metrics, timer).await;
            return refuse(if error == ReadError::TooLarge {
                Problem::new(
                    ProblemCode::ResponseTooLarge,
                    "the response was too large to store; nothing was committed",
                )
            } else {
                Problem::new(ProblemCode::HandlerFailed, "the response failed while it was read; nothing was committed")
            });
        }
    };
    let class = classified.with_trailers(trailers.as_ref());
    if class == OutcomeClass::Release {
        release(claim, &id, metrics, timer).await;
        let response = Response::from_parts(response_parts, IdempotencyBody::buffered(body, trailers));
        return (Ok(response), Some(RequestResult::Released));
    }
    let stored = protocol.stored_response(&response_parts, body.clone(), trailers.as_ref());
    let stored_bytes = stored.body.len();
    let outcome = match class {
        OutcomeClass::Reject => Outcome::Reject(stored),
        OutcomeClass::Unknown => Outcome::Unknown(stored),
        _ => Outcome::Complete(stored),
    };
    let finishing = timer.now();
    let finished = claim.finish(outcome).await;
    metrics.store(StoreStep::Finish, Timer::since(finishing));
    match finished {
        Ok(()) => {
            metrics.stored_bytes(stored_bytes);
            let response = Response::from_parts(response_parts, IdempotencyBody::buffered(body, trailers));
            (Ok(response), Some(RequestResult::Executed))
        }
        Err(error) => refuse(finish_problem(config, &id, &error)),
    }
}

/// Gives the claim up: nothing is stored, and the next attempt executes afresh.
async fn release<C: Claim>(claim: C, id: &RecordId, metrics: &OperationMetrics, timer: &Timer) {
    let releasing = timer.now();
    let released = claim.finish(Outcome::Release).await;
    metrics.store(StoreStep::Finish, Timer::since(releasing));
    if let Err(error) = released {
        tracing::warn!(record = %id, %error, "idempotency: releasing the claim failed");
    }
}

/// Replays or refuses, given the record that is already there and whether it is this
/// request's ([`same_request`]).
fn answer_existing<B>(
    config: &Config,
    protocol: &Protocol,
    id: &RecordId,
    same_request: bool,
    record: Record,
) -> (Response<IdempotencyBody<B>>, RequestResult) {
    let verdict = Verdict::of(&record, same_request);
    let response = match (verdict, record.response) {
        (Verdict::Expired, _) => protocol.refuse(Problem::new(
            ProblemCode::KeyExpired,
            "this key is past its retention; use a new key for a new request",
        )),
        (Verdict::Reused, _) => {
            tracing::debug!(record = %id, "idempotency: key reused with a different request");
            protocol.refuse(
                Problem::new(ProblemCode::KeyReused, "this key was used with a different request")
                    .status(config.mismatch_status),
            )
        }
        (Verdict::Replay, Some(stored)) => replay(stored),
        (Verdict::Unknown, _) => protocol.refuse(
            Problem::new(
                ProblemCode::OutcomeUnknown,
                "an earlier attempt with this key died and its outcome is unknown",
            )
            .retry_after(config.retry_after),
        ),
        _ => protocol.refuse(
            Problem::new(ProblemCode::RequestInFlight, "a request with this key is still being processed; retry later")
                .retry_after(config.retry_after),
        ),
    };
    (response, verdict.result())
}

/// The stored answer, with `Idempotent-Replayed: true`.
fn replay<B>(stored: StoredResponse) -> Response<IdempotencyBody<B>> {
    let trailers = stored.trailer_map();
    let mut response = Response::new(IdempotencyBody::buffered(stored.body, trailers));
    *response.status_mut() = stored.status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        headers.append(name, value);
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}

fn store_unavailable(config: &Config, id: &RecordId, error: &StoreError) -> Problem {
    tracing::warn!(record = %id, %error, "idempotency: store unavailable; the handler did not run");
    Problem::new(ProblemCode::StoreUnavailable, "the idempotency store is unavailable; nothing was executed")
        .retry_after(config.retry_after)
}

fn finish_problem(config: &Config, id: &RecordId, error: &FinishError) -> Problem {
    tracing::warn!(record = %id, %error, "idempotency: the outcome could not be stored");
    match error {
        FinishError::HandleStillHeld => Problem::new(
            ProblemCode::HandleStillHeld,
            "the handler kept its transaction handle after answering; nothing was committed",
        ),
        _ => Problem::new(
            ProblemCode::CommitUncertain,
            "the outcome could not be confirmed; retrying with the same key is safe",
        )
        .retry_after(config.retry_after),
    }
}
