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
use crate::guarded::Guarded;
use crate::outcome::OutcomeClass;
use crate::problem::{Problem, ProblemCode};
use crate::protocol::Classified;
use crate::store::{FinishError, PlainTransaction, Store};

/// Ends the old path's transaction as atomic mode ends a claim's: a *complete* answer, or one
/// whose outcome is *unknown* (enforce mode commits its writes with the record), commits; any
/// other rolls back, and whatever the rollback meets, nothing is committed.
async fn finish<H: Clone>(tx: PlainTransaction<H>, class: OutcomeClass) -> Result<(), FinishError> {
    match class {
        OutcomeClass::Complete | OutcomeClass::Unknown => tx.commit().await,
        _ => {
            drop(tx.rollback().await);
            Ok(())
        }
    }
}

/// What became of the old path's transaction: `None` without one.
pub(crate) type Finished = Option<Result<(), ()>>;

/// The answer of the old path, and the class of the handler's response (for shadow mode):
/// decided as in atomic mode when the response was buffered (there was a transaction to
/// finish), else from its head, and *complete* when only its trailers could tell (a gRPC answer
/// is not held back to read them).
pub(crate) type OldAnswer<B> = (Response<IdempotencyBody<B>>, OutcomeClass, Finished);

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
    mut request: Request<ReqBody>,
    context: Option<IdempotencyContext>,
) -> Result<OldAnswer<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let Guarded { inner, store, config, protocol, .. } = guarded;
    let transaction = match store.plain_transaction(config.in_flight_wait).await {
        Ok(transaction) => transaction,
        Err(error) => {
            tracing::warn!(%error, "idempotency (old path): no transaction from the store; the handler runs without one");
            None
        }
    };
    if let Some(context) = context {
        request.extensions_mut().insert(context);
    }
    if let Some(transaction) = &transaction {
        request.extensions_mut().insert(transaction.handle());
    }
    // On an error the transaction is dropped, and rolls back.
    let response = inner.call(request).await?;
    let (parts, body) = response.into_parts();
    let classified = protocol.classify(&parts);
    let Some(transaction) = transaction else {
        let class = classified.head_or(OutcomeClass::Complete);
        return Ok((Response::from_parts(parts, IdempotencyBody::inner(body)), class, None));
    };
    if let Classified::Ready(OutcomeClass::Release) = classified {
        let finished = finish(transaction, OutcomeClass::Release).await;
        if let Err(error) = &finished {
            tracing::debug!(%error, "idempotency (old path): rolling back");
        }
        let response = Response::from_parts(parts, IdempotencyBody::inner(body));
        return Ok((response, OutcomeClass::Release, Some(finished.map_err(drop))));
    }
    let (body, trailers) = match buffer::read_to_end(body, config.max_response_body).await {
        Ok(read) => read,
        Err(error) => {
            let finished = finish(transaction, OutcomeClass::Release).await;
            let problem = if error == ReadError::TooLarge {
                Problem::new(ProblemCode::ResponseTooLarge, "the response was too large; nothing was committed")
            } else {
                Problem::new(ProblemCode::HandlerFailed, "the response failed while it was read; nothing was committed")
            };
            return Ok((protocol.refuse(problem), OutcomeClass::Release, Some(finished.map_err(drop))));
        }
    };
    let class = classified.with_trailers(trailers.as_ref());
    match finish(transaction, class).await {
        Ok(()) => {
            let response = Response::from_parts(parts, IdempotencyBody::buffered(body, trailers));
            Ok((response, class, Some(Ok(()))))
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
            Ok((protocol.refuse(problem), OutcomeClass::Release, Some(Err(()))))
        }
    }
}
