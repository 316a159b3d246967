//! # A small fake payment provider, itself guarded by this crate
//!
//! The provider the orders service pays through (issue 14's flow), and a second reference
//! service: its `POST /v1/charges` is safe to retry because `IdempotencyLayer` guards it, so a
//! caller that timed out may send the same charge again with the same `Idempotency-Key` and is
//! charged once. Charges live in memory for the life of the process.
//!
//! ```text
//! cargo run --example psp
//! curl -i http://127.0.0.1:3100/v1/charges -H 'idempotency-key: pay-1' \
//!   -H 'content-type: application/json' -d '{"amount_minor":1200,"currency":"JPY","reference":"order-1"}'
//! curl -s 'http://127.0.0.1:3100/v1/charges?idempotency_key=pay-1'
//! ```
//!
//! ## The interface
//!
//! - `POST /v1/charges`, `Idempotency-Key` required, body `{"amount_minor": <integer>,
//!   "currency": "<3 letters>", "reference": "<string>"}` → 201 `{"charge_id", "status":
//!   "succeeded"|"declined", "amount_minor", "currency", "reference"}`. A charge whose
//!   `amount_minor` ends in the digits `402` is declined (a deterministic hook for tests). The
//!   same key with the same body replays the first answer (`idempotent-replayed: true`); the
//!   same key with another body is 422 `idempotency_key_reused`; a body that breaks the rules
//!   is 422 `validation_failed` (nothing charged, the key may be reused).
//! - `GET /v1/charges?idempotency_key=K` → `{"charges": [...]}` with zero or one charge: the
//!   lookup a reconciler uses. `GET /v1/charges` → every charge (for audits and tests). A
//!   charge listed here also carries its `idempotency_key` (`null` when the call had none).
//!
//! ## Environment
//!
//! - `PSP_ADDR`: where to listen (default `127.0.0.1:3100`; port `0` picks a free one). It
//!   prints `listening on HOST:PORT` once bound.
//! - `PSP_SEED` (default 1): the seed of the generator the faults are drawn with, so a run can
//!   be repeated.
//! - `PSP_FAIL_RATE` (0–1, default 0): that share of fresh executions answers 503
//!   `provider_unavailable` **without** executing (a replay is never failed: the layer answers
//!   it before the handler runs). The layer releases a 503, so the same key may try again.
//! - `PSP_AMBIGUOUS_RATE` (0–1, default 0): that share of fresh executions charges and commits
//!   (from then on the charge is visible to the lookup and the audit), then holds its answer for
//!   `PSP_STALL_MS` (default 10000), so the caller's timeout fires first: the ambiguous case. A
//!   call with the same key meanwhile gets the provider's own 409
//!   `idempotency_request_in_flight`; after the stall the answer is stored, and a retry replays
//!   it.
//! - `PSP_DELAY_MS` (default 0): latency added before executing every charge.
//! - `PSP_MODE=no_idempotency`: the provider with neither keys nor lookup. Every call executes a
//!   new charge (an `Idempotency-Key` is neither required nor honoured);
//!   `GET /v1/charges?idempotency_key=` answers 501 `lookup_unsupported`; the audit
//!   `GET /v1/charges` still works.
//!
//! A request, once it reaches the charge handler, runs to its end even when the caller hangs
//! up (it is spawned apart from the connection): a provider that charged must also store its
//! answer, or the next retry could not replay it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tower_idempotency::key::parse_key;
use tower_idempotency::{BoxError, IdempotencyLayer, MemoryStore};

/// How the provider behaves: its faults and whether it honours keys.
#[derive(Debug, Clone)]
struct Settings {
    idempotent: bool,
    fail_rate: f64,
    ambiguous_rate: f64,
    stall: Duration,
    delay: Duration,
}

impl Settings {
    fn from_env() -> Result<(Self, u64), BoxError> {
        let mode = std::env::var("PSP_MODE").unwrap_or_default();
        let idempotent = match mode.as_str() {
            "" | "idempotent" => true,
            "no_idempotency" => false,
            _ => return Err("PSP_MODE must be `idempotent` (the default) or `no_idempotency`".into()),
        };
        let rate = |name: &str| -> Result<f64, BoxError> {
            match std::env::var(name) {
                Err(_) => Ok(0.0),
                Ok(text) => match text.parse::<f64>() {
                    Ok(rate) if (0.0..=1.0).contains(&rate) => Ok(rate),
                    _ => Err(format!("{name} must be a number from 0 to 1").into()),
                },
            }
        };
        let millis = |name: &str, default: u64| -> Result<Duration, BoxError> {
            match std::env::var(name) {
                Err(_) => Ok(Duration::from_millis(default)),
                Ok(text) => {
                    text.parse().map(Duration::from_millis).map_err(|_| format!("{name} must be milliseconds").into())
                }
            }
        };
        let seed = match std::env::var("PSP_SEED") {
            Err(_) => 1,
            Ok(text) => text.parse().map_err(|_| "PSP_SEED must be an unsigned integer")?,
        };
        let settings = Settings {
            idempotent,
            fail_rate: rate("PSP_FAIL_RATE")?,
            ambiguous_rate: rate("PSP_AMBIGUOUS_RATE")?,
            stall: millis("PSP_STALL_MS", 10_000)?,
            delay: millis("PSP_DELAY_MS", 0)?,
        };
        Ok((settings, seed))
    }
}

/// One charge, as the provider keeps and shows it.
#[derive(Debug, Clone, Serialize)]
struct Charge {
    charge_id: String,
    status: &'static str,
    /// The client's integer literal, digits only.
    amount_minor: serde_json::Number,
    currency: String,
    reference: String,
    idempotency_key: Option<String>,
}

