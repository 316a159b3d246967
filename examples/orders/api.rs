//! The routes: authentication on every one, idempotency on `POST /orders` only, and the
//! handlers behind them.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::header::LOCATION;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
#[cfg(feature = "postgres")]
use sqlx::Postgres;
use sqlx::Sqlite;
use tower_idempotency::store::Admin;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, RolloutSwitch, Store, TxHandle};
use uuid::Uuid;

use super::auth::authenticate;
use super::book::account::Account;
use super::book::created_at::CreatedAt;
use super::book::order::Order;
use super::book::storage::{OrderBook, OrderTx};
use super::create_request::{draft_from_json, require_json};
use super::cursor::CursorCodec;
use super::lifecycle::Lifecycle;
use super::limits::RequestLimits;
use super::operations;
use super::problem::ApiProblem;

/// The operation name of order creation: the route's stable identity for the idempotency layer.
const CREATE_OPERATION: &str = "orders.create";
/// Page size when the client gives none.
const DEFAULT_PAGE_SIZE: usize = 20;
/// The largest page a client may ask for.
const MAX_PAGE_SIZE: usize = 100;

/// Where `created_at` comes from; tests inject their own to force equal timestamps.
pub(crate) type Clock = Arc<dyn Fn() -> CreatedAt + Send + Sync>;

/// What the handlers share.
#[derive(Clone)]
pub(crate) struct AppState {
    /// Where orders are read (they are written through the request's transaction, [`OrderTx`]).
    pub(crate) orders: OrderBook,
    /// Signs and checks pagination cursors.
    pub(crate) cursors: CursorCodec,
    /// Where `created_at` comes from: the system clock, or a test's.
    pub(crate) clock: Clock,
    /// The body deadline and the buffer budget of `POST /orders`.
    pub(crate) limits: RequestLimits,
    /// How long answers replay and tombstones are kept.
    pub(crate) lifecycle: Lifecycle,
}

/// The service: authentication on every route, idempotency on `POST /orders` only, and the
/// status of the caller's operations (`GET /operations/{operation_id}`, from the same store).
///
/// `idempotency_store` must be an atomic store on the same database as `state.orders`
/// (a `SqliteStore` beside `OrderBook::Sqlite`, a `PostgresStore` beside
/// `OrderBook::Postgres`): the create handler writes through its transaction.
#[allow(dead_code, reason = "the in-process tests build the router with it; the binary uses app_with_rollout")]
pub(crate) fn app<St: Store + Admin>(state: AppState, idempotency_store: St) -> Router {
    app_with_rollout(state, idempotency_store, RolloutSwitch::default())
}

/// [`app`], with the idempotency layer of `POST /orders` in the mode and cohort of `rollout`
/// (see `rollout.rs`).
pub(crate) fn app_with_rollout<St: Store + Admin>(
    state: AppState,
    idempotency_store: St,
    rollout: RolloutSwitch,
) -> Router {
    let operations = operations::routes(idempotency_store.clone());
    let idempotency = IdempotencyLayer::new(idempotency_store)
        .operation(CREATE_OPERATION)
        .retention(state.lifecycle.retention())
        .rollout(rollout);
    let idempotency = state.limits.apply(idempotency);
    // `layer` on a method router wraps only the handlers added before it: POST is guarded,
    // the GET added afterwards is not.
    let orders = post(create_order).layer(idempotency).get(list_orders);
    Router::new()
        .route("/orders", orders)
        .route("/orders/{order_id}", get(get_order))
        .merge(operations)
        // Router-wide layers run before the route's own, so an unauthenticated request never
        // reaches the idempotency layer and nothing is stored for it.
        .layer(middleware::from_fn(authenticate))
        .with_state(state)
}

