//! The one place where HTTP and gRPC differ.
//!
//! The guarded path (`service.rs`) asks the request's [`Protocol`] everything that depends on
//! the protocol, and knows nothing else about which one it serves:
//!
//! | question | HTTP | gRPC (feature `tonic`) |
//! |---|---|---|
//! | guarded at all? ([`Protocol::of`]) | the method is in `methods` (POST, PATCH) | `content-type: application/grpc*` and the path is in `grpc_methods` |
//! | the key ([`Protocol::read_key`]) | the `Idempotency-Key` header | the `idempotency-key` metadata (the same HTTP/2 field) |
//! | the operation ([`Protocol::operation`]) | explicit name, else `MatchedPath`, else method and path | the method path, `/package.Service/Method` |
//! | success ([`Protocol::classify_head`], [`Protocol::classify_trailers`]) | the status code (marker, route rule, 1xx–3xx) | `grpc-status` from the headers (trailers-only) or the trailers; OK completes |
//! | stored headers ([`Protocol::keeps_header`]) | the allow-list | the allow-list and the `grpc-*` fields |
//! | a refusal ([`Protocol::refuse`]) | `application/problem+json` | a trailers-only gRPC status |
//!
//! The fingerprint is computed the same way for both (method, path, content type, declared
//! headers, body); a gRPC body is not JSON or a form, so it counts as its raw bytes.

use std::sync::Arc;

use http::request::Parts;
use http::{HeaderMap, HeaderName, Request, Response};

use crate::body::IdempotencyBody;
use crate::config::Config;
use crate::key::{self, IdempotencyKey};
use crate::outcome::{self, OutcomeClass};
use crate::problem::{Problem, ProblemCode};

/// The protocol of a guarded request.
#[derive(Debug, Clone)]
pub(crate) enum Protocol {
    /// Plain HTTP: status codes and problem+json.
    Http,
    /// A gRPC method named in the layer's `grpc_methods`; holds the configured method path.
    #[cfg(feature = "tonic")]
    Grpc(Arc<str>),
}

impl Protocol {
    /// The protocol of a request the layer guards, or `None` when it passes through untouched.
    ///
    /// A gRPC request (any `application/grpc*` content type) is guarded only when its method
    /// is named in `grpc_methods`; the HTTP method rule never decides for it (every gRPC call
    /// is a POST).
    pub(crate) fn of<B>(config: &Config, request: &Request<B>) -> Option<Protocol> {
        #[cfg(feature = "tonic")]
        if crate::grpc::is_grpc(request.headers()) {
            let path = request.uri().path();
            return config.grpc_methods.iter().find(|method| ***method == *path).cloned().map(Protocol::Grpc);
        }
        config.methods.contains(request.method()).then_some(Protocol::Http)
    }

    /// The key: `Ok(None)` when there is none, a refusal when it is invalid.
    pub(crate) fn read_key(&self, config: &Config, headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
        key::parse_key(headers, &config.header)
            .map_err(|error| Problem::new(ProblemCode::KeyInvalid, error.to_string()))
    }

    /// The refusal of a request that must carry a key and has none.
    pub(crate) fn key_missing(&self) -> Problem {
        let detail = match self {
            Protocol::Http => "this request requires an Idempotency-Key header",
            #[cfg(feature = "tonic")]
            Protocol::Grpc(_) => "this method requires idempotency-key metadata",
        };
        Problem::new(ProblemCode::KeyMissing, detail)
    }

    /// The operation: for HTTP the explicit name, else axum's matched route template, else
    /// method and path; for gRPC the method path.
    pub(crate) fn operation(&self, config: &Config, parts: &Parts) -> Arc<str> {
        match self {
            Protocol::Http => {
                if let Some(name) = &config.operation {
                    return name.clone();
                }
                #[cfg(feature = "axum")]
                if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
                    return Arc::from(format!("{} {}", parts.method, matched.as_str()));
                }
                Arc::from(format!("{} {}", parts.method, parts.uri.path()))
            }
            #[cfg(feature = "tonic")]
            Protocol::Grpc(method) => method.clone(),
        }
    }

    /// The class of a response when its head decides it: always for HTTP; for gRPC when the
    /// handler marked it, or when it is trailers-only (`grpc-status` in the headers). `None`:
    /// the trailers decide, after the body is read ([`classify_trailers`](Self::classify_trailers)).
    pub(crate) fn classify_head(&self, config: &Config, parts: &http::response::Parts) -> Option<OutcomeClass> {
        match self {
            Protocol::Http => Some(outcome::classify(parts, config.classifier.as_ref())),
            #[cfg(feature = "tonic")]
            Protocol::Grpc(_) => crate::grpc::classify_head(parts, config.grpc_classifier.as_ref()),
        }
    }

    /// The class of a response whose head did not decide it, from its trailers.
    #[cfg_attr(not(feature = "tonic"), allow(unused_variables))]
    pub(crate) fn classify_trailers(
        &self,
        config: &Config,
        parts: &http::response::Parts,
        trailers: Option<&HeaderMap>,
    ) -> OutcomeClass {
        match self {
            Protocol::Http => outcome::classify(parts, config.classifier.as_ref()),
            #[cfg(feature = "tonic")]
            Protocol::Grpc(_) => crate::grpc::classify_trailers(parts, trailers, config.grpc_classifier.as_ref()),
        }
    }

    /// Whether a response header is stored with the answer and replayed.
    pub(crate) fn keeps_header(&self, config: &Config, name: &HeaderName) -> bool {
        match self {
            Protocol::Http => outcome::is_stored(name, &config.stored_headers),
            #[cfg(feature = "tonic")]
            Protocol::Grpc(_) => crate::grpc::keeps_header(name, &config.stored_headers),
        }
    }

    /// The layer's own answer: problem+json for HTTP, a trailers-only status for gRPC.
    pub(crate) fn refuse<B>(&self, config: &Config, problem: Problem) -> Response<IdempotencyBody<B>> {
        match self {
            Protocol::Http => problem.to_http(&config.problem_type_base).map(IdempotencyBody::full),
            #[cfg(feature = "tonic")]
            Protocol::Grpc(_) => problem.to_grpc().map(IdempotencyBody::full),
        }
    }
}
