//! The policy table, `Retry-After`, the deadline and the jitter bounds.

use std::time::{Duration, SystemTime};

use http::StatusCode;

use super::{Decision, RetryPolicy, RetryReason, decide_grpc, decide_http};
use crate::client::parse_retry_after;
use crate::problem::ProblemCode;

fn http(status: u16, code: Option<ProblemCode>, retry_after: bool) -> Decision {
    decide_http(StatusCode::from_u16(status).unwrap(), code.map(ProblemCode::code), retry_after)
}

#[test]
fn every_http_answer_class_of_the_contract_maps_to_retry_or_stop() {
    use Decision::{Retry, Stop};
    use ProblemCode as P;
    let table = [
        // Successes and replays are final.
        (http(200, None, false), Stop),
        (http(201, None, false), Stop),
        (http(303, None, false), Stop),
        // The answers that say "later".
        (http(409, Some(P::RequestInFlight), true), Retry(RetryReason::InFlight)),
        (http(409, Some(P::OutcomeUnknown), true), Retry(RetryReason::OutcomeUnknown)),
        (http(503, Some(P::StoreUnavailable), true), Retry(RetryReason::StoreUnavailable)),
        (http(503, Some(P::CommitUncertain), true), Retry(RetryReason::CommitUncertain)),
        (http(503, Some(P::StoreUnavailable), false), Retry(RetryReason::StoreUnavailable)),
        (http(503, None, true), Retry(RetryReason::Unavailable)),
        (http(429, None, false), Retry(RetryReason::RateLimited)),
        (http(429, None, true), Retry(RetryReason::RateLimited)),
        // Definitive answers.
        (http(503, None, false), Stop),
        (http(422, Some(P::KeyReused), false), Stop),
        (http(409, Some(P::KeyReused), false), Stop),
        (http(422, Some(P::KeyExpired), false), Stop),
        (http(409, None, true), Stop),
        (http(400, Some(P::KeyInvalid), false), Stop),
        (http(400, Some(P::KeyMissing), false), Stop),
        (http(400, None, false), Stop),
        (http(401, Some(P::ScopeMissing), false), Stop),
        (http(413, Some(P::BodyTooLarge), false), Stop),
        (http(422, None, false), Stop),
        (http(500, Some(P::ResponseTooLarge), false), Stop),
        (http(500, None, true), Stop),
        (http(502, None, false), Stop),
        // A code only counts on the status the contract gives it.
        (http(500, Some(P::CommitUncertain), false), Stop),
        (http(200, Some(P::RequestInFlight), false), Stop),
    ];
    for (i, (got, want)) in table.into_iter().enumerate() {
        assert_eq!(got, want, "row {i}");
    }
}

#[test]
fn grpc_statuses_follow_the_same_rules() {
    use Decision::{Retry, Stop};
    use ProblemCode as P;
    let grpc = |status, code: Option<ProblemCode>, retry_after| decide_grpc(status, code.map(P::code), retry_after);
    assert_eq!(grpc(0, None, false), Stop);
    assert_eq!(grpc(10, Some(P::RequestInFlight), true), Retry(RetryReason::InFlight));
    assert_eq!(grpc(10, Some(P::OutcomeUnknown), true), Retry(RetryReason::OutcomeUnknown));
    assert_eq!(grpc(10, None, false), Stop);
    assert_eq!(grpc(14, Some(P::StoreUnavailable), true), Retry(RetryReason::StoreUnavailable));
    assert_eq!(grpc(14, Some(P::CommitUncertain), true), Retry(RetryReason::CommitUncertain));
    assert_eq!(grpc(14, None, false), Retry(RetryReason::Unavailable));
    assert_eq!(grpc(4, None, false), Retry(RetryReason::TimedOut));
    assert_eq!(grpc(8, None, true), Retry(RetryReason::RateLimited));
    assert_eq!(grpc(8, Some(P::BodyTooLarge), false), Stop);
    assert_eq!(grpc(9, Some(P::KeyReused), false), Stop);
    assert_eq!(grpc(9, Some(P::KeyExpired), false), Stop);
    assert_eq!(grpc(3, Some(P::KeyInvalid), false), Stop);
    assert_eq!(grpc(13, Some(P::ResponseTooLarge), false), Stop);
    assert_eq!(grpc(2, None, false), Stop);
}

