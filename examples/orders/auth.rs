//! Authentication, before everything else: `Authorization: Bearer <account>` becomes the
//! request's [`Account`] and its idempotency [`Scope`], or the answer is 401.

use axum::extract::{FromRequestParts, Request};
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_idempotency::Scope;

use super::book::account::Account;
use super::problem::ApiProblem;

/// The middleware that runs before everything else: finds the account, or answers 401.
pub(crate) async fn authenticate(mut request: Request, next: Next) -> Response {
    match account_from_headers(request.headers()) {
        Ok(account) => {
            request.extensions_mut().insert(Scope::new(account.as_str()));
            request.extensions_mut().insert(account);
            next.run(request).await
        }
        Err(problem) => problem.into_response(),
    }
}

/// Reads `Authorization: Bearer <account>`.
fn account_from_headers(headers: &HeaderMap) -> Result<Account, ApiProblem> {
    let mut fields = headers.get_all(AUTHORIZATION).iter();
    let (Some(field), None) = (fields.next(), fields.next()) else {
        return Err(ApiProblem::unauthenticated("send exactly one `Authorization: Bearer <account>` header"));
    };
    let token = field
        .to_str()
        .ok()
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start_matches(' '))
        .ok_or_else(|| ApiProblem::unauthenticated("the Authorization header must use the Bearer scheme"))?;
    Account::parse(token).ok_or_else(|| {
        ApiProblem::unauthenticated("the bearer token must be an account id of 1 to 64 visible ASCII characters")
    })
}

/// The handlers' extractor: the account [`authenticate`] found.
impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = ApiProblem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Account>()
            .cloned()
            .ok_or_else(|| ApiProblem::unauthenticated("the request was not authenticated"))
    }
}
