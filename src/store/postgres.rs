//! [`PostgresStore`] (feature `postgres`): records in a PostgreSQL table, in atomic or leased
//! mode.
//!
//! - **Atomic** (the default): [`Store::begin`] opens a transaction, claims the identity in it
//!   and hands the transaction to the handler as a [`TxHandle`]. The handler's business writes,
//!   the stored response and the claim commit together, or not at all. A concurrent duplicate
//!   waits on the first transaction's row lock for at most the configured wait (PostgreSQL's
//!   `lock_timeout`, not a sleep loop), then sees its outcome.
//! - **Leased**: the claim commits at once as `processing` with a lease and a fencing token;
//!   the outcome is written later by a fenced, state-checked update. For handlers that call the
//!   outside world, where one transaction cannot span the side effect.
//!
//! Uniqueness comes from the table's primary key on the scoped identity, at any isolation
//! level; a conflict is read back in a new statement outside the claiming transaction.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::{IdempotencyLayer, store::postgres::PostgresStore};
//!
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! let store = PostgresStore::new(pool).schema("idempotency")?;
//! store.migrate().await?;
//! let layer = IdempotencyLayer::new(store);
//! # drop(layer); Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgPool, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row, SqlSafeStr, SqlStr};
use tokio::time::Instant;

use super::sql::{Found, RecordRow, check_identifier, millis};
use super::{
    Begin, BeginRequest, Claim, CouplingMode, FinishError, Outcome, Retention, StaleLeasePolicy, Store, StoreError,
};
use crate::key::RecordId;
use crate::record::StoredResponse;
use crate::tx::TxHandle;

const MIGRATION_0001: &str = include_str!("../../migrations/postgres/0001_create_records.sql");

/// The savepoint taken right after the claim, so a stored failure can roll the handler's
/// writes back and keep the claim.
const CLAIM_SAVEPOINT: &str = "tower_idempotency_claim";

/// A PostgreSQL-backed [`Store`].
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    mode: CouplingMode,
    schema: Arc<str>,
    table: Arc<str>,
    sql: Arc<Statements>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("mode", &self.mode)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// A schema or table name that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("invalid identifier: {0}")]
pub struct InvalidIdentifier(String);

impl PostgresStore {
    /// An atomic-mode store over `pool`, in schema `public`, table `idempotency_records`.
    pub fn new(pool: PgPool) -> Self {
        Self::build(pool, CouplingMode::Atomic, "public", "idempotency_records")
    }

    /// The schema that holds the table (created by [`migrate`](Self::migrate) if missing).
    pub fn schema(self, schema: &str) -> Result<Self, InvalidIdentifier> {
        check_identifier(schema).map_err(InvalidIdentifier)?;
        Ok(Self::build(self.pool, self.mode, schema, &self.table))
    }

    /// The table's name.
    pub fn table(self, table: &str) -> Result<Self, InvalidIdentifier> {
        check_identifier(table).map_err(InvalidIdentifier)?;
        Ok(Self::build(self.pool, self.mode, &self.schema, table))
    }

    /// The coupling mode: [`CouplingMode::Atomic`] (default) or [`CouplingMode::Leased`].
    pub fn mode(mut self, mode: CouplingMode) -> Self {
        self.mode = mode;
        self
    }

    /// The same store in leased mode.
    pub fn leased(self) -> Self {
        self.mode(CouplingMode::Leased)
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates or upgrades the schema, table, sequence and indexes. Safe to run concurrently and
    /// repeatedly; its history is kept in `<schema>._<table>_migrations`, apart from the
    /// application's own sqlx migrations.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let sql = MIGRATION_0001.replace("{schema}", &self.schema).replace("{table}", &self.table);
        let migration = sqlx::migrate::Migration::new(
            1,
            "create idempotency records".into(),
            sqlx::migrate::MigrationType::Simple,
            AssertSqlSafe(sql).into_sql_str(),
            false,
        );
        let mut migrator = sqlx::migrate::Migrator::with_migrations(vec![migration]);
        migrator.dangerous_set_table_name(format!("\"{}\".\"_{}_migrations\"", self.schema, self.table));
        migrator.create_schema(format!("\"{}\"", self.schema));
        migrator.run(&self.pool).await
    }

