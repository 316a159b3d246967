//! `POST /admin/payments/{payment_id}/settle` on the operator listener (behind
//! `ORDERS_ADMIN_TOKEN`, like every `/admin/` route): an operator who checked the provider's
//! own records settles an `unknown` attempt, and with it the idempotency record of its request.
//!
//! Body: `{"status": "succeeded", "charge_id": "<the provider's>"}`, `{"status": "declined"}`,
//! or `{"status": "not_executed"}` (the provider has no such charge: the attempt goes back to
//! `pending` with its call permit re-issued, and the record is released, so the client's next
//! retry with the same key calls the provider once more). 200 with the payment as
//! `GET /orders/{order_id}/payments` shows it; 404 `payment_not_found`; 409
//! `payment_not_unknown` for an attempt that is not `unknown`; 422 `invalid_settlement`; 415 for
//! a body not declared as JSON.
//!
//! The attempt is settled first, conditional on its being `unknown`; then the record, if it is
//! `unknown`. A record not yet `unknown` (its lease had not run out) is settled by the
//! reconciler at its next look, from the attempt.

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use tower_idempotency::store::{Admin, SettleRequest, Settlement};
use tower_idempotency::{RecordState, Retention, Scope};

use super::super::book::created_at::CreatedAt;
use super::super::book::storage::OrderBook;
use super::super::create_request::require_json;
use super::super::problem::ApiProblem;
use super::attempts::{self, Attempt};
use super::{answer, problems};

#[derive(Clone)]
struct Operator<A> {
    book: OrderBook,
    records: A,
    retention: Retention,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettleBody {
    status: String,
    charge_id: Option<String>,
}

/// The route over `records` (the payment route's store).
pub(crate) fn routes<A: Admin>(book: OrderBook, records: A, retention: Retention) -> Router {
    Router::new().route("/admin/payments/{payment_id}/settle", post(settle::<A>)).with_state(Operator {
        book,
        records,
        retention,
    })
}

async fn settle<A: Admin>(
    State(operator): State<Operator<A>>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiProblem> {
    let Ok(Path(payment_id)) = path else { return Err(problems::payment_not_found()) };
    require_json(&headers).map_err(|_| ApiProblem::json_required())?;
    let body: SettleBody = serde_json::from_slice(&body).map_err(|e| problems::invalid_settlement(&e.to_string()))?;
    let book = &operator.book;
    let storage = |error: sqlx::Error| problems::storage(&error);
    let attempt = attempts::by_id(book, &payment_id).await.map_err(storage)?.ok_or_else(problems::payment_not_found)?;
    if attempt.state != "unknown" {
        return Err(problems::payment_not_unknown(&attempt.state));
    }
    let now = CreatedAt::now().unix_micros();
    let changed = match (body.status.as_str(), body.charge_id.as_deref()) {
        ("succeeded", Some(charge_id)) if !charge_id.is_empty() && charge_id.len() <= 128 => {
            attempts::settle_succeeded(book, &payment_id, charge_id, now).await
        }
        ("declined", charge_id) => attempts::settle_declined(book, &payment_id, charge_id, now).await,
        ("not_executed", None) => attempts::reopen_not_executed(book, &payment_id).await,
        _ => {
            return Err(problems::invalid_settlement(
                "status must be succeeded (with the provider's charge_id), declined, or not_executed",
            ));
        }
    }
    .map_err(storage)?;
    if !changed {
        return Err(problems::payment_not_unknown("no longer unknown"));
    }
    let now = attempts::by_id(book, &payment_id).await.map_err(storage)?.ok_or_else(problems::payment_not_found)?;
    settle_record(&operator, &now).await?;
    Ok(Json(serde_json::json!({
        "payment_id": now.payment_id,
        "status": now.state,
        "charge_id": now.charge_id,
        "created_at": CreatedAt::from_unix_micros(now.created_at).to_string(),
        "settled_at": now.settled_at.map(|at| CreatedAt::from_unix_micros(at).to_string()),
    })))
}

/// Settles the attempt's idempotency record if it is `unknown`, as the attempt now says.
async fn settle_record<A: Admin>(operator: &Operator<A>, attempt: &Attempt) -> Result<(), ApiProblem> {
    let scope = Scope::new(attempt.account_id.as_str());
    let info = operator
        .records
        .inspect_operation(&scope, &attempt.operation_id)
        .await
        .map_err(|e| ApiProblem::records_unavailable(&e))?;
    let Some(info) = info.filter(|info| info.state == RecordState::Unknown) else {
        return Ok(());
    };
    let settlement = match attempt.state.as_str() {
        "succeeded" => Settlement::Completed(answer::succeeded(attempt)),
        "declined" => Settlement::Failed(answer::declined(attempt)),
        _ => Settlement::NotExecuted,
    };
    let request = SettleRequest::new(&info.id, settlement).fenced(info.fencing_token).retention(operator.retention);
    // Lost a race (the reconciler settled it meanwhile, from the same attempt): nothing to do.
    match operator.records.settle(request).await {
        Ok(())
        | Err(
            tower_idempotency::store::SettleError::NotUnknown(_) | tower_idempotency::store::SettleError::Superseded,
        ) => Ok(()),
        Err(tower_idempotency::store::SettleError::NotFound) => Ok(()),
        Err(error) => Err(ApiProblem::records_unavailable(&error)),
    }
}
