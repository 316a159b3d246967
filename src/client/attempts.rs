//! The retry loop shared by the HTTP and the gRPC layer: one logical request, sent attempt
//! after attempt with the same key and the same bytes until the policy says stop.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, Response, request};
use http_body::Body;
use tower_service::Service;

use super::body::{ResponseBody, buffer_request};
use super::policy::{Decision, RetryPolicy, RetryReason};
use super::report::{RetryError, RetryErrorKind, RetryReport};
use super::telemetry;
use crate::BoxError;

/// The future of a call: the answer with its [`RetryReport`], or the error.
pub type RetryFuture<B> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, RetryError>> + Send>>;

/// The request body, read once for all attempts.
pub(crate) async fn buffered<B>(body: B, limit: usize, key: Option<&str>) -> Result<Bytes, RetryError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let refused = |kind, source| RetryError {
        kind,
        key: key.map(str::to_owned),
        attempts: 0,
        retries: Vec::new(),
        may_have_executed: false,
        source,
    };
    match buffer_request(body, limit).await {
        Ok(Some(bytes)) => Ok(bytes),
        Ok(None) => Err(refused(RetryErrorKind::BodyTooLarge, None)),
        Err(error) => Err(refused(RetryErrorKind::BodyUnreadable, Some(error))),
    }
}

/// How one protocol builds an attempt's body and judges an answer.
pub(crate) trait Wire {
    /// The body type the inner service takes.
    type RequestBody;

    /// The body of one attempt.
    fn request_body(bytes: Bytes) -> Self::RequestBody;

    /// The policy's verdict on `response`, read at `now`, and the answer to hand back should it
    /// be the last. Reading a body to judge it may fail: the answer was cut short.
    fn judge<B>(response: Response<B>, now: SystemTime) -> impl Future<Output = Result<Judged<B>, BoxError>> + Send
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>;
}

/// An answer with its verdict.
pub(crate) struct Judged<B> {
    pub response: Response<ResponseBody<B>>,
    pub decision: Decision,
    pub retry_after: Option<Duration>,
}

/// One logical request: what to send and with which key.
pub(crate) struct LogicalRequest {
    pub parts: request::Parts,
    pub body: Bytes,
    /// `None`: a method the layer does not guard, sent once, as it came.
    pub key: Option<String>,
}

/// What the loop has learnt so far.
#[derive(Default)]
struct Tally {
    attempts: u32,
    retries: Vec<RetryReason>,
    may_have_executed: bool,
}

/// Sends `request` through `inner` until an answer is final or `policy` runs out, and hands
/// back the last answer with a [`RetryReport`], or a [`RetryError`] if the last attempt failed.
pub(crate) async fn run<W, S, RB>(
    mut inner: S,
    policy: RetryPolicy,
    request: LogicalRequest,
) -> Result<Response<ResponseBody<RB>>, RetryError>
where
    W: Wire,
    S: Service<Request<W::RequestBody>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let guarded = request.key.is_some();
    let policy = if guarded { policy } else { policy.max_attempts(1) };
    let started = tokio::time::Instant::now();
    let mut tally = Tally::default();
    loop {
        tally.attempts += 1;
        if guarded {
            telemetry::attempt();
        }
        let attempt = Request::from_parts(request.parts.clone(), W::request_body(request.body.clone()));
        let exchange = async {
            let response = send(&mut inner, attempt).await?;
            W::judge(response, SystemTime::now()).await
        };
        let (reason, retry_after, last) =
            match tokio::time::timeout(policy.timeout_at(started.elapsed()), exchange).await {
                Ok(Ok(Judged { response, decision: Decision::Stop, .. })) => {
                    return Ok(answer(response, tally, request.key.clone(), false));
                }
                Ok(Ok(Judged { response, decision: Decision::Retry(reason), retry_after })) => {
                    (reason, retry_after, Ok(response))
                }
                Ok(Err(error)) => (RetryReason::ConnectionFailed, None, Err(error)),
                Err(_elapsed) => (RetryReason::TimedOut, None, Err(BoxError::from("the attempt timed out"))),
            };
        tally.may_have_executed |= match &last {
            Err(error) if reason == RetryReason::ConnectionFailed => !connection_refused(error),
            _ => reason.may_have_executed(),
        };
        let delay = policy.delay(tally.retries.len() as u32, retry_after, random());
        if !policy.may_retry(tally.attempts, started.elapsed(), delay) {
            if guarded {
                telemetry::give_up(reason);
            }
            return match last {
                Ok(response) => Ok(answer(response, tally, request.key.clone(), guarded)),
                Err(source) => Err(gave_up(tally, reason, request.key.clone(), source)),
            };
        }
        tracing::debug!(attempt = tally.attempts, reason = reason.as_str(), ?delay, "idempotent retry");
        telemetry::retry(reason);
        tally.retries.push(reason);
        drop(last);
        tokio::time::sleep(delay).await;
    }
}

/// Sends `request` once, as it came, for a method the layer does not guard (gRPC: its body
/// needs no buffering).
#[cfg(feature = "tonic")]
pub(crate) async fn pass_through<S, R, RB>(mut inner: S, request: R) -> Result<Response<ResponseBody<RB>>, RetryError>
where
    S: Service<R, Response = Response<RB>>,
    S::Error: Into<BoxError>,
{
    let tally = Tally { attempts: 1, ..Tally::default() };
    match send(&mut inner, request).await {
        Ok(response) => Ok(answer(response.map(ResponseBody::streaming), tally, None, false)),
        Err(error) => {
            let may_have_executed = !connection_refused(&error);
            Err(gave_up(Tally { may_have_executed, ..tally }, RetryReason::ConnectionFailed, None, error))
        }
    }
}

/// One attempt: wait until `inner` is ready, then call it.
async fn send<S, R>(inner: &mut S, request: R) -> Result<S::Response, BoxError>
where
    S: Service<R>,
    S::Error: Into<BoxError>,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx)).await.map_err(Into::into)?;
    inner.call(request).await.map_err(Into::into)
}

/// The final answer, with its report.
fn answer<B>(
    mut response: Response<ResponseBody<B>>,
    tally: Tally,
    key: Option<String>,
    gave_up: bool,
) -> Response<ResponseBody<B>> {
    let replayed = response.headers().get(crate::REPLAYED_HEADER).is_some_and(|v| v == "true");
    response.extensions_mut().insert(RetryReport {
        key,
        attempts: tally.attempts,
        retries: tally.retries,
        replayed,
        gave_up,
    });
    response
}

/// The error when the last attempt failed and no further attempt is allowed.
fn gave_up(mut tally: Tally, last: RetryReason, key: Option<String>, source: BoxError) -> RetryError {
    tally.retries.push(last);
    RetryError {
        kind: RetryErrorKind::GaveUp,
        key,
        attempts: tally.attempts,
        retries: tally.retries,
        may_have_executed: tally.may_have_executed,
        source: Some(source),
    }
}

/// Whether `error` is, at its root, a refused connection: the request never left.
fn connection_refused(error: &BoxError) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error.as_ref());
    while let Some(error) = cause {
        if error.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        cause = error.source();
    }
    false
}

/// A random number for the jitter (from the operating system; the clock if that fails).
fn random() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.subsec_nanos().into())
    })
}
