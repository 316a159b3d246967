//! [`IdempotencyService`]: the whole path of a guarded request, top to bottom, in
//! [`guard`]. Each step is a call into the module that owns it; everything that depends on
//! whether the request is HTTP or gRPC is a question to its [`Protocol`].

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::BoxError;
use crate::body::IdempotencyBody;
use crate::budget::Reservation;
use crate::buffer::{self, ReadError};
use crate::config::{Config, RolloutMode};
use crate::context::IdempotencyContext;
use crate::fingerprint::{self, Fingerprint};
use crate::future::ResponseFuture;
use crate::heartbeat;
use crate::key::RecordId;
use crate::outcome::OutcomeClass;
use crate::problem::{Problem, ProblemCode};
use crate::protocol::{Classified, Protocol, Protocols, UnnamedGrpc};
use crate::record::{Record, RecordState, StoredResponse};
use crate::store::{Begin, BeginRequest, Claim, FinishError, Outcome, Store, StoreError};

/// The header that marks a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The idempotency middleware around an inner service. Built by
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<S, St> {
    inner: S,
    store: St,
    config: Arc<Config>,
    protocols: Protocols,
}

impl<S, St> IdempotencyService<S, St> {
    pub(crate) fn new(inner: S, store: St, config: Arc<Config>, protocols: Protocols) -> Self {
        Self { inner, store, config, protocols }
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
        let protocol = match self.config.rollout.get() {
            RolloutMode::Enforce => self.protocols.guard(&request, unnamed_grpc),
            _ => None,
        };
        let Some(protocol) = protocol else {
            return ResponseFuture::passthrough(self.inner.call(request));
        };
        // The service that was made ready goes into the future; a fresh clone stays behind.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let guarded = guard(inner, self.store.clone(), self.config.clone(), protocol, request, rebuild);
        ResponseFuture::guarded(Box::pin(guarded))
    }
}

/// The guarded path of one request.
async fn guard<S, St, ReqBody, ResBody>(
    mut inner: S,
    store: St,
    config: Arc<Config>,
    protocol: Protocol,
    request: Request<ReqBody>,
    rebuild: fn(Bytes) -> ReqBody,
) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let refuse = |problem: Problem| Ok(protocol.refuse(problem));

    // 1. Key, scope and operation.
    let key = match protocol.read_key(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if !config.key_required => {
            let response = inner.call(request).await?;
            return Ok(response.map(IdempotencyBody::inner));
        }
        Ok(None) => return refuse(protocol.key_missing()),
        Err(problem) => return refuse(problem),
    };
    let (mut parts, body) = request.into_parts();
    let Some(scope) = config.scope.scope(&parts) else {
        return refuse(Problem::new(ProblemCode::ScopeMissing, "the request has no authenticated scope"));
    };
    let operation = protocol.operation(&parts);
    let id = RecordId::new(&scope, &operation, &key);

    // 2. Buffer the body within the limit, the budget and the deadline, and fingerprint the
    //    request. The reservation is held until the handler has answered.
    let (body, reservation) = match buffer_request_body(&parts.headers, body, &config).await {
        Ok(buffered) => buffered,
        Err(problem) => return refuse(problem),
    };
    let fingerprint = fingerprint::fingerprint(&parts.method, &parts.uri, &parts.headers, &body, &config.fingerprint);

    // 3. Claim the identity, or answer from what is already there.
    let begin = BeginRequest::new(&id, &fingerprint)
        .labels(&scope, &operation)
        .wait(config.in_flight_wait)
        .lease(config.lease)
        .stale_lease(config.stale_lease)
        .retention(config.retention);
    let claim = match store.begin(begin).await {
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
            return Ok(answer_existing(&config, &protocol, &id, same, record));
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
        Err(error) => return refuse(store_unavailable(&config, &id, &error)),
    };

    // 4. Run the handler with the context and the claim's handle, renewing a leased claim's
    //    lease beside it.
    let lease_signal = heartbeat::signal(&claim, config.heartbeat);
    let (beat, lease_lost) = lease_signal.map_or((None, None), |(beat, lost)| (Some(beat), Some(lost)));
    parts.extensions.insert(IdempotencyContext::with_lease_signal(id, operation, claim.fencing_token(), lease_lost));
    if let Some(handle) = claim.handle() {
        parts.extensions.insert(handle);
    }
    let handler = inner.call(Request::from_parts(parts, rebuild(body)));
    let (claim, response) = heartbeat::beside(claim, config.lease, beat, handler).await;
    drop(reservation);
    let response = response?;

    // 5. Classify the response (from its head, or else from its trailers once it is read),
    //    store it with the claim, and answer only once it is settled.
    let (response_parts, response_body) = response.into_parts();
    let classified = protocol.classify(&response_parts);
    if let Classified::Ready(OutcomeClass::Release) = classified {
        release(claim, &id).await;
        return Ok(Response::from_parts(response_parts, IdempotencyBody::inner(response_body)));
    }
    let (body, trailers) = match buffer::read_to_end(response_body, config.max_response_body).await {
        Ok(read) => read,
        Err(error) => {
            release(claim, &id).await;
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
        release(claim, &id).await;
        return Ok(Response::from_parts(response_parts, IdempotencyBody::buffered(body, trailers)));
    }
    let stored = protocol.stored_response(&response_parts, body.clone(), trailers.as_ref());
    let outcome = match class {
        OutcomeClass::Reject => Outcome::Reject(stored),
        OutcomeClass::Unknown => Outcome::Unknown(stored),
        _ => Outcome::Complete(stored),
    };
    match claim.finish(outcome).await {
        Ok(()) => Ok(Response::from_parts(response_parts, IdempotencyBody::buffered(body, trailers))),
        Err(error) => refuse(finish_problem(&config, &id, &error)),
    }
}

