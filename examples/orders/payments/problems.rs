//! The payment routes' own error answers (problem+json, like every answer of the service).

use axum::http::StatusCode;

use super::super::problem::ApiProblem;

/// 503: `PSP_URL` is unset, so the service takes no payments.
pub(crate) fn payments_unavailable() -> ApiProblem {
    ApiProblem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "payments_unavailable",
        "Payments unavailable",
        "this service is not connected to a payment provider",
    )
}

/// 503: the provider said it did not execute the charge; the same key may try again, with the
/// same attempt.
pub(crate) fn provider_unavailable() -> ApiProblem {
    ApiProblem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "payment_provider_unavailable",
        "Payment provider unavailable",
        "the payment provider did not execute the charge; retrying with the same Idempotency-Key is safe",
    )
}

/// 409: a payment of the order succeeded already (under any key).
pub(crate) fn already_paid() -> ApiProblem {
    ApiProblem::new(StatusCode::CONFLICT, "order_already_paid", "Order already paid", "this order is paid")
}

/// 409: another key's attempt on this order is pending or unknown.
pub(crate) fn in_progress() -> ApiProblem {
    ApiProblem::new(
        StatusCode::CONFLICT,
        "payment_in_progress",
        "Payment in progress",
        "another payment attempt of this order is pending or its outcome is unknown; retry that one's key",
    )
}

/// 422: the body of `POST /orders/{order_id}/payments` is not `{}`.
pub(crate) fn invalid_body() -> ApiProblem {
    ApiProblem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "validation_failed",
        "The payment request is not valid",
        "the body must be the empty JSON object {}",
    )
}

/// 404 on the operator route: no such payment.
pub(crate) fn payment_not_found() -> ApiProblem {
    ApiProblem::new(StatusCode::NOT_FOUND, "payment_not_found", "Payment not found", "no payment with this id")
}

/// 409 on the operator route: only an `unknown` payment is settled by hand.
pub(crate) fn payment_not_unknown(state: &str) -> ApiProblem {
    ApiProblem::new(
        StatusCode::CONFLICT,
        "payment_not_unknown",
        "Payment is not unknown",
        format!("only an unknown payment can be settled by hand; this one is {state}"),
    )
}

/// 422 on the operator route: the settlement is not valid.
pub(crate) fn invalid_settlement(detail: &str) -> ApiProblem {
    ApiProblem::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_settlement", "The settlement is not valid", detail)
}

/// 503 or the like: the payments table could not be read or written.
pub(crate) fn storage(error: &dyn std::fmt::Display) -> ApiProblem {
    eprintln!("orders: payments storage unavailable: {error}");
    ApiProblem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "storage_unavailable",
        "Storage unavailable",
        "the payments could not be read or written; try again",
    )
}
