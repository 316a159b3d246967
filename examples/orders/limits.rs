//! What one client can make the service hold: how long a `POST /orders` body may take to
//! arrive, and how many bytes of request bodies the idempotency layer buffers at once.
//!
//! - `ORDERS_BODY_TIMEOUT_SECS` (default 30): a body not complete within this many seconds of
//!   the layer starting to read it is answered 408 `idempotency_body_timeout`.
//! - `ORDERS_BUFFER_BUDGET_BYTES` (default 67108864, 64 MiB; at least 1048576, the largest
//!   body): the bytes of request bodies held at once; a request whose body does not fit is
//!   refused before it is read with 503 `idempotency_buffer_budget_exhausted` and
//!   `Retry-After`.

use std::time::Duration;

use tower_idempotency::{BoxError, BufferBudget, IdempotencyLayer};

/// The largest `POST /orders` body, the layer's default (1 MiB).
pub(crate) const MAX_BODY_BYTES: usize = 1024 * 1024;
/// `ORDERS_BODY_TIMEOUT_SECS` when unset.
const DEFAULT_BODY_TIMEOUT_SECS: u64 = 30;

/// The service's limits on request bodies.
#[derive(Clone, Debug)]
pub(crate) struct RequestLimits {
    /// The deadline for a whole request body.
    pub(crate) body_timeout: Duration,
    /// The bytes of request bodies held at once.
    pub(crate) buffer_budget: BufferBudget,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            body_timeout: Duration::from_secs(DEFAULT_BODY_TIMEOUT_SECS),
            buffer_budget: BufferBudget::new(BufferBudget::DEFAULT_CAPACITY),
        }
    }
}

impl RequestLimits {
    /// The limits from the environment (see the module docs); a value that is set but not
    /// valid stops the start.
    pub(crate) fn from_env() -> Result<Self, BoxError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The limits from `var` (the environment, or a test's table).
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, BoxError> {
        let number = |name: &str, at_least: u64| -> Result<Option<u64>, BoxError> {
            let Some(text) = var(name).filter(|text| !text.is_empty()) else { return Ok(None) };
            match text.trim().parse::<u64>() {
                Ok(value) if value >= at_least => Ok(Some(value)),
                _ => Err(format!("{name} must be a whole number, at least {at_least}").into()),
            }
        };
        let mut limits = Self::default();
        if let Some(secs) = number("ORDERS_BODY_TIMEOUT_SECS", 1)? {
            limits.body_timeout = Duration::from_secs(secs);
        }
        if let Some(bytes) = number("ORDERS_BUFFER_BUDGET_BYTES", MAX_BODY_BYTES as u64)? {
            let bytes = usize::try_from(bytes).map_err(|_| "ORDERS_BUFFER_BUDGET_BYTES is too large")?;
            limits.buffer_budget = BufferBudget::new(bytes);
        }
        Ok(limits)
    }

    /// `layer` with these limits.
    pub(crate) fn apply<St>(&self, layer: IdempotencyLayer<St>) -> IdempotencyLayer<St>
    where
        St: tower_idempotency::Store,
    {
        layer.max_request_body(MAX_BODY_BYTES).body_timeout(self.body_timeout).buffer_budget(self.buffer_budget.clone())
    }
}
