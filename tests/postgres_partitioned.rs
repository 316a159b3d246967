//! `PostgresStore::hash_partitions` against the real PostgreSQL on this machine: the store,
//! lifecycle and HTTP contract suites in both modes on a hash-partitioned records table, the
//! layout itself, the purge's walk over the partitions, duplicates released together, and the
//! refusal of a table laid out otherwise.
#![cfg(all(feature = "testkit", feature = "postgres"))]

mod support;

support::suites_in_both_modes!(crate::support::pg_partitioned_store);

use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::MigrateError;
use tower_idempotency::store::FinishError;
use tower_idempotency::store::postgres::LayoutMismatch;
use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
use tower_idempotency::{
    Begin, BeginRequest, Claim, CouplingMode, Outcome, PostgresStore, RecordState, Retention, Store,
};

use support::TEST_PARTITIONS;

/// The schema the store's pool looks in first (each test's own).
async fn schema_of(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT current_schema()").fetch_one(pool).await.expect("current schema")
}

/// Per partition of the records table, in order: its name and how many records it holds.
async fn rows_per_partition(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT c.relname::text, (SELECT count(*) FROM idempotency_records r WHERE r.tableoid = c.oid) \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'idempotency_records'::regclass ORDER BY c.relname",
    )
    .fetch_all(pool)
    .await
    .expect("rows per partition")
}

/// Claims and completes `n` fresh identities (retention `retention`); their ids.
async fn complete_records(store: &PostgresStore, n: usize, retention: Retention) -> Vec<tower_idempotency::RecordId> {
    let fp = fingerprint(3);
    let mut ids = Vec::new();
    for _ in 0..n {
        let id = fresh_id("partitioned");
        let Begin::Claimed(claim) = store.begin(BeginRequest::new(&id, &fp).retention(retention)).await.unwrap() else {
            panic!("a fresh identity is claimed")
        };
        claim.finish(Outcome::Complete(answer("spread"))).await.expect("finish");
        ids.push(id);
    }
    ids
}

/// The table is `PARTITION BY HASH (record_id)` into the configured partitions, each with every
/// index and constraint of the table; records written through the store land in all of them.
#[tokio::test]
async fn the_table_is_hash_partitioned_and_records_spread_over_the_partitions() {
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_partitioned_store(mode).await;
        let pool = store.pool();
        let (strategy, key, partitions): (String, String, i64) = sqlx::query_as(
            "SELECT p.partstrat::text, pg_get_partkeydef(p.partrelid), \
                    (SELECT count(*) FROM pg_inherits i WHERE i.inhparent = p.partrelid) \
             FROM pg_partitioned_table p WHERE p.partrelid = 'idempotency_records'::regclass",
        )
        .fetch_one(pool)
        .await
        .expect("the records table is a partitioned table");
        assert_eq!((strategy.as_str(), key.as_str()), ("h", "HASH (record_id)"));
        assert_eq!(partitions, i64::from(TEST_PARTITIONS));
        let names: Vec<String> = rows_per_partition(pool).await.into_iter().map(|(name, _)| name).collect();
        let expected: Vec<String> = (0..TEST_PARTITIONS).map(|r| format!("idempotency_records_p{r:03}")).collect();
        assert_eq!(names, expected);

        // The indexes of 0001, 0003, 0007 and 0010 (not the ones 0003, 0007 and 0010 dropped), on the parent and every
        // partition; the constraints on the parent, which the partitions inherit.
        let indexes: Vec<String> = sqlx::query_scalar(
            "SELECT indexrelid::regclass::text FROM pg_index \
             WHERE indrelid = 'idempotency_records'::regclass ORDER BY 1",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        let expected_indexes = [
            "idempotency_records_live_until_idx",
            "idempotency_records_open_idx",
            "idempotency_records_operation_id_hash",
            "idempotency_records_pkey",
            "idempotency_records_tombstone_forget_idx",
            "idempotency_records_unknown_age_idx",
            "idempotency_records_unknown_idx",
        ];
        assert_eq!(indexes, expected_indexes);
        let per_partition: Vec<i64> = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM pg_index x WHERE x.indrelid = i.inhrelid) \
             FROM pg_inherits i WHERE i.inhparent = 'idempotency_records'::regclass",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        assert_eq!(per_partition, vec![expected_indexes.len() as i64; usize::from(TEST_PARTITIONS)]);
        let constraints: Vec<String> = sqlx::query_scalar(
            "SELECT conname::text FROM pg_constraint WHERE conrelid = 'idempotency_records'::regclass ORDER BY 1",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        // Migration 12 drops the two CHECK constraints; the primary key stays.
        assert_eq!(constraints, ["idempotency_records_pkey"]);

        complete_records(&store, 200, Retention::default()).await;
        let rows = rows_per_partition(pool).await;
        assert_eq!(rows.iter().map(|(_, n)| n).sum::<i64>(), 200, "{mode:?}: {rows:?}");
        // 200 SHA-256 identities over 8 partitions: an empty one would mean they do not spread.
        assert!(rows.iter().all(|(_, n)| *n > 0), "{mode:?}: every partition holds records: {rows:?}");
    }
}

