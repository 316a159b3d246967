//! Shadow mode (see [`rollout`](crate::rollout)): the request takes the old path, exactly as
//! in `Off` mode, and once its answer has been produced, what shadow mode records of it goes to
//! the layer's [shadow log](crate::shadow_log), which records it under the request's shadow
//! identity off the request's path and counts what enforce mode would have done. Nothing is
//! looked up before the handler runs, and nothing is written while the request waits.

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::BoxError;
use crate::body::IdempotencyBody;
use crate::context::IdempotencyContext;
use crate::fingerprint::{self, FINGERPRINT_VERSION};
use crate::guarded::Guarded;
use crate::key::{IdempotencyKey, RecordId, Scope};
use crate::old_path::old_path;
use crate::outcome::OutcomeClass;
use crate::problem::Problem;
use crate::request_body::{admit_request_body, read_request_body};
use crate::shadow_log::{self, Queued, ShadowLog};
use crate::store::{ShadowEntry, Store};
use crate::telemetry::RequestResult;

/// The shadow path of one request. The answer is the old path's, always, with one exception: a
/// body that cannot be read whole (over the limit without a `Content-Length`, broken, or late)
/// cannot be handed on, so it is answered as enforce mode answers it. What shadow mode
/// records goes to `log`, to be written on `records` (the layer's store, or its shadow store).
pub(crate) async fn shadow<S, St, ReqBody, ResBody>(
    mut guarded: Guarded<S, St>,
    (log, records): (ShadowLog, St),
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
    let would = move |result: RequestResult| shadow_log::count(&metrics, None, result);
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
    let spec = &guarded.config.fingerprint;
    let (method, uri, headers) = (&parts.method, &parts.uri, &parts.headers);
    let fingerprint = fingerprint::fingerprint(method, uri, headers, &body, spec);
    // The other version this crate knows, for a record written before (or after) an upgrade.
    let other = fingerprint::KNOWN_VERSIONS.into_iter().find(|&version| version != FINGERPRINT_VERSION);
    let earlier =
        other.and_then(|other| fingerprint::fingerprint_with_version(other, method, uri, headers, &body, spec));

    let answered = old_path(&mut guarded, Request::from_parts(parts, rebuild(body)), Some(context)).await;
    drop(reservation);
    let (response, class, finished) = answered?;
    let entry = ShadowEntry::new(id.shadow(), fingerprint, response.status(), guarded.config.retention);
    let queued = |entry| Queued { entry, earlier, metrics: guarded.metrics.clone() };
    let count = |result| shadow_log::count(&guarded.metrics, Some(&entry.id), result);
    match (class, finished) {
        // The handler's writes did not commit (the answer says so): nothing is recorded.
        (_, Some(Err(()))) => count(RequestResult::StoreUnavailable),
        // A released answer (or one too large to keep): enforce mode would store nothing.
        (OutcomeClass::Release, _) => count(RequestResult::Released),
        // A stored failure: its writes rolled back, and it is recorded as enforce mode stores it.
        (OutcomeClass::Reject, _) => log.record(&records, queued(entry.as_failure())),
        // A complete answer, or one whose outcome is unknown: never an `unknown` record (a
        // shadow record is never reconciled, and must not count among the unknown ones).
        _ => log.record(&records, queued(entry)),
    }
    Ok(response)
}
