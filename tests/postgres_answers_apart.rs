//! `PostgresStore::answers_apart` against the real PostgreSQL on this machine: the store,
//! lifecycle and HTTP contract suites in both modes with answers in a table of their own, the
//! layout itself, tombstones made by the purge without writing the record, a record whose answer
//! is gone, the move of a table with answers inline, the refusal of a store without the option,
//! and the storm.
#![cfg(all(feature = "testkit", feature = "postgres"))]

mod support;

use support::apart::{
    Moved, SHORT, complete, leftovers_are_looked_for_by_every_64th_purge_once_none_is_due, move_to_answers_apart,
    settlements_leave_no_answer_row_that_nothing_points_at,
};

support::suites_in_both_modes!(crate::support::pg_apart_store);

use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::MigrateError;
use tower_idempotency::store::StoreError;
use tower_idempotency::store::postgres::LayoutMismatch;
use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
use tower_idempotency::{
    Admin, Begin, BeginRequest, Claim, CouplingMode, Fingerprint, PostgresStore, RecordId, RecordState, Retention,
    Store,
};

/// What a retry of `id` finds.
async fn retry(store: &PostgresStore, id: &RecordId, fp: &Fingerprint) -> Result<Begin<impl Claim>, StoreError> {
    store.begin(BeginRequest::new(id, fp)).await
}

/// The record's row: its state, whether an answer is inline, and the answer it points at.
async fn row(pool: &PgPool, id: &RecordId) -> (String, bool, Option<i64>) {
    sqlx::query_as(
        "SELECT state, response_body IS NOT NULL OR response_status IS NOT NULL, answer_seq \
         FROM idempotency_records WHERE record_id = $1",
    )
    .bind(id.digest().to_vec())
    .fetch_one(pool)
    .await
    .expect("the record's row")
}

/// The row's version: a record that was not written since keeps it.
async fn version(pool: &PgPool, id: &RecordId) -> String {
    sqlx::query_scalar("SELECT xmin::text || ctid::text FROM idempotency_records WHERE record_id = $1")
        .bind(id.digest().to_vec())
        .fetch_one(pool)
        .await
        .expect("the record's version")
}

async fn answers(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_records_answers").fetch_one(pool).await.expect("answers")
}

async fn records(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_records").fetch_one(pool).await.expect("records")
}

/// In both modes the answer is a row of `<table>_answers` and the record points at it with no
/// answer of its own; a retry replays it byte for byte.
#[tokio::test]
async fn the_answer_is_a_row_of_its_own_and_replays() {
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_apart_store(mode).await;
        let (id, fp) = (fresh_id("apart"), fingerprint(1));
        complete(&store, &id, &fp, "{\"order\":1}", Retention::default()).await;
        let (state, inline, seq) = row(store.pool(), &id).await;
        assert_eq!((state.as_str(), inline), ("completed", false), "{mode:?}: nothing of the answer inline");
        let seq = seq.expect("the record points at its answer");
        let (status, body): (i16, Vec<u8>) =
            sqlx::query_as("SELECT status, body FROM idempotency_records_answers WHERE seq = $1")
                .bind(seq)
                .fetch_one(store.pool())
                .await
                .expect("the answer's row");
        assert_eq!((status, body.as_slice()), (201, b"{\"order\":1}".as_slice()));
        let Ok(Begin::Existing(record)) = retry(&store, &id, &fp).await else { panic!("{mode:?}: a replay") };
        assert_eq!(record.state, RecordState::Completed);
        assert_eq!(record.response, Some(answer("{\"order\":1}")), "{mode:?}: the answer, byte for byte");
    }
}

/// Past its response retention the record is a tombstone without being written: the purge
/// deletes its answer and leaves the row as it was; past its tombstone time the purge deletes it.
#[tokio::test]
async fn the_purge_makes_tombstones_without_writing_the_record() {
    let store = support::pg_apart_store(CouplingMode::Atomic).await;
    let pool = store.pool();
    let fp = fingerprint(2);
    let (due, kept) = (fresh_id("due"), fresh_id("kept"));
    complete(&store, &due, &fp, "due", SHORT).await;
    complete(&store, &kept, &fp, "kept", Retention::default()).await;
    let before = version(pool, &due).await;
    tokio::time::sleep(Duration::from_millis(400)).await;

    assert_eq!(store.purge(100).await.expect("purge"), 1, "one answer was due");
    assert_eq!(answers(pool).await, 1, "the due answer is gone, the other kept");
    assert_eq!(version(pool, &due).await, before, "the record was not written");
    let Ok(Begin::Existing(record)) = retry(&store, &due, &fp).await else { panic!("a tombstone") };
    assert_eq!((record.state, record.response), (RecordState::Expired, None));
    let info = store.inspect(&due).await.expect("inspect").expect("kept as a tombstone");
    assert_eq!((info.state, info.status), (RecordState::Expired, None));
    let Ok(Begin::Existing(record)) = retry(&store, &kept, &fp).await else { panic!("a replay") };
    assert_eq!(record.response, Some(answer("kept")));

    // Past the tombstone time the record itself goes, whatever its stored state says.
    sqlx::query(
        "UPDATE idempotency_records SET forget_at = clock_timestamp() - interval '1 second' WHERE record_id = $1",
    )
    .bind(due.digest().to_vec())
    .execute(pool)
    .await
    .expect("age the tombstone");
    assert_eq!(store.purge(100).await.expect("purge"), 1);
    assert_eq!(records(pool).await, 1, "only the kept record is left");
    complete(&store, &due, &fp, "again", Retention::default()).await;
}

