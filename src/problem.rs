//! The layer's own answers: `application/problem+json` (RFC 9457) for HTTP, with a stable
//! machine-readable `code` ([contract §3](crate::contract#3-answers)), and the matching trailers-only status for gRPC
//! ([`Problem::to_grpc`]).
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::problem::{Problem, ProblemCode};
//!
//! let problem = Problem::new(ProblemCode::RequestInFlight, "the first request is still running")
//!     .retry_after(Duration::from_secs(1));
//! let response = problem.to_http("urn:tower-idempotency:problem:");
//! assert_eq!(response.status(), 409);
//! assert_eq!(response.headers()["retry-after"], "1");
//! assert_eq!(response.headers()["content-type"], "application/problem+json");
//! ```

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// Every refusal the layer can answer with. Each has a stable `code` string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemCode {
    /// 400: the key is malformed, repeated, a list, empty, too long or not visible ASCII.
    KeyInvalid,
    /// 400: the route requires a key and the request has none.
    KeyMissing,
    /// 422 (or 409): the same key came with a different request.
    KeyReused,
    /// 409: the original request is still in flight after the bounded wait.
    RequestInFlight,
    /// 422: the key is past its retention; only a tombstone is left.
    KeyExpired,
    /// 409: an earlier attempt died and its outcome is unknown.
    OutcomeUnknown,
    /// 413: the request body is over the buffer limit.
    BodyTooLarge,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 503: the store could not be reached; the handler did not run.
    StoreUnavailable,
    /// 503: committing the outcome failed or its result is unknown; a retry is safe.
    CommitUncertain,
    /// 500: the response was too large to store; the effect was rolled back.
    ResponseTooLarge,
    /// 500: the handler's response body failed while it was read; the effect was rolled back.
    HandlerFailed,
    /// 500: the handler kept the transaction handle after answering; the effect was rolled back.
    HandleStillHeld,
    /// 401: no scope (tenant or principal) could be found for a guarded request.
    ScopeMissing,
    /// 500: a handler asked for its [`IdempotencyContext`](crate::IdempotencyContext) on a route
    /// the layer did not guard (a misconfiguration: the handler did not run).
    ContextMissing,
    /// 500: a handler asked for a transaction handle on a route without an atomic SQL store
    /// behind the layer (a misconfiguration: the handler did not run).
    TransactionMissing,
    /// 408: the request body did not arrive whole within the layer's body deadline.
    BodyTimeout,
    /// 503: the process's budget for buffered request bodies is spent; the body was not read.
    BufferBudgetExhausted,
}

