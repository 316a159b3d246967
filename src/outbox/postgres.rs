//! [`PostgresOutbox`]: the outbox table on PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres};

use super::sql::{ClaimedRow, migrator, millis, short, unavailable};
use super::{Counts, Finish, Leased, NewEvent, OutboxError, OutboxStore};
use crate::name::InvalidName;
use crate::store::sql::check_identifier;
use crate::tx::TxHandle;

const MIGRATION: &str = include_str!("../../migrations/postgres/0004_outbox.sql");

/// The outbox table on PostgreSQL: events enqueued in the request's transaction, claimed by
/// relays with `FOR UPDATE SKIP LOCKED`.
///
/// By default the table is `outbox_events`, unqualified: it lives where the connection's
/// `search_path` puts it (as the application's own tables do); [`schema`](Self::schema) pins it.
#[derive(Clone)]
pub struct PostgresOutbox {
    pool: PgPool,
    names: Arc<Names>,
}

struct Names {
    schema: Option<String>,
    table: String,
    qualified: String,
    enqueue: String,
    claim: String,
    delivered: String,
    delivered_all: String,
    retry: String,
    dead: String,
    counts: String,
    oldest: String,
}

impl std::fmt::Debug for PostgresOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresOutbox").field("table", &self.names.qualified).finish_non_exhaustive()
    }
}

impl PostgresOutbox {
    /// The outbox table `outbox_events` on `pool`, wherever `search_path` puts it.
    pub fn new(pool: PgPool) -> Self {
        Self { pool, names: Arc::new(Names::new(None, "outbox_events")) }
    }

    /// The schema that holds the table (created by [`migrate`](Self::migrate) if missing).
    pub fn schema(self, schema: &str) -> Result<Self, InvalidName> {
        check_identifier(schema, "a schema name")?;
        Ok(Self { names: Arc::new(Names::new(Some(schema), &self.names.table)), pool: self.pool })
    }

    /// The table's name.
    pub fn table(self, table: &str) -> Result<Self, InvalidName> {
        check_identifier(table, "a table name")?;
        Ok(Self { names: Arc::new(Names::new(self.names.schema.as_deref(), table)), pool: self.pool })
    }

