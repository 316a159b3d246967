//! Migration 9's compact record on the real PostgreSQL: what an atomic record leaves out (its
//! fencing token, `updated_at`, attempts and scope digest) is written as NULL and read back as
//! the values it stood for; records written in the earlier form are still found; and a table the
//! migration has not reached still takes records, in the earlier form.
#![cfg(all(feature = "axum", feature = "postgres"))]

mod support;

use http::StatusCode;
use tower_idempotency::store::FinishError;
use tower_idempotency::store::postgres::PgClaim;
use tower_idempotency::{
    Admin, Begin, BeginRequest, Claim, CouplingMode, Fingerprint, IdempotencyKey, Outcome, PostgresStore, RecordId,
    Scope, Store, StoredResponse,
};

fn scope() -> Scope {
    Scope::new("account-7")
}

fn id(key: &str) -> RecordId {
    RecordId::new(&scope(), "POST /orders", &IdempotencyKey::new(key).unwrap())
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_parts(tower_idempotency::fingerprint::FINGERPRINT_VERSION, [7; 32])
}

async fn store_with_orders() -> PostgresStore {
    let store = support::pg_store(CouplingMode::Atomic).await;
    sqlx::raw_sql("CREATE TABLE orders (key text NOT NULL)").execute(store.pool()).await.expect("orders table");
    store
}

/// Claims `key` in the account's scope and writes its order in the claim's transaction.
async fn claim_with_an_order(store: &PostgresStore, key: &str) -> PgClaim {
    let (id, fingerprint, scope) = (id(key), fingerprint(), scope());
    let request = BeginRequest::new(&id, &fingerprint).labels(&scope, "POST /orders");
    let Begin::Claimed(claim) = store.begin(request).await.expect("begin") else {
        panic!("a new identity must be claimed");
    };
    let handle = claim.handle().expect("an atomic claim hands out its transaction");
    let mut conn = handle.acquire().await.expect("open transaction");
    sqlx::query("INSERT INTO orders (key) VALUES ($1)").bind(key).execute(&mut *conn).await.unwrap();
    drop(conn);
    claim
}

fn created() -> Outcome {
    Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "{\"order\":1}"))
}

async fn count(store: &PostgresStore, table: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM {table}");
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap()
}

/// Which of the columns migration 9 lets the store leave out are NULL in `key`'s record, and
/// whether its operation id column holds the scoped key (not the bare operation id).
async fn left_out(store: &PostgresStore, key: &str) -> (bool, bool, bool, bool, bool) {
    let id = id(key);
    let bare = uuid_bytes(&id.operation_id());
    sqlx::query_as(
        "SELECT fencing_token IS NULL, updated_at IS NULL, attempts IS NULL, scope_digest IS NULL, \
                operation_id IS NOT NULL AND operation_id <> $2 \
         FROM idempotency_records WHERE record_id = $1",
    )
    .bind(id.digest().to_vec())
    .bind(bare)
    .fetch_one(store.pool())
    .await
    .expect("the record")
}

/// The 16 bytes of a UUID-shaped operation id.
fn uuid_bytes(operation_id: &str) -> Vec<u8> {
    let hex: String = operation_id.chars().filter(|c| *c != '-').collect();
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
}

