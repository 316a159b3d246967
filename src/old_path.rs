//! The old path, taken by requests in `Off` and `Shadow` mode (see [`rollout`](crate::rollout)):
//! the handler runs as if the layer were absent, except that a handler written for atomic mode
//! still gets its `TxHandle`, a plain transaction from the same store, committed when it is done.

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::BoxError;
use crate::body::IdempotencyBody;
use crate::buffer::{self, ReadError};
use crate::context::IdempotencyContext;
use crate::fingerprint::Fingerprint;
use crate::guarded::Guarded;
use crate::key::RecordId;
use crate::outcome::OutcomeClass;
use crate::problem::{Problem, ProblemCode};
use crate::protocol::Classified;
use crate::record::StoredResponse;
use crate::store::{
    Claim, FinishError, Outcome, PlainTransaction, Retention, ShadowCommit, ShadowEntry, ShadowSeen, Store,
};

/// The transaction a handler on the old path writes in: the store's plain transaction; in
/// shadow mode, one that records the request's shadow record as it commits, or the transaction
/// of the request's shadow claim (on a store whose plain transaction cannot record), so that
/// the shadow record commits with the handler's writes either way, in one transaction.
pub(crate) enum OldTx<C: Claim> {
    /// A plain transaction: committed for a *complete* answer or an *unknown* outcome, else
    /// rolled back.
    Plain(PlainTransaction<C::Handle>),
    /// A plain transaction committed by the same rule, recording the request under its shadow
    /// identity (with the answer's status, no body) as it commits.
    Recording(PlainTransaction<C::Handle>, ShadowPending),
    /// A shadow claim with a transaction: finished by the same rule, storing a record with the
    /// answer's status and no body (never replayed) for a *complete* or *failed* answer.
    Shadow(C),
}

/// What a recording transaction records of its request, but the answer's status.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShadowPending {
    pub(crate) id: RecordId,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) retention: Retention,
}

impl<C: Claim> OldTx<C> {
    fn handle(&self) -> Option<C::Handle> {
        match self {
            OldTx::Plain(tx) | OldTx::Recording(tx, _) => Some(tx.handle()),
            OldTx::Shadow(claim) => claim.handle(),
        }
    }

    async fn finish(
        self,
        class: OutcomeClass,
        status: http::StatusCode,
    ) -> (Result<(), FinishError>, Option<ShadowSeen>) {
        match (self, class) {
            // An unknown outcome keeps its writes, as enforce mode commits them with the record.
            (OldTx::Plain(tx), OutcomeClass::Complete | OutcomeClass::Unknown) => (tx.commit().await, None),
            (OldTx::Recording(tx, pending), OutcomeClass::Complete | OutcomeClass::Unknown) => {
                let entry = ShadowEntry::new(pending.id, pending.fingerprint, status, pending.retention);
                let ShadowCommit { committed, seen } = tx.commit_recording(entry).await;
                (committed, Some(seen))
            }
            (OldTx::Plain(tx) | OldTx::Recording(tx, _), _) => {
                // Whatever the rollback meets, nothing is committed.
                drop(tx.rollback().await);
                (Ok(()), None)
            }
            // An unknown outcome is kept as its status only, never as an `unknown` record: a shadow
            // record is never reconciled, and must not count among the unknown ones.
            (OldTx::Shadow(claim), OutcomeClass::Complete | OutcomeClass::Unknown) => {
                (claim.finish(Outcome::Complete(StoredResponse::new(status, ""))).await, None)
            }
            (OldTx::Shadow(claim), OutcomeClass::Reject) => {
                (claim.finish(Outcome::Reject(StoredResponse::new(status, ""))).await, None)
            }
            (OldTx::Shadow(claim), _) => (claim.finish(Outcome::Release).await, None),
        }
    }
}

/// What became of the old path's transaction: `None` without one.
pub(crate) type Finished = Option<Result<(), ()>>;

/// The answer of the old path, and the class of the handler's response (for shadow mode):
/// decided as in atomic mode when the response was buffered (there was a transaction to
/// finish), else from its head, and *complete* when only its trailers could tell (a gRPC answer
/// is not held back to read them).
/// With a recording transaction, also what became of the shadow record.
pub(crate) type OldAnswer<B> = (Response<IdempotencyBody<B>>, OutcomeClass, Finished, Option<ShadowSeen>);