    fn build(pool: PgPool, mode: CouplingMode, schema: &str, table: &str) -> Self {
        let sql = Arc::new(Statements::new(schema, table));
        Self { pool, mode, schema: schema.into(), table: table.into(), sql }
    }

    async fn begin_atomic(&self, request: &BeginRequest<'_>) -> Result<Begin<PgClaim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        loop {
            // lock_timeout bounds the wait on a concurrent claimant's uncommitted row; 0 would
            // mean no bound at all, so at least 1 ms.
            let lock_ms = millis(deadline.saturating_duration_since(Instant::now())).max(1);
            let begin = AssertSqlSafe(format!("BEGIN; SET LOCAL lock_timeout = {lock_ms}"));
            let mut tx = self.pool.begin_with(begin).await.map_err(unavailable)?;
            let claimed = self.claim_statement(request).fetch_optional(&mut *tx).await;
            match claimed {
                Ok(Some(row)) => {
                    let token: i64 = row.try_get(0).map_err(unavailable)?;
                    let after =
                        AssertSqlSafe(format!("SET LOCAL lock_timeout TO DEFAULT; SAVEPOINT {CLAIM_SAVEPOINT}"));
                    sqlx::raw_sql(after).execute(&mut *tx).await.map_err(unavailable)?;
                    return Ok(Begin::Claimed(PgClaim::atomic(self, request, token, TxHandle::new(tx))));
                }
                Ok(None) => {
                    // Someone else's committed record is in the way; read it outside this
                    // transaction, so the read sees it whatever the isolation level.
                    let _ = tx.rollback().await;
                }
                Err(error) if is_lock_timeout(&error) => {
                    let _ = tx.rollback().await;
                    return Ok(Begin::InFlight { retry_after: Duration::from_secs(1) });
                }
                Err(error) if is_retryable(&error) && Instant::now() < deadline => {
                    let _ = tx.rollback().await;
                    continue;
                }
                Err(error) => return Err(unavailable(error)),
            }
            if let Some(answer) = self.settle_existing(request, deadline).await? {
                return Ok(answer);
            }
        }
    }

    async fn begin_leased(&self, request: &BeginRequest<'_>) -> Result<Begin<PgClaim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        loop {
            match self.claim_statement(request).fetch_optional(&self.pool).await {
                Ok(Some(row)) => {
                    let token: i64 = row.try_get(0).map_err(unavailable)?;
                    return Ok(Begin::Claimed(PgClaim::leased(self, request, token)));
                }
                Ok(None) => {}
                Err(error) if is_retryable(&error) && Instant::now() < deadline => continue,
                Err(error) => return Err(unavailable(error)),
            }
            if let Some(answer) = self.settle_existing(request, deadline).await? {
                return Ok(answer);
            }
        }
    }

    /// Reads the record in the way of a claim and decides. `None`: try to claim again.
    async fn settle_existing(
        &self,
        request: &BeginRequest<'_>,
        deadline: Instant,
    ) -> Result<Option<Begin<PgClaim>>, StoreError> {
        let mut backoff = Duration::from_millis(10);
        loop {
            let row = sqlx::query(self.sql.read.clone())
                .bind(request.id.digest().as_slice())
                .fetch_optional(&self.pool)
                .await
                .map_err(unavailable)?;
            let Some(row) = row else { return Ok(None) };
            match record_row(&row)?.decide(request.fingerprint, request.stale_lease)? {
                Found::Forgotten => return Ok(None),
                Found::Record(record) => return Ok(Some(Begin::Existing(record))),
                Found::StaleLease { token, record } => {
                    let marked = sqlx::query(self.sql.mark_unknown.clone())
                        .bind(request.id.digest().as_slice())
                        .bind(token)
                        .execute(&self.pool)
                        .await
                        .map_err(unavailable)?;
                    if marked.rows_affected() == 1 {
                        return Ok(Some(Begin::Existing(record)));
                    }
                }
                Found::Live { lease_left } => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(Some(Begin::InFlight { retry_after: lease_left.min(request.lease) }));
                    }
                    // A leased holder is alive: look again soon, never past the deadline.
                    tokio::time::sleep(backoff.min(lease_left).min(deadline - now)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
            }
        }
    }

    fn claim_statement<'q>(
        &self,
        request: &BeginRequest<'_>,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        let lease_ms = (self.mode == CouplingMode::Leased).then(|| millis(request.lease));
        sqlx::query(self.sql.claim.clone())
            .bind(request.id.digest().to_vec())
            .bind(i16::from(request.fingerprint.version()))
            .bind(request.fingerprint.digest().to_vec())
            .bind(lease_ms)
            .bind(request.stale_lease == StaleLeasePolicy::Reexecute)
    }
}