/// An atomic record is written compact and read back whole: fencing token 0, `updated_at` its
/// `created_at`, no attempts; found by its operation id in its own scope only; and a
/// reconciler's look counts from zero on it.
#[tokio::test]
async fn an_atomic_record_is_written_compact_and_read_back_whole() {
    let store = store_with_orders().await;
    claim_with_an_order(&store, "compact").await.finish(created()).await.expect("finish");
    assert_eq!(left_out(&store, "compact").await, (true, true, true, true, true));

    let shown = store.inspect(&id("compact")).await.expect("inspect").expect("the record");
    assert_eq!(shown.fencing_token, 0);
    assert_eq!(shown.updated_at, shown.created_at, "never updated: updated when created");
    assert_eq!(shown.attempts, 0);
    let found = store.inspect_operation(&scope(), &id("compact").operation_id()).await.expect("lookup");
    assert_eq!(found.map(|info| info.id), Some(id("compact")));
    let elsewhere = store.inspect_operation(&Scope::new("account-8"), &id("compact").operation_id()).await;
    assert!(elsewhere.expect("lookup").is_none(), "another scope does not find it");

    // The retry replays it.
    let fingerprint = fingerprint();
    let (compact, scope) = (id("compact"), scope());
    let retry = BeginRequest::new(&compact, &fingerprint).labels(&scope, "POST /orders");
    let Begin::Existing(record) = store.begin(retry).await.expect("begin") else { panic!("a retry replays") };
    assert_eq!(record.response.expect("the answer").body, "{\"order\":1}");
    assert_eq!((count(&store, "orders").await, count(&store, "idempotency_records").await), (1, 1));
}

/// A record written before migration 9 (the bare operation id and the scope's digest in columns
/// of their own) is still found by its operation id within its scope, and from no other.
#[tokio::test]
async fn a_record_written_before_migration_9_is_still_found_in_its_scope() {
    let store = store_with_orders().await;
    let earlier = id("earlier");
    sqlx::query(
        "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
             response_status, response_until, forget_at, operation, scope_digest, operation_id) \
         VALUES ($1, 'completed', 1, $2, 0, 201, clock_timestamp() + interval '1 day', \
                 clock_timestamp() + interval '2 days', 'POST /orders', $3, $4)",
    )
    .bind(earlier.digest().to_vec())
    .bind(vec![7_u8; 32])
    .bind(scope().digest().to_vec())
    .bind(uuid_bytes(&earlier.operation_id()))
    .execute(store.pool())
    .await
    .expect("a record in the earlier form");

    let found = store.inspect_operation(&scope(), &earlier.operation_id()).await.expect("lookup");
    assert_eq!(found.map(|info| (info.id, info.fencing_token)), Some((earlier, 0)));
    let elsewhere = store.inspect_operation(&Scope::new("account-8"), &earlier.operation_id()).await;
    assert!(elsewhere.expect("lookup").is_none(), "another scope does not find it");
}

/// A table without migration 9 (its columns still refuse NULL): the first compact record is
/// refused, its business write rolls back with it and the claim reports an uncertain commit (a
/// retry is safe); from then on the store writes the earlier form, which the table takes.
#[tokio::test]
async fn without_migration_9_the_store_writes_records_in_the_earlier_form() {
    let store = store_with_orders().await;
    sqlx::raw_sql(
        "ALTER TABLE idempotency_records ALTER COLUMN fencing_token SET NOT NULL, \
             ALTER COLUMN updated_at SET NOT NULL, ALTER COLUMN attempts SET NOT NULL",
    )
    .execute(store.pool())
    .await
    .expect("the table as before migration 9");

    let refused = claim_with_an_order(&store, "first").await.finish(created()).await;
    assert!(matches!(refused, Err(FinishError::CommitUncertain(_))), "{refused:?}");
    assert_eq!((count(&store, "orders").await, count(&store, "idempotency_records").await), (0, 0));

    for key in ["first", "second"] {
        claim_with_an_order(&store, key).await.finish(created()).await.expect("finish in the earlier form");
        let (token, updated, attempts, scope_digest, scoped) = left_out(&store, key).await;
        assert_eq!((token, updated, attempts), (false, false, false), "{key}: the earlier form");
        assert!(scope_digest && scoped, "{key}: the operation's key needs no migration");
        let shown = store.inspect(&id(key)).await.expect("inspect").expect("the record");
        assert_eq!((shown.fencing_token, shown.attempts), (0, 0));
    }
    assert_eq!((count(&store, "orders").await, count(&store, "idempotency_records").await), (2, 2));
}
