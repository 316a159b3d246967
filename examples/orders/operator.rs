//! The operator routes of the idempotency records, on the operator listener (see `admin.rs`:
//! each requires `Authorization: Bearer <ORDERS_ADMIN_TOKEN>`, and all are absent when the
//! token is unset). JSON in and out; every error is problem+json.
//!
//! A record is named by the query parameters `account`, `operation` and `key` (the caller's
//! raw key, used only to compute the identity; raw keys are not stored). They are URL-encoded
//! like any query (`+` is a space: a key with a `+` is sent as `%2B`):
//!
//! - `GET /admin/idempotency/record?account=&operation=&key=`: 200 `{"state", "operation_id",
//!   "created_at", "updated_at", "expires_at", "status", "fencing_token"}`, or 404
//!   `record_not_found`. `state` is `processing`, `completed`, `failed`, `unknown` or
//!   `expired`; times are RFC 3339 UTC with microseconds (`expires_at`, when the record stops
//!   answering as it does now, is null for an `expired` one); `status` is the stored answer's
//!   HTTP status, or null.
//! - `DELETE /admin/idempotency/record?account=&operation=&key=`: 204, or 404. The record is
//!   gone whatever its state: the next request with that key executes afresh.
//! - `POST /admin/idempotency/record/settle?account=&operation=&key=` with
//!   `{"state": "completed"|"failed", "status": 201, "headers": {"name": "value"}, "body":
//!   "<text>"}`: 200 with the record as `GET` shows it; 404 `record_not_found`; 409
//!   `record_not_unknown` when the record is not `unknown` (only an unknown outcome is settled
//!   by hand). `status` is 200 to 399 for `completed`, 400 to 599 for `failed`; `headers` may
//!   name only what the layer stores (`content-type`, `location`, `etag`, `last-modified`,
//!   `link`, `content-language`, `content-location`); `headers` and `body` may be left out.
//!   Anything else is 422 `invalid_settlement`; a body not declared as JSON, 415.
//! - `GET /admin/idempotency/unknown?limit=N` (1 to 1000, default 100): `{"records": [{"operation",
//!   "operation_id", "age_seconds", "created_at", "updated_at", "fencing_token", "attempts"}]}`,
//!   oldest first; `age_seconds` is whole seconds since the claim, `attempts` how often a
//!   reconciler looked at it.
//! - `GET /admin/idempotency/counts`: `{"processing": n, "completed": n, "failed": n,
//!   "unknown": n, "expired": n}`.
//!
//! A query that is missing a parameter or cannot be read is 400 `invalid_query`; a store that
//! cannot answer, 503 `storage_unavailable` with `Retry-After: 1`.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use tower_idempotency::Retention;
use tower_idempotency::store::{Admin, RecordInfo, SettleError, SettleRequest, Settlement as StoreSettlement};

use super::admin::AdminRoutes;
use super::book::created_at::CreatedAt;
use super::operator_request::{MAX_SETTLEMENT_BYTES, RecordQuery, SettledAs, Settlement, UnknownQuery};
use super::problem::ApiProblem;

/// What the operator routes share.
#[derive(Clone)]
struct Operator<A> {
    records: A,
    /// The retention of an answer settled by hand.
    retention: Retention,
}

/// The operator routes over `records` (the service's idempotency store, behind its fast path
/// if it has one, so that a record changed here is never replayed from a stale cached copy).
pub(crate) fn routes<A: Admin>(records: A, retention: Retention) -> AdminRoutes {
    let operator = Router::new()
        .route("/admin/idempotency/record", get(inspect::<A>).delete(evict::<A>))
        .route("/admin/idempotency/record/settle", post(settle::<A>))
        .route("/admin/idempotency/unknown", get(list_unknown::<A>))
        .route("/admin/idempotency/counts", get(counts::<A>))
        .layer(DefaultBodyLimit::max(MAX_SETTLEMENT_BYTES))
        .with_state(Operator { records, retention });
    AdminRoutes { open: Router::new(), operator }
}

/// `GET /admin/idempotency/record`.
async fn inspect<A: Admin>(
    State(operator): State<Operator<A>>,
    query: Result<Query<RecordQuery>, QueryRejection>,
) -> Result<Json<RecordView>, ApiProblem> {
    let name = read_query(query)?.name()?;
    let info = operator.records.inspect(&name.id).await.map_err(|e| ApiProblem::records_unavailable(&e))?;
    info.map(|info| Json(RecordView::of(&info))).ok_or_else(ApiProblem::record_not_found)
}

/// `DELETE /admin/idempotency/record`.
async fn evict<A: Admin>(
    State(operator): State<Operator<A>>,
    query: Result<Query<RecordQuery>, QueryRejection>,
) -> Result<StatusCode, ApiProblem> {
    let name = read_query(query)?.name()?;
    match operator.records.evict(&name.id).await.map_err(|e| ApiProblem::records_unavailable(&e))? {
        true => Ok(StatusCode::NO_CONTENT),
        false => Err(ApiProblem::record_not_found()),
    }
}