impl Store for PostgresStore {
    type Claim = PgClaim;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<PgClaim>, StoreError> {
        match self.mode {
            CouplingMode::Atomic => self.begin_atomic(&request).await,
            CouplingMode::Leased => self.begin_leased(&request).await,
        }
    }

    async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let forgotten = sqlx::query(self.sql.purge_forget.clone()).bind(limit).execute(&self.pool).await;
        let forgotten = forgotten.map_err(unavailable)?.rows_affected();
        let left = limit.saturating_sub(i64::try_from(forgotten).unwrap_or(i64::MAX));
        let expired = sqlx::query(self.sql.purge_expire.clone()).bind(left).execute(&self.pool).await;
        Ok((forgotten + expired.map_err(unavailable)?.rows_affected()) as usize)
    }
}

/// A claim on a [`PostgresStore`] record: a live transaction (atomic) or a lease (leased).
#[derive(Debug)]
pub struct PgClaim {
    store: PostgresStore,
    id: RecordId,
    token: i64,
    retention: Retention,
    handle: Option<TxHandle<Postgres>>,
    settled: bool,
}

impl PgClaim {
    fn atomic(store: &PostgresStore, request: &BeginRequest<'_>, token: i64, handle: TxHandle<Postgres>) -> Self {
        Self {
            store: store.clone(),
            id: *request.id,
            token,
            retention: request.retention,
            handle: Some(handle),
            settled: false,
        }
    }

    fn leased(store: &PostgresStore, request: &BeginRequest<'_>, token: i64) -> Self {
        Self {
            store: store.clone(),
            id: *request.id,
            token,
            retention: request.retention,
            handle: None,
            settled: false,
        }
    }