/// Gives the claim up: nothing is stored, and the next attempt executes afresh.
async fn release<C: Claim>(claim: C, id: &RecordId) {
    if let Err(error) = claim.finish(Outcome::Release).await {
        tracing::warn!(record = %id, %error, "idempotency: releasing the claim failed");
    }
}

/// Buffers the request body: refused before it is read when its `Content-Length` is over the
/// limit or does not fit the buffer budget; without one, charged chunk by chunk and refused
/// when the budget cannot take the next (see [`BufferBudget`](crate::BufferBudget)); never
/// buffered past its declared length; refused when it is not complete within the body
/// deadline. Returns the body and its reservation, cut down to the body's length.
async fn buffer_request_body<B>(
    headers: &http::HeaderMap,
    body: B,
    config: &Config,
) -> Result<(Bytes, Reservation), Problem>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit = config.max_request_body;
    let too_large =
        || Problem::new(ProblemCode::BodyTooLarge, format!("the request body is larger than {limit} bytes"));
    let declared = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (charge, read_limit) = match declared {
        Some(length) if length > limit as u64 => return Err(too_large()),
        // At most `limit`, which is a `usize`.
        Some(length) => (length as usize, length as usize),
        None => (0, limit),
    };
    let budget_spent = || {
        tracing::warn!("idempotency: request refused, the buffer budget is spent");
        Problem::new(ProblemCode::BufferBudgetExhausted, "the server is buffering too many request bodies; retry later")
            .retry_after(config.retry_after)
    };
    let Some(mut reservation) = config.buffer_budget.try_reserve(charge) else {
        return Err(budget_spent());
    };
    // Without a declared length, each chunk is charged as it arrives.
    let admit = |length: usize| reservation.grow_to(length);
    let read = tokio::time::timeout(config.body_timeout, buffer::read_admitted(body, read_limit, admit)).await;
    match read {
        Ok(Err(ReadError::NotAdmitted)) => Err(budget_spent()),
        Ok(Ok((bytes, _trailers))) => {
            reservation.shrink_to(bytes.len());
            Ok((bytes, reservation))
        }
        Ok(Err(ReadError::TooLarge)) if declared.is_some() => {
            Err(Problem::new(ProblemCode::BodyUnreadable, "the request body is longer than its Content-Length"))
        }
        Ok(Err(ReadError::TooLarge)) => Err(too_large()),
        Ok(Err(ReadError::Failed)) => {
            Err(Problem::new(ProblemCode::BodyUnreadable, "the request body could not be read"))
        }
        Err(_elapsed) => Err(Problem::new(
            ProblemCode::BodyTimeout,
            format!("the request body did not arrive whole within {:?}", config.body_timeout),
        )),
    }
}

/// Whether a stored record's fingerprint is this request's: compared as they are when both have
/// the same version, else with the request's fingerprint at the record's version (computed only
/// then, by `at_version`). A record of a version this crate does not know is another request.
fn same_request(
    stored: &Fingerprint,
    request: &Fingerprint,
    at_version: impl FnOnce(u8) -> Option<Fingerprint>,
) -> bool {
    if stored.version() == request.version() {
        return stored == request;
    }
    at_version(stored.version()).is_some_and(|request| request == *stored)
}

/// Replays or refuses, given the record that is already there and whether it is this
/// request's ([`same_request`]).
fn answer_existing<B>(
    config: &Config,
    protocol: &Protocol,
    id: &RecordId,
    same_request: bool,
    record: Record,
) -> Response<IdempotencyBody<B>> {
    if record.state == RecordState::Expired {
        return protocol.refuse(Problem::new(
            ProblemCode::KeyExpired,
            "this key is past its retention; use a new key for a new request",
        ));
    }
    if !same_request {
        tracing::debug!(record = %id, "idempotency: key reused with a different request");
        return protocol.refuse(
            Problem::new(ProblemCode::KeyReused, "this key was used with a different request")
                .status(config.mismatch_status),
        );
    }
    match (record.state, record.response) {
        (RecordState::Completed | RecordState::Failed, Some(stored)) => replay(stored),
        (RecordState::Unknown, _) => protocol.refuse(
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
    }
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
