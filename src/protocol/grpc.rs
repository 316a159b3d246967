//! The rules of gRPC (feature `tonic`): which calls are gRPC and which are guarded, success by
//! `grpc-status` (from a trailers-only head, or else from the trailers), the stored fields, and
//! refusals as trailers-only statuses. The public helpers here are re-exported, with their user
//! documentation, by the tonic adapter (`tower_idempotency::grpc`).

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName};
use http::{HeaderMap, Response};
use tonic::{Code, Status};

use super::Classified;
use crate::outcome::{self, OutcomeClass};
use crate::problem::Problem;

/// The detail of the refusal of a call without a key.
pub(crate) const KEY_MISSING: &str = "this method requires idempotency-key metadata";

/// The header (in a trailers-only answer) or trailer that carries a gRPC call's status code.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A route's own rule for gRPC answers, keyed on the gRPC status code.
pub type GrpcClassifier = Arc<dyn Fn(Code) -> OutcomeClass + Send + Sync>;

/// Whether `headers` say gRPC: a content type of `application/grpc`, `application/grpc+…`
/// (`+proto`, `+json`), `application/grpc;…` or `application/grpc-…` (gRPC-Web), in any case.
///
/// ```
/// use http::HeaderMap;
/// use tower_idempotency::grpc::is_grpc;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("content-type", "application/grpc+proto".parse().unwrap());
/// assert!(is_grpc(&headers));
/// headers.insert("content-type", "application/grpcx".parse().unwrap());
/// assert!(!is_grpc(&headers));
/// ```
pub fn is_grpc(headers: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    headers.get(CONTENT_TYPE).is_some_and(|value| {
        let value = value.as_bytes();
        value.len() >= GRPC.len()
            && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
            && matches!(value.get(GRPC.len()), None | Some(b'+' | b';' | b'-'))
    })
}

/// The gRPC status code in `headers` (or trailers): `None` when there is no `grpc-status`,
/// [`Code::Unknown`] when it is not a status code.
///
/// ```
/// use http::HeaderMap;
/// use tonic::Code;
/// use tower_idempotency::grpc::grpc_status;
///
/// let mut trailers = HeaderMap::new();
/// assert_eq!(grpc_status(&trailers), None);
/// trailers.insert("grpc-status", "9".parse().unwrap());
/// assert_eq!(grpc_status(&trailers), Some(Code::FailedPrecondition));
/// ```
pub fn grpc_status(headers: &HeaderMap) -> Option<Code> {
    headers.get(GRPC_STATUS).map(|value| Code::from_bytes(value.as_bytes()))
}

/// Marks a handler's error status as a business rejection to store: retries with the same key
/// get the same status again instead of executing afresh (the *reject* outcome; in
/// atomic mode the handler's writes are still rolled back).
///
/// The mark travels as the status's [`source`](std::error::Error::source), which tonic keeps
/// with the answer and never sends to the client; it replaces a source set earlier.
///
/// ```
/// use tonic::Status;
/// use tower_idempotency::grpc::{is_rejection, reject};
///
/// let declined = reject(Status::failed_precondition("card declined"));
/// assert!(is_rejection(&declined));
/// assert!(!is_rejection(&Status::unavailable("try again")));
/// ```
pub fn reject(mut status: Status) -> Status {
    status.set_source(Arc::new(RejectionMark));
    status
}

/// Whether `status` was marked with [`reject`].
pub fn is_rejection(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<RejectionMark>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// Marks a handler's error status as an outcome it does not know (a downstream call that timed
/// out after it was sent): the record becomes `unknown`, the status still reaches the client,
/// and retries get `ABORTED` (`idempotency_outcome_unknown`) until the record is settled. In
/// atomic mode the handler's writes commit with the `unknown` record.
///
/// The mark travels as the status's source, as [`reject`]'s does (and replaces it).
///
/// ```
/// use tonic::Status;
/// use tower_idempotency::grpc::{is_outcome_unknown, outcome_unknown};
///
/// let unsure = outcome_unknown(Status::deadline_exceeded("the provider did not answer"));
/// assert!(is_outcome_unknown(&unsure));
/// assert!(!is_outcome_unknown(&Status::unavailable("try again")));
/// ```
pub fn outcome_unknown(mut status: Status) -> Status {
    status.set_source(Arc::new(UnknownMark));
    status
}

/// Whether `status` was marked with [`outcome_unknown`].
pub fn is_outcome_unknown(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<UnknownMark>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// The mark [`outcome_unknown`] puts on a status.
#[derive(Debug)]
struct UnknownMark;

impl fmt::Display for UnknownMark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the handler told the idempotency layer that this outcome is unknown")
    }
}

impl std::error::Error for UnknownMark {}

/// The mark [`reject`] puts on a status.
#[derive(Debug)]
struct RejectionMark;