    fn finish_query(
        &self,
        state: &'static str,
        response: &StoredResponse,
    ) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(self.store.sql.finish.clone())
            .bind(self.id.digest().to_vec())
            .bind(self.token)
            .bind(state)
            .bind(response.status.as_u16() as i16)
            .bind(response.encode_headers())
            .bind(response.body.to_vec())
            .bind(millis(self.retention.response))
            .bind(millis(self.retention.tombstone))
    }

    async fn finish_atomic(&self, handle: &TxHandle<Postgres>, outcome: Outcome) -> Result<(), FinishError> {
        let shared = handle.is_shared();
        let Some(mut tx) = handle.try_take() else { return Err(FinishError::HandleStillHeld) };
        if shared {
            let _ = tx.rollback().await;
            return Err(FinishError::HandleStillHeld);
        }
        let (state, response) = match outcome {
            Outcome::Release => {
                // A failed rollback leaves the transaction to die with its connection: nothing
                // of it is committed either way.
                let _ = tx.rollback().await;
                return Ok(());
            }
            Outcome::Complete(response) => ("completed", response),
            Outcome::StoreFailure(response) => {
                let undo = AssertSqlSafe(format!("ROLLBACK TO SAVEPOINT {CLAIM_SAVEPOINT}"));
                sqlx::raw_sql(undo).execute(&mut *tx).await.map_err(|e| FinishError::Store(unavailable(e)))?;
                ("failed", response)
            }
        };
        let updated = self.finish_query(state, &response).execute(&mut *tx).await;
        match updated {
            Ok(done) if done.rows_affected() == 1 => {}
            Ok(_) => {
                let _ = tx.rollback().await;
                return Err(FinishError::LeaseLost);
            }
            Err(error) => {
                let _ = tx.rollback().await;
                return Err(FinishError::Store(unavailable(error)));
            }
        }
        tx.commit().await.map_err(|e| FinishError::CommitUncertain(Box::new(e)))
    }

    async fn finish_leased(&self, outcome: Outcome) -> Result<(), FinishError> {
        let done = match outcome {
            Outcome::Release => {
                sqlx::query(self.store.sql.release.clone())
                    .bind(self.id.digest().to_vec())
                    .bind(self.token)
                    .execute(&self.store.pool)
                    .await
            }
            Outcome::Complete(response) => self.finish_query("completed", &response).execute(&self.store.pool).await,
            Outcome::StoreFailure(response) => self.finish_query("failed", &response).execute(&self.store.pool).await,
        };
        match done {
            Ok(done) if done.rows_affected() == 1 => Ok(()),
            Ok(_) => Err(FinishError::LeaseLost),
            // The update may or may not have reached the database.
            Err(error) => Err(FinishError::CommitUncertain(Box::new(error))),
        }
    }
}

impl Claim for PgClaim {
    type Handle = TxHandle<Postgres>;

    fn handle(&self) -> Option<TxHandle<Postgres>> {
        self.handle.clone()
    }

    fn fencing_token(&self) -> u64 {
        self.token as u64
    }

    async fn finish(mut self, outcome: Outcome) -> Result<(), FinishError> {
        self.settled = true;
        match self.handle.take() {
            Some(handle) => self.finish_atomic(&handle, outcome).await,
            None => self.finish_leased(outcome).await,
        }
    }
}

impl Drop for PgClaim {
    /// Atomic: the transaction rolls back. Leased: the lease is given up at once (in the
    /// background), so the next retry applies the stale-lease policy without waiting it out.
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if let Some(handle) = self.handle.take() {
            drop(handle.try_take());
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (pool, sql, id, token) = (self.store.pool.clone(), self.store.sql.abandon.clone(), self.id, self.token);
        runtime.spawn(async move {
            let _ = sqlx::query(sql).bind(id.digest().to_vec()).bind(token).execute(&pool).await;
        });
    }
}

struct Statements {
    claim: SqlStr,
    read: SqlStr,
    mark_unknown: SqlStr,
    finish: SqlStr,
    release: SqlStr,
    abandon: SqlStr,
    purge_forget: SqlStr,
    purge_expire: SqlStr,
}

