//! The operator listener: a second address (`ORDERS_ADMIN_ADDR`, default `127.0.0.1:3001`) for
//! the people who run the service, apart from the public API.
//!
//! Two kinds of route live on it:
//!
//! - **open** routes (`GET /metrics`), with no authentication: a scraper on the operators'
//!   network reads them;
//! - **operator** routes, every one under `/admin/`, each requiring
//!   `Authorization: Bearer <ORDERS_ADMIN_TOKEN>`: without it (or with another token) the answer
//!   is 401 `unauthenticated`. When `ORDERS_ADMIN_TOKEN` is unset, every `/admin/` route answers
//!   404 `not_found`, as if it did not exist: an operator surface is never open by accident.
//!
//! Anything else on this listener is 404 `not_found`.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tower_idempotency::BoxError;

use super::problem::ApiProblem;

/// Where the operator listener binds when `ORDERS_ADMIN_ADDR` is unset.
pub(crate) const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:3001";

/// The operator token, `ORDERS_ADMIN_TOKEN`; `None` turns every `/admin/` route off.
#[derive(Clone)]
pub(crate) struct AdminToken(Option<Arc<str>>);

impl AdminToken {
    /// A token given in code (tests), or none.
    #[allow(dead_code, reason = "the tests build the operator listener with a token of their own")]
    pub(crate) fn new(token: Option<&str>) -> Self {
        Self(token.map(Arc::from))
    }

    /// Reads `ORDERS_ADMIN_TOKEN`: unset or empty turns the operator routes off; a token must be
    /// at least 16 visible ASCII characters, else the service refuses to start.
    pub(crate) fn from_env() -> Result<Self, BoxError> {
        match std::env::var("ORDERS_ADMIN_TOKEN").ok().filter(|token| !token.is_empty()) {
            None => Ok(Self(None)),
            Some(token) if token.len() >= 16 && token.bytes().all(|b| b.is_ascii_graphic()) => {
                Ok(Self(Some(token.into())))
            }
            // Not echoed: it is a secret.
            Some(_) => Err("ORDERS_ADMIN_TOKEN must be at least 16 visible ASCII characters".into()),
        }
    }
}

/// The routes of the operator listener, as each part of the service contributes them.
#[derive(Default)]
pub(crate) struct AdminRoutes {
    /// Routes with no authentication (`/metrics`).
    pub(crate) open: Router,
    /// Routes under `/admin/`, behind the operator token.
    pub(crate) operator: Router,
}

impl AdminRoutes {
    /// Adds the routes of `other`.
    pub(crate) fn merge(self, other: AdminRoutes) -> Self {
        Self { open: self.open.merge(other.open), operator: self.operator.merge(other.operator) }
    }

    /// The operator listener's service: `open` as it is, `operator` behind `token` (or absent
    /// when there is none), 404 for the rest.
    pub(crate) fn into_router(self, token: AdminToken) -> Router {
        let router = match token.0 {
            Some(token) => self.open.merge(self.operator.layer(middleware::from_fn_with_state(token, require_token))),
            None => self.open,
        };
        router.fallback(|| async { ApiProblem::admin_not_found() })
    }
}

/// Lets a request through only with `Authorization: Bearer <token>`.
async fn require_token(State(token): State<Arc<str>>, request: Request, next: Next) -> Response {
    if bearer_matches(request.headers(), &token) {
        next.run(request).await
    } else {
        ApiProblem::unauthenticated("send `Authorization: Bearer <ORDERS_ADMIN_TOKEN>`").into_response()
    }
}

/// Whether the request carries exactly one `Authorization: Bearer <token>`, compared in
/// constant time.
fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let mut fields = headers.get_all(AUTHORIZATION).iter();
    let (Some(field), None) = (fields.next(), fields.next()) else {
        return false;
    };
    let Some((scheme, given)) = field.to_str().ok().and_then(|value| value.split_once(' ')) else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && constant_time_eq(given.trim_start_matches(' ').as_bytes(), token.as_bytes())
}

/// Compares two byte strings without an early exit on the first difference.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_matches() {
        let mut headers = HeaderMap::new();
        assert!(!bearer_matches(&headers, "secret-token-0123"));
        headers.insert(AUTHORIZATION, "Bearer secret-token-0123".parse().unwrap());
        assert!(bearer_matches(&headers, "secret-token-0123"));
        headers.insert(AUTHORIZATION, "bearer secret-token-0124".parse().unwrap());
        assert!(!bearer_matches(&headers, "secret-token-0123"));
        headers.insert(AUTHORIZATION, "Basic secret-token-0123".parse().unwrap());
        assert!(!bearer_matches(&headers, "secret-token-0123"));
    }
}
