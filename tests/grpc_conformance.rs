//! The contract over gRPC (CONTRACT.md, gRPC column): a real tonic client against a real tonic
//! server on a loopback port, the idempotency layer over PostgreSQL, in atomic and in leased
//! mode. The server and its test service are in `support/grpc.rs`.
#![cfg(all(feature = "grpc-example", feature = "postgres"))]

#[path = "support/grpc.rs"]
mod grpc;
mod support;

use std::time::{Duration, Instant};

use tonic::Code;
use tower_idempotency::{CouplingMode, OutcomeClass};

use grpc::{ThingsService, call, client, replayed, rows, serve, thing};

const ACCOUNT: Option<&str> = Some("acct_1");

/// A store, its service and a server with the default test layer (adjusted by `adjust`).
async fn start(
    mode: CouplingMode,
    adjust: impl FnOnce(
        tower_idempotency::IdempotencyLayer<tower_idempotency::PostgresStore>,
    ) -> tower_idempotency::IdempotencyLayer<tower_idempotency::PostgresStore>,
) -> (ThingsService, sqlx::PgPool, std::net::SocketAddr) {
    let store = support::pg_store(mode).await;
    grpc::create_table(store.pool()).await;
    let service = ThingsService::new(store.pool().clone());
    let addr = serve(adjust(grpc::layer(store.clone())), service.clone()).await;
    (service, store.pool().clone(), addr)
}

fn metadata_str<'a>(metadata: &'a tonic::metadata::MetadataMap, name: &str) -> Option<&'a str> {
    metadata.get(name).and_then(|v| v.to_str().ok())
}

