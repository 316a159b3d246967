//! Shadow mode (see [`rollout`](crate::rollout)): the request takes the old path, and what
//! enforce mode would have done is found out under the request's shadow identity, by one of
//! two ways:
//!
//! - **In the COMMIT** (the SQL stores in atomic mode, whose plain transaction
//!   [records shadow requests](crate::store::PlainTransaction::records_shadow)): nothing is
//!   looked up before the handler runs. Once the answer is produced, the shadow record is
//!   written in the handler's transaction by one prepared statement just before its COMMIT
//!   (on PostgreSQL the function of migration 0006, which catches its own failure); only when
//!   a record was already there does a read follow, to tell a replay from a reused key. A request that found its duplicate still in flight counts as `replayed` here
//!   (both commit one after the other), not `in_flight`. A stored failure rolls the handler's
//!   writes back and is recorded apart, after the answer.
//! - **With a claim** (any other store): a lookup without waiting before the handler runs, and
//!   the claim finished once the answer is produced; on an atomic store the handler writes in
//!   the shadow claim's transaction.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use tower_service::Service;

use crate::BoxError;
use crate::body::IdempotencyBody;
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::fingerprint::{self, Fingerprint};
use crate::guarded::Guarded;
use crate::key::{IdempotencyKey, RecordId, Scope};
use crate::old_path::{OldTx, ShadowPending, old_path, old_path_in};
use crate::outcome::OutcomeClass;
use crate::problem::Problem;
use crate::record::{Record, StoredResponse};
use crate::request_body::{admit_request_body, read_request_body};
use crate::store::{Begin, BeginRequest, Claim, Outcome, ShadowSeen, Store};
use crate::telemetry::RequestResult;
use crate::verdict::{Verdict, same_request};

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

    let shadow_id = id.shadow();
    let config = guarded.config.clone();
    let same = |record: &Record| {
        same_request(&record.fingerprint, &fingerprint, |version| Some(request.fingerprint(&config, Some(version))))
    };

    // A store whose plain transaction records the request as it commits (the SQL stores):
    // nothing is looked up before the handler runs, and the shadow record commits with the
    // handler's writes.
    let plain = match guarded.store.plain_transaction(config.in_flight_wait).await {
        Ok(plain) => plain,
        Err(error) => {
            tracing::warn!(%error, "idempotency (shadow): no transaction from the store; the handler runs without one");
            None
        }
    };
    let plain = match plain {
        Some(plain) if plain.records_shadow() => Some(plain),
        // A plain transaction that cannot record: the shadow claim's transaction is used
        // instead (below), and this one must not hold the store's write lock meanwhile.
        Some(plain) => {
            drop(plain.rollback().await);
            None
        }
        None => None,
    };
    if let Some(plain) = plain {
        let pending = ShadowPending { id: shadow_id, fingerprint, retention: config.retention };
        let request_in = Request::from_parts(parts, rebuild(body));
        let answered =
            old_path_in(&mut guarded, request_in, Some(context), Some(OldTx::Recording(plain, pending))).await;
        drop(reservation);
        let (response, class, _, seen) = answered?;
        let result = match seen {
            Some(ShadowSeen::Recorded) => executed(class),
            Some(ShadowSeen::Existing(record)) => Verdict::of(&record, same(&record)).result(),
            Some(ShadowSeen::InFlight) => RequestResult::InFlight,
            Some(ShadowSeen::NotRecorded(error)) => {
                if let Some(error) = error {
                    tracing::debug!(%error, "idempotency (shadow): recording failed");
                }
                RequestResult::StoreUnavailable
            }
            None if class == OutcomeClass::Release => RequestResult::Released,
            // A stored failure: the handler's writes rolled back, and the failure is recorded
            // apart, as enforce mode stores it.
            None if class == OutcomeClass::Reject => {
                record_apart(&guarded.store, &shadow_id, &fingerprint, &config, response.status(), same).await
            }
            // The answer was too large to store, or the COMMIT failed: nothing was recorded.
            None => RequestResult::StoreUnavailable,
        };
        guarded.metrics.shadow(result);
        tracing::debug!(record = %shadow_id, result = result.as_str(), "idempotency (shadow): what enforce mode would have done");
        return Ok(response);
    }

    // Any other store: the lookup, under the shadow identity, never waiting on a duplicate in
    // flight.
    let (transaction, pending, known) = match guarded.store.begin(shadow_begin(&shadow_id, &fingerprint, &config)).await
    {
        // An atomic store: the handler writes in the shadow claim's transaction, and the shadow
        // record commits with its writes.
        Ok(Begin::Claimed(claim)) if claim.handle().is_some() => (Some(OldTx::Shadow(claim)), None, None),
        // Leased, or in memory: the claim is finished once the answer is produced.
        Ok(Begin::Claimed(claim)) => (plain_tx(&guarded.store, config.in_flight_wait).await, Some(claim), None),
        Ok(Begin::Existing(record)) => (
            plain_tx(&guarded.store, config.in_flight_wait).await,
            None,
            Some(Verdict::of(&record, same(&record)).result()),
        ),
        Ok(Begin::InFlight { .. }) => {
            (plain_tx(&guarded.store, config.in_flight_wait).await, None, Some(RequestResult::InFlight))
        }
        Err(error) => {
            tracing::debug!(%error, "idempotency (shadow): the store failed");
            (plain_tx(&guarded.store, config.in_flight_wait).await, None, Some(RequestResult::StoreUnavailable))
        }
    };
    let in_claim = matches!(transaction, Some(OldTx::Shadow(_)));
    let answered =
        old_path_in(&mut guarded, Request::from_parts(parts, rebuild(body)), Some(context), transaction).await;
    drop(reservation);
    let (response, class, finished, _) = match answered {
        Ok(answered) => answered,
        Err(error) => {
            if let Some(claim) = pending {
                let _ = claim.finish(Outcome::Release).await;
            }
            return Err(error);
        }
    };
    let result = match (known, pending) {
        (Some(result), _) => result,
        (None, Some(claim)) => match claim.finish(shadow_outcome(class, response.status())).await {
            Ok(()) => executed(class),
            Err(error) => {
                tracing::debug!(%error, "idempotency (shadow): recording failed");
                RequestResult::StoreUnavailable
            }
        },
        (None, None) if in_claim && finished == Some(Ok(())) => executed(class),
        (None, None) => RequestResult::StoreUnavailable,
    };
    guarded.metrics.shadow(result);
    tracing::debug!(record = %shadow_id, result = result.as_str(), "idempotency (shadow): what enforce mode would have done");
    Ok(response)
}

