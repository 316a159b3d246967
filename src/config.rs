//! The layer's settings, shared by every clone of the layer and its services.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};

use crate::budget::BufferBudget;
use crate::fingerprint::FingerprintSpec;
use crate::key::Scope;
use crate::outcome::Classifier;
use crate::protocol::Protocols;
#[cfg(feature = "tonic")]
use crate::protocol::grpc::{GrpcClassifier, GrpcRules};
use crate::protocol::http::HttpRules;
use crate::rollout::RolloutSwitch;
use crate::shadow_log::{self, ShadowLog};
use crate::store::{Retention, StaleLeasePolicy};
use crate::telemetry::Telemetry;

/// The application's scope function.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Option<Scope> + Send + Sync>;

/// Where the scope of a guarded request comes from.
#[derive(Clone)]
pub(crate) enum ScopeSource {
    /// A [`Scope`] in the request's extensions, put there by the application's authentication.
    Extension,
    /// One scope for every caller, chosen explicitly by the application.
    Shared(Scope),
    /// The application's function.
    With(ScopeFn),
}

impl ScopeSource {
    pub(crate) fn scope(&self, parts: &Parts) -> Option<Scope> {
        match self {
            ScopeSource::Extension => parts.extensions.get::<Scope>().cloned(),
            ScopeSource::Shared(scope) => Some(scope.clone()),
            ScopeSource::With(f) => f(parts),
        }
    }
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) key_required: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) scope: ScopeSource,
    pub(crate) operation: Option<Arc<str>>,
    pub(crate) fingerprint: FingerprintSpec,
    pub(crate) max_request_body: usize,
    /// The deadline for reading a guarded request's whole body.
    pub(crate) body_timeout: Duration,
    /// The bytes of request bodies buffered at once, shared with other layers.
    pub(crate) buffer_budget: BufferBudget,
    pub(crate) max_response_body: usize,
    pub(crate) in_flight_wait: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) lease: Duration,
    /// Whether a leased claim's lease is renewed while its handler runs.
    pub(crate) heartbeat: bool,
    pub(crate) stale_lease: StaleLeasePolicy,
    pub(crate) retention: Retention,
    pub(crate) mismatch_status: StatusCode,
    pub(crate) classifier: Option<Classifier>,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) problem_type_base: Arc<str>,
    pub(crate) rollout: RolloutSwitch,
    /// Shadow mode's log, shared by the layer's clones and services.
    pub(crate) shadow_log: ShadowLog,
    /// The layer's metric handles, shared by its clones.
    pub(crate) telemetry: Arc<Telemetry>,
    /// The gRPC method paths guarded (`/package.Service/Method`); other gRPC calls pass through.
    #[cfg(feature = "tonic")]
    pub(crate) grpc_methods: Vec<Arc<str>>,
    /// The route's own rule for gRPC answers, keyed on the gRPC status code.
    #[cfg(feature = "tonic")]
    pub(crate) grpc_classifier: Option<GrpcClassifier>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            header: HeaderName::from_static("idempotency-key"),
            key_required: true,
            methods: vec![Method::POST, Method::PATCH],
            scope: ScopeSource::Extension,
            operation: None,
            fingerprint: FingerprintSpec::new(),
            max_request_body: 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            buffer_budget: BufferBudget::process(),
            max_response_body: 1024 * 1024,
            in_flight_wait: Duration::from_secs(2),
            retry_after: Duration::from_secs(1),
            lease: Duration::from_secs(30),
            heartbeat: true,
            stale_lease: StaleLeasePolicy::MarkUnknown,
            retention: Retention::default(),
            mismatch_status: StatusCode::UNPROCESSABLE_ENTITY,
            classifier: None,
            stored_headers: Vec::new(),
            problem_type_base: Arc::from("urn:tower-idempotency:problem:"),
            rollout: RolloutSwitch::default(),
            shadow_log: ShadowLog::new(shadow_log::DEFAULT_INTERVAL, shadow_log::DEFAULT_CAPACITY),
            telemetry: Arc::default(),
            #[cfg(feature = "tonic")]
            grpc_methods: Vec::new(),
            #[cfg(feature = "tonic")]
            grpc_classifier: None,
        }
    }
}

impl Config {
    /// The rules of every protocol the layer speaks, from these settings.
    pub(crate) fn protocols(&self) -> Protocols {
        let http = HttpRules {
            methods: self.methods.clone(),
            key_header: self.header.clone(),
            operation: self.operation.clone(),
            classifier: self.classifier.clone(),
            stored_headers: self.stored_headers.clone(),
            problem_type_base: self.problem_type_base.clone(),
        };
        #[cfg(feature = "tonic")]
        let grpc = GrpcRules {
            methods: self.grpc_methods.clone(),
            key_header: self.header.clone(),
            classifier: self.grpc_classifier.clone(),
            stored_headers: self.stored_headers.clone(),
        };
        Protocols::new(
            http,
            #[cfg(feature = "tonic")]
            grpc,
        )
    }
}
