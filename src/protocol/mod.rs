//! The one place where HTTP and gRPC differ.
//!
//! The guarded path (`service.rs`) asks the request's [`Protocol`] everything that depends on
//! the protocol, and knows nothing else about which one it serves. Each protocol's rules are
//! pure and live in their own module (`http`, `grpc`); this module only dispatches:
//!
//! | question | HTTP | gRPC (feature `tonic`) |
//! |---|---|---|
//! | guarded at all? ([`Protocols::guard`]) | the method is in `methods` (POST, PATCH), whatever the content type | the path is in `grpc_methods`, whatever the content type |
//! | the key ([`Protocol::read_key`]) | the `Idempotency-Key` header | the `idempotency-key` metadata (the same HTTP/2 field) |
//! | the operation ([`Protocol::operation`]) | explicit name, else `MatchedPath`, else method and path | the method path, `/package.Service/Method` |
//! | success ([`Protocol::classify`]) | the status code (marker, route rule, 1xx–3xx), from the head | `grpc-status` from the headers (trailers-only) or else the trailers; OK completes |
//! | stored headers and trailers ([`Protocol::stored_response`]) | the allow-list; trailers whole | the allow-list and the `grpc-*` fields; trailers whole |
//! | a refusal ([`Protocol::refuse`]) | `application/problem+json` | a trailers-only gRPC status |
//!
//! The fingerprint is computed the same way for both (method, path, content type, declared
//! headers, body); a gRPC body is not JSON or a form, so it counts as its raw bytes.

#[cfg(feature = "tonic")]
pub(crate) mod grpc;
pub(crate) mod http;

use std::sync::Arc;

use ::http::request::Parts;
use ::http::{HeaderMap, HeaderName, Request, Response};
use bytes::Bytes;

use crate::body::IdempotencyBody;
use crate::key::{self, IdempotencyKey};
use crate::outcome::{self, OutcomeClass};
use crate::problem::{Problem, ProblemCode};
use crate::record::{Fields, StoredResponse};

/// The protocols a layer speaks, with their rules, made once per layer from its settings
/// ([`Config::protocols`](crate::config::Config::protocols)).
#[derive(Clone)]
pub(crate) struct Protocols {
    http: Arc<http::HttpRules>,
    #[cfg(feature = "tonic")]
    grpc: Arc<grpc::GrpcRules>,
}

impl Protocols {
    /// The protocols with these rules.
    pub(crate) fn new(http: http::HttpRules, #[cfg(feature = "tonic")] grpc: grpc::GrpcRules) -> Self {
        Self {
            http: Arc::new(http),
            #[cfg(feature = "tonic")]
            grpc: Arc::new(grpc),
        }
    }

    /// The guard decision: the protocol of a request the layer guards, or `None` when it passes
    /// through untouched.
    ///
    /// A request is either guarded or refused whenever its route is guarded; nothing the client
    /// sends other than the method itself (content type, override headers) moves it out:
    ///
    /// 1. A path named in `grpc_methods` is guarded as gRPC, whatever its content type.
    /// 2. A request with a gRPC content type on any other path is judged by the HTTP method
    ///    rule, like any HTTP request, through the plain layer; through the tonic adapter
    ///    ([`UnnamedGrpc::PassThrough`]) it is an unnamed method of a gRPC server and passes
    ///    through.
    /// 3. Every other request is guarded when its method is in `methods`. The method is the
    ///    request's own: `X-HTTP-Method-Override` and the like are never read.
    #[cfg_attr(not(feature = "tonic"), allow(unused_variables))]
    pub(crate) fn guard<B>(&self, request: &Request<B>, unnamed_grpc: UnnamedGrpc) -> Option<Protocol> {
        #[cfg(feature = "tonic")]
        {
            if let Some(method) = self.grpc.guarded_method(request.uri().path()) {
                return Some(Protocol::Grpc { rules: self.grpc.clone(), method });
            }
            if unnamed_grpc == UnnamedGrpc::PassThrough && grpc::is_grpc(request.headers()) {
                return None;
            }
        }
        self.http.guards(request.method()).then(|| Protocol::Http(self.http.clone()))
    }
}

/// What the layer does with a gRPC call to a method not named in `grpc_methods`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum UnnamedGrpc {
    /// The HTTP method rule decides, as for any request (the plain layer: a gRPC content type
    /// on an HTTP route must not be a way around the layer).
    HttpRules,
    /// It passes through (the tonic adapter, in front of a gRPC server whose other methods
    /// are not guarded).
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    PassThrough,
}

/// The protocol of a guarded request, with its rules.
#[derive(Clone)]
pub(crate) enum Protocol {
    /// Plain HTTP: status codes and problem+json.
    Http(Arc<http::HttpRules>),
    /// A gRPC method named in the layer's `grpc_methods`.
    #[cfg(feature = "tonic")]
    Grpc {
        /// The gRPC rules.
        rules: Arc<grpc::GrpcRules>,
        /// The method path, `/package.Service/Method`.
        method: Arc<str>,
    },
}