#[test]
fn only_answers_that_may_carry_a_side_effect_say_so() {
    assert!(RetryReason::ConnectionFailed.may_have_executed());
    assert!(RetryReason::TimedOut.may_have_executed());
    assert!(RetryReason::OutcomeUnknown.may_have_executed());
    assert!(RetryReason::CommitUncertain.may_have_executed());
    assert!(!RetryReason::StoreUnavailable.may_have_executed());
    assert!(!RetryReason::RateLimited.may_have_executed());
}

#[test]
fn retry_after_takes_seconds_and_http_dates() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_400); // 07:26:40 GMT
    assert_eq!(parse_retry_after("0", now), Some(Duration::ZERO));
    assert_eq!(parse_retry_after(" 120 ", now), Some(Duration::from_secs(120)));
    assert_eq!(parse_retry_after("99999999999999999999999", now), Some(Duration::from_secs(u64::MAX)));
    assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now), Some(Duration::from_secs(80)));
    // The obsolete date forms RFC 9110 still asks recipients to accept.
    assert_eq!(parse_retry_after("Wednesday, 21-Oct-15 07:28:00 GMT", now), Some(Duration::from_secs(80)));
    assert_eq!(parse_retry_after("Wed Oct 21 07:28:00 2015", now), Some(Duration::from_secs(80)));
    // A date in the past: retry now.
    assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:00:00 GMT", now), Some(Duration::ZERO));
    for bad in ["", "-1", "1.5", "soon", "Wed, 32 Oct 2015 07:28:00 GMT", "1e3"] {
        assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
    }
}

#[test]
fn full_jitter_stays_between_zero_and_the_exponential_ceiling() {
    let policy =
        RetryPolicy::new().base_delay(Duration::from_millis(100)).max_delay(Duration::from_secs(2)).max_attempts(50);
    assert_eq!(policy.backoff_ceiling(0), Duration::from_millis(100));
    assert_eq!(policy.backoff_ceiling(1), Duration::from_millis(200));
    assert_eq!(policy.backoff_ceiling(4), Duration::from_millis(1600));
    assert_eq!(policy.backoff_ceiling(5), Duration::from_secs(2));
    assert_eq!(policy.backoff_ceiling(u32::MAX), Duration::from_secs(2));
    for retry in [0, 1, 3, 10, 40] {
        let ceiling = policy.backoff_ceiling(retry);
        assert_eq!(policy.delay(retry, None, 0), Duration::ZERO);
        assert_eq!(policy.delay(retry, None, u64::try_from(ceiling.as_nanos()).unwrap()), ceiling);
        assert!(policy.delay(retry, None, u64::MAX) <= ceiling);
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..1000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            assert!(policy.delay(retry, None, seed) <= ceiling);
        }
    }
}

#[test]
fn retry_after_is_a_floor_under_the_jitter() {
    let policy = RetryPolicy::new().base_delay(Duration::from_millis(100)).max_delay(Duration::from_millis(100));
    let after = Some(Duration::from_secs(3));
    assert_eq!(policy.delay(0, after, 0), Duration::from_secs(3));
    assert_eq!(policy.delay(0, after, u64::MAX), Duration::from_secs(3));
    assert_eq!(policy.delay(0, Some(Duration::ZERO), 100_000_000), Duration::from_millis(100));
}

#[test]
fn attempts_and_the_deadline_bound_the_retries() {
    let policy = RetryPolicy::new().max_attempts(3).deadline(Duration::from_secs(10));
    assert!(policy.may_retry(1, Duration::ZERO, Duration::from_secs(1)));
    assert!(policy.may_retry(2, Duration::from_secs(8), Duration::from_secs(1)));
    assert!(!policy.may_retry(3, Duration::ZERO, Duration::ZERO), "attempts exhausted");
    assert!(!policy.may_retry(1, Duration::from_secs(9), Duration::from_secs(1)), "would start at the deadline");
    assert!(!policy.may_retry(1, Duration::from_secs(2), Duration::from_secs(3600)), "Retry-After past the deadline");
    assert_eq!(RetryPolicy::new().max_attempts(0).attempts_allowed(), 1);
}

#[test]
fn an_attempt_never_outlives_the_deadline() {
    let policy = RetryPolicy::new().attempt_timeout(Duration::from_secs(5)).deadline(Duration::from_secs(12));
    assert_eq!(policy.timeout_at(Duration::ZERO), Duration::from_secs(5));
    assert_eq!(policy.timeout_at(Duration::from_secs(9)), Duration::from_secs(3));
    assert_eq!(policy.timeout_at(Duration::from_secs(20)), Duration::ZERO);
}
