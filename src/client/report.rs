//! What the caller learns about a logical request: the report on an answer, or the error.

use super::policy::RetryReason;
use crate::BoxError;

/// How a logical request went, in the extensions of the answer the layer hands back
/// (`response.extensions().get::<RetryReport>()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryReport {
    pub(crate) key: Option<String>,
    pub(crate) attempts: u32,
    pub(crate) retries: Vec<RetryReason>,
    pub(crate) replayed: bool,
    pub(crate) gave_up: bool,
}

impl RetryReport {
    /// The `Idempotency-Key` every attempt carried (`None` for a method the layer does not guard).
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// How many attempts were sent, the first included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Why each retry was made, in order (one fewer than the attempts).
    pub fn retries(&self) -> &[RetryReason] {
        &self.retries
    }

    /// Whether the answer was a replay of a stored one (`Idempotent-Replayed: true`): an earlier
    /// attempt ran the request, and its answer was lost on the way.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// Whether this answer still said "later" (a 409, 503 or 429) when the attempts or the
    /// deadline ran out. A later retry with the same [`key`](Self::key) is safe.
    pub fn gave_up(&self) -> bool {
        self.gave_up
    }
}

/// Why the layer has no answer to hand back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryErrorKind {
    /// The request body is over the layer's buffer limit; nothing was sent.
    BodyTooLarge,
    /// The request body could not be read; nothing was sent.
    BodyUnreadable,
    /// The last attempt failed (connection, timeout) and the attempts or the deadline ran out.
    GaveUp,
}

/// The layer's error: no answer came back for the logical request.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.describe())]
pub struct RetryError {
    pub(crate) kind: RetryErrorKind,
    pub(crate) key: Option<String>,
    pub(crate) attempts: u32,
    pub(crate) retries: Vec<RetryReason>,
    pub(crate) may_have_executed: bool,
    #[source]
    pub(crate) source: Option<BoxError>,
}

impl RetryError {
    /// Why there is no answer.
    pub fn kind(&self) -> RetryErrorKind {
        self.kind
    }

    /// The key the attempts carried: retry later with it, and the server answers with the
    /// outcome of whichever attempt ran, instead of running the request a second time.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// How many attempts were sent (0 when the body was refused).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Why each retry was made, in order; the last is why the last attempt failed.
    pub fn retries(&self) -> &[RetryReason] {
        &self.retries
    }

    /// Whether any attempt may have run the request on the server: one whose connection broke or
    /// timed out after it was sent, or one the server answered "in flight", "outcome unknown" or
    /// "commit uncertain". `false` only when the server certainly did not run it.
    pub fn may_have_executed(&self) -> bool {
        self.may_have_executed
    }

    fn describe(&self) -> String {
        let what = match self.kind {
            RetryErrorKind::BodyTooLarge => return "the request body is over the retry buffer limit".to_owned(),
            RetryErrorKind::BodyUnreadable => return "the request body could not be read".to_owned(),
            RetryErrorKind::GaveUp => "no answer",
        };
        let executed = if self.may_have_executed { "may have executed" } else { "did not execute" };
        format!("{what} after {} attempt(s); the request {executed}", self.attempts)
    }
}