/// What a response means for its record, decided from its head or only at the end of its body
/// (as tower-http's `ClassifiedResponse::{Ready, RequiresEos}`).
pub(crate) enum Classified {
    /// The head decides.
    Ready(OutcomeClass),
    /// The trailers decide, once the body is read (a gRPC answer with its status in them).
    #[cfg(feature = "tonic")]
    RequiresTrailers(grpc::ClassifyTrailers),
}

impl Classified {
    /// The class when the head decides, else `otherwise` (the trailers are not waited for).
    #[cfg_attr(not(feature = "tonic"), allow(unused_variables))]
    pub(crate) fn head_or(self, otherwise: OutcomeClass) -> OutcomeClass {
        match self {
            Classified::Ready(class) => class,
            #[cfg(feature = "tonic")]
            Classified::RequiresTrailers(_) => otherwise,
        }
    }

    /// The class, given the trailers found at the end of the body.
    #[cfg_attr(not(feature = "tonic"), allow(unused_variables))]
    pub(crate) fn with_trailers(self, trailers: Option<&HeaderMap>) -> OutcomeClass {
        match self {
            Classified::Ready(class) => class,
            #[cfg(feature = "tonic")]
            Classified::RequiresTrailers(rule) => rule.classify(trailers),
        }
    }
}

impl Protocol {
    /// The key: `Ok(None)` when there is none, a refusal when it is invalid.
    pub(crate) fn read_key(&self, headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
        let name = match self {
            Protocol::Http(rules) => &rules.key_header,
            #[cfg(feature = "tonic")]
            Protocol::Grpc { rules, .. } => &rules.key_header,
        };
        key::parse_key(headers, name).map_err(|error| Problem::new(ProblemCode::KeyInvalid, error.to_string()))
    }

    /// The refusal of a request that must carry a key and has none.
    pub(crate) fn key_missing(&self) -> Problem {
        let detail = match self {
            Protocol::Http(_) => http::KEY_MISSING,
            #[cfg(feature = "tonic")]
            Protocol::Grpc { .. } => grpc::KEY_MISSING,
        };
        Problem::new(ProblemCode::KeyMissing, detail)
    }

    /// The operation: for HTTP the explicit name, else axum's matched route template, else
    /// method and path; for gRPC the method path.
    pub(crate) fn operation(&self, parts: &Parts) -> Arc<str> {
        match self {
            Protocol::Http(rules) => rules.operation(parts),
            #[cfg(feature = "tonic")]
            Protocol::Grpc { method, .. } => method.clone(),
        }
    }

    /// The class of a response: the handler's [`OutcomeClass`] marker wins, for every protocol;
    /// else the protocol's rule, from the head when it can, or else from the trailers.
    pub(crate) fn classify(&self, parts: &::http::response::Parts) -> Classified {
        if let Some(marker) = outcome::handler_marker(parts) {
            return Classified::Ready(marker);
        }
        match self {
            Protocol::Http(rules) => Classified::Ready(rules.classify(parts)),
            #[cfg(feature = "tonic")]
            Protocol::Grpc { rules, .. } => rules.classify(parts),
        }
    }

    /// What is kept of a response: its status, the headers the protocol keeps, the trailers
    /// it keeps, and the body.
    pub(crate) fn stored_response(
        &self,
        parts: &::http::response::Parts,
        body: Bytes,
        trailers: Option<&HeaderMap>,
    ) -> StoredResponse {
        let headers = kept(&parts.headers, |name| self.keeps_header(name));
        let trailers = trailers.map_or_else(Vec::new, |trailers| kept(trailers, |name| self.keeps_trailer(name)));
        StoredResponse { status: parts.status, headers, trailers, body }
    }

    /// Whether a response header is stored with the answer and replayed.
    fn keeps_header(&self, name: &HeaderName) -> bool {
        match self {
            Protocol::Http(rules) => rules.keeps_header(name),
            #[cfg(feature = "tonic")]
            Protocol::Grpc { rules, .. } => rules.keeps_header(name),
        }
    }

    /// Whether a trailer is stored with the answer and replayed.
    fn keeps_trailer(&self, name: &HeaderName) -> bool {
        match self {
            Protocol::Http(_) => http::keeps_trailer(name),
            #[cfg(feature = "tonic")]
            Protocol::Grpc { .. } => grpc::keeps_trailer(name),
        }
    }

    /// The layer's own answer: problem+json for HTTP, a trailers-only status for gRPC.
    pub(crate) fn refuse<B>(&self, problem: Problem) -> Response<IdempotencyBody<B>> {
        match self {
            Protocol::Http(rules) => rules.refuse(&problem),
            #[cfg(feature = "tonic")]
            Protocol::Grpc { .. } => grpc::refuse(&problem),
        }
        .map(IdempotencyBody::full)
    }
}

/// The fields of `map` that `keep` keeps, in order.
fn kept(map: &HeaderMap, keep: impl Fn(&HeaderName) -> bool) -> Fields {
    map.iter().filter(|(name, _)| keep(name)).map(|(name, value)| (name.clone(), value.clone())).collect()
}
