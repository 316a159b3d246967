//! The server's write-ahead log, for the PostgreSQL benchmarks that read what a measure wrote
//! to it (`pg_scale`, `pg_layout`, `pg_vacuum`).

use sqlx::PgPool;

/// Ends the log's current checkpoint cycle, so that a measure starts where every page it
/// changes costs its first full-page image, as most pages do in a table much larger than what
/// one cycle touches.
pub async fn checkpoint(pool: &PgPool) {
    sqlx::raw_sql("CHECKPOINT").execute(pool).await.expect("checkpoint");
}

/// The server's write-ahead log insert position, in bytes: what a measure wrote to the log is the
/// difference (the server's whole log, so only with nothing else running). The insert position,
/// not the write position (`pg_current_wal_lsn`): a vacuum commits nothing, so most of its log
/// can still be in the log's buffers when it ends, where the write position does not count it.
pub async fn wal_position<'e>(executor: impl sqlx::PgExecutor<'e>) -> i64 {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint")
        .fetch_one(executor)
        .await
        .expect("the log's position")
}
