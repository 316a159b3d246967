//! `POST /orders/{order_id}/payments` (leased, operation `payments.create`) and
//! `GET /orders/{order_id}/payments[/{payment_id}]`.

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router, middleware};
use serde::Serialize;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, OutcomeClass, Store};
use uuid::Uuid;

use super::super::auth::authenticate;
use super::super::book::account::Account;
use super::super::book::created_at::CreatedAt;
use super::super::book::storage::OrderBook;
use super::super::create_request::require_json;
use super::super::lifecycle::Lifecycle;
use super::super::problem::ApiProblem;
use super::attempts::{self, Attempt, Inserted, PROVIDER};
use super::provider::{Charged, Provider};
use super::{PAYMENTS_OPERATION, PROVIDER_KEY_PURPOSE, PaymentSettings, answer, problems, settle_from_charge};

/// What the payment handlers share.
#[derive(Clone)]
pub(crate) struct Payments {
    pub(crate) book: OrderBook,
    /// `None`: `PSP_URL` is unset.
    pub(crate) provider: Option<Provider>,
    pub(crate) idempotent: bool,
}

/// The payment routes over the leased store `records`, behind their own authentication.
pub(crate) fn routes<St: Store>(
    book: OrderBook,
    records: St,
    lifecycle: &Lifecycle,
    settings: &PaymentSettings,
) -> Router {
    let provider = settings.provider.as_ref().map(|base| Provider::new(base, settings.timeout));
    let payments = Payments { book, provider, idempotent: settings.idempotent };
    let create = if payments.provider.is_some() {
        let idempotency = IdempotencyLayer::new(records)
            .operation(PAYMENTS_OPERATION)
            .lease(settings.lease)
            .retention(lifecycle.retention());
        axum::routing::post(create_payment).layer(idempotency)
    } else {
        // No provider: nothing to guard, every payment route answers 503.
        axum::routing::post(create_payment)
    };
    Router::new()
        .route("/orders/{order_id}/payments", create.get(list_payments))
        .route("/orders/{order_id}/payments/{payment_id}", get(get_payment))
        .layer(middleware::from_fn(authenticate))
        .with_state(payments)
}

/// A payment, as `GET` shows it.
#[derive(Serialize)]
struct PaymentView {
    payment_id: String,
    status: String,
    charge_id: Option<String>,
    created_at: String,
    settled_at: Option<String>,
}

impl PaymentView {
    fn of(attempt: Attempt) -> Self {
        Self {
            payment_id: attempt.payment_id,
            status: attempt.state,
            charge_id: attempt.charge_id,
            created_at: CreatedAt::from_unix_micros(attempt.created_at).to_string(),
            settled_at: attempt.settled_at.map(|at| CreatedAt::from_unix_micros(at).to_string()),
        }
    }
}

#[derive(Serialize)]
struct PaymentList {
    payments: Vec<PaymentView>,
}

/// The caller's order named by the path, or 404.
async fn caller_order(
    payments: &Payments,
    account: &Account,
    order_id: &str,
) -> Result<super::super::book::order::Order, ApiProblem> {
    let order_id = Uuid::try_parse(order_id).map_err(|_| ApiProblem::not_found())?;
    let order = payments.book.get(account, order_id).await.map_err(ApiProblem::read_failed)?;
    order.ok_or_else(ApiProblem::not_found)
}

