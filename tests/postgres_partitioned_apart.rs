//! `PostgresStore::hash_partitions` and `PostgresStore::answers_apart` together, against the
//! real PostgreSQL on this machine: the store, lifecycle and HTTP contract suites in both modes
//! on a hash partitioned table whose answers are in a table of their own, the layout itself,
//! tombstones made by the purge across the partitions without writing a record, each
//! partition's walk starting where its own last walk reached, the move of a partitioned table
//! with answers inline, the refusals, and the storm.
#![cfg(all(feature = "testkit", feature = "postgres"))]

mod support;

use support::apart::{
    Moved, SHORT, complete, leftovers_are_looked_for_by_every_64th_purge_once_none_is_due, move_to_answers_apart,
    settlements_leave_no_answer_row_that_nothing_points_at,
};

support::suites_in_both_modes!(crate::support::pg_partitioned_apart_store);

use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::MigrateError;
use tower_idempotency::store::postgres::LayoutMismatch;
use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
use tower_idempotency::{
    Begin, BeginRequest, CouplingMode, Fingerprint, PostgresStore, RecordId, RecordState, Retention, Store,
};

/// What a retry of `id` finds, as a record.
async fn replay(store: &PostgresStore, id: &RecordId, fp: &Fingerprint) -> tower_idempotency::Record {
    match store.begin(BeginRequest::new(id, fp)).await {
        Ok(Begin::Existing(record)) => record,
        Ok(_) => panic!("a retry of a finished request finds its record"),
        Err(error) => panic!("a retry: {error}"),
    }
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}"))).fetch_one(pool).await.unwrap()
}

/// Every record row's version (`xmin` and `ctid`), in `record_id` order: a record not written
/// since keeps it.
async fn versions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT xmin::text || ctid::text FROM idempotency_records ORDER BY record_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// How many of the table's partitions hold at least one record.
async fn partitions_used(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM idempotency_records").fetch_one(pool).await.unwrap()
}

/// The layout in the database: the records table's kind, its partitions, whether the answers
/// table exists, and the migrations applied.
async fn layout(pool: &PgPool) -> (String, i64, bool, Vec<i64>) {
    let (kind, partitions, apart): (String, i64, bool) = sqlx::query_as(
        "SELECT c.relkind::text, (SELECT count(*) FROM pg_inherits WHERE inhparent = c.oid), \
                to_regclass('idempotency_records_answers') IS NOT NULL \
         FROM pg_class c WHERE c.oid = 'idempotency_records'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let applied = sqlx::query_scalar("SELECT version FROM _idempotency_records_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap();
    (kind, partitions, apart, applied)
}

fn refusal(result: Result<(), MigrateError>) -> String {
    match result {
        Err(MigrateError::Source(source)) => {
            source.downcast_ref::<LayoutMismatch>().expect("a layout mismatch").to_string()
        }
        other => panic!("a layout mismatch, got {other:?}"),
    }
}

/// The table is partitioned and its answers apart; a record in any partition points at its
/// answer and replays it byte for byte, in both modes.
#[tokio::test]
async fn records_in_every_partition_point_at_their_answers() {
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_partitioned_apart_store(mode).await;
        let pool = store.pool();
        let (kind, partitions, apart, applied) = layout(pool).await;
        assert_eq!((kind.as_str(), partitions, apart), ("p", i64::from(support::TEST_PARTITIONS), true), "{mode:?}");
        assert_eq!(applied.last(), Some(&14), "{mode:?}: migrations 11 to 14 ran on the partitioned table");
        let fp = fingerprint(1);
        let ids: Vec<RecordId> = (0..24).map(|_| fresh_id("spread")).collect();
        for id in &ids {
            complete(&store, id, &fp, "spread", Retention::default()).await;
        }
        assert!(partitions_used(pool).await > 1, "{mode:?}: the records spread over the partitions");
        let inline: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_records WHERE response_status IS NOT NULL OR answer_seq IS NULL",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!((inline, count(pool, "idempotency_records_answers").await), (0, 24), "{mode:?}: every answer apart");
        for id in &ids {
            assert_eq!(replay(&store, id, &fp).await.response, Some(answer("spread")), "{mode:?}");
        }
    }
}