/// Answers kept for different times are deleted as each falls due, a limited batch at a time,
/// and an answer the walk has passed (one a concurrent purge held and let go, made here by
/// hand) is still deleted by a later walk from the start.
#[tokio::test]
async fn due_answers_go_in_the_order_they_fall_due_and_none_is_left_behind() {
    let store = support::pg_apart_store(CouplingMode::Leased).await;
    let pool = store.pool();
    let fp = fingerprint(5);
    let longer = Retention { response: Duration::from_millis(900), ..SHORT };
    for n in 0..6 {
        let retention = if n % 2 == 0 { SHORT } else { longer };
        complete(&store, &fresh_id("mixed"), &fp, "mixed", retention).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut purged = Vec::new();
    loop {
        let n = store.purge(2).await.expect("purge");
        if n == 0 {
            break;
        }
        purged.push(n);
    }
    assert_eq!((purged.iter().sum::<usize>(), answers(pool).await), (3, 3), "the short ones only: {purged:?}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(store.purge(100).await.expect("purge"), 3);
    assert_eq!(answers(pool).await, 0);

    // An answer due long before where the walk has reached.
    sqlx::raw_sql(
        "INSERT INTO idempotency_records_answers (keep_until, status, headers, body) \
         VALUES (clock_timestamp() - interval '1 day', 201, '', '')",
    )
    .execute(pool)
    .await
    .expect("a straggler");
    let mut calls = 0;
    while answers(pool).await > 0 {
        calls += 1;
        assert!(calls <= 300, "the straggler was never deleted");
        store.purge(100).await.expect("purge");
    }
    assert!(calls > 1, "the walk starts where the last one reached, past the straggler, until it starts over");
}

/// A record whose answer is gone before its time (deleted by hand, say) is answered as a
/// tombstone, never replayed with an empty answer.
#[tokio::test]
async fn a_record_whose_answer_is_gone_is_a_tombstone() {
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_apart_store(mode).await;
        let (id, fp) = (fresh_id("lost"), fingerprint(3));
        complete(&store, &id, &fp, "lost", Retention::default()).await;
        sqlx::raw_sql("DELETE FROM idempotency_records_answers").execute(store.pool()).await.expect("delete");
        let Ok(Begin::Existing(record)) = retry(&store, &id, &fp).await else { panic!("{mode:?}: a tombstone") };
        assert_eq!((record.state, record.response), (RecordState::Expired, None), "{mode:?}");
        let info = store.inspect(&id).await.expect("inspect").expect("the record");
        assert_eq!(info.state, RecordState::Expired, "{mode:?}");
    }
}

/// Refused settlements write no answer row; a settlement replaces the unknown record's answer
/// row with its own.
#[tokio::test]
async fn settlements_leave_no_answer_row_that_nothing_points_at_on_one_table() {
    settlements_leave_no_answer_row_that_nothing_points_at(&support::pg_apart_store(CouplingMode::Leased).await).await;
}

/// After a purge that found no answer written inline before the move due, the purge looks for
/// them in one table again only every 64th call, and still empties one that fell due.
#[tokio::test]
async fn inline_leftovers_are_looked_for_by_every_64th_purge_on_one_table() {
    leftovers_are_looked_for_by_every_64th_purge_once_none_is_due(&support::pg_store(CouplingMode::Atomic).await).await;
}

/// A table with answers inline moves to answers apart by the migration, nothing copied: its
/// records replay from their inline answers, are made tombstones in place at their time, and
/// new records go apart. From then on a store without the option is refused by `migrate`, and
/// one that never migrates fails a request for a record written apart rather than replay it
/// empty.
#[tokio::test]
async fn a_table_with_answers_inline_moves_to_answers_apart() {
    let inline = support::pg_store(CouplingMode::Atomic).await;
    let pool = inline.pool().clone();
    let Moved { apart, fp, old_kept, old_due } = move_to_answers_apart(&inline).await;
    let Ok(Begin::Existing(record)) = retry(&apart, &old_kept, &fp).await else { panic!("a replay") };
    assert_eq!(record.response, Some(answer("old kept")), "an inline answer replays as before");
    let new = fresh_id("new");
    complete(&apart, &new, &fp, "new", Retention::default()).await;
    assert!(!row(&pool, &new).await.1, "a new record's answer is apart");

    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(apart.purge(100).await.expect("purge"), 1, "the inline answer that was due");
    let (state, inline_answer, _) = row(&pool, &old_due).await;
    assert_eq!((state.as_str(), inline_answer), ("expired", false), "emptied in place");
    let Ok(Begin::Existing(record)) = retry(&apart, &old_kept, &fp).await else { panic!("a replay") };
    assert_eq!(record.response, Some(answer("old kept")));

    // A store without the option: refused by the migration, and failing closed without it.
    match inline.migrate().await {
        Err(MigrateError::Source(source)) => {
            let mismatch = source.downcast_ref::<LayoutMismatch>().expect("a layout mismatch");
            assert!(mismatch.to_string().contains("answers apart"), "{mismatch}");
        }
        other => panic!("a store without answers_apart must be refused, got {other:?}"),
    }
    let unmigrated = inline.clone();
    match retry(&unmigrated, &new, &fp).await {
        Err(StoreError::Corrupt(_)) => {}
        Ok(Begin::Existing(record)) => panic!("an answer read without its table: {record:?}"),
        other => panic!("a store error, got {:?}", other.map(|_| "a claim or a wait")),
    }
}

/// The index scans and the rows read by sequential scans so far, of the records table and of
/// the answers table.
async fn scans(pool: &PgPool) -> [i64; 4] {
    let (records_idx, records_seq_rows, answers_idx, answers_seq_rows): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT COALESCE(sum(idx_scan) FILTER (WHERE relname = 'idempotency_records'), 0)::bigint, \
                COALESCE(sum(seq_tup_read) FILTER (WHERE relname = 'idempotency_records'), 0)::bigint, \
                COALESCE(sum(idx_scan) FILTER (WHERE relname = 'idempotency_records_answers'), 0)::bigint, \
                COALESCE(sum(seq_tup_read) FILTER (WHERE relname = 'idempotency_records_answers'), 0)::bigint \
         FROM pg_stat_user_tables WHERE schemaname = current_schema()",
    )
    .fetch_one(pool)
    .await
    .expect("scans");
    [records_idx, records_seq_rows, answers_idx, answers_seq_rows]
}

