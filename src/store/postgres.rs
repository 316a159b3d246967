//! [`PostgresStore`] (feature `postgres`): records in a PostgreSQL table, in atomic or leased
//! mode.
//!
//! - **Atomic** (the default): [`Store::begin`] opens a transaction, claims the identity in it
//!   and hands the transaction to the handler as a [`TxHandle`]. The handler's business writes,
//!   the stored response and the claim commit together, or not at all. A concurrent duplicate
//!   waits on the first transaction's lock on the identity for at most the configured wait
//!   (PostgreSQL's `lock_timeout`, not a sleep loop), then sees its outcome.
//! - **Leased**: the claim commits at once as `processing` with a lease and a fencing token;
//!   the outcome is written later by a fenced, state-checked update. For handlers that call the
//!   outside world, where one transaction cannot span the side effect.
//!
//! Uniqueness comes from the table's primary key on the scoped identity, at any isolation
//! level; a conflict is read back in a new statement outside the claiming transaction.
//!
//! # How an atomic request travels
//!
//! 1. A plain read of the record (a prepared statement), outside any transaction: a retry of a
//!    finished request is answered from it, with no transaction and no lock.
//! 2. On the same connection, `BEGIN` and the migration's `<table>_claim` function in one round
//!    trip: a transaction-scoped advisory lock on the identity, taken at once when nobody holds
//!    it and otherwise waited for, at most the in-flight wait (`lock_timeout`, not a sleep
//!    loop), then a check that no record appeared meanwhile. A concurrent duplicate therefore
//!    waits for the first request's COMMIT or ROLLBACK, then sees its outcome. A record that
//!    the read found forgotten (or a dead lease, on a re-executable route) is deleted here,
//!    under the lock, in the same round trip.
//! 3. The handler's own statements, on the transaction's connection ([`TxHandle`]).
//! 4. The record, written once with its outcome by the migration's `<table>_store` function (a
//!    plain INSERT, planned once per session), and `COMMIT`, in one round trip. Atomic mode
//!    never commits a `processing` row. The primary key decides here: if another record holds
//!    the identity, the INSERT fails, the COMMIT does not run and the business write rolls back.
//!
//! Against a bare `BEGIN; INSERT; COMMIT` this costs one more round trip (the read), a lock, an
//! index probe and the record's row; `benches/pg_orders.rs` measures what that comes to.
//!
//! At READ COMMITTED (PostgreSQL's default) step 2 sees a record committed while it waited. At
//! REPEATABLE READ or SERIALIZABLE its snapshot predates the wait, so a duplicate may run the
//! handler after the first request committed; step 4 then rolls it back and answers 503
//! `idempotency_commit_uncertain`, and its retry replays. Either way one execution commits.
//!
//! A stored failure (a business rejection the handler marks to be stored) rolls the
//! transaction back and stores the answer under a fresh claim: a per-request savepoint would
//! cost every request a subtransaction for the sake of this rarer path.
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

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPool, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row, SqlSafeStr, SqlStr};
use tokio::time::Instant;

pub use super::sql::InvalidIdentifier;
use super::sql::{self, RecordAccess, RecordRow, check_identifier, millis};
use super::{
    Begin, BeginRequest, Claim, CouplingMode, FinishError, Outcome, Retention, StaleLeasePolicy, Store, StoreError,
};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::StoredResponse;
use crate::tx::{ManagedTx, OpenTx, TxHandle};

const MIGRATION_0001: &str = include_str!("../../migrations/postgres/0001_create_records.sql");

/// The SQLSTATE the `_claim` function raises when a live record is in the way.
const RECORD_EXISTS: &str = "TI001";

/// A unique violation; on the records table's primary key, another record holds the identity.
const UNIQUE_VIOLATION: &str = "23505";

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

impl PostgresStore {
    /// An atomic-mode store over `pool`, in schema `public`, table `idempotency_records`.
    pub fn new(pool: PgPool) -> Self {
        Self::build(pool, CouplingMode::Atomic, "public", "idempotency_records")
    }