/// Identical requests released together, for several keys at once, in both modes: exactly one
/// of each key's contenders claims it, and every other one is answered from its record (or
/// told it is in flight).
#[tokio::test]
async fn duplicates_released_together_claim_each_identity_once() {
    const KEYS: usize = 24;
    const DUPLICATES: usize = 16;
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_partitioned_store(mode).await;
        support::each_identity_claimed_once(&store, KEYS, DUPLICATES, &format!("{mode:?}")).await;
        let rows = rows_per_partition(store.pool()).await;
        assert_eq!(rows.iter().map(|(_, n)| n).sum::<i64>(), KEYS as i64, "one record per key");
    }
}

/// The HTTP storm of the single-table test (`pg_storm.rs`) on the partitioned table: many
/// identical requests released together, one order row per key.
#[cfg(feature = "axum")]
#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key() {
    const KEYS: usize = 60;
    const DUPLICATES: usize = 32;
    tower_idempotency::testkit::run(async {
        let store = support::pg_partitioned_store(CouplingMode::Atomic).await;
        let conflicts = support::storm::pg_storm(&store, "pstorm", KEYS, DUPLICATES, 4).await;
        let records = rows_per_partition(store.pool()).await;
        assert_eq!(records.iter().map(|(_, n)| n).sum::<i64>(), KEYS as i64);
        println!("partitioned storm: {KEYS} keys x {DUPLICATES} requests, {conflicts} answers were 409");
    });
}

/// An atomic claim whose record is beaten to the table: the violation names the partition's
/// primary key (`<table>_pNNN_pkey`), and the claim still reports the identity lost, not an
/// uncertain commit.
#[tokio::test]
async fn a_record_committed_first_by_another_writer_is_the_identity_lost_on_a_partition() {
    let store = support::pg_partitioned_store(CouplingMode::Atomic).await;
    let id = fresh_id("raced");
    let fp = fingerprint(4);
    let Begin::Claimed(claim) = store.begin(BeginRequest::new(&id, &fp)).await.unwrap() else { panic!("claimed") };
    // A writer that skips the claim's lock.
    sqlx::query(
        "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
             response_status) VALUES (decode($1, 'hex'), 'completed', 1, $2, 0, 201)",
    )
    .bind(id.to_hex())
    .bind(vec![7_u8; 32])
    .execute(store.pool())
    .await
    .expect("the other writer's record");
    let violated: String = sqlx::query_scalar(
        "SELECT tableoid::regclass::text || '_pkey' FROM idempotency_records WHERE record_id = decode($1, 'hex')",
    )
    .bind(id.to_hex())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(violated.starts_with("idempotency_records_p"), "the record is in a partition: {violated}");
    let finished = claim.finish(Outcome::Complete(answer("mine"))).await;
    assert!(matches!(finished, Err(FinishError::ClaimLost)), "{finished:?}");
    let record = store.begin(BeginRequest::new(&id, &fingerprint(7))).await.unwrap();
    assert!(matches!(record, Begin::Existing(r) if r.state == RecordState::Completed), "the other writer's record");
}