/// With nothing due, the purge walks the start of its indexes and stops: no row of either
/// table is read by a sequential scan, though routes keep their answers for different times.
#[tokio::test]
async fn a_purge_with_nothing_due_scans_neither_table() {
    let store = support::pg_apart_store(CouplingMode::Atomic).await;
    let pool = store.pool();
    // 20,000 records and answers, due in one to ten days, written out of their order.
    sqlx::raw_sql(
        "WITH a AS (INSERT INTO idempotency_records_answers (keep_until, status, headers, body) \
                    SELECT clock_timestamp() + (1 + g % 10) * interval '1 day', 201, '', '\\x00' \
                    FROM generate_series(1, 20000) g RETURNING seq, keep_until) \
         INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                                          response_until, forget_at, answer_seq) \
         SELECT sha256(int8send(seq)), 'completed', 2, sha256(int8send(-seq)), 0, keep_until, \
                keep_until + interval '7 days', seq FROM a; \
         ANALYZE idempotency_records; ANALYZE idempotency_records_answers",
    )
    .execute(pool)
    .await
    .expect("fill");
    let before = scans(pool).await;
    for _ in 0..3 {
        assert_eq!(store.purge(1_000).await.expect("purge"), 0, "nothing is due");
    }
    // A backend reports its statistics once idle, within seconds: wait for the three calls'
    // walks (two indexes of the records table and one of the answers a call) to show.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let after = loop {
        let now = scans(pool).await;
        if (now[0] >= before[0] + 6 && now[2] >= before[2] + 3) || std::time::Instant::now() > deadline {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        after[0] >= before[0] + 6 && after[2] >= before[2] + 3,
        "each call walks its indexes: {before:?} -> {after:?}"
    );
    assert_eq!((after[1], after[3]), (0, 0), "no row of either table was read by a sequential scan");
    assert_eq!((records(pool).await, answers(pool).await), (20_000, 20_000));
}

/// The storm on answers apart: 64 identical requests released together per key, one order each.
#[cfg(feature = "axum")]
#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key() {
    tower_idempotency::testkit::run(async {
        let store = support::pg_apart_store(CouplingMode::Atomic).await;
        let conflicts = support::storm::pg_storm(&store, "apart", 100, 64, 4).await;
        println!("storm on answers apart: 100 keys x 64 requests: 100 orders, {conflicts} answers were 409");
    });
}