async fn retry_replays_the_message_metadata_and_trailers(mode: CouplingMode) {
    let (service, pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;

    let first = client.create(call(thing("book", 1299), ACCOUNT, &["k-1"])).await.expect("first call");
    assert!(!replayed(first.metadata()), "the first answer is not a replay");
    assert_eq!(metadata_str(first.metadata(), "x-not-stored"), Some("first-answer-only"));
    let first_trailer = metadata_str(first.metadata(), "x-trailer-seq").expect("the trailer").to_owned();

    let retry = client.create(call(thing("book", 1299), ACCOUNT, &["k-1"])).await.expect("retry");
    assert!(replayed(retry.metadata()), "the retry carries idempotent-replayed: true");
    assert_eq!(retry.get_ref(), first.get_ref(), "the replayed message is the first answer's");
    assert_eq!(metadata_str(retry.metadata(), "x-thing-execution"), Some("1"), "declared metadata is replayed");
    assert_eq!(
        metadata_str(retry.metadata(), "x-trailer-seq"),
        Some(first_trailer.as_str()),
        "the trailers are the first answer's"
    );
    assert_eq!(metadata_str(retry.metadata(), "x-not-stored"), None, "undeclared metadata is not replayed");
    assert_eq!(retry.metadata().get("content-type").map(|v| v.as_bytes()), Some(&b"application/grpc"[..]));
    assert_eq!(service.executions("create"), 1, "the handler ran once");
    assert_eq!(rows(&pool, "create").await, 1, "one row for the key");
}

async fn handler_gets_its_context_and_transaction_from_the_request_extensions(mode: CouplingMode) {
    let (_service, pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    let first = client.create(call(thing("pen", 1), ACCOUNT, &["k-ctx"])).await.expect("call").into_inner();
    assert_eq!(first.operation_id.len(), 36, "a UUID-shaped operation id: {first:?}");
    let (operation_id, in_claim_tx): (String, bool) =
        sqlx::query_as("SELECT operation_id, in_claim_tx FROM things").fetch_one(&pool).await.expect("the row");
    assert_eq!(operation_id, first.operation_id);
    assert_eq!(in_claim_tx, mode == CouplingMode::Atomic, "a TxHandle reaches the handler in atomic mode only");
}

async fn same_key_with_a_different_message_is_failed_precondition(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    client.create(call(thing("book", 1299), ACCOUNT, &["k-2"])).await.expect("first call");
    let status = client.create(call(thing("book", 1300), ACCOUNT, &["k-2"])).await.expect_err("a different message");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(metadata_str(status.metadata(), "idempotency-code"), Some("idempotency_key_reused"));
    assert_eq!(service.executions("create"), 1);
}

async fn missing_key_is_invalid_argument_and_runs_nothing(mode: CouplingMode) {
    let (service, pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    let status = client.create(call(thing("book", 1), ACCOUNT, &[])).await.expect_err("no key");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(metadata_str(status.metadata(), "idempotency-code"), Some("idempotency_key_missing"));
    assert_eq!(status.message(), "this method requires idempotency-key metadata");
    assert_eq!(service.executions("create"), 0);
    assert_eq!(rows(&pool, "create").await, 0);
}

async fn invalid_keys_are_invalid_argument(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    let too_long = "k".repeat(256);
    let cases: [(&str, &[&str]); 5] = [
        ("an sf-list", &["\"a\", \"b\""]),
        ("two fields", &["a", "b"]),
        ("an empty key", &[""]),
        ("a key over 255 characters", &[too_long.as_str()]),
        ("a parameterised key", &["\"a\";p=1"]),
    ];
    for (what, keys) in cases {
        let status = client.create(call(thing("book", 1), ACCOUNT, keys)).await.expect_err(what);
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert_eq!(metadata_str(status.metadata(), "idempotency-code"), Some("idempotency_key_invalid"), "{what}");
    }
    assert_eq!(service.executions("create"), 0);
}

async fn in_flight_duplicate_is_aborted_after_the_bounded_wait(mode: CouplingMode) {
    let wait = Duration::from_millis(300);
    let (service, _pool, addr) = start(mode, |l| l.in_flight_wait(wait)).await;
    let mut first_client = client(addr).await;
    let first = tokio::spawn(async move { first_client.slow(call(thing("slow", 1), ACCOUNT, &["k-slow"])).await });
    service.slow_entered().await;

    let mut client = client(addr).await;
    let started = Instant::now();
    let status = client.slow(call(thing("slow", 1), ACCOUNT, &["k-slow"])).await.expect_err("still in flight");
    let waited = started.elapsed();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert_eq!(metadata_str(status.metadata(), "idempotency-code"), Some("idempotency_request_in_flight"));
    assert!(metadata_str(status.metadata(), "retry-after").is_some(), "a retry-after hint");
    assert!(waited >= wait.mul_f32(0.9), "the duplicate waited for the original first ({waited:?})");
    assert!(waited < Duration::from_secs(5), "the wait is bounded ({waited:?})");

    service.open_gate(1);
    let first = first.await.expect("task").expect("the original completes");
    let replay = client.slow(call(thing("slow", 1), ACCOUNT, &["k-slow"])).await.expect("then the retry replays");
    assert!(replayed(replay.metadata()));
    assert_eq!(replay.get_ref(), first.get_ref());
    assert_eq!(service.executions("slow"), 1);
}

async fn stored_failure_status_is_replayed_and_its_writes_roll_back(mode: CouplingMode) {
    let (service, pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    let first = client.reject(call(thing("card", 5), ACCOUNT, &["k-rej"])).await.expect_err("rejected");
    assert_eq!(first.code(), Code::FailedPrecondition);
    assert_eq!(first.message(), grpc::REJECTION, "the handler's own message, percent-decoded intact");
    assert!(!replayed(first.metadata()));

    let retry = client.reject(call(thing("card", 5), ACCOUNT, &["k-rej"])).await.expect_err("replayed rejection");
    assert_eq!((retry.code(), retry.message()), (Code::FailedPrecondition, grpc::REJECTION));
    assert!(replayed(retry.metadata()), "the stored failure is replayed, marked");
    assert_eq!(metadata_str(retry.metadata(), "idempotency-code"), None, "it is the handler's status, not a refusal");
    assert_eq!(service.executions("reject"), 1, "the handler ran once");
    if mode == CouplingMode::Atomic {
        assert_eq!(rows(&pool, "reject").await, 0, "a stored failure rolls the handler's writes back");
    }
}

async fn released_failure_status_executes_again(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    for attempt in 1..=2 {
        let status = client.fail(call(thing("x", 1), ACCOUNT, &["k-fail"])).await.expect_err("fails");
        assert_eq!(status.code(), Code::Unavailable, "attempt {attempt}");
        assert!(!replayed(status.metadata()), "attempt {attempt} is not a replay");
    }
    assert_eq!(service.executions("fail"), 2, "a released failure lets the retry execute");
}

async fn route_rule_keyed_on_the_grpc_code_stores_a_failure(mode: CouplingMode) {
    let rule = |code| match code {
        Code::Ok => OutcomeClass::Complete,
        Code::Unavailable => OutcomeClass::Reject,
        _ => OutcomeClass::Release,
    };
    let (service, _pool, addr) = start(mode, move |l| l.classify_grpc_with(rule)).await;
    let mut client = client(addr).await;
    client.fail(call(thing("x", 1), ACCOUNT, &["k-rule"])).await.expect_err("fails");
    let retry = client.fail(call(thing("x", 1), ACCOUNT, &["k-rule"])).await.expect_err("replayed");
    assert_eq!(retry.code(), Code::Unavailable);
    assert!(replayed(retry.metadata()));
    assert_eq!(service.executions("fail"), 1);
}

async fn a_method_not_named_passes_through_untouched(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    for _ in 0..2 {
        let answer = client.unguarded(call(thing("u", 1), ACCOUNT, &["k-u"])).await.expect("passes through");
        assert!(!replayed(answer.metadata()));
        assert_eq!(answer.get_ref().operation_id, "", "the layer gave the handler no context");
    }
    client.unguarded(call(thing("u", 1), ACCOUNT, &[])).await.expect("no key needed");
    client.unguarded(call(thing("u", 1), ACCOUNT, &["\"a\", \"b\""])).await.expect("no key check either");
    assert_eq!(service.executions("unguarded"), 4);
}

async fn unauthenticated_calls_are_refused_before_the_layer_and_store_nothing(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    let status = client.create(call(thing("book", 1), None, &["k-auth"])).await.expect_err("no account");
    assert_eq!(status.code(), Code::Unauthenticated);
    let answer = client.create(call(thing("book", 1), ACCOUNT, &["k-auth"])).await.expect("authenticated");
    assert!(!replayed(answer.metadata()), "nothing was stored for the refused call");
    assert_eq!(service.executions("create"), 1);
}

async fn scopes_are_isolated(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l).await;
    let mut client = client(addr).await;
    let a = client.create(call(thing("book", 1), Some("acct_a"), &["shared"])).await.expect("a");
    let b = client.create(call(thing("book", 1), Some("acct_b"), &["shared"])).await.expect("b");
    assert!(!replayed(b.metadata()), "another account's key never replays");
    assert_ne!(a.get_ref().operation_id, b.get_ref().operation_id);
    assert_eq!(service.executions("create"), 2);
}

async fn request_over_the_body_limit_is_resource_exhausted(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l.max_request_body(64)).await;
    let mut client = client(addr).await;
    let status = client.create(call(thing(&"x".repeat(100), 1), ACCOUNT, &["k-big"])).await.expect_err("too big");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(metadata_str(status.metadata(), "idempotency-code"), Some("idempotency_body_too_large"));
    assert_eq!(service.executions("create"), 0);
}

async fn key_past_its_retention_is_failed_precondition(mode: CouplingMode) {
    let retention = tower_idempotency::Retention {
        response: Duration::from_millis(300),
        tombstone: Duration::from_secs(60),
        ..Default::default()
    };
    let (service, _pool, addr) = start(mode, move |l| l.retention(retention)).await;
    let mut client = client(addr).await;
    client.create(call(thing("old", 1), ACCOUNT, &["k-old"])).await.expect("first call");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let late = client.create(call(thing("old", 1), ACCOUNT, &["k-old"])).await.expect_err("expired");
    assert_eq!(late.code(), Code::FailedPrecondition, "{late:?}");
    assert_eq!(metadata_str(late.metadata(), "idempotency-code"), Some("idempotency_key_expired"));
    assert_eq!(service.executions("create"), 1, "an expired key never executes again");
}

async fn unknown_outcome_is_aborted_on_retry(mode: CouplingMode) {
    // The route's rule: the downstream's UNAVAILABLE after sending means nobody knows.
    let rule = |code| match code {
        Code::Ok => OutcomeClass::Complete,
        Code::Unavailable => OutcomeClass::Unknown,
        _ => OutcomeClass::Release,
    };
    let (service, _pool, addr) = start(mode, move |l| l.classify_grpc_with(rule)).await;
    let mut client = client(addr).await;
    let first = client.fail(call(thing("x", 1), ACCOUNT, &["k-unknown"])).await.expect_err("fails");
    assert_eq!(first.code(), Code::Unavailable, "the handler's own status reaches the client");
    let retry = client.fail(call(thing("x", 1), ACCOUNT, &["k-unknown"])).await.expect_err("refused");
    assert_eq!(retry.code(), Code::Aborted, "{retry:?}");
    assert_eq!(metadata_str(retry.metadata(), "idempotency-code"), Some("idempotency_outcome_unknown"));
    assert_eq!(service.executions("fail"), 1);
}

async fn response_too_large_to_store_is_internal(mode: CouplingMode) {
    let (service, _pool, addr) = start(mode, |l| l.max_response_body(8)).await;
    let mut client = client(addr).await;
    for attempt in 1..=2 {
        let status = client.create(call(thing("big", 1), ACCOUNT, &["k-large"])).await.expect_err("too large");
        assert_eq!(status.code(), Code::Internal, "attempt {attempt}: {status:?}");
        assert_eq!(metadata_str(status.metadata(), "idempotency-code"), Some("idempotency_response_too_large"));
    }
    assert_eq!(service.executions("create"), 2, "nothing was stored: the retry executed afresh");
}

macro_rules! modes {
    ($($case:ident),+ $(,)?) => {
        mod atomic {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(tower_idempotency::CouplingMode::Atomic).await;
                }
            )+
        }
        mod leased {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(tower_idempotency::CouplingMode::Leased).await;
                }
            )+
        }
    };
}

modes!(
    retry_replays_the_message_metadata_and_trailers,
    handler_gets_its_context_and_transaction_from_the_request_extensions,
    same_key_with_a_different_message_is_failed_precondition,
    missing_key_is_invalid_argument_and_runs_nothing,
    invalid_keys_are_invalid_argument,
    in_flight_duplicate_is_aborted_after_the_bounded_wait,
    stored_failure_status_is_replayed_and_its_writes_roll_back,
    released_failure_status_executes_again,
    route_rule_keyed_on_the_grpc_code_stores_a_failure,
    a_method_not_named_passes_through_untouched,
    unauthenticated_calls_are_refused_before_the_layer_and_store_nothing,
    scopes_are_isolated,
    request_over_the_body_limit_is_resource_exhausted,
    key_past_its_retention_is_failed_precondition,
    unknown_outcome_is_aborted_on_retry,
    response_too_large_to_store_is_internal,
);
