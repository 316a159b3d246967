//! The crash drill: a leased route for proving recovery, off unless `ORDERS_CRASH_DRILL` is set.
//!
//! `POST /orders` is atomic: a crash leaves nothing behind, so it has nothing to recover. The
//! drill's route is the other kind, a handler whose effect lives *outside* the idempotency
//! record's transaction (as a call to a payment provider would):
//!
//! - `POST /drill/effects` (authenticated like every route, `Idempotency-Key` required, any
//!   body): the idempotency store claims the key in **leased** mode (committed as `processing`
//!   with a short lease, kept alive by the layer's heartbeat while the handler runs); the
//!   handler pauses a little, writes one row to `drill_effects` in a transaction of its own,
//!   pauses again, and answers 201 `{"effect_id", "operation_id"}` with
//!   `Location: /drill/effects/{effect_id}`.
//! - A process killed mid-handler leaves a `processing` record whose lease runs out. The
//!   recovery worker turns it into `unknown`, then runs the drill's **reconciler**: it looks
//!   for the effect row by the record's operation id. Found: the record is settled `completed`
//!   with the answer the handler would have given (the same bytes). Not found: the effect
//!   never happened, and cannot happen any more (its process is gone), so the record is
//!   released and the next retry executes.
//!
//! `ORDERS_CRASH_DRILL=blind` is the crash test's negative control: the same route declared
//! re-executable, without the reconciler (see [`DrillMode::Blind`]).
//!
//! `drill_effects` has no UNIQUE constraint on `operation_id`, on purpose: the crash test
//! counts rows per operation id, and a constraint would make that count unable to fail.
//!
//! The drill is not part of the service's interface; `tests/orders_recovery.rs` turns it on.

use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, LOCATION};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Serialize;
use tower_idempotency::recovery::Reconciliation;
use tower_idempotency::store::RecordInfo;
use tower_idempotency::{
    BoxError, IdempotencyContext, IdempotencyLayer, OutcomeClass, StaleLeasePolicy, Store, StoredResponse,
};
use uuid::Uuid;

use super::auth::authenticate;
use super::book::account::Account;
use super::book::storage::OrderBook;
use super::lifecycle::Lifecycle;
use super::problem::ApiProblem;

/// The drill route's operation name.
pub(crate) const DRILL_OPERATION: &str = "drill.effect";
/// The drill route's lease: short, so a killed holder's record is found stale soon; the
/// heartbeat keeps a live handler's claim however long it runs.
pub(crate) const DRILL_LEASE: Duration = Duration::from_secs(1);
/// The longest pause before and after the effect.
const MAX_PAUSE_MS: u64 = 150;

/// How the drill recovers what a killed process left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DrillMode {
    /// `ORDERS_CRASH_DRILL=1`: a stale lease makes the record `unknown`, and the drill's
    /// reconciler settles it from the evidence.
    Reconciled,
    /// `ORDERS_CRASH_DRILL=blind`, the crash test's negative control: the route declares itself
    /// re-executable (a retry that finds a stale lease runs the handler again) and no reconciler
    /// looks at the evidence, so an effect whose answer was lost is done twice.
    Blind,
}

/// The drill's mode from `ORDERS_CRASH_DRILL`: unset or empty is off, `1` and `blind` are the
/// modes above, anything else stops the start.
pub(crate) fn mode_from_env() -> Result<Option<DrillMode>, BoxError> {
    match std::env::var("ORDERS_CRASH_DRILL").ok().filter(|value| !value.is_empty()).as_deref() {
        None => Ok(None),
        Some("1") => Ok(Some(DrillMode::Reconciled)),
        Some("blind") => Ok(Some(DrillMode::Blind)),
        Some(_) => Err("ORDERS_CRASH_DRILL must be 1, blind, or unset (off)".into()),
    }
}

/// The table of effects, created if missing.
const SQLITE_CREATE: &str = "
    CREATE TABLE IF NOT EXISTS drill_effects (
        effect_id    TEXT   NOT NULL PRIMARY KEY,
        operation_id TEXT   NOT NULL,
        account_id   TEXT   NOT NULL
    );
    CREATE INDEX IF NOT EXISTS drill_effects_operation_idx ON drill_effects (operation_id);";
#[cfg(feature = "postgres")]
const POSTGRES_CREATE: &str = "
    CREATE TABLE IF NOT EXISTS drill_effects (
        effect_id    text NOT NULL PRIMARY KEY,
        operation_id text NOT NULL,
        account_id   text NOT NULL
    );
    CREATE INDEX IF NOT EXISTS drill_effects_operation_idx ON drill_effects (operation_id);";
/// Binds: effect_id, operation_id, account_id (the same text in both dialects).
const INSERT: &str = "INSERT INTO drill_effects (effect_id, operation_id, account_id) VALUES ($1, $2, $3)";
/// Binds: operation_id. The first effect, should there be several (the test counts them).
const FIND: &str = "SELECT effect_id FROM drill_effects WHERE operation_id = $1 ORDER BY effect_id LIMIT 1";

/// Creates `drill_effects` if it is missing.
pub(crate) async fn create_table(book: &OrderBook) -> Result<(), BoxError> {
    match book {
        OrderBook::Sqlite(pool) => {
            sqlx::raw_sql(SQLITE_CREATE).execute(pool).await?;
        }
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pool) => {
            sqlx::raw_sql(POSTGRES_CREATE).execute(pool).await?;
        }
    }
    Ok(())
}

