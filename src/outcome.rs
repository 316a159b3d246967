//! Deciding what a handler's response means for the record ([contract §4](crate::contract#4-what-is-stored-and-what-is-replayed)).
//!
//! - *complete*: commit the business write and store the response;
//! - *reject*: roll the business write back, store the response as a definitive rejection, so
//!   retries get the same error;
//! - *release*: roll back, store nothing: the next retry executes afresh.
//!
//! By default 1xx–3xx complete and everything else releases. A handler opts a business
//! rejection into *reject* with a marker in the response's extensions:
//!
//! ```
//! use http::{Response, StatusCode};
//! use tower_idempotency::OutcomeClass;
//!
//! let mut response = Response::new("card declined");
//! *response.status_mut() = StatusCode::PAYMENT_REQUIRED;
//! response.extensions_mut().insert(OutcomeClass::Reject);
//! ```
//!
//! A handler whose downstream call timed out after it was sent does not know whether the
//! effect happened; it says so with [`OutcomeClass::Unknown`], and the record becomes
//! `unknown` instead of `completed`:
//!
//! ```
//! use http::{Response, StatusCode};
//! use tower_idempotency::OutcomeClass;
//!
//! let mut response = Response::new("the payment provider did not answer in time");
//! *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
//! response.extensions_mut().insert(OutcomeClass::Unknown);
//! ```

use http::header::{self, HeaderName};
use http::response::Parts;

/// How a response settles its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutcomeClass {
    /// Commit the business write and store the response for replay.
    Complete,
    /// Roll the business write back and store the response as a definitive rejection (a
    /// declined card), so retries get the same error instead of executing again.
    Reject,
    /// Roll back and store nothing; the next retry executes afresh.
    Release,
    /// The handler knows its own outcome is unknown (a downstream call timed out after it was
    /// sent): the response still reaches the client, the record becomes `unknown` (never
    /// `completed`; in atomic mode the business write commits with it), and retries get
    /// `idempotency_outcome_unknown` until the record is settled by hand or by a reconciler.
    /// A handler marks its response so (over gRPC, its error status with
    /// `grpc::outcome_unknown`), or a route's own rule decides it; the default rule never does.
    Unknown,
}

/// A route's own rule for classifying responses.
pub type Classifier = std::sync::Arc<dyn Fn(&Parts) -> OutcomeClass + Send + Sync>;

/// The class of a response: the handler's marker if present, else the route's rule, else
/// the default (1xx–3xx complete, everything else release).
pub fn classify(parts: &Parts, route_rule: Option<&Classifier>) -> OutcomeClass {
    handler_marker(parts).unwrap_or_else(|| by_route_rule(parts, route_rule))
}

/// The handler's marker in the response's extensions: it wins over every rule, for every
/// protocol.
pub(crate) fn handler_marker(parts: &Parts) -> Option<OutcomeClass> {
    parts.extensions.get::<OutcomeClass>().copied()
}

/// The class of a response the handler did not mark: the route's rule, else the default.
pub(crate) fn by_route_rule(parts: &Parts, route_rule: Option<&Classifier>) -> OutcomeClass {
    match route_rule {
        Some(rule) => rule(parts),
        None => default_class(parts.status),
    }
}

/// The default rule: 1xx–3xx complete, everything else release.
pub fn default_class(status: http::StatusCode) -> OutcomeClass {
    if status.is_informational() || status.is_success() || status.is_redirection() {
        OutcomeClass::Complete
    } else {
        OutcomeClass::Release
    }
}

/// The headers stored and replayed by default ([contract §4](crate::contract#4-what-is-stored-and-what-is-replayed)).
pub const DEFAULT_STORED_HEADERS: [HeaderName; 7] = [
    header::CONTENT_TYPE,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::LINK,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
];

/// Headers that are never stored or replayed, whatever a route adds to its allow-list:
/// credentials, cookies, proxy and hop-by-hop headers.
pub fn is_never_stored(name: &HeaderName) -> bool {
    matches!(
        *name,
        header::SET_COOKIE
            | header::AUTHORIZATION
            | header::WWW_AUTHENTICATE
            | header::PROXY_AUTHENTICATE
            | header::PROXY_AUTHORIZATION
            | header::CONNECTION
            | header::TRANSFER_ENCODING
            | header::TE
            | header::TRAILER
            | header::UPGRADE
            | header::CONTENT_LENGTH
    ) || name.as_str().starts_with("proxy-")
        || name.as_str() == "keep-alive"
}

/// Whether a header is kept in the stored response, given the route's extra allow-list.
pub fn is_stored(name: &HeaderName, extra: &[HeaderName]) -> bool {
    !is_never_stored(name) && (DEFAULT_STORED_HEADERS.contains(name) || extra.contains(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Response, StatusCode};

    fn parts(status: u16) -> Parts {
        let (mut parts, ()) = Response::new(()).into_parts();
        parts.status = StatusCode::from_u16(status).unwrap();
        parts
    }

    #[test]
    fn default_rule_completes_success_and_releases_errors() {
        assert_eq!(classify(&parts(201), None), OutcomeClass::Complete);
        assert_eq!(classify(&parts(303), None), OutcomeClass::Complete);
        assert_eq!(classify(&parts(422), None), OutcomeClass::Release);
        assert_eq!(classify(&parts(500), None), OutcomeClass::Release);
    }

    #[test]
    fn handler_marker_beats_route_rule() {
        let mut p = parts(402);
        p.extensions.insert(OutcomeClass::Reject);
        let rule: Classifier = std::sync::Arc::new(|_| OutcomeClass::Release);
        assert_eq!(classify(&p, Some(&rule)), OutcomeClass::Reject);
        assert_eq!(classify(&parts(402), Some(&rule)), OutcomeClass::Release);
    }

    #[test]
    fn credentials_and_hop_by_hop_headers_are_never_stored() {
        let extra = [header::SET_COOKIE, HeaderName::from_static("x-request-cost")];
        assert!(!is_stored(&header::SET_COOKIE, &extra));
        assert!(!is_stored(&header::AUTHORIZATION, &extra));
        assert!(!is_stored(&HeaderName::from_static("proxy-status"), &extra));
        assert!(is_stored(&HeaderName::from_static("x-request-cost"), &extra));
        assert!(is_stored(&header::LOCATION, &[]));
        assert!(!is_stored(&HeaderName::from_static("x-request-cost"), &[]));
    }
}
