//! The answers of `POST /orders/{order_id}/payments`, built from the attempt row alone, so the
//! handler and the reconciler give the same bytes for the same attempt.

use axum::http::header::{CONTENT_TYPE, LOCATION};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::value::RawValue;
use tower_idempotency::{OutcomeClass, StoredResponse};

use super::super::problem::ApiProblem;
use super::attempts::Attempt;

#[derive(Serialize)]
struct Succeeded<'a> {
    payment_id: &'a str,
    order_id: &'a str,
    status: &'static str,
    charge_id: Option<&'a str>,
    amount_minor: &'a RawValue,
    currency: &'a str,
}

#[derive(Serialize)]
struct Unknown<'a> {
    payment_id: &'a str,
    order_id: &'a str,
    status: &'static str,
    operation_id: &'a str,
}

/// 201 for a `succeeded` attempt, with `Location: /orders/{order_id}/payments/{payment_id}`.
pub(crate) fn succeeded(attempt: &Attempt) -> StoredResponse {
    let amount = RawValue::from_string(attempt.amount_minor.clone())
        .unwrap_or_else(|_| RawValue::from_string("null".to_owned()).expect("null is JSON"));
    let body = Succeeded {
        payment_id: &attempt.payment_id,
        order_id: &attempt.order_id,
        status: "succeeded",
        charge_id: attempt.charge_id.as_deref(),
        amount_minor: &amount,
        currency: &attempt.currency,
    };
    let mut stored = StoredResponse::new(StatusCode::CREATED, serde_json::to_vec(&body).unwrap_or_default());
    stored.headers.push((CONTENT_TYPE, HeaderValue::from_static("application/json")));
    let location = format!("/orders/{}/payments/{}", attempt.order_id, attempt.payment_id);
    if let Ok(location) = HeaderValue::try_from(location) {
        stored.headers.push((LOCATION, location));
    }
    stored
}

/// 402 `payment_declined` for a `declined` attempt.
pub(crate) fn declined(attempt: &Attempt) -> StoredResponse {
    let problem = ApiProblem::new(
        StatusCode::PAYMENT_REQUIRED,
        "payment_declined",
        "Payment declined",
        format!("the provider declined payment {}; a new attempt needs a new Idempotency-Key", attempt.payment_id),
    );
    let mut stored = StoredResponse::new(StatusCode::PAYMENT_REQUIRED, problem.to_json());
    stored.headers.push((CONTENT_TYPE, HeaderValue::from_static("application/problem+json")));
    stored
}

/// 202 for an attempt whose outcome is unknown, with `Location: /operations/{operation_id}`.
pub(crate) fn unknown(attempt: &Attempt) -> StoredResponse {
    let body = Unknown {
        payment_id: &attempt.payment_id,
        order_id: &attempt.order_id,
        status: "unknown",
        operation_id: &attempt.operation_id,
    };
    let mut stored = StoredResponse::new(StatusCode::ACCEPTED, serde_json::to_vec(&body).unwrap_or_default());
    stored.headers.push((CONTENT_TYPE, HeaderValue::from_static("application/json")));
    if let Ok(location) = HeaderValue::try_from(format!("/operations/{}", attempt.operation_id)) {
        stored.headers.push((LOCATION, location));
    }
    stored
}

/// The answer the attempt's state calls for, as the handler gives it (marked for the layer):
/// 201 (complete), 402 (stored as a rejection) or 202 (unknown). `None` for a `pending` one.
pub(crate) fn for_state(attempt: &Attempt) -> Option<Response> {
    let (stored, class) = match attempt.state.as_str() {
        "succeeded" => (succeeded(attempt), OutcomeClass::Complete),
        "declined" => (declined(attempt), OutcomeClass::Reject),
        "unknown" => (unknown(attempt), OutcomeClass::Unknown),
        _ => return None,
    };
    Some(into_response(stored, class))
}

/// `stored` as the handler's response, marked with `class`.
pub(crate) fn into_response(stored: StoredResponse, class: OutcomeClass) -> Response {
    let mut response = (stored.status, stored.body).into_response();
    for (name, value) in stored.headers {
        response.headers_mut().insert(name, value);
    }
    response.extensions_mut().insert(class);
    response
}
