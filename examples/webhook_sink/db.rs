//! The sink's SQLite file: the deliveries it received, the events it processed, and (the
//! idempotency layer's) the answers that replay.

use std::time::Duration;

use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqliteConnection};
use tower_idempotency::{BoxError, SqliteStore};

/// Opens (creating if missing) the file, in WAL mode with a busy timeout, and its tables.
pub(crate) async fn open(options: SqliteConnectOptions) -> Result<SqlitePool, BoxError> {
    let options = options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5))
        .synchronous(SqliteSynchronous::Full);
    let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await?;
    SqliteStore::new(pool.clone()).migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS sink_deliveries (
             id TEXT NOT NULL PRIMARY KEY,
             event_type TEXT NOT NULL,
             order_id TEXT,
             deliveries INTEGER NOT NULL,
             first_seen INTEGER NOT NULL
         ) STRICT;
         CREATE TABLE IF NOT EXISTS sink_events (
             id TEXT NOT NULL PRIMARY KEY,
             processed INTEGER NOT NULL
         ) STRICT;",
    )
    .execute(&pool)
    .await?;
    Ok(pool)
}

/// Counts a delivery with a valid signature (the first one's type and order id are kept).
pub(crate) async fn count_delivery(
    pool: &SqlitePool,
    id: &str,
    event_type: &str,
    order_id: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sink_deliveries (id, event_type, order_id, deliveries, first_seen) \
         VALUES (?1, ?2, ?3, 1, unixepoch('subsec') * 1000) \
         ON CONFLICT (id) DO UPDATE SET deliveries = deliveries + 1",
    )
    .bind(id)
    .bind(event_type)
    .bind(order_id)
    .execute(pool)
    .await?;
    Ok(())
}

/// Processes the event: records that it was (once more), on `conn` (the layer's transaction).
pub(crate) async fn process(conn: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sink_events (id, processed) VALUES (?1, 1) \
         ON CONFLICT (id) DO UPDATE SET processed = processed + 1",
    )
    .bind(id)
    .execute(conn)
    .await?;
    Ok(())
}

/// One event as `GET /events` lists it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub(crate) struct EventRow {
    id: String,
    #[serde(rename = "type")]
    event_type: String,
    order_id: Option<String>,
    processed: i64,
    deliveries: i64,
}

/// Every event received, in the order first seen.
pub(crate) async fn events(pool: &SqlitePool) -> Result<Vec<EventRow>, sqlx::Error> {
    sqlx::query_as::<Sqlite, EventRow>(
        "SELECT d.id, d.event_type, d.order_id, COALESCE(e.processed, 0) AS processed, d.deliveries \
         FROM sink_deliveries d LEFT JOIN sink_events e ON e.id = d.id ORDER BY d.first_seen, d.id",
    )
    .fetch_all(pool)
    .await
}
