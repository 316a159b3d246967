//! What to do after one attempt: retry (and why) or stop, and how long to wait first.
//!
//! Pure: no I/O, no clock, no randomness of its own (the caller passes the current time and a
//! random number in), so every rule is a plain function of its inputs. The HTTP and the gRPC
//! layer share it.

use std::time::Duration;

use http::StatusCode;

use crate::problem::ProblemCode;

/// Why an attempt is sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryReason {
    /// The inner service failed: connection refused or reset, an answer cut short.
    ConnectionFailed,
    /// The attempt took longer than the per-attempt timeout (or gRPC `DEADLINE_EXCEEDED`).
    TimedOut,
    /// 409 (gRPC `ABORTED`) `idempotency_request_in_flight`: the first attempt is still running.
    InFlight,
    /// 409 (gRPC `ABORTED`) `idempotency_outcome_unknown`: an earlier attempt died; the server
    /// settles it, and a later retry gets the settled answer.
    OutcomeUnknown,
    /// 503 (gRPC `UNAVAILABLE`) `idempotency_store_unavailable`: nothing ran.
    StoreUnavailable,
    /// 503 (gRPC `UNAVAILABLE`) `idempotency_commit_uncertain`: a retry with the same key is safe.
    CommitUncertain,
    /// Any other 503 with `Retry-After`, or any other gRPC `UNAVAILABLE`.
    Unavailable,
    /// 429 Too Many Requests (gRPC `RESOURCE_EXHAUSTED` with `retry-after` metadata).
    RateLimited,
}

impl RetryReason {
    /// A short stable name, for logs and metrics labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            RetryReason::ConnectionFailed => "connection_failed",
            RetryReason::TimedOut => "timed_out",
            RetryReason::InFlight => "in_flight",
            RetryReason::OutcomeUnknown => "outcome_unknown",
            RetryReason::StoreUnavailable => "store_unavailable",
            RetryReason::CommitUncertain => "commit_uncertain",
            RetryReason::Unavailable => "unavailable",
            RetryReason::RateLimited => "rate_limited",
        }
    }

    /// Whether an attempt that ended this way may have run the request's side effect. The key
    /// makes a retry safe either way; this only matters when the layer gives up.
    pub const fn may_have_executed(self) -> bool {
        match self {
            // A failed connection may have carried the whole request before it broke.
            RetryReason::ConnectionFailed | RetryReason::TimedOut => true,
            RetryReason::InFlight | RetryReason::OutcomeUnknown | RetryReason::CommitUncertain => true,
            RetryReason::StoreUnavailable | RetryReason::Unavailable | RetryReason::RateLimited => false,
        }
    }
}

impl std::fmt::Display for RetryReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The verdict on one attempt's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The answer is final (a success or a definitive refusal): hand it to the caller.
    Stop,
    /// The answer says "try again later": send the request again with the same key.
    Retry(RetryReason),
}

/// The verdict on an HTTP answer with `status`, the problem `code` of its body (if it was read
/// and had one) and whether it carried `Retry-After`.
///
/// Retried: 409 `idempotency_request_in_flight` and `idempotency_outcome_unknown`; 503
/// `idempotency_store_unavailable`, `idempotency_commit_uncertain`, and any 503 with
/// `Retry-After`; 429. Everything else is final: successes, 422 `idempotency_key_reused`, every
/// other 4xx, and 5xx answers that do not say a retry is welcome.
pub fn decide_http(status: StatusCode, code: Option<&str>, has_retry_after: bool) -> Decision {
    match status {
        StatusCode::CONFLICT => match known_code(code) {
            Some(ProblemCode::RequestInFlight) => Decision::Retry(RetryReason::InFlight),
            Some(ProblemCode::OutcomeUnknown) => Decision::Retry(RetryReason::OutcomeUnknown),
            _ => Decision::Stop,
        },
        StatusCode::SERVICE_UNAVAILABLE => match known_code(code) {
            Some(ProblemCode::StoreUnavailable) => Decision::Retry(RetryReason::StoreUnavailable),
            Some(ProblemCode::CommitUncertain) => Decision::Retry(RetryReason::CommitUncertain),
            _ if has_retry_after => Decision::Retry(RetryReason::Unavailable),
            _ => Decision::Stop,
        },
        StatusCode::TOO_MANY_REQUESTS => Decision::Retry(RetryReason::RateLimited),
        _ => Decision::Stop,
    }
}

/// gRPC status codes this policy looks at (the numbers of `tonic::Code`, which this module does
/// not depend on).
mod grpc_code {
    pub const OK: i32 = 0;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const ABORTED: i32 = 10;
    pub const UNAVAILABLE: i32 = 14;
}