impl fmt::Display for RejectionMark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the handler asked the idempotency layer to store this failure")
    }
}

impl std::error::Error for RejectionMark {}

/// The gRPC rules of one layer, made from its settings ([`Config::protocols`](crate::config::Config::protocols)).
pub(crate) struct GrpcRules {
    /// The method paths guarded (`/package.Service/Method`); other gRPC calls pass through.
    pub(crate) methods: Vec<Arc<str>>,
    /// The metadata that carries the key.
    pub(crate) key_header: HeaderName,
    /// The route's own rule, keyed on the gRPC status code.
    pub(crate) classifier: Option<GrpcClassifier>,
    /// The route's additions to the stored allow-list.
    pub(crate) stored_headers: Vec<HeaderName>,
}

impl GrpcRules {
    /// The configured method path when `path` names a guarded method.
    pub(crate) fn guarded_method(&self, path: &str) -> Option<Arc<str>> {
        self.methods.iter().find(|method| ***method == *path).cloned()
    }

    /// The class of an answer the handler did not mark: from the `grpc-status` of a
    /// trailers-only head, or else from the trailers.
    pub(crate) fn classify(&self, parts: &http::response::Parts) -> Classified {
        let status = parts.extensions.get::<Status>();
        let marked = match status {
            Some(status) if is_rejection(status) => Some(OutcomeClass::Reject),
            Some(status) if is_outcome_unknown(status) => Some(OutcomeClass::Unknown),
            _ => None,
        };
        let rule = ClassifyTrailers { marked, classifier: self.classifier.clone() };
        match grpc_status(&parts.headers) {
            Some(code) => Classified::Ready(rule.classify_code(code)),
            None => Classified::RequiresTrailers(rule),
        }
    }

    /// Whether a response header is stored: the allow-list, and every `grpc-*` field (the
    /// status of a trailers-only answer, `grpc-encoding`), never what is never stored.
    pub(crate) fn keeps_header(&self, name: &HeaderName) -> bool {
        outcome::is_stored(name, &self.stored_headers)
            || (name.as_str().starts_with("grpc-") && !outcome::is_never_stored(name))
    }
}

/// The classification of a gRPC answer whose head has no status: its trailers decide.
pub(crate) struct ClassifyTrailers {
    /// The answer's status was marked with [`reject`] or [`outcome_unknown`].
    marked: Option<OutcomeClass>,
    /// The route's own rule.
    classifier: Option<GrpcClassifier>,
}

impl ClassifyTrailers {
    /// The class from the trailers' `grpc-status` (none counts as `UNKNOWN`).
    pub(crate) fn classify(self, trailers: Option<&HeaderMap>) -> OutcomeClass {
        self.classify_code(trailers.and_then(grpc_status).unwrap_or(Code::Unknown))
    }

    /// A [`reject`] mark on the answer's status, else the route's rule, else the default:
    /// `OK` completes, everything else releases.
    fn classify_code(&self, code: Code) -> OutcomeClass {
        if let Some(class) = self.marked {
            return class;
        }
        match &self.classifier {
            Some(rule) => rule(code),
            None if code == Code::Ok => OutcomeClass::Complete,
            None => OutcomeClass::Release,
        }
    }
}

/// Whether a trailer is stored: all of them (the status and trailing metadata), less what is
/// never stored.
pub(crate) fn keeps_trailer(name: &HeaderName) -> bool {
    !outcome::is_never_stored(name)
}

