//! The orders example (`examples/orders/`), driven in process through its router, on both of
//! its databases: every case runs once on SQLite (`sqlite::…`, a fresh file in the temp
//! directory) and, with the `postgres` feature, once on PostgreSQL (`postgres::…`, a fresh
//! schema on the server that `DATABASE_URL` names, default
//! `postgres://postgres@127.0.0.1:5432/test`). `cargo test --all-features` runs both.
#![cfg(all(feature = "axum", feature = "sqlite"))]

/// The orders example's modules, all but its `main.rs` and start-up (the tests build the
/// router themselves, with a clock of their own).
#[path = "../../examples/orders"]
#[allow(dead_code, reason = "what only start-up or the gRPC example uses goes unused here")]
mod orders {
    pub mod admin;
    pub mod api;
    pub mod auth;
    pub mod book;
    mod create_request;
    pub mod cursor;
    mod drill;
    pub mod events;
    pub mod lifecycle;
    pub mod limits;
    mod operations;
    pub mod operator;
    mod operator_request;
    // Only for what the events module enqueues when a payment settles.
    mod payments;
    mod problem;
    pub mod recovery;
}

#[path = "../support/cleanup.rs"]
mod cleanup;
mod harness;

mod accounts_and_creation;
mod one_transaction;
mod operator_routes;
mod pagination;
mod retention;

use accounts_and_creation::*;
use one_transaction::*;
use operator_routes::*;
use pagination::*;
use retention::*;

use orders::book::created_at::CreatedAt;

const CURSOR_SECRET: &[u8] = b"orders example test cursor secret";
/// 2025-01-02T03:04:05.000006Z
const START_MICROS: i64 = 1_735_787_045_000_006;
const ALICE: &str = "acct_alice";
/// The operator token of the tests' operator listener.
const ADMIN_TOKEN: &str = "operator-token-0123456789";
const BOB: &str = "acct_bob";

// ---------------------------------------------------------------------------------------------
// Every case on every backend
// ---------------------------------------------------------------------------------------------

/// Stamps out, for each case, one test on SQLite and (with the `postgres` feature) one on
/// PostgreSQL. Each gets a database of its own, removed when the case ends, passed or failed.
macro_rules! on_every_backend {
    ($($case:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $case() {
                    let db = crate::harness::TestDb::create(crate::harness::Backend::Sqlite).await;
                    crate::$case(&db).await;
                    db.remove().await;
                }
            )+
        }

        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test]
                async fn $case() {
                    let db = crate::harness::TestDb::create(crate::harness::Backend::Postgres).await;
                    crate::$case(&db).await;
                    db.remove().await;
                }
            )+
        }
    };
}

on_every_backend!(
    request_without_authorization_is_401_and_stores_nothing_so_the_key_still_executes_later,
    malformed_authorization_is_401_on_every_route,
    bearer_scheme_is_case_insensitive_and_64_character_accounts_are_accepted,
    create_answers_201_with_location_json_and_the_order,
    retry_with_same_key_and_body_replays_the_first_answer_and_creates_one_order,
    same_key_with_a_different_body_is_422_idempotency_key_reused,
    missing_idempotency_key_is_400_idempotency_key_missing_and_creates_nothing,
    invalid_input_is_422_validation_failed_and_a_corrected_retry_with_the_same_key_executes,
    every_kind_of_invalid_order_is_422_validation_failed_naming_the_problem,
    a_body_not_declared_as_json_is_415,
    amounts_beyond_f64_and_u64_are_preserved_exactly,
    amounts_that_differ_beyond_f64_precision_under_different_keys_are_different_orders,
    key_reused_with_an_amount_that_differs_beyond_f64_precision_is_422_idempotency_key_reused,
    two_accounts_using_the_same_key_get_separate_orders,
    another_accounts_order_an_unknown_id_and_a_malformed_id_are_the_same_404,
    get_routes_are_not_guarded_by_the_idempotency_layer,
    pages_of_ten_return_all_25_orders_once_newest_first_with_ties_broken_by_order_id,
    the_last_page_has_a_null_next_cursor_even_when_it_is_exactly_full,
    the_default_page_is_20_orders,
    an_order_created_between_page_fetches_neither_repeats_nor_skips_older_orders,
    a_tampered_cursor_is_400_invalid_cursor,
    another_accounts_cursor_is_400_invalid_cursor,
    a_cursor_of_another_version_or_signed_with_another_secret_is_400_invalid_cursor,
    limit_out_of_range_or_not_a_number_is_400_invalid_limit_and_a_repeated_limit_is_400_invalid_query,
    create_writes_the_order_and_the_stored_answer_in_one_transaction,
    operator_routes_answer_401_without_the_token_and_404_when_it_is_unset,
    a_record_is_inspected_by_account_operation_and_key_and_never_shows_the_key,
    a_record_query_missing_a_parameter_or_with_an_invalid_one_is_400_invalid_query,
    evicting_a_record_lets_its_key_execute_afresh,
    a_record_in_flight_is_shown_processing_and_evicting_it_takes_the_claim_from_its_holder,
    an_unknown_outcome_is_409_until_an_operator_settles_it_and_then_replays_the_settlement,
    unknown_records_are_listed_oldest_first_and_counted_by_state,
    settling_a_record_that_is_not_unknown_is_409_and_a_bad_settlement_is_422_or_415,
    operation_status_is_the_callers_own_and_the_same_404_for_anything_else,
    a_key_past_its_retention_is_422_expired_until_its_tombstone_ends_then_executes_afresh,
);

// ---------------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------------

#[test]
fn created_at_is_rfc3339_utc_with_microseconds() {
    let cases = [
        (0, "1970-01-01T00:00:00.000000Z"),
        (-1, "1969-12-31T23:59:59.999999Z"),
        (951_782_400_000_000, "2000-02-29T00:00:00.000000Z"),
        (START_MICROS, "2025-01-02T03:04:05.000006Z"),
        (253_402_300_799_999_999, "9999-12-31T23:59:59.999999Z"),
    ];
    for (micros, expected) in cases {
        assert_eq!(CreatedAt::from_unix_micros(micros).to_string(), expected);
    }
}