/// A shadow claim on `shadow_id`: it never waits on a duplicate in flight.
fn shadow_begin<'a>(shadow_id: &'a RecordId, fingerprint: &'a Fingerprint, config: &Config) -> BeginRequest<'a> {
    BeginRequest::new(shadow_id, fingerprint)
        .wait(Duration::ZERO)
        .lease(config.lease)
        .stale_lease(config.stale_lease)
        .retention(config.retention)
}

/// Records a stored failure under `shadow_id` with a claim of its own (the handler's writes
/// rolled back): what enforce mode would have done.
async fn record_apart<St: Store>(
    store: &St,
    shadow_id: &RecordId,
    fingerprint: &Fingerprint,
    config: &Config,
    status: StatusCode,
    same: impl FnOnce(&Record) -> bool,
) -> RequestResult {
    match store.begin(shadow_begin(shadow_id, fingerprint, config)).await {
        Ok(Begin::Claimed(claim)) => match claim.finish(shadow_outcome(OutcomeClass::Reject, status)).await {
            Ok(()) => RequestResult::Executed,
            Err(error) => {
                tracing::debug!(%error, "idempotency (shadow): recording failed");
                RequestResult::StoreUnavailable
            }
        },
        Ok(Begin::Existing(record)) => Verdict::of(&record, same(&record)).result(),
        Ok(Begin::InFlight { .. }) => RequestResult::InFlight,
        Err(error) => {
            tracing::debug!(%error, "idempotency (shadow): recording failed");
            RequestResult::StoreUnavailable
        }
    }
}

/// The store's plain transaction for the old path (none if it fails).
async fn plain_tx<St: Store>(store: &St, wait: Duration) -> Option<OldTx<St::Claim>> {
    match store.plain_transaction(wait).await {
        Ok(transaction) => transaction.map(OldTx::Plain),
        Err(error) => {
            tracing::warn!(%error, "idempotency (shadow): no transaction from the store; the handler runs without one");
            None
        }
    }
}

/// What a shadow record keeps of an answer of `class`: its status, no body.
fn shadow_outcome(class: OutcomeClass, status: StatusCode) -> Outcome {
    match class {
        OutcomeClass::Release => Outcome::Release,
        OutcomeClass::Reject => Outcome::Reject(StoredResponse::new(status, "")),
        // Never an `unknown` record: a shadow record is never reconciled, and must not count
        // among the unknown ones (`idempotency_records`, `idempotency_oldest_unknown_seconds`).
        _ => Outcome::Complete(StoredResponse::new(status, "")),
    }
}

/// What enforce mode would have counted for a first execution whose answer is of `class`.
fn executed(class: OutcomeClass) -> RequestResult {
    if class == OutcomeClass::Release { RequestResult::Released } else { RequestResult::Executed }
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