/// A refusal as a trailers-only gRPC status.
pub(crate) fn refuse(problem: &Problem) -> Response<Bytes> {
    problem.to_grpc()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Protocol;

    fn parts(headers: &[(&'static str, &'static str)]) -> http::response::Parts {
        let mut response = Response::new(());
        for (name, value) in headers {
            response.headers_mut().insert(*name, http::HeaderValue::from_static(value));
        }
        response.into_parts().0
    }

    /// The rules of a layer that guards one method, with `rule` and the extra allow-list.
    fn rules(rule: Option<&GrpcClassifier>, stored_headers: &[HeaderName]) -> GrpcRules {
        GrpcRules {
            methods: vec![Arc::from("/pkg.Svc/Create")],
            key_header: HeaderName::from_static("idempotency-key"),
            classifier: rule.cloned(),
            stored_headers: stored_headers.to_vec(),
        }
    }

    /// A guarded gRPC call under `rule`.
    fn protocol(rule: Option<&GrpcClassifier>) -> Protocol {
        Protocol::Grpc { rules: Arc::new(rules(rule, &[])), method: Arc::from("/pkg.Svc/Create") }
    }

    /// The class when the head decides it; `None`: the trailers decide.
    fn classify_head(parts: &http::response::Parts, rule: Option<&GrpcClassifier>) -> Option<OutcomeClass> {
        match protocol(rule).classify(parts) {
            Classified::Ready(class) => Some(class),
            Classified::RequiresTrailers(_) => None,
        }
    }

    fn classify_trailers(
        parts: &http::response::Parts,
        trailers: Option<&HeaderMap>,
        rule: Option<&GrpcClassifier>,
    ) -> OutcomeClass {
        protocol(rule).classify(parts).with_trailers(trailers)
    }

    fn keeps_header(name: &HeaderName, extra: &[HeaderName]) -> bool {
        rules(None, extra).keeps_header(name)
    }

    #[test]
    fn grpc_content_types_are_recognised_and_look_alikes_are_not() {
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, http::HeaderValue::from_static(value));
            is_grpc(&headers)
        };
        for value in
            ["application/grpc", "application/grpc+proto", "Application/GRPC;charset=x", "application/grpc-web"]
        {
            assert!(with(value), "{value} is gRPC");
        }
        for value in ["application/json", "application/grpcx", "application/grp", "text/grpc"] {
            assert!(!with(value), "{value} is not gRPC");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn trailers_only_answers_are_judged_by_their_header_status() {
        assert_eq!(classify_head(&parts(&[("grpc-status", "0")]), None), Some(OutcomeClass::Complete));
        assert_eq!(classify_head(&parts(&[("grpc-status", "9")]), None), Some(OutcomeClass::Release));
        assert_eq!(classify_head(&parts(&[("grpc-status", "banana")]), None), Some(OutcomeClass::Release));
        // No status in the head: the trailers decide.
        assert_eq!(classify_head(&parts(&[("content-type", "application/grpc")]), None), None);
    }

    #[test]
    fn streamed_answers_are_judged_by_their_trailers_and_a_missing_status_releases() {
        let head = parts(&[("content-type", "application/grpc")]);
        let mut trailers = HeaderMap::new();
        trailers.insert(GRPC_STATUS, http::HeaderValue::from_static("0"));
        assert_eq!(classify_trailers(&head, Some(&trailers), None), OutcomeClass::Complete);
        trailers.insert(GRPC_STATUS, http::HeaderValue::from_static("14"));
        assert_eq!(classify_trailers(&head, Some(&trailers), None), OutcomeClass::Release);
        assert_eq!(classify_trailers(&head, None, None), OutcomeClass::Release);
    }

    #[test]
    fn the_http_status_never_decides_a_grpc_answer() {
        // HTTP 200 with an error status in the head: released, not completed.
        let head = parts(&[("grpc-status", "13")]);
        assert_eq!(head.status, http::StatusCode::OK);
        assert_eq!(classify_head(&head, None), Some(OutcomeClass::Release));
    }

    #[test]
    fn a_status_marked_unknown_makes_the_record_unknown() {
        let marked = outcome_unknown(Status::deadline_exceeded("no answer")).into_http::<()>().into_parts().0;
        assert_eq!(classify_head(&marked, None), Some(OutcomeClass::Unknown));
        let plain = Status::deadline_exceeded("no answer").into_http::<()>().into_parts().0;
        assert_eq!(classify_head(&plain, None), Some(OutcomeClass::Release));
    }

    #[test]
    fn a_marked_status_is_stored_and_the_marker_and_rule_are_honoured() {
        let marked = reject(Status::failed_precondition("declined")).into_http::<()>().into_parts().0;
        assert_eq!(classify_head(&marked, None), Some(OutcomeClass::Reject));
        let plain = Status::failed_precondition("declined").into_http::<()>().into_parts().0;
        assert_eq!(classify_head(&plain, None), Some(OutcomeClass::Release));

        let rule: GrpcClassifier =
            Arc::new(
                |code| {
                    if code == Code::FailedPrecondition { OutcomeClass::Reject } else { OutcomeClass::Release }
                },
            );
        assert_eq!(classify_head(&plain, Some(&rule)), Some(OutcomeClass::Reject));

        let mut marker = parts(&[("grpc-status", "0")]);
        marker.extensions.insert(OutcomeClass::Release);
        assert_eq!(classify_head(&marker, None), Some(OutcomeClass::Release));
    }

    #[test]
    fn grpc_fields_are_stored_but_never_credentials() {
        for name in ["grpc-status", "grpc-message", "grpc-status-details-bin", "grpc-encoding", "content-type"] {
            assert!(keeps_header(&HeaderName::from_static(name), &[]), "{name} is stored");
        }
        for name in ["x-custom", "set-cookie", "authorization", "date"] {
            assert!(!keeps_header(&HeaderName::from_static(name), &[]), "{name} is not stored");
        }
        let custom = HeaderName::from_static("x-order-id");
        assert!(keeps_header(&custom, std::slice::from_ref(&custom)));
    }
}