/// The purge deletes the due answers once across the partitions, writes no record, and later
/// deletes the records past their tombstone time from every partition.
#[tokio::test]
async fn the_purge_makes_tombstones_across_the_partitions_without_writing_a_record() {
    let store = support::pg_partitioned_apart_store(CouplingMode::Atomic).await;
    let pool = store.pool();
    let fp = fingerprint(2);
    let due: Vec<RecordId> = (0..16).map(|_| fresh_id("due")).collect();
    let kept: Vec<RecordId> = (0..4).map(|_| fresh_id("kept")).collect();
    for id in &due {
        complete(&store, id, &fp, "due", SHORT).await;
    }
    for id in &kept {
        complete(&store, id, &fp, "kept", Retention::default()).await;
    }
    let before = versions(pool).await;
    tokio::time::sleep(Duration::from_millis(400)).await;

    assert_eq!(store.purge(100).await.expect("purge"), 16, "the due answers, each once");
    assert_eq!(count(pool, "idempotency_records_answers").await, 4);
    assert_eq!(versions(pool).await, before, "no record was written");
    for id in &due {
        let record = replay(&store, id, &fp).await;
        assert_eq!((record.state, record.response), (RecordState::Expired, None));
    }
    for id in &kept {
        assert_eq!(replay(&store, id, &fp).await.response, Some(answer("kept")));
    }
    assert_eq!(store.purge(100).await.expect("purge"), 0, "nothing else is due");

    sqlx::raw_sql(
        "UPDATE idempotency_records r SET forget_at = clock_timestamp() - interval '1 second' \
         WHERE NOT EXISTS (SELECT 1 FROM idempotency_records_answers a WHERE a.seq = r.answer_seq)",
    )
    .execute(pool)
    .await
    .expect("age the tombstones");
    assert_eq!(store.purge(100).await.expect("purge"), 16, "the tombstones past their time, from every partition");
    assert_eq!(count(pool, "idempotency_records").await, 4);
}

/// Each partition's walk over the records past their tombstone time starts where its own last
/// walk reached, not where another partition's did: with every record due at a different time,
/// spread over the partitions, a purge of one record at a time deletes one on every call until
/// none is left (a walk shared by the partitions would skip the earlier records of the others
/// until it started over).
#[tokio::test]
async fn each_partition_walks_from_where_its_own_walk_reached() {
    let store = support::pg_partitioned_apart_store(CouplingMode::Leased).await;
    let pool = store.pool();
    let fp = fingerprint(3);
    for _ in 0..40 {
        complete(&store, &fresh_id("walk"), &fp, "walk", Retention::default()).await;
    }
    // Due one second apart, in an order that crosses the partitions (the identity's digest).
    sqlx::raw_sql(
        "UPDATE idempotency_records r SET forget_at = clock_timestamp() - interval '1 hour' + n * interval '1 second' \
         FROM (SELECT record_id, row_number() OVER (ORDER BY record_id) AS n FROM idempotency_records) o \
         WHERE o.record_id = r.record_id",
    )
    .execute(pool)
    .await
    .expect("spread the tombstone times");
    assert!(partitions_used(pool).await >= 4, "the records spread over the partitions");
    for call in 1..=40 {
        assert_eq!(store.purge(1).await.expect("purge"), 1, "call {call} deleted a record");
    }
    assert_eq!(count(pool, "idempotency_records").await, 0);
}

