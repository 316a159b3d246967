//! The purge on the real PostgreSQL walks its indexes, never the table: with nothing due, a call
//! reads the start of the expiry and tombstone indexes and stops. The open counts, which a
//! recovery pass takes between its censuses, read the index of open records, never the table. (Comparing with the database's
//! clock read row by row, it could only filter what a scan found: PostgreSQL chose to scan the
//! whole table, half a second a call at 3 million records with nothing to do, and an index walk
//! in the purge's order would have fetched every row of the index.)
#![cfg(feature = "postgres")]

mod support;

use std::time::{Duration, Instant};

use tower_idempotency::store::Admin;
use tower_idempotency::{CouplingMode, PostgresStore, Store};

/// Enough records that an index walk is the plan on its merits, few enough to fill at once.
const RECORDS: i64 = 50_000;

/// The records table's scans so far: (sequential, by index, rows fetched by index scans).
async fn scans(store: &PostgresStore) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT COALESCE(seq_scan, 0), COALESCE(idx_scan, 0), COALESCE(idx_tup_fetch, 0) FROM pg_stat_user_tables \
         WHERE relid = 'idempotency_records'::regclass",
    )
    .fetch_one(store.pool())
    .await
    .expect("the table's statistics")
}

/// How long the scans must stay unchanged to count as settled. An idle backend reports its
/// statistics at most once a second, and one whose report could not take the shared statistics'
/// lock at once (a busy server: CI runs many tests side by side) tries again only after
/// PostgreSQL's idle interval of 10 s. With two readings 1.5 s apart as the test, one CI run saw
/// 10 sequential scans arrive after the baseline, most likely the migration's index builds (each
/// a scan of the table) reported late, and charged them to the purge.
const SETTLED_FOR: Duration = Duration::from_secs(11);

/// The scans once every connection has reported its own: read every 1.5 s until they have not
/// changed for [`SETTLED_FOR`].
async fn settled_scans(store: &PostgresStore) -> (i64, i64, i64) {
    let mut last = scans(store).await;
    let mut unchanged_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let now = scans(store).await;
        if now != last {
            (last, unchanged_since) = (now, Instant::now());
        } else if unchanged_since.elapsed() >= SETTLED_FOR {
            return now;
        }
    }
}

/// Fills the records table with `insert`, an `INSERT ... SELECT` of `$1` (= [`RECORDS`]) rows,
/// and analyses it, so that the planner knows what it holds.
async fn fill(store: &PostgresStore, insert: &'static str) {
    sqlx::query(insert).bind(RECORDS).execute(store.pool()).await.expect("fill");
    sqlx::raw_sql("ANALYZE idempotency_records").execute(store.pool()).await.expect("analyze");
}

#[tokio::test]
async fn a_purge_with_nothing_due_walks_the_indexes_not_the_table() {
    {
        let store = support::pg_store(CouplingMode::Atomic).await;
        // Answered records not due for a day, and tombstones not due for a week.
        fill(
            &store,
            "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, response_status, \
                 response_body, response_until, forget_at) \
             SELECT sha256(int8send(g)), CASE WHEN g % 4 = 0 THEN 'expired' ELSE 'completed' END, 2, \
                 sha256(int8send(-g)), CASE WHEN g % 4 = 0 THEN NULL ELSE 201 END, \
                 CASE WHEN g % 4 = 0 THEN NULL ELSE '\\x00'::bytea END, \
                 clock_timestamp() + interval '1 day' + g * interval '1 millisecond', \
                 clock_timestamp() + interval '7 days' + g * interval '1 millisecond' \
             FROM generate_series(1, $1) g",
        )
        .await;

        let (seq_before, idx_before, fetched_before) = settled_scans(&store).await;
        for _ in 0..3 {
            assert_eq!(store.purge(1_000).await.expect("purge"), 0, "nothing is due");
        }
        let (seq_after, idx_after, fetched_after) = scans_once(&store, |(_, idx, _)| idx >= idx_before + 6).await;
        assert!(idx_after >= idx_before + 6, "each call walks both indexes: {idx_before} -> {idx_after}");
        assert_eq!(seq_after, seq_before, "no call scanned the table");
        // Each walk stops at the first entry not yet due: it fetches no row (a walk filtering
        // on a clock read row by row would fetch every one of them).
        assert_eq!(fetched_after, fetched_before, "no call fetched a row it did not purge");
    }
}

/// Reads the scans until a reading satisfies `done`, for at most 15 s (the counting connections
/// report their statistics once idle, within about a second).
async fn scans_once(store: &PostgresStore, done: impl Fn((i64, i64, i64)) -> bool) -> (i64, i64, i64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = scans(store).await;
        if done(now) || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn open_counts_read_the_index_of_open_records_not_the_table() {
    let store = support::pg_store(CouplingMode::Leased).await;
    // Settled records, and five each of `processing` and `unknown`.
    fill(
        &store,
        "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, response_status, \
             response_body, response_until, forget_at, lease_until) \
         SELECT sha256(int8send(g)), \
             CASE WHEN g <= 5 THEN 'processing' WHEN g <= 10 THEN 'unknown' ELSE 'completed' END, 2, \
             sha256(int8send(-g)), CASE WHEN g > 10 THEN 201 END, CASE WHEN g > 10 THEN '\\x00'::bytea END, \
             CASE WHEN g > 10 THEN clock_timestamp() + interval '1 day' END, \
             clock_timestamp() + interval '7 days', \
             CASE WHEN g <= 5 THEN clock_timestamp() + interval '1 hour' END \
         FROM generate_series(1, $1) g",
    )
    .await;

    let (seq_before, idx_before, _) = settled_scans(&store).await;
    for _ in 0..3 {
        let open = store.open_counts().await.expect("open counts");
        assert_eq!((open.processing, open.unknown), (5, 5), "{open:?}");
    }
    let (seq_after, idx_after, _) = scans_once(&store, |(_, idx, _)| idx >= idx_before + 3).await;
    assert!(idx_after >= idx_before + 3, "each count reads the index: {idx_before} -> {idx_after}");
    assert_eq!(seq_after, seq_before, "no count scanned the table");

    // The census counts every record: it scans the table, which the readings above would show.
    let census = store.counts().await.expect("counts");
    assert_eq!((census.processing, census.unknown, census.completed), (5, 5, RECORDS as u64 - 10), "{census:?}");
    let (seq_census, _, _) = scans_once(&store, |(seq, _, _)| seq > seq_after).await;
    assert!(seq_census > seq_after, "the census scans the table: {seq_after} -> {seq_census}");
}