impl ProblemCode {
    /// The stable machine-readable code.
    pub const fn code(self) -> &'static str {
        match self {
            ProblemCode::KeyInvalid => "idempotency_key_invalid",
            ProblemCode::KeyMissing => "idempotency_key_missing",
            ProblemCode::KeyReused => "idempotency_key_reused",
            ProblemCode::RequestInFlight => "idempotency_request_in_flight",
            ProblemCode::KeyExpired => "idempotency_key_expired",
            ProblemCode::OutcomeUnknown => "idempotency_outcome_unknown",
            ProblemCode::BodyTooLarge => "idempotency_body_too_large",
            ProblemCode::BodyUnreadable => "idempotency_body_unreadable",
            ProblemCode::StoreUnavailable => "idempotency_store_unavailable",
            ProblemCode::CommitUncertain => "idempotency_commit_uncertain",
            ProblemCode::ResponseTooLarge => "idempotency_response_too_large",
            ProblemCode::HandlerFailed => "idempotency_handler_failed",
            ProblemCode::HandleStillHeld => "idempotency_handle_still_held",
            ProblemCode::ScopeMissing => "idempotency_scope_missing",
            ProblemCode::ContextMissing => "idempotency_context_missing",
            ProblemCode::TransactionMissing => "idempotency_transaction_missing",
            ProblemCode::BodyTimeout => "idempotency_body_timeout",
            ProblemCode::BufferBudgetExhausted => "idempotency_buffer_budget_exhausted",
        }
    }

    /// The short human-readable summary (`title`).
    pub const fn title(self) -> &'static str {
        match self {
            ProblemCode::KeyInvalid => "Invalid Idempotency-Key",
            ProblemCode::KeyMissing => "Idempotency-Key required",
            ProblemCode::KeyReused => "Idempotency-Key reused with a different request",
            ProblemCode::RequestInFlight => "Original request still in flight",
            ProblemCode::KeyExpired => "Idempotency-Key expired",
            ProblemCode::OutcomeUnknown => "Outcome of an earlier attempt is unknown",
            ProblemCode::BodyTooLarge => "Request body too large",
            ProblemCode::BodyUnreadable => "Request body could not be read",
            ProblemCode::StoreUnavailable => "Idempotency store unavailable",
            ProblemCode::CommitUncertain => "Commit outcome uncertain",
            ProblemCode::ResponseTooLarge => "Response too large to store",
            ProblemCode::HandlerFailed => "Handler response failed",
            ProblemCode::HandleStillHeld => "Transaction handle still held",
            ProblemCode::ScopeMissing => "Idempotency scope missing",
            ProblemCode::ContextMissing => "Idempotency context missing",
            ProblemCode::TransactionMissing => "Idempotency transaction missing",
            ProblemCode::BodyTimeout => "Request body too slow",
            ProblemCode::BufferBudgetExhausted => "Request buffer budget exhausted",
        }
    }

    /// The default HTTP status (the mismatch status can be set to 409 per layer).
    pub const fn http_status(self) -> StatusCode {
        match self {
            ProblemCode::KeyInvalid | ProblemCode::KeyMissing | ProblemCode::BodyUnreadable => StatusCode::BAD_REQUEST,
            ProblemCode::KeyReused | ProblemCode::KeyExpired => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemCode::RequestInFlight | ProblemCode::OutcomeUnknown => StatusCode::CONFLICT,
            ProblemCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemCode::StoreUnavailable | ProblemCode::CommitUncertain => StatusCode::SERVICE_UNAVAILABLE,
            ProblemCode::ResponseTooLarge
            | ProblemCode::HandlerFailed
            | ProblemCode::HandleStillHeld
            | ProblemCode::ContextMissing
            | ProblemCode::TransactionMissing => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemCode::ScopeMissing => StatusCode::UNAUTHORIZED,
            ProblemCode::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ProblemCode::BufferBudgetExhausted => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The matching gRPC status code number (`google.rpc.Code`).
    pub const fn grpc_code(self) -> i32 {
        match self {
            ProblemCode::KeyInvalid | ProblemCode::KeyMissing | ProblemCode::BodyUnreadable => 3, // INVALID_ARGUMENT
            ProblemCode::KeyReused | ProblemCode::KeyExpired => 9,                                // FAILED_PRECONDITION
            ProblemCode::RequestInFlight | ProblemCode::OutcomeUnknown => 10,                     // ABORTED
            ProblemCode::BodyTooLarge => 8,                                                       // RESOURCE_EXHAUSTED
            ProblemCode::StoreUnavailable | ProblemCode::CommitUncertain => 14,                   // UNAVAILABLE
            ProblemCode::ResponseTooLarge
            | ProblemCode::HandlerFailed
            | ProblemCode::HandleStillHeld
            | ProblemCode::ContextMissing
            | ProblemCode::TransactionMissing => 13, // INTERNAL
            ProblemCode::ScopeMissing => 16,                                                      // UNAUTHENTICATED
            ProblemCode::BodyTimeout => 4,                                                        // DEADLINE_EXCEEDED
            ProblemCode::BufferBudgetExhausted => 14,                                             // UNAVAILABLE
        }
    }
}

/// One refusal: a code, a status, a detail for the client and an optional `Retry-After`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    code: ProblemCode,
    status: StatusCode,
    detail: String,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem with the code's default status.
    pub fn new(code: ProblemCode, detail: impl Into<String>) -> Self {
        Self { code, status: code.http_status(), detail: detail.into(), retry_after: None }
    }

    /// Overrides the HTTP status (used for the 409 mismatch option).
    pub fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds a `Retry-After` (whole seconds, rounded up, at least 1).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The problem's code.
    pub fn code(&self) -> ProblemCode {
        self.code
    }

    /// The detail text.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The problem+json document.
    pub fn to_json(&self, type_base: &str) -> String {
        let mut out = String::with_capacity(192 + self.detail.len());
        out.push_str("{\"type\":");
        push_json_string(&mut out, &format!("{type_base}{}", self.code.code()));
        out.push_str(",\"title\":");
        push_json_string(&mut out, self.code.title());
        out.push_str(",\"status\":");
        out.push_str(&self.status.as_u16().to_string());
        out.push_str(",\"detail\":");
        push_json_string(&mut out, &self.detail);
        out.push_str(",\"code\":");
        push_json_string(&mut out, self.code.code());
        out.push('}');
        out
    }

    /// The HTTP answer: status, `content-type: application/problem+json`, `Retry-After` when
    /// set, and the JSON document. `type_base` prefixes the code to form the `type` URI.
    pub fn to_http(&self, type_base: &str) -> Response<Bytes> {
        let mut response = Response::new(Bytes::from(self.to_json(type_base)));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(after) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        response
    }

    /// The gRPC answer: a trailers-only response (HTTP 200, `content-type: application/grpc`,
    /// no body) whose headers carry `grpc-status` (the code's
    /// [`grpc_code`](ProblemCode::grpc_code)), `grpc-message` (the detail, percent-encoded as
    /// the gRPC protocol requires), the stable code as `idempotency-code` metadata, and
    /// `retry-after` metadata (whole seconds) when set.
    ///
    /// ```
    /// use tower_idempotency::problem::{Problem, ProblemCode};
    ///
    /// let response = Problem::new(ProblemCode::KeyReused, "key used with 100% different data").to_grpc();
    /// assert_eq!(response.status(), 200);
    /// assert_eq!(response.headers()["content-type"], "application/grpc");
    /// assert_eq!(response.headers()["grpc-status"], "9"); // FAILED_PRECONDITION
    /// assert_eq!(response.headers()["grpc-message"], "key%20used%20with%20100%25%20different%20data");
    /// assert_eq!(response.headers()["idempotency-code"], "idempotency_key_reused");
    /// assert!(response.body().is_empty());
    /// ```
    pub fn to_grpc(&self) -> Response<Bytes> {
        let mut response = Response::new(Bytes::new());
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert("grpc-status", HeaderValue::from(self.code.grpc_code()));
        if let Ok(message) = HeaderValue::from_str(&grpc_percent_encode(&self.detail)) {
            headers.insert("grpc-message", message);
        }
        headers.insert("idempotency-code", HeaderValue::from_static(self.code.code()));
        if let Some(after) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        response
    }
}