/// Runs `request` on the old path: with the store's plain transaction, if it has one (a store
/// failure leaves the handler without it, as if the layer were absent), and `context`.
///
/// With a transaction, the answer leaves after the transaction is finished, as in atomic mode:
/// a *complete* answer, or one whose outcome is *unknown*, commits (a failed COMMIT answers 503 `idempotency_commit_uncertain`, a
/// handle still held 500 `idempotency_handle_still_held`), any other rolls back; the body is
/// read first, within the response limit (a larger one rolls back and answers 500
/// `idempotency_response_too_large`). Nothing is claimed, stored or replayed.
pub(crate) async fn old_path<S, St, ReqBody, ResBody>(
    guarded: &mut Guarded<S, St>,
    request: Request<ReqBody>,
    context: Option<IdempotencyContext>,
) -> Result<OldAnswer<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let transaction = match guarded.store.plain_transaction(guarded.config.in_flight_wait).await {
        Ok(transaction) => transaction.map(OldTx::Plain),
        Err(error) => {
            tracing::warn!(%error, "idempotency (old path): no transaction from the store; the handler runs without one");
            None
        }
    };
    old_path_in(guarded, request, context, transaction).await
}

/// [`old_path`] in `transaction` (if any).
pub(crate) async fn old_path_in<S, St, ReqBody, ResBody>(
    guarded: &mut Guarded<S, St>,
    mut request: Request<ReqBody>,
    context: Option<IdempotencyContext>,
    transaction: Option<OldTx<St::Claim>>,
) -> Result<OldAnswer<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let Guarded { inner, config, protocol, .. } = guarded;
    if let Some(context) = context {
        request.extensions_mut().insert(context);
    }
    if let Some(handle) = transaction.as_ref().and_then(OldTx::handle) {
        request.extensions_mut().insert(handle);
    }
    // On an error the transaction is dropped, and rolls back.
    let response = inner.call(request).await?;
    let (parts, body) = response.into_parts();
    let classified = protocol.classify(&parts);
    let Some(transaction) = transaction else {
        let class = classified.head_or(OutcomeClass::Complete);
        return Ok((Response::from_parts(parts, IdempotencyBody::inner(body)), class, None, None));
    };
    if let Classified::Ready(OutcomeClass::Release) = classified {
        let (finished, _) = transaction.finish(OutcomeClass::Release, parts.status).await;
        if let Err(error) = &finished {
            tracing::debug!(%error, "idempotency (old path): rolling back");
        }
        let response = Response::from_parts(parts, IdempotencyBody::inner(body));
        return Ok((response, OutcomeClass::Release, Some(finished.map_err(drop)), None));
    }
    let (body, trailers) = match buffer::read_to_end(body, config.max_response_body).await {
        Ok(read) => read,
        Err(error) => {
            let (finished, _) = transaction.finish(OutcomeClass::Release, parts.status).await;
            let problem = if error == ReadError::TooLarge {
                Problem::new(ProblemCode::ResponseTooLarge, "the response was too large; nothing was committed")
            } else {
                Problem::new(ProblemCode::HandlerFailed, "the response failed while it was read; nothing was committed")
            };
            return Ok((protocol.refuse(problem), OutcomeClass::Release, Some(finished.map_err(drop)), None));
        }
    };
    let class = classified.with_trailers(trailers.as_ref());
    let (finished, seen) = transaction.finish(class, parts.status).await;
    match finished {
        Ok(()) => {
            let response = Response::from_parts(parts, IdempotencyBody::buffered(body, trailers));
            Ok((response, class, Some(Ok(())), seen))
        }
        Err(error) => {
            tracing::warn!(%error, "idempotency (old path): the handler's transaction did not commit");
            let problem = match error {
                FinishError::HandleStillHeld => Problem::new(
                    ProblemCode::HandleStillHeld,
                    "the handler kept its transaction handle after answering; nothing was committed",
                ),
                _ => Problem::new(ProblemCode::CommitUncertain, "the outcome could not be confirmed")
                    .retry_after(config.retry_after),
            };
            Ok((protocol.refuse(problem), OutcomeClass::Release, Some(Err(())), seen))
        }
    }
}