    /// The schema that holds the table (created by [`migrate`](Self::migrate) if missing).
    pub fn schema(self, schema: &str) -> Result<Self, InvalidIdentifier> {
        check_identifier(schema)?;
        Ok(Self::build(self.pool, self.mode, schema, &self.table))
    }

    /// The table's name.
    pub fn table(self, table: &str) -> Result<Self, InvalidIdentifier> {
        check_identifier(table)?;
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
        // Retries of finished requests are the common case worth making cheap: one plain read,
        // no transaction, no lock. A new key goes on to claim on the same connection, so the
        // miss costs one round trip and no extra trip through the pool.
        let mut conn = self.pool.acquire().await.map_err(unavailable)?;
        let mut found = self.read_with(&mut *conn, request.id).await?;
        let mut held = Some(conn);
        // Whether the claim deletes a forgotten record, or a dead lease on a re-executable
        // route, under the lock, so that the outcome can take its place.
        let mut replace = false;
        loop {
            if let Some(row) = found.take() {
                // Something is in the way: settle it without holding a connection while it waits.
                held = None;
                match sql::settle(self, request, deadline, Some(row)).await? {
                    Some(answer) => return Ok(answer),
                    None => replace = true,
                }
            }
            let conn = match held.take() {
                Some(conn) => conn,
                None => self.pool.acquire().await.map_err(unavailable)?,
            };
            let lock_ms = millis(deadline.saturating_duration_since(Instant::now()));
            let begin = self.sql.begin_claim(request.id, request.fingerprint, request.stale_lease, lock_ms, replace);
            let failed = match ManagedTx::begin(conn, begin).await {
                Ok(tx) => {
                    let handle = TxHandle::from_open(OpenTx::Managed(tx));
                    return Ok(Begin::Claimed(PgClaim::atomic(self, request, handle, replace)));
                }
                Err((error, failed)) => match sqlstate(&error).as_deref() {
                    Some(RECORD_EXISTS) => failed,
                    Some(LOCK_NOT_AVAILABLE) => {
                        roll_back_failed_claim(failed).await;
                        return Ok(Begin::InFlight { retry_after: Duration::from_secs(1) });
                    }
                    Some(SERIALIZATION_FAILURE | DEADLOCK_DETECTED) if Instant::now() < deadline => {
                        roll_back_failed_claim(failed).await;
                        continue;
                    }
                    _ => {
                        roll_back_failed_claim(failed).await;
                        return Err(unavailable(error));
                    }
                },
            };
            // A concurrent claimant committed a record while this request waited for it. Roll
            // the failed claim back and read the record in one round trip: a new statement,
            // outside any transaction, so the read sees it whatever the isolation level.
            replace = false;
            found = rollback_and_read(failed, &self.sql.read_literal(request.id)).await?;
        }
    }

    async fn begin_leased(&self, request: &BeginRequest<'_>) -> Result<Begin<PgClaim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        // As in atomic mode: a retry of a finished request costs one read and no write (the
        // claim statement would lock the existing row even when it changes nothing).
        if let Some(answer) = sql::settle(self, request, deadline, None).await? {
            return Ok(answer);
        }
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
            if let Some(answer) = sql::settle(self, request, deadline, None).await? {
                return Ok(answer);
            }
        }
    }

    /// Whether `error` is the records table's primary key turning this claim's record away
    /// (another request's record holds the identity). A unique violation of any other
    /// constraint, such as a deferred one of the application's at COMMIT, is not.
    fn is_identity_conflict(&self, error: &sqlx::Error) -> bool {
        error.as_database_error().is_some_and(|e| {
            e.code().as_deref() == Some(UNIQUE_VIOLATION) && e.constraint() == Some(&*self.sql.primary_key)
        })
    }

    fn claim_statement<'q>(
        &self,
        request: &BeginRequest<'_>,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(self.sql.claim.clone())
            .bind(request.id.digest().to_vec())
            .bind(i16::from(request.fingerprint.version()))
            .bind(request.fingerprint.digest().to_vec())
            .bind(millis(request.lease))
            .bind(request.stale_lease == StaleLeasePolicy::Reexecute)
    }
}