/// The purge sends its statements only to the partitions with rows due: it first asks all of
/// them in one statement. Each partition here logs every DELETE and UPDATE statement sent to it
/// (a statement-level trigger fires also when the statement changes no row).
#[tokio::test]
async fn the_purge_sends_statements_only_to_partitions_with_rows_due() {
    let store = support::pg_partitioned_apart_store(CouplingMode::Atomic).await;
    let pool = store.pool();
    let fp = fingerprint(6);
    let ids: Vec<RecordId> = (0..24).map(|_| fresh_id("probe")).collect();
    for id in &ids {
        complete(&store, id, &fp, "probe", Retention::default()).await;
    }
    sqlx::raw_sql(
        "CREATE TABLE statements_sent (partition text); \
         CREATE FUNCTION log_statement() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN INSERT INTO statements_sent VALUES (TG_TABLE_NAME); RETURN NULL; END $$;",
    )
    .execute(pool)
    .await
    .unwrap();
    for n in 0..support::TEST_PARTITIONS {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER log_statement BEFORE DELETE OR UPDATE ON idempotency_records_p{n:03} \
             FOR EACH STATEMENT EXECUTE FUNCTION log_statement()"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
    let sent = || async {
        let sent: Vec<String> = sqlx::query_scalar("SELECT partition FROM statements_sent ORDER BY partition")
            .fetch_all(pool)
            .await
            .unwrap();
        sqlx::raw_sql("DELETE FROM statements_sent").execute(pool).await.unwrap();
        sent
    };

    assert_eq!(store.purge(100).await.expect("purge"), 0);
    assert_eq!(sent().await, Vec::<String>::new(), "nothing due: no partition was sent a statement");

    let partition: String = sqlx::query_scalar(
        "UPDATE idempotency_records SET forget_at = clock_timestamp() - interval '1 second' \
         WHERE record_id = $1 RETURNING tableoid::regclass::text",
    )
    .bind(ids[0].digest().to_vec())
    .fetch_one(pool)
    .await
    .unwrap();
    sent().await;
    assert_eq!(store.purge(100).await.expect("purge"), 1);
    assert_eq!(sent().await, vec![partition], "one record due: its partition alone was sent the delete");
}

/// A partitioned table with answers inline moves to answers apart by the migration: its records
/// replay from their inline answers, new ones go apart, and the inline ones are made tombstones
/// in place at their time. From then on a partitioned store without the option is refused, and
/// a store of another partition count or one table with its answers apart is refused too.
#[tokio::test]
async fn a_partitioned_table_moves_to_answers_apart_and_other_layouts_are_refused() {
    let inline = support::pg_partitioned_store(CouplingMode::Atomic).await;
    let pool = inline.pool().clone();
    let Moved { apart, fp, old_kept, old_due } = move_to_answers_apart(&inline).await;
    let partitions = i64::from(support::TEST_PARTITIONS);
    assert_eq!(layout(&pool).await, ("p".to_owned(), partitions, true, vec![1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14]));
    assert_eq!(replay(&apart, &old_kept, &fp).await.response, Some(answer("old kept")));
    let new = fresh_id("new");
    complete(&apart, &new, &fp, "new", Retention::default()).await;
    assert_eq!(count(&pool, "idempotency_records_answers").await, 1, "the new answer is apart");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(apart.purge(100).await.expect("purge"), 1, "the inline answer that was due");
    let record = replay(&apart, &old_due, &fp).await;
    assert_eq!((record.state, record.response), (RecordState::Expired, None));

    let message = refusal(inline.migrate().await);
    assert!(message.contains("hash partitioned into 8 partitions with its answers apart"), "{message}");
    assert!(message.contains("configured for hash_partitions(8)"), "{message}");
    let message = refusal(apart.clone().hash_partitions(4).unwrap().migrate().await);
    assert!(message.contains("configured for hash_partitions(4) with answers_apart"), "{message}");
    let schema: String = sqlx::query_scalar("SELECT current_schema()").fetch_one(&pool).await.unwrap();
    let one_table = PostgresStore::new(pool.clone()).schema(&schema).unwrap().answers_apart();
    let message = refusal(one_table.migrate().await);
    assert!(message.contains("configured for answers_apart"), "{message}");
    assert_eq!(layout(&pool).await, ("p".to_owned(), partitions, true, vec![1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14]));
}

/// Refused settlements write no answer row; a settlement replaces the unknown record's answer
/// row with its own.
#[tokio::test]
async fn settlements_leave_no_answer_row_that_nothing_points_at_on_partitions() {
    settlements_leave_no_answer_row_that_nothing_points_at(
        &support::pg_partitioned_apart_store(CouplingMode::Leased).await,
    )
    .await;
}

/// After a purge that found no answer written inline before the move due, the purge looks for
/// them across the partitions again only every 64th call, and still empties one that fell due.
#[tokio::test]
async fn inline_leftovers_are_looked_for_by_every_64th_purge_on_partitions() {
    leftovers_are_looked_for_by_every_64th_purge_once_none_is_due(
        &support::pg_partitioned_store(CouplingMode::Atomic).await,
    )
    .await;
}

/// The two options hold together in either order.
#[tokio::test]
async fn the_options_combine_in_either_order() {
    let schema = support::unique_name("tidem");
    let pool = support::pg_pool(&schema, 4).await;
    let store = PostgresStore::new(pool.clone()).schema(&schema).unwrap().answers_apart().hash_partitions(4).unwrap();
    store.migrate().await.expect("migrate");
    assert_eq!(layout(&pool).await, ("p".to_owned(), 4, true, vec![1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14]));
    // Migration 11 came before 12 here: 12 dropped the answer's check that 11 had put back.
    let checks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_constraint WHERE contype = 'c' AND conrelid = 'idempotency_records'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(checks, 0, "no CHECK constraint on the records table");
    let other_order = PostgresStore::new(pool).schema(&schema).unwrap().hash_partitions(4).unwrap().answers_apart();
    other_order.migrate().await.expect("the same layout, said the other way round");
}

/// The storm on partitions with answers apart: 64 identical requests released together per key,
/// one order each.
#[cfg(feature = "axum")]
#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key() {
    tower_idempotency::testkit::run(async {
        let store = support::pg_partitioned_apart_store(CouplingMode::Atomic).await;
        let conflicts = support::storm::pg_storm(&store, "partitioned-apart", 100, 64, 4).await;
        println!(
            "storm on partitions with answers apart: 100 keys x 64 requests: 100 orders, {conflicts} answers were 409"
        );
    });
}