/// Writes one effect, committed on its own (autocommit), apart from the idempotency record.
pub(crate) async fn write_effect(
    book: &OrderBook,
    effect_id: &str,
    operation_id: &str,
    account: &str,
) -> Result<(), sqlx::Error> {
    match book {
        OrderBook::Sqlite(pool) => {
            sqlx::query(INSERT).bind(effect_id).bind(operation_id).bind(account).execute(pool).await?;
        }
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pool) => {
            sqlx::query(INSERT).bind(effect_id).bind(operation_id).bind(account).execute(pool).await?;
        }
    }
    Ok(())
}

/// The effect of `operation_id`, if one was written: the reconciler's evidence.
pub(crate) async fn find_effect(book: &OrderBook, operation_id: &str) -> Result<Option<String>, sqlx::Error> {
    match book {
        OrderBook::Sqlite(pool) => sqlx::query_scalar(FIND).bind(operation_id).fetch_optional(pool).await,
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pool) => sqlx::query_scalar(FIND).bind(operation_id).fetch_optional(pool).await,
    }
}

/// The answer of an effect, the same bytes whether the handler gives it or the reconciler
/// rebuilds it from the row.
#[derive(Serialize)]
struct EffectBody<'a> {
    effect_id: &'a str,
    operation_id: &'a str,
}

/// The 201 of effect `effect_id` of `operation_id`, as stored for replay.
pub(crate) fn effect_answer(effect_id: &str, operation_id: &str) -> StoredResponse {
    let body = serde_json::to_vec(&EffectBody { effect_id, operation_id }).unwrap_or_default();
    let mut response = StoredResponse::new(StatusCode::CREATED, body);
    response.headers.push((CONTENT_TYPE, HeaderValue::from_static("application/json")));
    // An effect id is a UUID: always a valid header value.
    if let Ok(location) = HeaderValue::try_from(format!("/drill/effects/{effect_id}")) {
        response.headers.push((LOCATION, location));
    }
    response
}

/// `answer` as the handler's response.
pub(crate) fn into_response(answer: StoredResponse) -> Response {
    let mut response = (answer.status, answer.body).into_response();
    for (name, value) in answer.headers {
        response.headers_mut().insert(name, value);
    }
    response
}

/// A pause of 0 to [`MAX_PAUSE_MS`] ms, so kills land before, during and after the effect.
pub(crate) async fn pause() {
    let random = Uuid::new_v4().as_u128() as u64;
    tokio::time::sleep(Duration::from_millis(random % (MAX_PAUSE_MS + 1))).await;
}

/// What the drill's handler shares.
#[derive(Clone)]
struct Drill {
    book: OrderBook,
}

/// `POST /drill/effects` over the leased store `records`, behind its own authentication (the
/// router is merged after the API's authentication layer, which covers only its own routes).
pub(crate) fn routes<St: Store>(book: OrderBook, records: St, lifecycle: &Lifecycle, mode: DrillMode) -> Router {
    let stale_lease = match mode {
        DrillMode::Reconciled => StaleLeasePolicy::MarkUnknown,
        DrillMode::Blind => StaleLeasePolicy::Reexecute,
    };
    let idempotency = IdempotencyLayer::new(records)
        .operation(DRILL_OPERATION)
        .lease(DRILL_LEASE)
        .stale_lease(stale_lease)
        .retention(lifecycle.retention());
    Router::new()
        .route("/drill/effects", post(create_effect).layer(idempotency))
        .layer(middleware::from_fn(authenticate))
        .with_state(Drill { book })
}

/// `POST /drill/effects`: pause, write the effect on its own, pause, answer.
async fn create_effect(State(drill): State<Drill>, account: Account, context: IdempotencyContext) -> Response {
    pause().await;
    if context.lease_lost() {
        // The claim is someone else's now: stop before the effect. (The layer answers 503
        // `idempotency_commit_uncertain` whatever this says.)
        return ApiProblem::records_unavailable(&"the drill's lease was lost").into_response();
    }
    let effect_id = Uuid::new_v4().to_string();
    let operation_id = context.operation_id();
    if let Err(error) = write_effect(&drill.book, &effect_id, operation_id, account.as_str()).await {
        // The INSERT may have committed before its answer was lost: the outcome is unknown,
        // not released (a release would let the retry write a second effect). The reconciler
        // settles it from the table.
        eprintln!("orders: drill effect outcome unknown: {error}");
        let mut response = ApiProblem::records_unavailable(&error).into_response();
        response.extensions_mut().insert(OutcomeClass::Unknown);
        return response;
    }
    pause().await;
    into_response(effect_answer(&effect_id, operation_id))
}

/// The drill's reconciler: the effect row of the record's operation id is the evidence. Found:
/// the effect happened, and the record completes with the handler's answer. Not found: it
/// never happened and cannot any more (its process is gone; a live holder keeps its lease with
/// the heartbeat and stops before its effect once it loses it), so the record is released. A
/// database that cannot answer leaves the record unknown, asked again after its backoff.
pub(crate) async fn reconcile(book: OrderBook, record: RecordInfo) -> Reconciliation {
    match find_effect(&book, &record.operation_id).await {
        Ok(Some(effect_id)) => Reconciliation::Completed(effect_answer(&effect_id, &record.operation_id)),
        Ok(None) => Reconciliation::NotExecuted,
        Err(error) => {
            eprintln!("orders: the drill's reconciler could not read its evidence: {error}");
            Reconciliation::StillUnknown
        }
    }
}
