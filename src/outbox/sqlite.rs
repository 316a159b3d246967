//! [`SqliteOutbox`]: the outbox table on SQLite.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use sqlx::{AssertSqlSafe, Sqlite, SqliteConnection, SqlitePool};

use super::sql::{ClaimedRow, migrator, millis, short, unavailable};
use super::{Counts, Finish, Leased, NewEvent, OutboxError, OutboxStore};
use crate::name::InvalidName;
use crate::store::sql::check_identifier;
use crate::tx::TxHandle;

const MIGRATION: &str = include_str!("../../migrations/sqlite/0004_outbox.sql");

/// The outbox table on SQLite (default name `outbox_events`).
///
/// SQLite has no `SKIP LOCKED`, and needs none: a claim is one `UPDATE … RETURNING` statement,
/// which holds the database's write lock from its first row to its last, so relays claiming at
/// once are serialised by SQLite itself and never take the same event (the second waits for the
/// lock, up to the connection's busy timeout, then sees the first one's leases). Times are unix
/// milliseconds from the application's clock, as in the records table.
#[derive(Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    names: Arc<Names>,
}

struct Names {
    table: String,
    enqueue: String,
    claim: String,
    delivered: String,
    retry: String,
    dead: String,
    counts: String,
    oldest: String,
}

impl std::fmt::Debug for SqliteOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteOutbox").field("table", &self.names.table).finish_non_exhaustive()
    }
}