/// `POST /admin/idempotency/record/settle`.
async fn settle<A: Admin>(
    State(operator): State<Operator<A>>,
    query: Result<Query<RecordQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiProblem> {
    let name = read_query(query)?.name()?;
    let settlement = Settlement::parse(&headers, &body)?;
    let settled = match settlement.state {
        SettledAs::Completed => StoreSettlement::Completed(settlement.response),
        SettledAs::Failed => StoreSettlement::Failed(settlement.response),
    };
    let request = SettleRequest::new(&name.id, settled).retention(operator.retention);
    match operator.records.settle(request).await {
        Ok(()) => {}
        Err(SettleError::NotFound) => return Err(ApiProblem::record_not_found()),
        Err(SettleError::NotUnknown(state)) => return Err(ApiProblem::record_not_unknown(state.as_str())),
        // Unfenced settlements are not superseded; should the store say so all the same, the
        // record moved on from `unknown` meanwhile.
        Err(SettleError::Superseded) => return Err(ApiProblem::record_not_unknown("no longer unknown")),
        Err(error) => return Err(ApiProblem::records_unavailable(&error)),
    }
    // The record as it is now (evicted meanwhile: the settlement still happened).
    let info = operator.records.inspect(&name.id).await.map_err(|e| ApiProblem::records_unavailable(&e))?;
    Ok(match info {
        Some(info) => Json(RecordView::of(&info)).into_response(),
        None => StatusCode::OK.into_response(),
    })
}

/// `GET /admin/idempotency/unknown`.
async fn list_unknown<A: Admin>(
    State(operator): State<Operator<A>>,
    query: Result<Query<UnknownQuery>, QueryRejection>,
) -> Result<Json<UnknownPage>, ApiProblem> {
    let limit = read_query(query)?.limit()?;
    let records = operator.records.list_unknown(limit).await.map_err(|e| ApiProblem::records_unavailable(&e))?;
    Ok(Json(UnknownPage { records: records.iter().map(UnknownView::of).collect() }))
}

/// `GET /admin/idempotency/counts`.
async fn counts<A: Admin>(State(operator): State<Operator<A>>) -> Result<Json<CountsView>, ApiProblem> {
    let counts = operator.records.counts().await.map_err(|e| ApiProblem::records_unavailable(&e))?;
    Ok(Json(CountsView {
        processing: counts.processing,
        completed: counts.completed,
        failed: counts.failed,
        unknown: counts.unknown,
        expired: counts.expired,
    }))
}

fn read_query<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, ApiProblem> {
    query.map(|Query(query)| query).map_err(|rejection| ApiProblem::invalid_query(rejection.body_text()))
}

/// A record, as `GET /admin/idempotency/record` shows it.
#[derive(Serialize)]
pub(crate) struct RecordView {
    state: &'static str,
    operation_id: String,
    created_at: String,
    updated_at: String,
    expires_at: Option<String>,
    status: Option<u16>,
    fencing_token: u64,
}

impl RecordView {
    fn of(info: &RecordInfo) -> Self {
        Self {
            state: info.state.as_str(),
            operation_id: info.operation_id.clone(),
            created_at: rfc3339(info.created_at),
            updated_at: rfc3339(info.updated_at),
            expires_at: info.expires_at.map(rfc3339),
            status: info.status.map(|status| status.as_u16()),
            fencing_token: info.fencing_token,
        }
    }
}

/// `GET /admin/idempotency/unknown`'s page.
#[derive(Serialize)]
struct UnknownPage {
    records: Vec<UnknownView>,
}

/// An `unknown` record in the list.
#[derive(Serialize)]
struct UnknownView {
    operation: Option<String>,
    operation_id: String,
    age_seconds: u64,
    created_at: String,
    updated_at: String,
    fencing_token: u64,
    attempts: u32,
}

impl UnknownView {
    fn of(info: &RecordInfo) -> Self {
        Self {
            operation: info.operation.clone(),
            operation_id: info.operation_id.clone(),
            age_seconds: info.age().as_secs(),
            created_at: rfc3339(info.created_at),
            updated_at: rfc3339(info.updated_at),
            fencing_token: info.fencing_token,
            attempts: info.attempts,
        }
    }
}

/// `GET /admin/idempotency/counts`.
#[derive(Serialize)]
struct CountsView {
    processing: u64,
    completed: u64,
    failed: u64,
    unknown: u64,
    expired: u64,
}

/// `time` as RFC 3339 UTC with microseconds, like an order's `created_at`.
pub(crate) fn rfc3339(time: SystemTime) -> String {
    let micros = match time.duration_since(UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
        Err(before) => -i64::try_from(before.duration().as_micros()).unwrap_or(i64::MAX),
    };
    CreatedAt::from_unix_micros(micros).to_string()
}
