//! What one guarded request brings along its path (enforced, shadow or old).

use std::sync::Arc;

use crate::config::Config;
use crate::protocol::Protocol;
use crate::telemetry::OperationMetrics;

/// What one guarded request brings along the path.
pub(crate) struct Guarded<S, St> {
    pub(crate) inner: S,
    pub(crate) store: St,
    pub(crate) config: Arc<Config>,
    pub(crate) protocol: Protocol,
    pub(crate) operation: Arc<str>,
    pub(crate) metrics: OperationMetrics,
    /// The request's `idempotency` span, whose fields the path fills in.
    pub(crate) span: tracing::Span,
}