impl SqliteOutbox {
    /// The outbox table `outbox_events` on `pool`.
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool, names: Arc::new(Names::new("outbox_events")) }
    }

    /// The table's name.
    pub fn table(self, table: &str) -> Result<Self, InvalidName> {
        check_identifier(table, "a table name")?;
        Ok(Self { names: Arc::new(Names::new(table)), pool: self.pool })
    }

    /// Creates the table and its index if missing (migration `0004_outbox`), in one write
    /// transaction, so processes migrating at once queue on the write lock. History in
    /// `_<table>_migrations`.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let table = &self.names.table;
        let migrator = migrator(MIGRATION.replace("{table}", table), format!("\"_{table}_migrations\""));
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        migrator.run(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Writes `event` in the request's transaction: it commits with the business write and the
    /// stored answer, or not at all. An event whose id is already there changes nothing;
    /// whether it was new.
    ///
    /// Takes the handle's lock: do not hold a [`TxConnection`](crate::tx::TxConnection) of the
    /// same handle while calling it (use [`enqueue_on`](Self::enqueue_on) with that connection).
    pub async fn enqueue(&self, tx: &TxHandle<Sqlite>, event: &NewEvent) -> Result<bool, OutboxError> {
        let mut conn = tx.acquire().await.map_err(|_| OutboxError::TransactionFinished)?;
        self.enqueue_on(&mut conn, event).await
    }

    /// [`enqueue`](Self::enqueue) on a connection the caller holds (the transaction's).
    pub async fn enqueue_on(&self, conn: &mut SqliteConnection, event: &NewEvent) -> Result<bool, OutboxError> {
        let done = sqlx::query(AssertSqlSafe(self.names.enqueue.as_str()))
            .bind(event.id.as_str())
            .bind(event.event_type.as_str())
            .bind(event.body.as_ref())
            .bind(now_ms())
            .execute(conn)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    /// The pool the outbox reads and claims on.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

impl Names {
    fn new(table: &str) -> Self {
        let q = format!("\"{table}\"");
        Self {
            table: table.to_owned(),
            enqueue: format!(
                "INSERT INTO {q} (event_id, event_type, body, available_at, created_at) VALUES (?1, ?2, ?3, ?4, ?4) \
                 ON CONFLICT (event_id) DO NOTHING"
            ),
            // One statement under the write lock: nothing can claim between its read and its
            // write, so no SKIP LOCKED is needed.
            claim: format!(
                "UPDATE {q} SET lease_token = lease_token + 1, attempts = attempts + 1, available_at = ?1 + ?3 \
                 WHERE event_id IN (SELECT event_id FROM {q} WHERE state = 'pending' AND available_at <= ?1 \
                                    ORDER BY available_at LIMIT ?2) \
                 RETURNING event_id, event_type, body, attempts, lease_token, ?1 - created_at AS age_ms"
            ),
            delivered: format!(
                "UPDATE {q} SET state = 'delivered', delivered_at = ?3, last_error = NULL \
                 WHERE event_id = ?1 AND lease_token = ?2 AND state = 'pending'"
            ),
            retry: format!(
                "UPDATE {q} SET available_at = ?3, last_error = ?4 \
                 WHERE event_id = ?1 AND lease_token = ?2 AND state = 'pending'"
            ),
            dead: format!(
                "UPDATE {q} SET state = 'dead', last_error = ?3 \
                 WHERE event_id = ?1 AND lease_token = ?2 AND state = 'pending'"
            ),
            counts: format!(
                "SELECT COALESCE(SUM(state = 'pending'), 0), COALESCE(SUM(state = 'delivered'), 0), \
                     COALESCE(SUM(state = 'dead'), 0) FROM {q}"
            ),
            oldest: format!("SELECT ?1 - MIN(created_at) FROM {q} WHERE state = 'pending'"),
        }
    }
}

impl SqliteOutbox {
    /// The statement that writes `finish` for `leased`, if its token still holds the event.
    fn finish_query<'q>(
        &'q self,
        leased: &'q Leased,
        finish: &'q Finish,
    ) -> sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments> {
        let (id, token) = (leased.event.id.as_str(), leased.lease_token);
        match finish {
            Finish::Delivered => {
                sqlx::query(AssertSqlSafe(self.names.delivered.as_str())).bind(id).bind(token).bind(now_ms())
            }
            Finish::Retry { after, error } => sqlx::query(AssertSqlSafe(self.names.retry.as_str()))
                .bind(id)
                .bind(token)
                .bind(now_ms().saturating_add(millis(*after)))
                .bind(short(error)),
            Finish::Dead { error } => {
                sqlx::query(AssertSqlSafe(self.names.dead.as_str())).bind(id).bind(token).bind(short(error))
            }
        }
    }
}

impl OutboxStore for SqliteOutbox {
    async fn claim(&self, batch: usize, lease: Duration) -> Result<Vec<Leased>, OutboxError> {
        let rows: Vec<ClaimedRow> = sqlx::query_as(AssertSqlSafe(self.names.claim.as_str()))
            .bind(now_ms())
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .bind(millis(lease))
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?;
        rows.into_iter().map(ClaimedRow::leased).collect()
    }

    async fn finish(&self, leased: &Leased, finish: &Finish) -> Result<bool, OutboxError> {
        let done = self.finish_query(leased, finish).execute(&self.pool).await.map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    async fn finish_all(&self, ends: &[(Leased, Finish)]) -> Result<Vec<bool>, OutboxError> {
        // One write transaction for the batch: one commit instead of one per event.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(unavailable)?;
        let mut written = Vec::with_capacity(ends.len());
        for (leased, finish) in ends {
            let done = self.finish_query(leased, finish).execute(&mut *tx).await.map_err(unavailable)?;
            written.push(done.rows_affected() == 1);
        }
        tx.commit().await.map_err(unavailable)?;
        Ok(written)
    }

    async fn counts(&self) -> Result<Counts, OutboxError> {
        let (pending, delivered, dead): (i64, i64, i64) = sqlx::query_as(AssertSqlSafe(self.names.counts.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(Counts { pending: pending as u64, delivered: delivered as u64, dead: dead as u64 })
    }

    async fn oldest_pending(&self) -> Result<Option<Duration>, OutboxError> {
        let age: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.names.oldest.as_str()))
            .bind(now_ms())
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(age.map(|ms| Duration::from_millis(ms.max(0) as u64)))
    }
}

/// Unix milliseconds from the application's clock, never going backwards within the process.
fn now_ms() -> i64 {
    static LAST: AtomicI64 = AtomicI64::new(0);
    let wall = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, millis);
    LAST.fetch_max(wall, Ordering::Relaxed).max(wall)
}