/// The verdict on a gRPC answer with status `status` (its number), the `idempotency-code`
/// metadata and whether it carried `retry-after` metadata: the HTTP rules, mapped.
///
/// Retried: `ABORTED` with `idempotency_request_in_flight` or `idempotency_outcome_unknown` (the
/// 409s); every `UNAVAILABLE` (gRPC defines it as transient); `DEADLINE_EXCEEDED` (a timeout);
/// `RESOURCE_EXHAUSTED` with `retry-after` (the 429). Everything else is final, among them
/// `FAILED_PRECONDITION` `idempotency_key_reused` and `RESOURCE_EXHAUSTED` without
/// `retry-after` (a message over a size limit).
pub fn decide_grpc(status: i32, code: Option<&str>, has_retry_after: bool) -> Decision {
    match status {
        grpc_code::ABORTED => match known_code(code) {
            Some(ProblemCode::RequestInFlight) => Decision::Retry(RetryReason::InFlight),
            Some(ProblemCode::OutcomeUnknown) => Decision::Retry(RetryReason::OutcomeUnknown),
            _ => Decision::Stop,
        },
        grpc_code::UNAVAILABLE => match known_code(code) {
            Some(ProblemCode::StoreUnavailable) => Decision::Retry(RetryReason::StoreUnavailable),
            Some(ProblemCode::CommitUncertain) => Decision::Retry(RetryReason::CommitUncertain),
            _ => Decision::Retry(RetryReason::Unavailable),
        },
        grpc_code::DEADLINE_EXCEEDED => Decision::Retry(RetryReason::TimedOut),
        grpc_code::RESOURCE_EXHAUSTED if has_retry_after => Decision::Retry(RetryReason::RateLimited),
        grpc_code::OK => Decision::Stop,
        _ => Decision::Stop,
    }
}

/// The problem codes that change a decision.
fn known_code(code: Option<&str>) -> Option<ProblemCode> {
    [
        ProblemCode::RequestInFlight,
        ProblemCode::OutcomeUnknown,
        ProblemCode::StoreUnavailable,
        ProblemCode::CommitUncertain,
    ]
    .into_iter()
    .find(|known| Some(known.code()) == code)
}

/// How often and how long the layer retries.
///
/// Waits grow exponentially with *full jitter*: before retry `n` (counting from 0) the layer
/// waits a uniformly random time between zero and `min(max_delay, base_delay × 2ⁿ)`, or the
/// answer's `Retry-After` if that is longer. It stops when `max_attempts` attempts were made or
/// when the next attempt could not start before `deadline` (counted from the first attempt);
/// each attempt gets at most `attempt_timeout`, and never more than what is left of the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
    attempt_timeout: Duration,
    deadline: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts, 100 ms base delay, 5 s largest backoff, 10 s per attempt, 30 s in all.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            attempt_timeout: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The default policy (see [`Default`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// At most this many attempts in all, the first included (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The backoff's scale: the ceiling of the first retry's random wait.
    pub fn base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// The largest backoff ceiling (a `Retry-After` may still ask for longer).
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// How long one attempt may take, until its answer's head has arrived.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// How long all attempts together may take, from the start of the first.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The configured number of attempts.
    pub fn attempts_allowed(&self) -> u32 {
        self.max_attempts
    }

    /// The ceiling of the random wait before retry `retry` (0 for the first retry):
    /// `min(max_delay, base_delay × 2^retry)`.
    pub fn backoff_ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX);
        self.base_delay.saturating_mul(factor).min(self.max_delay)
    }

    /// The wait before retry `retry`: `random` scaled into `[0, backoff_ceiling(retry)]`, or
    /// `retry_after` if that is longer.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>, random: u64) -> Duration {
        let ceiling = u64::try_from(self.backoff_ceiling(retry).as_nanos()).unwrap_or(u64::MAX);
        let jittered = Duration::from_nanos(random % ceiling.saturating_add(1));
        retry_after.map_or(jittered, |after| after.max(jittered))
    }

    /// Whether a retry that would start `delay` from now may be made, after `attempts_made`
    /// attempts and `elapsed` since the first began.
    pub fn may_retry(&self, attempts_made: u32, elapsed: Duration, delay: Duration) -> bool {
        attempts_made < self.max_attempts && elapsed.saturating_add(delay) < self.deadline
    }

    /// The timeout of an attempt that starts `elapsed` after the first: the per-attempt timeout,
    /// cut to what is left of the deadline.
    pub fn timeout_at(&self, elapsed: Duration) -> Duration {
        self.attempt_timeout.min(self.deadline.saturating_sub(elapsed))
    }
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