impl PostgresStore {
    /// The record of `id`, read with `executor` (the pool, or a connection about to claim).
    async fn read_with<'e>(
        &self,
        executor: impl sqlx::Executor<'e, Database = Postgres>,
        id: &RecordId,
    ) -> Result<Option<RecordRow>, StoreError> {
        let row = sqlx::query(self.sql.read.clone())
            .bind(id.digest().as_slice())
            .fetch_optional(executor)
            .await
            .map_err(unavailable)?;
        row.as_ref().map(record_row).transpose()
    }
}

impl RecordAccess for PostgresStore {
    async fn read(&self, id: &RecordId) -> Result<Option<RecordRow>, StoreError> {
        self.read_with(&self.pool, id).await
    }

    async fn mark_unknown(&self, id: &RecordId, token: i64) -> Result<bool, StoreError> {
        let marked = sqlx::query(self.sql.mark_unknown.clone())
            .bind(id.digest().as_slice())
            .bind(token)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(marked.rows_affected() == 1)
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
    fingerprint: Fingerprint,
    reexecute: bool,
    /// The leased claim's fencing token; atomic claims have none (their records carry 0).
    token: Option<i64>,
    retention: Retention,
    /// The bounded wait of the request, for a stored failure's fresh claim.
    wait: Duration,
    /// Atomic: the claim deleted a forgotten record or a dead lease (so must a fresh claim).
    replace: bool,
    handle: Option<TxHandle<Postgres>>,
    settled: bool,
}

impl PgClaim {
    fn new(
        store: &PostgresStore,
        request: &BeginRequest<'_>,
        token: Option<i64>,
        handle: Option<TxHandle<Postgres>>,
        replace: bool,
    ) -> Self {
        Self {
            store: store.clone(),
            id: *request.id,
            fingerprint: *request.fingerprint,
            reexecute: request.stale_lease == StaleLeasePolicy::Reexecute,
            token,
            retention: request.retention,
            wait: request.wait,
            replace,
            handle,
            settled: false,
        }
    }

    fn atomic(store: &PostgresStore, request: &BeginRequest<'_>, handle: TxHandle<Postgres>, replace: bool) -> Self {
        Self::new(store, request, None, Some(handle), replace)
    }

    fn leased(store: &PostgresStore, request: &BeginRequest<'_>, token: i64) -> Self {
        Self::new(store, request, Some(token), None, false)
    }

    /// Leased: the fenced update that settles the claim.
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
            .bind(response.encode_fields())
            .bind(response.body.to_vec())
            .bind(millis(self.retention.response))
            .bind(millis(self.retention.tombstone))
    }

    async fn finish_atomic(&self, handle: &TxHandle<Postgres>, outcome: Outcome) -> Result<(), FinishError> {
        let mut tx = handle.take_to_finish().await?;
        let (state, response) = match outcome {
            Outcome::Release => {
                tx.discard().await;
                return Ok(());
            }
            Outcome::Complete(response) => ("completed", response),
            Outcome::Reject(response) => {
                // The handler's writes go; the failure is stored under a fresh claim. (A
                // savepoint would keep the first claim, but costs a subtransaction on every
                // request for the sake of this rare path.) A duplicate that claims in between
                // wins, and this answer is not stored.
                tx.discard().await;
                tx = self.reclaim().await?;
                ("failed", response)
            }
        };
        // The record is written once, with its outcome (atomic mode never commits a
        // `processing` row), and committed in the same round trip. The primary key decides: if
        // another record holds the identity, the INSERT fails, the COMMIT after it never runs,
        // and the business write rolls back. The trailing BEGIN opens an empty transaction that
        // matches sqlx's bookkeeping (it still counts one open); it is rolled back when the
        // connection returns to the pool, in the same round trip as the pool's own check.
        let statement = format!(
            "{insert}; COMMIT; BEGIN",
            insert = self.store.sql.store_outcome_call(&self.id, state, &self.fingerprint, &response, self.retention),
        );
        match sqlx::raw_sql(AssertSqlSafe(statement)).execute(&mut *tx).await {
            Ok(_) => Ok(()),
            Err(error) => {
                let lost = self.store.is_identity_conflict(&error);
                tx.discard().await;
                if lost {
                    // Another request's record won: this execution's writes rolled back.
                    Err(FinishError::ClaimLost)
                } else {
                    // The INSERT failed (nothing committed) or the COMMIT did (its fate is
                    // unknown): either way a retry with the same key is safe.
                    Err(FinishError::CommitUncertain(Box::new(error)))
                }
            }
        }
    }