/// The purge walks the partitions until its limit is spent: deletes first, then tombstones,
/// never more than the limit in one call, and everything due in the end. Only tombstones are
/// deleted, so a record past both of its times is made one first, then deleted: 60 changes to
/// make tombstones and 40 deletes.
#[tokio::test]
async fn the_purge_walks_every_partition_within_its_limit() {
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_partitioned_store(mode).await;
        let forget_now = Retention { response: Duration::ZERO, tombstone: Duration::ZERO, ..Retention::default() };
        let expire_now = Retention { response: Duration::ZERO, ..Retention::default() };
        let forgotten = complete_records(&store, 40, forget_now).await;
        let expired = complete_records(&store, 20, expire_now).await;
        let kept = complete_records(&store, 10, Retention::default()).await;

        // 100 changes over 8 partitions, 15 at a time: each call spans partitions.
        let mut calls = Vec::new();
        loop {
            let n = store.purge(15).await.expect("purge");
            calls.push(n);
            if n == 0 {
                break;
            }
        }
        // Which records a call makes tombstones decides how many deletes the next one finds, so
        // only the first four calls (at least 15 records still to make tombstones) are sure to be
        // full.
        assert!(calls.iter().all(|&n| n <= 15), "{mode:?}: never past the limit: {calls:?}");
        assert_eq!(calls[..4], [15; 4], "{mode:?}: {calls:?}");
        assert_eq!(calls.iter().sum::<usize>(), 100, "{mode:?}: 60 tombstones, 40 of them deleted: {calls:?}");
        let rows = rows_per_partition(store.pool()).await;
        assert_eq!(rows.iter().map(|(_, n)| n).sum::<i64>(), 30, "{mode:?}: {rows:?}");
        let states: Vec<(String, i64)> =
            sqlx::query_as("SELECT state, count(*) FROM idempotency_records GROUP BY 1 ORDER BY 1")
                .fetch_all(store.pool())
                .await
                .unwrap();
        assert_eq!(states, [("completed".to_owned(), 10), ("expired".to_owned(), 20)], "{mode:?}");
        for id in &forgotten {
            assert!(tower_idempotency::Admin::inspect(&store, id).await.unwrap().is_none(), "{mode:?}: deleted");
        }
        for id in &expired {
            let info = tower_idempotency::Admin::inspect(&store, id).await.unwrap().expect("a tombstone");
            assert_eq!(info.state, RecordState::Expired);
        }
        for id in &kept {
            let info = tower_idempotency::Admin::inspect(&store, id).await.unwrap().expect("kept");
            assert_eq!(info.state, RecordState::Completed);
        }
    }
}

/// The layout `migrate` found, as the refusal says it.
fn refusal(result: Result<(), MigrateError>) -> LayoutMismatch {
    match result {
        Err(MigrateError::Source(source)) => match source.downcast::<LayoutMismatch>() {
            Ok(mismatch) => *mismatch,
            Err(other) => panic!("another migration error: {other}"),
        },
        other => panic!("migrate must refuse the table, got {other:?}"),
    }
}

/// How the records table is laid out now: its relkind, partition count, and applied migrations.
async fn layout(pool: &PgPool) -> (String, i64, Vec<i64>) {
    let schema = schema_of(pool).await;
    let (kind, count): (String, i64) = sqlx::query_as(
        "SELECT relkind::text, (SELECT count(*) FROM pg_inherits WHERE inhparent = 'idempotency_records'::regclass) \
         FROM pg_class WHERE oid = 'idempotency_records'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let history = format!("SELECT version FROM \"{schema}\".\"_idempotency_records_migrations\" ORDER BY 1");
    let versions = sqlx::query_scalar(sqlx::AssertSqlSafe(history)).fetch_all(pool).await.unwrap();
    (kind, count, versions)
}

