//! Every error answer of the service: `application/problem+json` (RFC 9457) with a stable
//! `code`, and the headers that go with its status.

use axum::http::header::{CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::book::storage::StorageError;

const PROBLEM_TYPE_BASE: &str = "urn:orders:problem:";

/// An error answer: `application/problem+json` with a stable `code`.
#[derive(Debug, Clone)]
pub(crate) struct ApiProblem {
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: String,
}

#[derive(Serialize)]
struct ProblemDocument<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    code: &'a str,
}

impl ApiProblem {
    pub(crate) fn new(status: StatusCode, code: &'static str, title: &'static str, detail: impl Into<String>) -> Self {
        Self { status, code, title, detail: detail.into() }
    }

    /// 401: no usable `Authorization: Bearer <account>`.
    pub(crate) fn unauthenticated(detail: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", "Authentication required", detail)
    }

    /// 422: the order in the body breaks a rule.
    pub(crate) fn validation_failed(detail: String) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed", "The order is not valid", detail)
    }

    /// 415: the body is not declared as JSON.
    pub(crate) fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Unsupported media type",
            "send the order as `content-type: application/json`",
        )
    }

    /// 404: no such order for this account (whether it exists elsewhere is not said).
    pub(crate) fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "order_not_found", "Order not found", "no order with this id for this account")
    }

    /// 404 on the operator listener: no such route (or the operator routes are off).
    pub(crate) fn admin_not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "Not found", "no such route on the operator listener")
    }

    /// 404 on `GET /operations/{operation_id}`: no such operation for this account (another
    /// account's, an unknown id and a malformed id are the same answer).
    pub(crate) fn operation_not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "operation_not_found",
            "Operation not found",
            "no operation with this id for this account",
        )
    }

    /// 404 on the operator routes: no idempotency record for this account, operation and key.
    pub(crate) fn record_not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "record_not_found",
            "Record not found",
            "no idempotency record for this account, operation and key",
        )
    }

    /// 409 on `POST /admin/idempotency/record/settle`: only an `unknown` record can be settled.
    pub(crate) fn record_not_unknown(state: &str) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "record_not_unknown",
            "Record is not unknown",
            format!("only an unknown record can be settled by hand; this one is {state}"),
        )
    }

    /// 422 on `POST /admin/idempotency/record/settle`: the settlement breaks a rule.
    pub(crate) fn invalid_settlement(detail: String) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_settlement", "The settlement is not valid", detail)
    }

    /// 415 on an operator route that takes a body: the body is not declared as JSON.
    pub(crate) fn json_required() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Unsupported media type",
            "send the body as `content-type: application/json`",
        )
    }

    /// 503 on the operator routes and `GET /operations/{operation_id}`: the idempotency store
    /// could not answer; nothing changed. The cause goes to stderr.
    pub(crate) fn records_unavailable(error: &dyn std::fmt::Display) -> Self {
        eprintln!("orders: idempotency store unavailable: {error}");
        Self::storage_unavailable("the idempotency records could not be read or changed; try again")
    }

    /// 400: `limit` is out of range or not a number.
    pub(crate) fn invalid_limit(detail: String) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_limit", "Invalid limit", detail)
    }

    /// 400: the query string could not be read at all.
    pub(crate) fn invalid_query(detail: String) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_query", "Invalid query", detail)
    }

    /// 400: the cursor is tampered, malformed, of another version or another account's.
    pub(crate) fn invalid_cursor(detail: &str) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_cursor", "Invalid cursor", detail)
    }

    /// 503: the database failed; nothing changed, and the same request may be retried. Answered
    /// with `Retry-After: 1`.
    fn storage_unavailable(detail: &'static str) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", "Storage unavailable", detail)
    }

    /// 500: something that cannot happen did.
    pub(crate) fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "Internal error", "an unexpected error occurred")
    }

    /// The answer to a failed `POST /orders`: 503 (nothing was created, the same key may be
    /// retried) or 500.
    pub(crate) fn create_failed(error: StorageError) -> Self {
        Self::storage_failed(
            error,
            "the order could not be stored, so nothing was created; \
             retrying with the same Idempotency-Key is safe",
        )
    }

    /// The answer to a failed `GET`: 503 or 500.
    pub(crate) fn read_failed(error: StorageError) -> Self {
        Self::storage_failed(error, "the orders could not be read; try again")
    }

    /// 503 or 500; the cause goes to stderr (sqlx's messages carry no bound values), never to
    /// the client.
    fn storage_failed(error: StorageError, unavailable: &'static str) -> Self {
        match error {
            StorageError::Unavailable(error) => {
                eprintln!("orders: storage unavailable: {error}");
                Self::storage_unavailable(unavailable)
            }
            StorageError::Internal(error) => {
                eprintln!("orders: internal error: {error}");
                Self::internal()
            }
        }
    }

    /// The problem+json body of this answer (for answers stored without going through a
    /// response, such as a reconciler's).
    pub(crate) fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(&self.document()).unwrap_or_default()
    }

    fn document(&self) -> ProblemDocument<'_> {
        ProblemDocument {
            kind: format!("{PROBLEM_TYPE_BASE}{}", self.code),
            title: self.title,
            status: self.status.as_u16(),
            detail: &self.detail,
            code: self.code,
        }
    }
}

impl IntoResponse for ApiProblem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.document()).unwrap_or_default();
        let mut response = (self.status, [(CONTENT_TYPE, "application/problem+json")], body).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"orders\""));
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