    /// Claims this identity again, in a new transaction, to store a failure.
    async fn reclaim(&self) -> Result<OpenTx<Postgres>, FinishError> {
        let store = &self.store;
        let conn = store.pool.acquire().await.map_err(|e| FinishError::Store(unavailable(e)))?;
        let policy = if self.reexecute { StaleLeasePolicy::Reexecute } else { StaleLeasePolicy::MarkUnknown };
        let begin = store.sql.begin_claim(&self.id, &self.fingerprint, policy, millis(self.wait), self.replace);
        match ManagedTx::begin(conn, begin).await {
            Ok(tx) => Ok(OpenTx::Managed(tx)),
            Err((error, conn)) => {
                let lost = matches!(sqlstate(&error).as_deref(), Some(RECORD_EXISTS | LOCK_NOT_AVAILABLE));
                roll_back_failed_claim(conn).await;
                Err(if lost { FinishError::ClaimLost } else { FinishError::Store(unavailable(error)) })
            }
        }
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
            Outcome::Reject(response) => self.finish_query("failed", &response).execute(&self.store.pool).await,
        };
        sql::fenced_write(done.map(|done| done.rows_affected()), |_| false)
    }
}

impl Claim for PgClaim {
    type Handle = TxHandle<Postgres>;

    fn handle(&self) -> Option<TxHandle<Postgres>> {
        self.handle.clone()
    }

    fn fencing_token(&self) -> Option<u64> {
        self.token.map(|token| token as u64)
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
        let Some(token) = self.token else { return };
        let (pool, sql, id) = (self.store.pool.clone(), self.store.sql.abandon.clone(), self.id);
        runtime.spawn(async move {
            let _ = sqlx::query(sql).bind(id.digest().to_vec()).bind(token).execute(&pool).await;
        });
    }
}