/// The prefix of problem `type` URIs unless a layer sets its own
/// ([`problem_type_base`](crate::IdempotencyLayer::problem_type_base)).
pub const DEFAULT_TYPE_BASE: &str = "urn:tower-idempotency:problem:";

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for Problem {
    /// The problem+json answer with the default `type` prefix ([`DEFAULT_TYPE_BASE`]): how the
    /// crate's axum extractors refuse a request.
    fn into_response(self) -> axum::response::Response {
        self.to_http(DEFAULT_TYPE_BASE).map(axum::body::Body::from)
    }
}

/// Whole seconds, rounded up, at least 1.
fn retry_after_secs(after: Duration) -> u64 {
    (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1)
}

/// Percent-encodes a `grpc-message` value as the gRPC protocol (PROTOCOL-HTTP2.md) asks: every
/// UTF-8 byte outside `0x20..=0x7E`, and `%`, becomes `%XX`. Like tonic's encoder, this one also
/// encodes the space and `` "#<>`?{} ``; any conforming decoder reads them back.
pub(crate) fn grpc_percent_encode(text: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(text.len());
    for &byte in text.as_bytes() {
        if (0x21..=0x7E).contains(&byte) && !b"%\"#<>`?{}".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xF)]));
        }
    }
    out
}

/// Appends `text` as a JSON string literal.
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_json_has_every_member_and_escapes_detail() {
        let json = Problem::new(ProblemCode::KeyInvalid, "bad \"key\"\n").to_json("urn:x:");
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["type"], "urn:x:idempotency_key_invalid");
        assert_eq!(value["title"], "Invalid Idempotency-Key");
        assert_eq!(value["status"], 400);
        assert_eq!(value["detail"], "bad \"key\"\n");
        assert_eq!(value["code"], "idempotency_key_invalid");
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let r = Problem::new(ProblemCode::StoreUnavailable, "").retry_after(Duration::from_millis(1500)).to_http("");
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r = Problem::new(ProblemCode::StoreUnavailable, "").retry_after(Duration::ZERO).to_http("");
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