    /// Creates the table and its index if missing (migration `0004_outbox`). Safe to run
    /// concurrently and repeatedly; its history is kept in `_<table>_migrations`, beside it.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let names = &self.names;
        let sql = MIGRATION.replace("{qualified}", &names.qualified).replace("{table}", &names.table);
        let history = match &names.schema {
            Some(schema) => format!("\"{schema}\".\"_{}_migrations\"", names.table),
            None => format!("\"_{}_migrations\"", names.table),
        };
        let mut migrator = migrator(sql, history);
        if let Some(schema) = &names.schema {
            migrator.create_schema(format!("\"{schema}\""));
        }
        migrator.run(&self.pool).await
    }

    /// Writes `event` in the request's transaction: it commits with the business write and the
    /// stored answer, or not at all. Enqueuing an event whose id is already there changes
    /// nothing (a re-executed operation enqueues the same events again); whether it was new.
    ///
    /// Takes the handle's lock: do not hold a [`TxConnection`](crate::tx::TxConnection) of the
    /// same handle while calling it (use [`enqueue_on`](Self::enqueue_on) with that connection).
    pub async fn enqueue(&self, tx: &TxHandle<Postgres>, event: &NewEvent) -> Result<bool, OutboxError> {
        let mut conn = tx.acquire().await.map_err(|_| OutboxError::TransactionFinished)?;
        self.enqueue_on(&mut conn, event).await
    }

    /// [`enqueue`](Self::enqueue) on a connection the caller holds (the transaction's).
    pub async fn enqueue_on(&self, conn: &mut PgConnection, event: &NewEvent) -> Result<bool, OutboxError> {
        let done = sqlx::query(AssertSqlSafe(self.names.enqueue.as_str()))
            .bind(event.id.as_str())
            .bind(event.event_type.as_str())
            .bind(event.body.as_ref())
            .execute(conn)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    /// The pool the outbox reads and claims on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

impl Names {
    fn new(schema: Option<&str>, table: &str) -> Self {
        let qualified = match schema {
            Some(schema) => format!("\"{schema}\".\"{table}\""),
            None => format!("\"{table}\""),
        };
        let q = &qualified;
        let age = "(EXTRACT(EPOCH FROM (clock_timestamp() - o.created_at)) * 1000)::bigint";
        Self {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
            enqueue: format!(
                "INSERT INTO {q} (event_id, event_type, body) VALUES ($1, $2, $3) \
                 ON CONFLICT ON CONSTRAINT \"{table}_pkey\" DO NOTHING"
            ),
            // SKIP LOCKED: relays claiming at once take disjoint batches without waiting on
            // each other's row locks; the lease (available_at moved past now) keeps the events
            // off every later claim until it runs out.
            claim: format!(
                "UPDATE {q} o SET lease_token = o.lease_token + 1, attempts = o.attempts + 1, \
                     available_at = clock_timestamp() + $2::float8 * interval '1 millisecond' \
                 FROM (SELECT event_id FROM {q} WHERE state = 'pending' AND available_at <= clock_timestamp() \
                       ORDER BY available_at LIMIT $1 FOR UPDATE SKIP LOCKED) due \
                 WHERE o.event_id = due.event_id \
                 RETURNING o.event_id, o.event_type, o.body, o.attempts::bigint AS attempts, o.lease_token, \
                     {age} AS age_ms"
            ),
            delivered: format!(
                "UPDATE {q} SET state = 'delivered', delivered_at = clock_timestamp(), last_error = NULL \
                 WHERE event_id = $1 AND lease_token = $2 AND state = 'pending'"
            ),
            delivered_all: format!(
                "UPDATE {q} o SET state = 'delivered', delivered_at = clock_timestamp(), last_error = NULL \
                 FROM unnest($1::text[], $2::bigint[]) AS d(event_id, lease_token) \
                 WHERE o.event_id = d.event_id AND o.lease_token = d.lease_token AND o.state = 'pending' \
                 RETURNING o.event_id, o.lease_token"
            ),
            retry: format!(
                "UPDATE {q} SET available_at = clock_timestamp() + $3::float8 * interval '1 millisecond', \
                     last_error = $4 \
                 WHERE event_id = $1 AND lease_token = $2 AND state = 'pending'"
            ),
            dead: format!(
                "UPDATE {q} SET state = 'dead', last_error = $3 \
                 WHERE event_id = $1 AND lease_token = $2 AND state = 'pending'"
            ),
            counts: format!(
                "SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'delivered'), \
                     count(*) FILTER (WHERE state = 'dead') FROM {q}"
            ),
            oldest: format!(
                "SELECT (EXTRACT(EPOCH FROM (clock_timestamp() - min(created_at))) * 1000)::bigint \
                 FROM {q} WHERE state = 'pending'"
            ),
            qualified,
        }
    }
}

impl PostgresOutbox {
    /// The statement that writes `finish` for `leased`, if its token still holds the event.
    fn finish_query<'q>(
        &'q self,
        leased: &'q Leased,
        finish: &'q Finish,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        let (id, token) = (leased.event.id.as_str(), leased.lease_token);
        match finish {
            Finish::Delivered => sqlx::query(AssertSqlSafe(self.names.delivered.as_str())).bind(id).bind(token),
            Finish::Retry { after, error } => sqlx::query(AssertSqlSafe(self.names.retry.as_str()))
                .bind(id)
                .bind(token)
                .bind(millis(*after) as f64)
                .bind(short(error)),
            Finish::Dead { error } => {
                sqlx::query(AssertSqlSafe(self.names.dead.as_str())).bind(id).bind(token).bind(short(error))
            }
        }
    }
}

impl OutboxStore for PostgresOutbox {
    async fn claim(&self, batch: usize, lease: Duration) -> Result<Vec<Leased>, OutboxError> {
        let rows: Vec<ClaimedRow> = sqlx::query_as(AssertSqlSafe(self.names.claim.as_str()))
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .bind(millis(lease) as f64)
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
        // One transaction for the batch: one commit (one WAL flush) instead of one per event, and
        // the deliveries (the common end) in one statement.
        let delivered: Vec<&Leased> =
            ends.iter().filter(|(_, finish)| matches!(finish, Finish::Delivered)).map(|(leased, _)| leased).collect();
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let marked: std::collections::HashSet<(String, i64)> = if delivered.is_empty() {
            Default::default()
        } else {
            let ids: Vec<&str> = delivered.iter().map(|leased| leased.event.id.as_str()).collect();
            let tokens: Vec<i64> = delivered.iter().map(|leased| leased.lease_token).collect();
            let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(self.names.delivered_all.as_str()))
                .bind(ids)
                .bind(tokens)
                .fetch_all(&mut *tx)
                .await
                .map_err(unavailable)?;
            rows.into_iter().collect()
        };
        let mut written = Vec::with_capacity(ends.len());
        for (leased, finish) in ends {
            if matches!(finish, Finish::Delivered) {
                written.push(marked.contains(&(leased.event.id.to_string(), leased.lease_token)));
            } else {
                let done = self.finish_query(leased, finish).execute(&mut *tx).await.map_err(unavailable)?;
                written.push(done.rows_affected() == 1);
            }
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
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(age.map(|ms| Duration::from_millis(ms.max(0) as u64)))
    }
}