impl Statements {
    fn new(schema: &str, table: &str) -> Self {
        let t = format!("\"{schema}\".\"{table}\"");
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        Self {
            // Claims a new identity, or takes over a forgotten record, or (when the route is
            // re-executable) a dead holder's lease on the same request. Any other existing row
            // returns nothing; a concurrent claimant's uncommitted row makes this wait.
            claim: sql(format!(
                "INSERT INTO {t} AS r (record_id, state, fingerprint_version, fingerprint, fencing_token, lease_until) \
                 VALUES ($1, 'processing', $2, $3, nextval('\"{schema}\".\"{table}_fencing_seq\"'), \
                         clock_timestamp() + $4::float8 * interval '1 millisecond') \
                 ON CONFLICT ON CONSTRAINT \"{table}_pkey\" DO UPDATE SET \
                     state = 'processing', fingerprint_version = EXCLUDED.fingerprint_version, \
                     fingerprint = EXCLUDED.fingerprint, fencing_token = EXCLUDED.fencing_token, \
                     lease_until = EXCLUDED.lease_until, response_status = NULL, response_headers = NULL, \
                     response_body = NULL, response_until = NULL, forget_at = NULL, \
                     created_at = clock_timestamp(), updated_at = clock_timestamp() \
                 WHERE r.forget_at <= clock_timestamp() \
                    OR ($5 AND r.state = 'processing' AND r.lease_until <= clock_timestamp() \
                        AND r.fingerprint = EXCLUDED.fingerprint) \
                 RETURNING fencing_token"
            )),
            read: sql(format!(
                "SELECT state, fingerprint_version, fingerprint, fencing_token, \
                        (EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::bigint, \
                        COALESCE(response_until <= clock_timestamp(), false), \
                        COALESCE(forget_at <= clock_timestamp(), false), \
                        response_status, response_headers, response_body \
                 FROM {t} WHERE record_id = $1"
            )),
            mark_unknown: sql(format!(
                "UPDATE {t} SET state = 'unknown', updated_at = clock_timestamp() \
                 WHERE record_id = $1 AND fencing_token = $2 AND state = 'processing' \
                   AND lease_until <= clock_timestamp()"
            )),
            finish: sql(format!(
                "UPDATE {t} SET state = $3, response_status = $4, response_headers = $5, response_body = $6, \
                     lease_until = NULL, \
                     response_until = clock_timestamp() + $7::float8 * interval '1 millisecond', \
                     forget_at = clock_timestamp() + ($7::float8 + $8::float8) * interval '1 millisecond', \
                     updated_at = clock_timestamp() \
                 WHERE record_id = $1 AND fencing_token = $2 AND state = 'processing'"
            )),
            release: sql(format!(
                "DELETE FROM {t} WHERE record_id = $1 AND fencing_token = $2 AND state = 'processing'"
            )),
            abandon: sql(format!(
                "UPDATE {t} SET lease_until = clock_timestamp() \
                 WHERE record_id = $1 AND fencing_token = $2 AND state = 'processing'"
            )),
            purge_forget: sql(format!(
                "DELETE FROM {t} WHERE record_id IN ( \
                     SELECT record_id FROM {t} WHERE forget_at <= clock_timestamp() \
                     LIMIT $1 FOR UPDATE SKIP LOCKED)"
            )),
            purge_expire: sql(format!(
                "UPDATE {t} SET state = 'expired', response_status = NULL, response_headers = NULL, \
                     response_body = NULL, updated_at = clock_timestamp() \
                 WHERE record_id IN ( \
                     SELECT record_id FROM {t} WHERE state IN ('completed', 'failed') \
                       AND response_until <= clock_timestamp() \
                     LIMIT $1 FOR UPDATE SKIP LOCKED)"
            )),
        }
    }
}

fn record_row(row: &PgRow) -> Result<RecordRow, StoreError> {
    let corrupt = |e: sqlx::Error| StoreError::Corrupt(e.to_string());
    Ok(RecordRow {
        state: row.try_get(0).map_err(corrupt)?,
        fingerprint_version: row.try_get(1).map_err(corrupt)?,
        fingerprint: row.try_get(2).map_err(corrupt)?,
        fencing_token: row.try_get(3).map_err(corrupt)?,
        lease_left_ms: row.try_get(4).map_err(corrupt)?,
        response_expired: row.try_get(5).map_err(corrupt)?,
        forgotten: row.try_get(6).map_err(corrupt)?,
        response_status: row.try_get(7).map_err(corrupt)?,
        response_headers: row.try_get(8).map_err(corrupt)?,
        response_body: row.try_get(9).map_err(corrupt)?,
    })
}

fn unavailable(error: sqlx::Error) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned())
}

/// `lock_not_available`: the bounded wait on a concurrent claimant ran out.
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    sqlstate(error).as_deref() == Some("55P03")
}

/// Serialization failures and deadlocks: the claim may simply be tried again.
fn is_retryable(error: &sqlx::Error) -> bool {
    matches!(sqlstate(error).as_deref(), Some("40001" | "40P01"))
}