/// `POST /orders`: validates the body and inserts the order, with its operation id, in the
/// idempotency claim's transaction.
async fn create_order(
    State(state): State<AppState>,
    account: Account,
    context: Option<IdempotencyContext>,
    transaction: OrderTx,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiProblem> {
    // Any early return drops `transaction` unused; the layer then rolls back (a 4xx is
    // released, so the key stays free for the corrected request).
    require_json(&headers)?;
    let draft = draft_from_json(&body).map_err(ApiProblem::validation_failed)?;
    // The layer gives the context whenever the request has a key, in every mode; in `off` or
    // `shadow` mode a request without one still creates an order (the old path), under an
    // operation id of its own.
    let operation_id = match &context {
        Some(context) => context.operation_id().to_owned(),
        None => Uuid::new_v4().to_string(),
    };
    let order = Order::new(account, draft, &operation_id, (state.clock)());
    // `insert` consumes the handle, so it is given back before the answer: the layer stores
    // the answer in the same transaction and commits the order and the answer together. If
    // the database fails instead, the 503 is released: the layer rolls the transaction back,
    // and the client's retry with the same key executes afresh.
    super::events::order_created(&state.orders, &transaction, context.as_ref(), &order).await?;
    transaction.insert(&order).await.map_err(ApiProblem::create_failed)?;
    let location = HeaderValue::try_from(order.location()).map_err(|_| ApiProblem::internal())?;
    Ok((StatusCode::CREATED, [(LOCATION, location)], Json(order)).into_response())
}

/// `GET /orders/{order_id}`: the caller's order, or 404 for anything else.
async fn get_order(
    State(state): State<AppState>,
    account: Account,
    order_id: Result<Path<String>, PathRejection>,
) -> Result<Json<Order>, ApiProblem> {
    let order_id = order_id.ok().and_then(|Path(raw)| Uuid::try_parse(&raw).ok()).ok_or_else(ApiProblem::not_found)?;
    let order = state.orders.get(&account, order_id).await.map_err(ApiProblem::read_failed)?;
    order.map(Json).ok_or_else(ApiProblem::not_found)
}

/// The query of `GET /orders`, parsed by hand for precise errors.
#[derive(Debug, Deserialize)]
struct ListQuery {
    limit: Option<String>,
    cursor: Option<String>,
}

/// One page of `GET /orders`.
#[derive(Debug, Serialize)]
struct OrderPage {
    orders: Vec<Order>,
    next_cursor: Option<String>,
}

/// `GET /orders?limit=&cursor=`: the caller's orders, newest first.
async fn list_orders(
    State(state): State<AppState>,
    account: Account,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<OrderPage>, ApiProblem> {
    let Query(query) = query.map_err(|rejection| ApiProblem::invalid_query(rejection.body_text()))?;
    let limit = parse_limit(query.limit.as_deref())?;
    let after = match query.cursor.as_deref() {
        Some(cursor) => Some(state.cursors.decode(cursor, &account).map_err(ApiProblem::invalid_cursor)?),
        None => None,
    };
    // One row more than asked tells whether another page follows.
    let mut orders = state.orders.page(&account, after, limit + 1).await.map_err(ApiProblem::read_failed)?;
    let next_cursor = if orders.len() > limit {
        orders.truncate(limit);
        orders.last().map(|last| state.cursors.encode(&account, last.position()))
    } else {
        None
    };
    Ok(Json(OrderPage { orders, next_cursor }))
}

/// `limit`: absent means the default; otherwise an integer from 1 to [`MAX_PAGE_SIZE`].
fn parse_limit(raw: Option<&str>) -> Result<usize, ApiProblem> {
    let Some(raw) = raw else {
        return Ok(DEFAULT_PAGE_SIZE);
    };
    raw.parse::<usize>()
        .ok()
        .filter(|limit| (1..=MAX_PAGE_SIZE).contains(limit))
        .ok_or_else(|| ApiProblem::invalid_limit(format!("limit must be an integer from 1 to {MAX_PAGE_SIZE}")))
}

/// The create handler's extractor: the claim's transaction, if it is on the order book's own
/// database.
impl FromRequestParts<AppState> for OrderTx {
    type Rejection = ApiProblem;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        // Only a transaction on the order book's own database will do.
        let transaction = match state.orders {
            OrderBook::Sqlite(_) => parts.extensions.get::<TxHandle<Sqlite>>().cloned().map(Self::Sqlite),
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(_) => parts.extensions.get::<TxHandle<Postgres>>().cloned().map(Self::Postgres),
        };
        // A bug, not an outage: the service was assembled with the wrong store.
        transaction.ok_or_else(|| {
            eprintln!("orders: no idempotency transaction for the order book's database; is the store atomic?");
            ApiProblem::internal()
        })
    }
}
