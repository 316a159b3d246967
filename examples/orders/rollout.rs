//! Rolling the idempotency layer out on `POST /orders`: the mode and the enforced cohort, from
//! the environment at start and from the operator listener at run time.
//!
//! - `ORDERS_IDEMPOTENCY_MODE` = `enforce` (default) | `shadow` | `off`.
//! - `ORDERS_IDEMPOTENCY_COHORT` = a comma-separated list of account ids: when set, those
//!   accounts are enforced and every other account gets `ORDERS_IDEMPOTENCY_MODE`.
//! - `GET /admin/idempotency/rollout` and `PUT /admin/idempotency/rollout` (operator token) show
//!   and change both: `{"mode": "enforce"|"shadow"|"off", "cohort": ["acct", ...] | null}`. A
//!   change applies to the next request. A body that is not that JSON is refused with 422
//!   `validation_failed` (415 `unsupported_media_type` without a JSON content type).
//!
//! In `off` and `shadow` mode `POST /orders` takes the old path: every call creates an order
//! (a duplicate creates a second one) in a plain transaction of the same database, answered
//! 201 as before, without `idempotent-replayed`. `orders_duplicate_effects` (see
//! `telemetry.rs`) shows what that costs.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tower_idempotency::{BoxError, Cohort, RolloutMode, RolloutSwitch};

use super::admin::AdminRoutes;
use super::book::account::Account;
use super::create_request::require_json;
use super::problem::ApiProblem;

/// The most accounts a cohort may list.
const MAX_COHORT: usize = 10_000;

/// The rollout as the operator routes show and take it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Rollout {
    mode: String,
    #[serde(default)]
    cohort: Option<Vec<String>>,
}

/// The switch `ORDERS_IDEMPOTENCY_MODE` and `ORDERS_IDEMPOTENCY_COHORT` describe.
pub(crate) fn switch_from_env() -> Result<RolloutSwitch, BoxError> {
    switch_from_vars(|name| std::env::var(name).ok())
}

/// [`switch_from_env`], reading the variables through `var`.
pub(crate) fn switch_from_vars(var: impl Fn(&str) -> Option<String>) -> Result<RolloutSwitch, BoxError> {
    let mode = match var("ORDERS_IDEMPOTENCY_MODE").filter(|mode| !mode.is_empty()) {
        None => RolloutMode::Enforce,
        Some(mode) => RolloutMode::parse(&mode).ok_or("ORDERS_IDEMPOTENCY_MODE must be one of enforce, shadow, off")?,
    };
    let switch = RolloutSwitch::new(mode);
    if let Some(list) = var("ORDERS_IDEMPOTENCY_COHORT").filter(|list| !list.trim().is_empty()) {
        let accounts: Vec<String> =
            list.split(',').map(str::trim).filter(|a| !a.is_empty()).map(str::to_owned).collect();
        switch.set_cohort(Some(cohort(accounts).map_err(|detail| format!("ORDERS_IDEMPOTENCY_COHORT: {detail}"))?));
    }
    Ok(switch)
}

/// The cohort of `accounts`, each a valid account id.
fn cohort(accounts: Vec<String>) -> Result<Cohort, String> {
    if accounts.len() > MAX_COHORT {
        return Err(format!("a cohort lists at most {MAX_COHORT} accounts"));
    }
    if let Some(bad) = accounts.iter().position(|account| Account::parse(account).is_none()) {
        return Err(format!("entry {bad} is not an account id (1 to 64 visible ASCII characters)"));
    }
    Ok(Cohort::scopes(accounts))
}

/// What the switch is set to now.
fn current(switch: &RolloutSwitch) -> Rollout {
    let cohort = switch.cohort().map(|cohort| cohort.listed().map(<[String]>::to_vec).unwrap_or_default());
    Rollout { mode: switch.get().as_str().to_owned(), cohort }
}

/// The operator routes of the rollout, on `switch`.
pub(crate) fn routes(switch: RolloutSwitch) -> AdminRoutes {
    let operator = Router::new().route("/admin/idempotency/rollout", get(show).put(change)).with_state(switch);
    AdminRoutes { open: Router::new(), operator }
}

/// `GET /admin/idempotency/rollout`.
async fn show(State(switch): State<RolloutSwitch>) -> Json<Rollout> {
    Json(current(&switch))
}

/// `PUT /admin/idempotency/rollout`: the new mode and cohort, for the next request.
async fn change(
    State(switch): State<RolloutSwitch>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<Rollout>, ApiProblem> {
    require_json(&headers)?;
    let wanted: Rollout = serde_json::from_slice(&body).map_err(|error| {
        ApiProblem::validation_failed(format!(
            "the body must be {{\"mode\": \"enforce\"|\"shadow\"|\"off\", \"cohort\": [account, ...] | null}}: {error}"
        ))
    })?;
    let mode = RolloutMode::parse(&wanted.mode)
        .ok_or_else(|| ApiProblem::validation_failed("mode must be one of enforce, shadow, off".to_owned()))?;
    let cohort = wanted.cohort.map(cohort).transpose().map_err(ApiProblem::validation_failed)?;
    // Two settings, one after the other: a request in between sees the new cohort with the old
    // mode.
    switch.set_cohort(cohort);
    switch.set(mode);
    eprintln!(
        "orders: idempotency rollout set to {} ({})",
        mode.as_str(),
        match switch.cohort() {
            Some(cohort) => format!("cohort of {}", cohort.listed().map_or(0, <[String]>::len)),
            None => "no cohort".to_owned(),
        }
    );
    Ok(Json(current(&switch)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_idempotency::Scope;

    #[test]
    fn the_environment_sets_the_mode_and_the_cohort() {
        let vars = |mode: &'static str, cohort: &'static str| {
            move |name: &str| match name {
                "ORDERS_IDEMPOTENCY_MODE" => Some(mode.to_owned()),
                "ORDERS_IDEMPOTENCY_COHORT" => Some(cohort.to_owned()),
                _ => None,
            }
        };
        let switch = switch_from_vars(vars("shadow", "acct_1, acct_2")).expect("valid");
        assert_eq!(switch.get(), RolloutMode::Shadow);
        assert_eq!(switch.mode_for(Some(&Scope::new("acct_2"))), RolloutMode::Enforce);
        assert_eq!(switch.mode_for(Some(&Scope::new("acct_3"))), RolloutMode::Shadow);
        assert_eq!(switch_from_vars(vars("", "")).expect("defaults").get(), RolloutMode::Enforce);
        assert!(switch_from_vars(vars("on", "")).is_err());
        assert!(switch_from_vars(vars("off", "a b")).is_err(), "a space is not part of an account id");
    }
}
