//! Shadow mode (see [`rollout`](crate::rollout)): the request takes the old path, and what
//! enforce mode would have done is found out afterwards, off the request's path, by looking
//! the request up under its shadow identity and recording it there.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use tower_service::Service;

use crate::BoxError;
use crate::body::IdempotencyBody;
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::fingerprint::{self, Fingerprint};
use crate::key::{IdempotencyKey, RecordId, Scope};
use crate::old_path::old_path;
use crate::outcome::OutcomeClass;
use crate::problem::Problem;
use crate::record::StoredResponse;
use crate::service::{Guarded, Verdict, admit_request_body, read_request_body, same_request};
use crate::store::{Begin, BeginRequest, Claim, Outcome, Store};
use crate::telemetry::{OperationMetrics, RequestResult};

/// How many shadow records a layer writes at once, at most; a request past it is counted as
/// `store_unavailable` and not recorded (memory stays bounded when the store is slow).
pub(crate) const MAX_SHADOW_WRITES: usize = 256;

/// The shadow path of one request. The answer is the old path's, always, with one exception: a
/// body that cannot be read whole (over the limit without a `Content-Length`, broken, or late)
/// cannot be handed on, so it is answered as enforce mode answers it.
pub(crate) async fn shadow<S, St, ReqBody, ResBody>(
    mut guarded: Guarded<S, St>,
    parts: http::request::Parts,
    body: ReqBody,
    key: Result<Option<IdempotencyKey>, Problem>,
    scope: Option<Scope>,
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
    let metrics = guarded.metrics.clone();
    let would = move |result: RequestResult| {
        metrics.shadow(result);
        tracing::debug!(result = result.as_str(), "idempotency (shadow): enforce mode would have refused this request");
    };
    let key = match key {
        Ok(Some(key)) => Some(key),
        Ok(None) if !guarded.config.key_required => None,
        Ok(None) => {
            would(RequestResult::KeyMissing);
            None
        }
        Err(_) => {
            would(RequestResult::KeyInvalid);
            None
        }
    };
    let Some(key) = key else {
        return Ok(old_path(&mut guarded, Request::from_parts(parts, body), None).await?.0);
    };
    let Some(scope) = scope else {
        would(RequestResult::ScopeMissing);
        return Ok(old_path(&mut guarded, Request::from_parts(parts, body), None).await?.0);
    };
    let id = RecordId::new(&scope, &guarded.operation, &key);
    guarded.span.record("record", tracing::field::display(&id));
    let context = IdempotencyContext::new(id, guarded.operation.clone(), None);

    // The body: refused before it is read, it goes on untouched; read, it is handed on whole.
    let admitted = match admit_request_body(&parts.headers, &guarded.config) {
        Ok(admitted) => admitted,
        Err(problem) => {
            would(RequestResult::of_problem(problem.code()));
            return Ok(old_path(&mut guarded, Request::from_parts(parts, body), Some(context)).await?.0);
        }
    };
    let (body, reservation) = match read_request_body(body, admitted, &guarded.config).await {
        Ok(read) => read,
        Err(problem) => {
            would(RequestResult::of_problem(problem.code()));
            return Ok(guarded.protocol.refuse(problem));
        }
    };
    let request = Looked {
        method: parts.method.clone(),
        uri: parts.uri.clone(),
        headers: parts.headers.clone(),
        body: body.clone(),
    };
    let fingerprint = request.fingerprint(&guarded.config, None);

    let (response, class) = old_path(&mut guarded, Request::from_parts(parts, rebuild(body)), Some(context)).await?;
    drop(reservation);

    // The answer is produced: look up and record off its path.
    let status = response.status();
    let job = record(
        guarded.store.clone(),
        guarded.config.clone(),
        guarded.metrics.clone(),
        id.shadow(),
        fingerprint,
        request,
        class,
        status,
    );
    match (tokio::runtime::Handle::try_current(), guarded.config.shadow_writes.clone().try_acquire_owned()) {
        (Ok(runtime), Ok(permit)) => {
            runtime.spawn(async move {
                job.await;
                drop(permit);
            });
        }
        // No runtime to spawn on: record in line.
        (Err(_), Ok(_permit)) => job.await,
        (_, Err(_)) => {
            tracing::debug!("idempotency (shadow): too many shadow records being written; this one is skipped");
            guarded.metrics.shadow(RequestResult::StoreUnavailable);
        }
    }
    Ok(response)
}

/// What shadow mode keeps of a request, to compare it with a record of another fingerprint
/// version.
struct Looked {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl Looked {
    /// The request's fingerprint, at `version` (`None`: the current one).
    fn fingerprint(&self, config: &Config, version: Option<u8>) -> Fingerprint {
        let (method, uri, headers, body) = (&self.method, &self.uri, &self.headers, &self.body);
        match version {
            None => fingerprint::fingerprint(method, uri, headers, body, &config.fingerprint),
            Some(version) => {
                match fingerprint::fingerprint_with_version(version, method, uri, headers, body, &config.fingerprint) {
                    Some(fingerprint) => fingerprint,
                    // A version this build does not know: another request.
                    None => Fingerprint::from_parts(0, [0; 32]),
                }
            }
        }
    }
}

/// Looks the request up under its shadow identity `shadow_id` and records it there (a record
/// with the answer's status and no body: it is never replayed), counting what enforce mode
/// would have done. A store failure is counted and otherwise ignored.
#[allow(clippy::too_many_arguments)]
async fn record<St: Store>(
    store: St,
    config: Arc<Config>,
    metrics: OperationMetrics,
    shadow_id: RecordId,
    fingerprint: Fingerprint,
    request: Looked,
    class: OutcomeClass,
    status: StatusCode,
) {
    let begin = BeginRequest::new(&shadow_id, &fingerprint)
        .wait(config.in_flight_wait)
        .lease(config.lease)
        .stale_lease(config.stale_lease)
        .retention(config.retention);
    let result = match store.begin(begin).await {
        Ok(Begin::Claimed(claim)) => {
            let (outcome, result) = match class {
                OutcomeClass::Release => (Outcome::Release, RequestResult::Released),
                OutcomeClass::Reject => (Outcome::Reject(StoredResponse::new(status, "")), RequestResult::Executed),
                _ => (Outcome::Complete(StoredResponse::new(status, "")), RequestResult::Executed),
            };
            match claim.finish(outcome).await {
                Ok(()) => result,
                Err(error) => {
                    tracing::debug!(%error, "idempotency (shadow): recording failed");
                    RequestResult::StoreUnavailable
                }
            }
        }
        Ok(Begin::Existing(record)) => {
            let same = same_request(&record.fingerprint, &fingerprint, |version| {
                Some(request.fingerprint(&config, Some(version)))
            });
            Verdict::of(&record, same).result()
        }
        Ok(Begin::InFlight { .. }) => RequestResult::InFlight,
        Err(error) => {
            tracing::debug!(%error, "idempotency (shadow): the store failed");
            RequestResult::StoreUnavailable
        }
    };
    metrics.shadow(result);
    tracing::debug!(record = %shadow_id, result = result.as_str(), "idempotency (shadow): what enforce mode would have done");
}
