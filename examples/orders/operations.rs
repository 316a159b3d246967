//! `GET /operations/{operation_id}` on the public API: what became of one of the caller's
//! idempotent requests, by the operation id the service gave it (an order's
//! `idempotency_operation_id`).
//!
//! 200 `{"operation_id", "state", "status", "location"}` for the caller's own operation:
//! `state` is `processing`, `succeeded` (a `completed` record), `failed`, `unknown` or
//! `expired`; `status` is the stored answer's HTTP status and `location` its `Location`
//! header, each null when there is none. Another account's operation, an unknown id and a
//! malformed one are all the same 404 `operation_not_found`: a caller learns nothing of other
//! accounts' operations. Authenticated like every route of the API.

use axum::Json;
use axum::Router;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::routing::get;
use serde::Serialize;
use tower_idempotency::store::{Admin, RecordInfo};
use tower_idempotency::{RecordState, Scope};

use super::book::account::Account;
use super::problem::ApiProblem;

/// The route, over `records` (the service's idempotency store), for any router state `S`.
pub(crate) fn routes<A: Admin, S: Clone + Send + Sync + 'static>(records: A) -> Router<S> {
    Router::new().route("/operations/{operation_id}", get(get_operation::<A>)).with_state(records)
}

/// An operation, as the caller sees it.
#[derive(Debug, Serialize)]
struct OperationView {
    operation_id: String,
    state: &'static str,
    status: Option<u16>,
    location: Option<String>,
}

impl OperationView {
    fn of(info: &RecordInfo) -> Self {
        Self {
            operation_id: info.operation_id.clone(),
            state: state_for_clients(info.state),
            status: info.status.map(|status| status.as_u16()),
            location: info.location.as_ref().and_then(|location| location.to_str().ok()).map(str::to_owned),
        }
    }
}

/// A record's state as an API client reads it: `completed` is `succeeded`.
fn state_for_clients(state: RecordState) -> &'static str {
    match state {
        RecordState::Completed => "succeeded",
        state => state.as_str(),
    }
}

/// `GET /operations/{operation_id}`.
async fn get_operation<A: Admin>(
    State(records): State<A>,
    account: Account,
    operation_id: Result<Path<String>, PathRejection>,
) -> Result<Json<OperationView>, ApiProblem> {
    let Ok(Path(operation_id)) = operation_id else {
        return Err(ApiProblem::operation_not_found());
    };
    let scope = Scope::new(account.as_str());
    let info =
        records.inspect_operation(&scope, &operation_id).await.map_err(|e| ApiProblem::records_unavailable(&e))?;
    info.map(|info| Json(OperationView::of(&info))).ok_or_else(ApiProblem::operation_not_found)
}
