//! The rules of plain HTTP: which methods are guarded, the operation's name, classification by
//! status code, the stored allow-list, and refusals as `application/problem+json`.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, Response};

use crate::outcome::{self, Classifier, OutcomeClass};
use crate::problem::Problem;

/// The detail of the refusal of a request without a key.
pub(crate) const KEY_MISSING: &str = "this request requires an Idempotency-Key header";

/// The HTTP rules of one layer, made from its settings ([`Config::protocols`](crate::config::Config::protocols)).
pub(crate) struct HttpRules {
    /// The methods guarded (POST and PATCH by default).
    pub(crate) methods: Vec<Method>,
    /// The header that carries the key.
    pub(crate) key_header: HeaderName,
    /// The operation's explicit name, if the route gave one.
    pub(crate) operation: Option<Arc<str>>,
    /// The route's own rule for classifying responses.
    pub(crate) classifier: Option<Classifier>,
    /// The route's additions to the stored allow-list.
    pub(crate) stored_headers: Vec<HeaderName>,
    /// The prefix of problem `type` URIs.
    pub(crate) problem_type_base: Arc<str>,
}

impl HttpRules {
    /// Whether requests with this method are guarded.
    pub(crate) fn guards(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// The explicit name, else axum's matched route template, else method and path.
    pub(crate) fn operation(&self, parts: &Parts) -> Arc<str> {
        if let Some(name) = &self.operation {
            return name.clone();
        }
        #[cfg(feature = "axum")]
        if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
            return method_and(&parts.method, matched.as_str());
        }
        method_and(&parts.method, parts.uri.path())
    }

    /// The class of a response the handler did not mark: the route's rule, else the default.
    pub(crate) fn classify(&self, parts: &http::response::Parts) -> OutcomeClass {
        outcome::by_route_rule(parts, self.classifier.as_ref())
    }

    /// Whether a response header is stored: the allow-list, never what is never stored.
    pub(crate) fn keeps_header(&self, name: &HeaderName) -> bool {
        outcome::is_stored(name, &self.stored_headers)
    }

    /// A refusal as `application/problem+json`.
    pub(crate) fn refuse(&self, problem: &Problem) -> Response<Bytes> {
        problem.to_http(&self.problem_type_base)
    }
}

/// Whether a trailer is stored: all of them, less what is never stored.
/// `"{method} {path}"`, in one allocation when it is short (as it nearly always is): built on
/// the stack, then copied into the `Arc`.
fn method_and(method: &Method, path: &str) -> Arc<str> {
    let (method, mut buffer) = (method.as_str(), [0u8; 192]);
    let length = method.len() + 1 + path.len();
    let Some(out) = buffer.get_mut(..length) else {
        return Arc::from(format!("{method} {path}"));
    };
    out[..method.len()].copy_from_slice(method.as_bytes());
    out[method.len()] = b' ';
    out[method.len() + 1..].copy_from_slice(path.as_bytes());
    // Two `str`s and a space: always UTF-8.
    std::str::from_utf8(out).map_or_else(|_| Arc::from(format!("{method} {path}")), Arc::from)
}

pub(crate) fn keeps_trailer(name: &HeaderName) -> bool {
    !outcome::is_never_stored(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_names_are_method_space_path_short_or_long() {
        assert_eq!(&*method_and(&Method::POST, "/orders"), "POST /orders");
        let long = format!("/{}", "x".repeat(300));
        assert_eq!(&*method_and(&Method::PATCH, &long), format!("PATCH {long}"));
        let custom = Method::from_bytes(b"PURGE").unwrap();
        assert_eq!(&*method_and(&custom, ""), "PURGE ");
    }
}