/// `GET /orders/{order_id}/payments`: the order's attempts, oldest first.
async fn list_payments(
    State(payments): State<Payments>,
    account: Account,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<PaymentList>, ApiProblem> {
    if payments.provider.is_none() {
        return Err(problems::payments_unavailable());
    }
    let Ok(Path(order_id)) = path else { return Err(ApiProblem::not_found()) };
    let order = caller_order(&payments, &account, &order_id).await?;
    let attempts =
        attempts::of_order(&payments.book, &order.order_id.to_string()).await.map_err(|e| problems::storage(&e))?;
    Ok(Json(PaymentList { payments: attempts.into_iter().map(PaymentView::of).collect() }))
}

/// `GET /orders/{order_id}/payments/{payment_id}`: one attempt of the caller's order.
async fn get_payment(
    State(payments): State<Payments>,
    account: Account,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<PaymentView>, ApiProblem> {
    if payments.provider.is_none() {
        return Err(problems::payments_unavailable());
    }
    let Ok(Path((order_id, payment_id))) = path else { return Err(ApiProblem::not_found()) };
    let order = caller_order(&payments, &account, &order_id).await?;
    let attempt = attempts::by_id(&payments.book, &payment_id).await.map_err(|e| problems::storage(&e))?;
    attempt
        .filter(|attempt| attempt.order_id == order.order_id.to_string())
        .map(|attempt| Json(PaymentView::of(attempt)))
        .ok_or_else(problems::payment_not_found)
}

/// `POST /orders/{order_id}/payments`: finds or makes this key's attempt, consumes its call
/// permit, calls the provider once, and answers what the provider's answer (or its absence)
/// means. See the module docs of `payments` for the states.
async fn create_payment(
    State(payments): State<Payments>,
    account: Account,
    context: Option<IdempotencyContext>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (Some(provider), Some(context)) = (payments.provider.clone(), context) else {
        return problems::payments_unavailable().into_response();
    };
    match pay(&payments, &provider, &account, &context, path, &headers, &body).await {
        Ok(response) | Err(response) => response,
    }
}

async fn pay(
    payments: &Payments,
    provider: &Provider,
    account: &Account,
    context: &IdempotencyContext,
    path: Result<Path<String>, PathRejection>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, Response> {
    let reply = |problem: ApiProblem| problem.into_response();
    let Ok(Path(order_id)) = path else { return Err(reply(ApiProblem::not_found())) };
    let order = caller_order(payments, account, &order_id).await.map_err(reply)?;
    require_json(headers).map_err(reply)?;
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
        Ok(members) if members.is_empty() => {}
        _ => return Err(reply(problems::invalid_body())),
    }
    let book = &payments.book;
    let storage = |error: sqlx::Error| problems::storage(&error).into_response();
    let key = context.downstream_key(PROVIDER_KEY_PURPOSE);

    // This key's attempt, or a new one if the order has no live attempt.
    let attempt = match attempts::by_provider_key(book, &key).await.map_err(storage)? {
        Some(attempt) => attempt,
        None => {
            let attempt = Attempt {
                payment_id: Uuid::new_v4().to_string(),
                order_id: order.order_id.to_string(),
                account_id: account.as_str().to_owned(),
                amount_minor: order.amount_minor.digits().to_owned(),
                currency: order.currency.clone(),
                provider: PROVIDER.to_owned(),
                provider_key: key.clone(),
                operation_id: context.operation_id().to_owned(),
                state: "pending".to_owned(),
                open_call: 0,
                charge_id: None,
                created_at: CreatedAt::now().unix_micros(),
                settled_at: None,
            };
            match attempts::insert(book, &attempt).await.map_err(storage)? {
                Inserted::Created => attempt,
                Inserted::Blocked => return Err(blocked(book, &attempt).await),
            }
        }
    };
    if let Some(settled) = answer::for_state(&attempt) {
        // Settled (or unknown) already: the same answer again.
        return Ok(settled);
    }
    if attempt.call_open() && !payments.idempotent {
        // A call was sent and its answer never written; a provider without idempotency must
        // never be called again for it: unknown, for the operator.
        return Ok(unknown(book, &attempt).await);
    }
    if context.lease_lost() {
        return Err(reply(ApiProblem::records_unavailable(&"the payment's lease was lost")));
    }
    // The permit, durably, before anything is sent. (With an idempotent provider an open call
    // may be re-sent: the same key is deduplicated there.)
    if !attempt.call_open() && !attempts::open_call(book, &attempt.payment_id).await.map_err(storage)? {
        // Someone else took it or moved the attempt on: say what it is now.
        return match attempts::by_id(book, &attempt.payment_id).await.map_err(storage)? {
            Some(now) => Ok(answer::for_state(&now).unwrap_or_else(|| reply(problems::in_progress()))),
            None => Err(reply(ApiProblem::internal())),
        };
    }
    let charged = provider.charge(&key, &attempt.amount_minor, &attempt.currency, &attempt.order_id).await;
    match charged {
        Charged::NotExecuted => {
            // Definitively not executed: the permit goes back, the attempt stays pending, and
            // the record is released (a 503), so a retry with the same key tries again.
            attempts::close_call_not_executed(book, &attempt.payment_id).await.map_err(storage)?;
            Err(reply(problems::provider_unavailable()))
        }
        Charged::Unknown(why) => {
            eprintln!("orders: payment {} outcome unknown: {why}", attempt.payment_id);
            Ok(unknown(book, &attempt).await)
        }
        Charged::Done(charge) => match settle_from_charge(book, &attempt, &charge).await {
            Ok(settled) => Ok(answer::for_state(&settled).unwrap_or_else(|| unknown_response(&attempt))),
            // Charged, but the result could not be written: unknown, never released.
            Err(error) => {
                eprintln!("orders: payment {} charged, but not recorded: {error}", attempt.payment_id);
                Ok(unknown_response(&attempt))
            }
        },
    }
}

/// The 409 for an order whose live attempt is another's: paid, or in progress.
async fn blocked(book: &OrderBook, ours: &Attempt) -> Response {
    match attempts::of_order(book, &ours.order_id).await {
        Ok(all) if all.iter().any(|attempt| attempt.state == "succeeded") => problems::already_paid().into_response(),
        Ok(_) => problems::in_progress().into_response(),
        Err(error) => problems::storage(&error).into_response(),
    }
}

/// Marks the attempt unknown and answers 202 (the record becomes `unknown`). The attempt is
/// unknown in either case: if the mark is not written, the record's reconciler finds the call
/// open.
async fn unknown(book: &OrderBook, attempt: &Attempt) -> Response {
    if let Err(error) = attempts::mark_unknown(book, &attempt.payment_id).await {
        eprintln!("orders: payment {} could not be marked unknown: {error}", attempt.payment_id);
    }
    unknown_response(attempt)
}

fn unknown_response(attempt: &Attempt) -> Response {
    answer::into_response(answer::unknown(attempt), OutcomeClass::Unknown)
}