/// `migrate` refuses a table laid out otherwise than the store says, and changes nothing: one
/// table for a partitioned store, another partition count, partitions for a one-table store.
/// The same layout migrates again as often as asked.
#[tokio::test]
async fn migrate_refuses_a_table_of_another_layout() {
    // One table, then a store that wants partitions.
    let plain = support::pg_store(CouplingMode::Atomic).await;
    let schema = schema_of(plain.pool()).await;
    let before = layout(plain.pool()).await;
    assert_eq!(before, ("r".to_owned(), 0, vec![1, 2, 3, 6, 7, 8, 9, 10, 12, 14]));
    let partitioned = plain.clone().hash_partitions(8).unwrap();
    let mismatch = refusal(partitioned.migrate().await);
    assert_eq!(mismatch.table(), format!("\"{schema}\".\"idempotency_records\""));
    let message = mismatch.to_string();
    assert!(message.contains("is one table, not partitioned"), "{message}");
    assert!(message.contains("configured for hash_partitions(8)"), "{message}");
    assert_eq!(layout(plain.pool()).await, before, "the refused migrate changed nothing");
    plain.migrate().await.expect("the one-table store migrates again");

    // Eight partitions, then a store that wants four, and one that wants one table.
    let eight = support::pg_partitioned_store(CouplingMode::Leased).await;
    let before = layout(eight.pool()).await;
    assert_eq!(before, ("p".to_owned(), 8, vec![1, 2, 3, 6, 7, 8, 9, 10, 12, 14]));
    let message = refusal(eight.clone().hash_partitions(4).unwrap().migrate().await).to_string();
    assert!(message.contains("is hash partitioned into 8 partitions"), "{message}");
    assert!(message.contains("configured for hash_partitions(4)"), "{message}");
    let one_table = PostgresStore::new(eight.pool().clone()).schema(&schema_of(eight.pool()).await).unwrap();
    let message = refusal(one_table.migrate().await).to_string();
    assert!(message.contains("is hash partitioned into 8 partitions"), "{message}");
    assert!(message.contains("configured for one table"), "{message}");
    assert_eq!(layout(eight.pool()).await, before, "the refused migrates changed nothing");
    eight.migrate().await.expect("the same layout migrates again");
    eight.clone().hash_partitions(8).unwrap().migrate().await.expect("said again, the same count");
    assert_eq!(layout(eight.pool()).await, before);
}

/// A table made by hand, with no migration history, is refused as well if it is not
/// partitioned as configured: `CREATE TABLE IF NOT EXISTS` would otherwise keep it silently.
#[tokio::test]
async fn migrate_refuses_a_table_made_by_hand_without_history() {
    let schema = support::unique_name("tidem");
    let pool = support::pg_pool(&schema, 4).await;
    sqlx::raw_sql("CREATE TABLE idempotency_records (record_id bytea PRIMARY KEY)").execute(&pool).await.unwrap();
    let store = PostgresStore::new(pool.clone()).schema(&schema).unwrap().hash_partitions(16).unwrap();
    let message = refusal(store.migrate().await).to_string();
    assert!(message.contains("is one table"), "{message}");
    let history: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT to_regclass('\"{schema}\".\"_idempotency_records_migrations\"')::text"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(history, None, "nothing ran");
}

/// Partition counts outside 2..=1024 are refused when the store is built.
#[tokio::test]
async fn partition_counts_outside_the_range_are_refused() {
    let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy(&support::database_url()).unwrap();
    for n in [0, 1, 1025, u16::MAX] {
        let refused = PostgresStore::new(pool.clone()).hash_partitions(n).unwrap_err();
        assert_eq!(refused.requested(), n);
        assert!(refused.to_string().contains("2 to 1024"), "{refused}");
    }
    for n in [2, 64, 1024] {
        assert!(PostgresStore::new(pool.clone()).hash_partitions(n).is_ok(), "{n}");
    }
}