/// The provider's state: its charges, in the order they were made, and the fault generator.
#[derive(Clone)]
struct Provider {
    settings: Arc<Settings>,
    charges: Arc<Mutex<Vec<Charge>>>,
    /// splitmix64 state: faults are drawn from `PSP_SEED`.
    draws: Arc<Mutex<u64>>,
}

/// A fault drawn for one fresh execution.
enum Fault {
    None,
    Fail,
    Ambiguous,
}

impl Provider {
    fn new(settings: Settings, seed: u64) -> Self {
        Self { settings: Arc::new(settings), charges: Arc::default(), draws: Arc::new(Mutex::new(seed)) }
    }

    /// A uniform number in `[0, 1)` from the seeded generator.
    fn draw(&self) -> f64 {
        let mut state = self.draws.lock().expect("generator lock");
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn fault(&self) -> Fault {
        let draw = self.draw();
        if draw < self.settings.fail_rate {
            Fault::Fail
        } else if draw < self.settings.fail_rate + self.settings.ambiguous_rate {
            Fault::Ambiguous
        } else {
            Fault::None
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (settings, seed) = Settings::from_env()?;
    let address = std::env::var("PSP_ADDR").unwrap_or_else(|_| "127.0.0.1:3100".to_owned());
    let idempotent = settings.idempotent;
    let provider = Provider::new(settings, seed);

    let create = post(create_charge);
    let create = if idempotent {
        // One scope: the provider has one caller here. The provider's own in-flight answer is
        // immediate: a duplicate of a charge still running gets 409 at once.
        let idempotency = IdempotencyLayer::new(MemoryStore::new())
            .shared_scope("psp")
            .operation("charges.create")
            .in_flight_wait(Duration::ZERO);
        create.layer(idempotency)
    } else {
        create
    };
    let app = Router::new()
        .route("/v1/charges", create.layer(middleware::from_fn(run_to_the_end)).get(list_charges))
        .with_state(provider);

    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).with_graceful_shutdown(stop_signal()).await?;
    Ok(())
}

/// Resolves on Ctrl-C.
async fn stop_signal() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Runs the rest of the request in a task of its own, so a caller that hangs up does not cancel
/// a charge half way (between committing it and storing its answer).
async fn run_to_the_end(request: Request, next: Next) -> Response {
    match tokio::spawn(next.run(request)).await {
        Ok(response) => response,
        Err(_) => problem(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the charge handler failed"),
    }
}

/// The body of `POST /v1/charges`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChargeRequest {
    amount_minor: serde_json::Number,
    currency: String,
    reference: String,
}

/// Executes a charge (under the idempotency layer, once per key).
async fn create_charge(State(provider): State<Provider>, headers: HeaderMap, body: Bytes) -> Response {
    let request: ChargeRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => return problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed", &error.to_string()),
    };
    if request.amount_minor.as_u64().is_none() {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed", "amount_minor must be an integer >= 0");
    }
    if request.currency.len() != 3 || !request.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed", "currency must be 3 uppercase letters");
    }
    if request.reference.is_empty() || request.reference.len() > 128 {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed", "reference must be 1 to 128 bytes");
    }
    let key = if provider.settings.idempotent {
        // The layer has parsed and required it already; read it again to keep it for the lookup.
        parse_key(&headers, &axum::http::HeaderName::from_static("idempotency-key"))
            .ok()
            .flatten()
            .map(|k| k.as_str().to_owned())
    } else {
        None
    };

    tokio::time::sleep(provider.settings.delay).await;
    let fault = provider.fault();
    if let Fault::Fail = fault {
        return problem(StatusCode::SERVICE_UNAVAILABLE, "provider_unavailable", "not executed; try again");
    }
    let declined = request.amount_minor.to_string().ends_with("402");
    let charge = Charge {
        charge_id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
        status: if declined { "declined" } else { "succeeded" },
        amount_minor: request.amount_minor,
        currency: request.currency,
        reference: request.reference,
        idempotency_key: key,
    };
    // Committed: from here on the lookup and the audit see it, whatever happens to the answer.
    provider.charges.lock().expect("charges lock").push(charge.clone());
    if let Fault::Ambiguous = fault {
        tokio::time::sleep(provider.settings.stall).await;
    }
    let answer = json!({
        "charge_id": charge.charge_id,
        "status": charge.status,
        "amount_minor": charge.amount_minor,
        "currency": charge.currency,
        "reference": charge.reference,
    });
    (StatusCode::CREATED, Json(answer)).into_response()
}

/// `GET /v1/charges[?idempotency_key=K]`: the lookup, or the whole audit.
async fn list_charges(State(provider): State<Provider>, Query(query): Query<HashMap<String, String>>) -> Response {
    let charges = provider.charges.lock().expect("charges lock").clone();
    let Some(key) = query.get("idempotency_key") else {
        return Json(json!({ "charges": charges })).into_response();
    };
    if !provider.settings.idempotent {
        return problem(StatusCode::NOT_IMPLEMENTED, "lookup_unsupported", "this provider keeps no idempotency keys");
    }
    let found: Vec<&Charge> = charges.iter().filter(|charge| charge.idempotency_key.as_deref() == Some(key)).collect();
    Json(json!({ "charges": found })).into_response()
}

/// A problem+json answer.
fn problem(status: StatusCode, code: &str, detail: &str) -> Response {
    let body: Value = json!({
        "type": format!("urn:psp:problem:{code}"),
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
        "code": code,
    });
    (status, [(CONTENT_TYPE, "application/problem+json")], body.to_string()).into_response()
}