struct Statements {
    /// The read, for the simple-query protocol: `{id}` is replaced with a hex digest.
    read_template: String,
    /// The table, qualified.
    table: String,
    /// The `_store` function, qualified.
    store_function: String,
    /// The table's primary key constraint: a violation of it is another record's claim.
    primary_key: String,
    /// The `_claim` function, qualified.
    claim_function: String,
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
        let columns = "state, fingerprint_version, fingerprint, fencing_token, \
                       (EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::bigint, \
                       COALESCE(response_until <= clock_timestamp(), false), \
                       COALESCE(forget_at <= clock_timestamp(), false), \
                       response_status, response_headers, response_body";
        Self {
            read_template: format!("SELECT {columns} FROM {t} WHERE record_id = {}", bytea_literal("{id}")),
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
            table: t.clone(),
            store_function: format!("\"{schema}\".\"{table}_store\""),
            primary_key: format!("{table}_pkey"),
            claim_function: format!("\"{schema}\".\"{table}_claim\""),
            read: sql(format!("SELECT {columns} FROM {t} WHERE record_id = $1")),
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

impl Statements {
    /// Atomic: BEGIN and the migration's `_claim` function, as one simple query: the bounded
    /// wait for a concurrent claimant (an advisory lock, taken at once when nobody holds it) and
    /// the check that no live record appeared meanwhile (SQLSTATE TI001 if one did). With
    /// `replace`, a forgotten record or a dead lease on a re-executable route is then deleted
    /// under the lock, so the outcome's INSERT can take its place. The values are ours (hex
    /// digests and integers), never the client's text.
    fn begin_claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        policy: StaleLeasePolicy,
        lock_ms: i64,
        replace: bool,
    ) -> SqlStr {
        let lock_key = lock_key(id);
        let (id, fingerprint) = (bytea_literal(&id.to_hex()), bytea_literal(&fingerprint.to_hex()));
        let reexecute = policy == StaleLeasePolicy::Reexecute;
        // lock_timeout 0 would mean no bound at all.
        let lock_ms = lock_ms.clamp(1, i64::from(i32::MAX));
        let mut statement = format!(
            "BEGIN; SELECT {function}({id}, {lock_key}, {lock_ms}, {fingerprint}, {reexecute})",
            function = self.claim_function,
        );
        if replace {
            statement.push_str(&format!(
                "; DELETE FROM {table} WHERE record_id = {id} \
                   AND (forget_at <= clock_timestamp() \
                        OR ({reexecute} AND state = 'processing' AND lease_until <= clock_timestamp() \
                            AND fingerprint = {fingerprint}))",
                table = self.table,
            ));
        }
        AssertSqlSafe(statement).into_sql_str()
    }

    /// The read with the identity written in (it is our hex digest, never client text).
    fn read_literal(&self, id: &RecordId) -> String {
        self.read_template.replace("{id}", &id.to_hex())
    }

    /// Atomic: the call of the migration's `<table>_store` function, which inserts the record
    /// with its outcome, for the simple-query protocol. Every value is written in as hex or a
    /// number we produced; none is client text.
    fn store_outcome_call(
        &self,
        id: &RecordId,
        state: &'static str,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        retention: Retention,
    ) -> String {
        let keep = millis(retention.response);
        format!(
            "SELECT {function}({id}, '{state}', {version}::smallint, {fp}, {status}::smallint, {fields}, {body}, \
                 {keep}, {forget})",
            function = self.store_function,
            id = bytea_literal(&id.to_hex()),
            version = fingerprint.version(),
            fp = bytea_literal(&fingerprint.to_hex()),
            status = response.status.as_u16(),
            fields = bytea_literal(&crate::hex::encode(&response.encode_fields())),
            body = bytea_literal(&crate::hex::encode(&response.body)),
            forget = keep.saturating_add(millis(retention.tombstone)),
        )
    }
}

/// A bytea literal of hex digits, for the simple-query protocol: an escape string, so that it
/// reads the same whatever `standard_conforming_strings` says, and a constant the parser takes
/// as it is (a `decode(..)` call would cost a function lookup on every statement).
fn bytea_literal(hex: &str) -> String {
    format!("E'\\\\x{hex}'::bytea")
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

/// The advisory lock key of an identity: the first eight bytes of its digest.
fn lock_key(id: &RecordId) -> i64 {
    let (first, _) = id.digest().split_first_chunk::<8>().expect("a 32-byte digest");
    i64::from_be_bytes(*first)
}

fn unavailable(error: sqlx::Error) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned())
}

/// The bounded wait on a concurrent claimant ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";

/// Serialization failures and deadlocks: the claim may simply be tried again.
fn is_retryable(error: &sqlx::Error) -> bool {
    matches!(sqlstate(error).as_deref(), Some(SERIALIZATION_FAILURE | DEADLOCK_DETECTED))
}

/// Rolls back a connection whose claim statement failed, so it goes back to the pool clean; a
/// connection that cannot even do that is closed instead.
async fn roll_back_failed_claim(mut conn: PoolConnection<Postgres>) {
    if sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.is_err() {
        conn.close_on_drop();
    }
}

/// Rolls back a connection whose claim failed and reads the record, in one round trip; the
/// connection then goes back to the pool clean.
async fn rollback_and_read(mut conn: PoolConnection<Postgres>, read: &str) -> Result<Option<RecordRow>, StoreError> {
    let rows = sqlx::raw_sql(AssertSqlSafe(format!("ROLLBACK; {read}"))).fetch_all(&mut *conn).await;
    match rows {
        Ok(rows) => rows.first().map(record_row).transpose(),
        Err(error) => {
            // The connection's state is unknown: do not give it back to the pool.
            conn.close_on_drop();
            Err(unavailable(error))
        }
    }
}
