//! The conformance kit (feature `testkit`): suites that prove a [`Store`](crate::Store)
//! implementation, or a layer configuration, keeps the contract.
//!
//! - [`store`]: the store suite. Stamp it out for your store with [`store_suite!`](crate::store_suite).
//! - [`lifecycle`]: the lifecycle suite, for stores that implement [`Admin`](crate::store::Admin)
//!   (unknown outcomes, inspection, settlement, eviction, expiry of every state, lease renewal,
//!   recovery). Stamp it out with [`lifecycle_suite!`](crate::lifecycle_suite).
//! - [`http`]: the HTTP contract suite, run through the real layer around a reference
//!   application ([`http::TestApp`]) whose executions it counts. Stamp it out with
//!   [`http_contract_suite!`](crate::http_contract_suite).
//!
//! Each case is a public `async fn`, so a suite can also be called case by case. The macros
//! expand to one `#[test]` per case, each on its own multi-threaded runtime:
//!
//! ```ignore
//! // tests/my_store.rs
//! tower_idempotency::store_suite!(leased, async { my_crate::MyStore::connect_for_tests().await });
//! tower_idempotency::http_contract_suite!(async { my_crate::MyStore::connect_for_tests().await });
//! ```

pub mod http;
pub mod lifecycle;
pub mod store;

use std::future::Future;

/// Runs a suite case on a fresh multi-threaded runtime (what the suite macros expand to).
pub fn run<F: Future<Output = ()>>(case: F) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance case")
        .block_on(case);
}

/// Stamps out the store suite for one store: one `#[test]` per case.
///
/// The first argument says which coupling mode the store keeps: `leased` (the claim is
/// committed first and held by a lease) or `atomic` (the claim is a live transaction). The
/// second is an expression that evaluates to a future of a fresh store, isolated from every
/// other test's (its own schema, database or instance).
#[macro_export]
macro_rules! store_suite {
    (leased, $make:expr) => {
        $crate::store_suite!(@cases $make;
            claims_a_new_identity, replays_a_completed_record, replays_a_stored_failure,
            release_lets_the_next_attempt_claim, reports_a_different_fingerprint_even_in_flight,
            in_flight_duplicate_waits_then_reports_in_flight, waiter_sees_the_outcome_when_the_holder_finishes,
            waiter_claims_after_a_release, identities_are_independent, concurrent_begins_grant_exactly_one_claim,
            retention_keeps_a_tombstone_then_forgets, forgotten_record_is_taken_over_before_any_purge,
            records_shadow_batches, fencing_tokens_increase,
            stale_lease_becomes_unknown, stale_lease_reexecute_takes_over_and_fences_the_old_holder,
            dropped_leased_claim_is_not_left_in_flight);
    };
    (atomic, $make:expr) => {
        $crate::store_suite!(@cases $make;
            claims_a_new_identity, replays_a_completed_record, replays_a_stored_failure,
            release_lets_the_next_attempt_claim, reports_a_different_fingerprint_even_in_flight,
            in_flight_duplicate_waits_then_reports_in_flight, waiter_sees_the_outcome_when_the_holder_finishes,
            waiter_claims_after_a_release, identities_are_independent, concurrent_begins_grant_exactly_one_claim,
            retention_keeps_a_tombstone_then_forgets, forgotten_record_is_taken_over_before_any_purge,
            records_shadow_batches, dropped_atomic_claim_leaves_nothing);
    };
    (@cases $make:expr; $($case:ident),+ $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::testkit::run(async { $crate::testkit::store::$case($make.await).await });
            }
        )+
    };
}

/// Stamps out the lifecycle suite for one store that implements
/// [`Admin`](crate::store::Admin): one `#[test]` per case. Arguments as for
/// [`store_suite!`](crate::store_suite).
#[macro_export]
macro_rules! lifecycle_suite {
    (leased, $make:expr) => {
        $crate::lifecycle_suite!(@cases $make;
            inspect_shows_the_record_but_never_its_key, operation_lookup_is_scoped,
            unknown_outcome_is_kept_and_reported, settlement_is_fenced_state_checked_and_once,
            not_executed_releases_the_key, eviction_frees_the_key, counts_and_unknown_list_follow_the_records,
            unknown_record_expires_after_its_retention, checkout_hands_each_due_record_once_per_backoff,
            recovery_worker_reconciles_unknown_records, renewal_extends_the_lease_and_reports_a_lost_claim,
            sweep_marks_stale_leases_unknown_and_releases_reexecutable,
            abandoned_processing_record_expires_after_its_retention, workers_at_once_settle_each_record_once,
            recovery_census_comes_at_its_interval);
    };
    (atomic, $make:expr) => {
        $crate::lifecycle_suite!(@cases $make;
            inspect_shows_the_record_but_never_its_key, operation_lookup_is_scoped,
            unknown_outcome_is_kept_and_reported, settlement_is_fenced_state_checked_and_once,
            not_executed_releases_the_key, eviction_frees_the_key, counts_and_unknown_list_follow_the_records,
            unknown_record_expires_after_its_retention, checkout_hands_each_due_record_once_per_backoff,
            recovery_worker_reconciles_unknown_records, recovery_census_comes_at_its_interval);
    };
    (@cases $make:expr; $($case:ident),+ $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::testkit::run(async { $crate::testkit::lifecycle::$case($make.await).await });
            }
        )+
    };
}

/// Stamps out the HTTP contract suite for one store: one `#[test]` per case, each wrapping a
/// fresh [`http::TestApp`] in an [`IdempotencyLayer`](crate::IdempotencyLayer) over the store
/// that `$make` (a future of a fresh store) yields.
///
/// An optional second argument, a closure `|layer| layer.some_setting(..)`, adjusts the layer
/// (the suite sets the scope source, the in-flight wait and the body limit itself).
#[macro_export]
macro_rules! http_contract_suite {
    ($make:expr) => {
        $crate::http_contract_suite!($make, |layer| layer);
    };
    ($make:expr, $adjust:expr) => {
        $crate::http_contract_suite!(@cases $make, $adjust;
            first_request_gets_the_handler_response, retry_replays_byte_for_byte,
            replay_keeps_only_allow_listed_headers, key_reused_with_a_different_body_is_refused,
            key_reused_with_a_different_query_is_refused, reordered_json_members_are_the_same_request,
            missing_key_is_refused, invalid_keys_are_refused, unguarded_methods_pass_through,
            in_flight_duplicate_gets_409_with_retry_after, waiting_duplicate_gets_the_replay,
            released_failure_executes_again, stored_failure_is_replayed, scopes_are_isolated,
            operations_are_isolated, body_over_the_limit_is_refused, concurrent_duplicates_run_the_handler_once,
            content_type_never_skips_the_layer, json_charset_parameter_is_the_same_request,
            key_past_its_retention_is_expired, unknown_outcome_is_answered_then_refused,
            response_too_large_to_store_is_500, mismatch_status_409_is_honoured,
            long_handler_keeps_its_lease_and_replays);
    };
    (@cases $make:expr, $adjust:expr; $($case:ident),+ $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::testkit::run(async {
                    let store = $make.await;
                    let adjust = $adjust;
                    let harness = $crate::testkit::http::Harness::new(move |app, settings| {
                        let layer = settings.apply($crate::IdempotencyLayer::new(store.clone()));
                        $crate::testkit::http::wrap(&adjust(layer), app)
                    });
                    $crate::testkit::http::$case(harness).await
                });
            }
        )+
    };
}
