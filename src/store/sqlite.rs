//! [`SqliteStore`] (feature `sqlite`): records in a SQLite table, in atomic or leased mode.
//!
//! - **Atomic** (the default): [`Store::begin`] opens a write transaction (`BEGIN IMMEDIATE`),
//!   claims the identity in it and hands the transaction to the handler as a [`TxHandle`]. The
//!   handler's business writes, the stored response and the claim commit together, or not at
//!   all.
//! - **Leased**: the claim commits at once as `processing` with a lease and a fencing token;
//!   the outcome is written later by a fenced, state-checked update. For handlers that call the
//!   outside world, where one transaction cannot span the side effect.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
//! use tower_idempotency::{IdempotencyLayer, SqliteStore};
//!
//! let options = SqliteConnectOptions::new()
//!     .filename("app.db")
//!     .create_if_missing(true)
//!     // Readers (replays) never wait for the writer, and the writer never waits for readers.
//!     .journal_mode(SqliteJournalMode::Wal)
//!     // Survives an application crash; use `Full` if a commit must also survive power loss.
//!     .synchronous(SqliteSynchronous::Normal)
//!     // How long a claim waits for the database's single write lock (see below).
//!     .busy_timeout(Duration::from_secs(5))
//!     .foreign_keys(true);
//! let pool = SqlitePoolOptions::new().max_connections(16).connect_with(options).await?;
//! let store = SqliteStore::new(pool);
//! store.migrate().await?;
//! let layer = IdempotencyLayer::new(store);
//! # drop(layer); Ok(()) }
//! ```
//!
//! # SQLite's nature, and what the store makes of it
//!
//! **Writers serialise.** A SQLite database has one write lock. Every write of this store starts
//! with `BEGIN IMMEDIATE`, which takes the write lock up front, so two requests never deadlock by
//! both upgrading a read lock. In atomic mode the whole handler runs inside that write
//! transaction: while one request's handler runs, a claim for *any* other key waits for the
//! lock. That is the price of one transaction for claim, business write and response on SQLite;
//! keep atomic handlers short, or use leased mode, whose write transactions last a statement or
//! two. Replays and refusals do not wait: the committed record is read first, outside any write
//! transaction, and with WAL readers do not wait for the writer.
//!
//! Two consequences for atomic handlers: write through the [`TxHandle`] only (a write through
//! the pool waits for the write lock the handler's own transaction holds, until the busy timeout
//! fails it), and give the pool more connections than the writers you expect at once (each
//! running or queued claim holds one; replays need one for their read).
//!
//! **The write-lock wait is the connection's `busy_timeout`** (sqlx's default: 5 s). The store
//! does not change it: it is a property of the database and its load, not of one request, and
//! shortening it to the in-flight wait (2 s, or zero) would turn every burst of unrelated
//! requests into errors. When it runs out (`SQLITE_BUSY`), the writer holding the lock may be
//! serving any key, so the store cannot say "this key is in flight": it answers
//! [`StoreError::Unavailable`] (503 with `Retry-After`), and nothing was claimed.
//!
//! **Duplicates wait in process, bounded by the in-flight wait.** An atomic claim is an
//! uncommitted row, invisible to every other connection. So that a duplicate can still be told
//! apart from a busy database, a store (and its clones) keeps a gate per identity it is
//! claiming: a duplicate in the same process queues on that gate for at most
//! [`BeginRequest::wait`], then gets [`Begin::InFlight`]; when the holder commits, it reads the
//! committed record and replays. Once a request holds the gate and the write lock, no other
//! transaction holds an uncommitted claim on its identity, so any conflict the claim statement
//! meets is a committed row, read back and decided like any other. A duplicate in *another
//! process* (or from another `SqliteStore` built over the same table) cannot be seen: it waits
//! for the write lock like any writer, then replays, or gets [`StoreError::Unavailable`] if the
//! holder outlasts the busy timeout. Build one store per database and clone it.
//!
//! **Time** is INTEGER milliseconds since the Unix epoch, from the application's clock
//! (`SystemTime`, never allowed to go backwards within the process), bound as a parameter of each
//! statement. Several processes sharing a database file share the machine's clock; a clock step
//! moves leases and retention by the same amount.
//!
//! **Fencing tokens** come from a one-row counter table, `<table>_fencing` (SQLite has no
//! sequences), bumped in the claim's own write transaction, so tokens keep increasing after rows
//! are released or purged. A leased claim's bump commits with the claim. An atomic claim's bump
//! rolls back with it when it stores nothing; that is harmless, because an atomic claim hands
//! out no token ([`Claim::fencing_token`] is `None`: the transaction fences the handler) and
//! leaves no row, so no holder of that token can exist.
//!
//! **Leased waits** poll the record with backoff (10 ms doubling to 200 ms), never past the
//! in-flight wait.
//!
//! The table has no schema (SQLite's "schemas" are attached files); its name is configurable
//! with [`SqliteStore::table`]. [`SqliteStore::migrate`] creates it, the counter table and the
//! indexes, keeping its history in `_<table>_migrations`, apart from the application's own
//! `_sqlx_migrations`. The table is `STRICT`, so SQLite 3.37 or later is required (the bundled
//! SQLite of sqlx is newer).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use sqlx::sqlite::{SqliteArguments, SqlitePool, SqliteRow};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr, Sqlite, Transaction};
use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

pub use super::sql::InvalidIdentifier;
use super::sql::{self, RecordAccess, RecordRow, check_identifier, millis};
use super::{
    Begin, BeginRequest, Claim, CouplingMode, FinishError, Outcome, Retention, StaleLeasePolicy, Store, StoreError,
};
use crate::key::RecordId;
use crate::record::StoredResponse;
use crate::tx::TxHandle;

const MIGRATION_0001: &str = include_str!("../../migrations/sqlite/0001_create_records.sql");

/// The savepoint taken right after the claim, so a stored failure can roll the handler's
/// writes back and keep the claim.
const CLAIM_SAVEPOINT: &str = "SAVEPOINT tower_idempotency_claim";
const ROLLBACK_TO_CLAIM: &str = "ROLLBACK TO SAVEPOINT tower_idempotency_claim";

/// How long a duplicate turned away by the in-process gate is told to wait.
const GATE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A SQLite-backed [`Store`].
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    mode: CouplingMode,
    table: Arc<str>,
    sql: Arc<Statements>,
    gates: Arc<Gates>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("mode", &self.mode).field("table", &self.table).finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// An atomic-mode store over `pool`, table `idempotency_records`.
    pub fn new(pool: SqlitePool) -> Self {
        Self::build(pool, CouplingMode::Atomic, "idempotency_records")
    }

    /// The table's name (its counter table is `<table>_fencing`).
    pub fn table(self, table: &str) -> Result<Self, InvalidIdentifier> {
        check_identifier(table)?;
        Ok(Self::build(self.pool, self.mode, table))
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
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Creates or upgrades the table, the fencing counter and the indexes. Safe to run
    /// concurrently and repeatedly; its history is kept in `_<table>_migrations`, apart from the
    /// application's own sqlx migrations.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let sql = MIGRATION_0001.replace("{table}", &self.table);
        let migration = sqlx::migrate::Migration::new(
            1,
            "create idempotency records".into(),
            sqlx::migrate::MigrationType::Simple,
            AssertSqlSafe(sql).into_sql_str(),
            false,
        );
        let mut migrator = sqlx::migrate::Migrator::with_migrations(vec![migration]);
        migrator.dangerous_set_table_name(format!("\"_{}_migrations\"", self.table));
        // sqlx takes no lock for SQLite migrations. Running the whole migrator inside one
        // write transaction makes concurrent migrate() calls (processes starting together)
        // queue on the write lock: the second one finds the first one's history. The
        // migrator's own transaction nests as a savepoint.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        migrator.run(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    fn build(pool: SqlitePool, mode: CouplingMode, table: &str) -> Self {
        let sql = Arc::new(Statements::new(table));
        Self { pool, mode, table: table.into(), sql, gates: Arc::default() }
    }

    async fn begin_atomic(&self, request: &BeginRequest<'_>) -> Result<Begin<SqliteClaim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        // A duplicate of a claim this process holds queues here, bounded by the wait: the
        // holder's row is uncommitted, so the database cannot tell it apart from a busy writer.
        let Some(gate) = self.gates.enter(*request.id.digest(), deadline).await else {
            return Ok(Begin::InFlight { retry_after: GATE_RETRY_AFTER });
        };
        loop {
            // The committed record first, without the write lock: replays and refusals never
            // queue behind another request's handler.
            if let Some(answer) = sql::settle(self, request, deadline, None).await? {
                return Ok(answer);
            }
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(unavailable)?;
            match self.claim_in(&mut tx, request, None).await {
                Ok(Some(token)) => {
                    sqlx::raw_sql(CLAIM_SAVEPOINT).execute(&mut *tx).await.map_err(unavailable)?;
                    let handle = TxHandle::new(tx);
                    return Ok(Begin::Claimed(SqliteClaim::new(self, request, token, Some(handle), Some(gate))));
                }
                // A row committed between the read and the write lock (another process): read
                // it again. Holding the write lock, it cannot be anyone's uncommitted claim.
                Ok(None) => drop(tx.rollback().await),
                Err(error) => {
                    drop(tx.rollback().await);
                    return Err(error);
                }
            }
        }
    }

    async fn begin_leased(&self, request: &BeginRequest<'_>) -> Result<Begin<SqliteClaim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        loop {
            if let Some(answer) = sql::settle(self, request, deadline, None).await? {
                return Ok(answer);
            }
            // The counter bump and the claim are one short write transaction.
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(unavailable)?;
            let lease_until = now_ms().saturating_add(millis(request.lease));
            match self.claim_in(&mut tx, request, Some(lease_until)).await {
                Ok(Some(token)) => {
                    tx.commit().await.map_err(unavailable)?;
                    return Ok(Begin::Claimed(SqliteClaim::new(self, request, token, None, None)));
                }
                Ok(None) => drop(tx.rollback().await),
                Err(error) => {
                    drop(tx.rollback().await);
                    return Err(error);
                }
            }
        }
    }

    /// Draws a fencing token and claims the identity in `tx`. `None`: a committed record is in
    /// the way (the rollback the caller does also gives the token back; it was never issued).
    async fn claim_in(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        request: &BeginRequest<'_>,
        lease_until: Option<i64>,
    ) -> Result<Option<i64>, StoreError> {
        let token: Option<i64> =
            sqlx::query_scalar(self.sql.bump.clone()).fetch_optional(&mut **tx).await.map_err(unavailable)?;
        let token = token.ok_or_else(|| StoreError::Corrupt("the fencing counter row is missing".into()))?;
        let claimed = sqlx::query(self.sql.claim.clone())
            .bind(request.id.digest().to_vec())
            .bind(i64::from(request.fingerprint.version()))
            .bind(request.fingerprint.digest().to_vec())
            .bind(token)
            .bind(lease_until)
            .bind(now_ms())
            .bind(request.stale_lease == StaleLeasePolicy::Reexecute)
            .fetch_optional(&mut **tx)
            .await
            .map_err(unavailable)?;
        Ok(claimed.map(|_| token))
    }
}

impl RecordAccess for SqliteStore {
    async fn read(&self, id: &RecordId) -> Result<Option<RecordRow>, StoreError> {
        let row = sqlx::query(self.sql.read.clone())
            .bind(id.digest().to_vec())
            .bind(now_ms())
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        row.as_ref().map(record_row).transpose()
    }

    async fn mark_unknown(&self, id: &RecordId, token: i64) -> Result<bool, StoreError> {
        let marked = sqlx::query(self.sql.mark_unknown.clone())
            .bind(id.digest().to_vec())
            .bind(token)
            .bind(now_ms())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(marked.rows_affected() == 1)
    }
}

impl Store for SqliteStore {
    type Claim = SqliteClaim;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<SqliteClaim>, StoreError> {
        match self.mode {
            CouplingMode::Atomic => self.begin_atomic(&request).await,
            CouplingMode::Leased => self.begin_leased(&request).await,
        }
    }

    async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let now = now_ms();
        let forgotten = sqlx::query(self.sql.purge_forget.clone()).bind(now).bind(limit).execute(&self.pool).await;
        let forgotten = forgotten.map_err(unavailable)?.rows_affected();
        let left = limit.saturating_sub(i64::try_from(forgotten).unwrap_or(i64::MAX));
        let expired = sqlx::query(self.sql.purge_expire.clone()).bind(now).bind(left).execute(&self.pool).await;
        Ok((forgotten + expired.map_err(unavailable)?.rows_affected()) as usize)
    }
}

/// A claim on a [`SqliteStore`] record: a live write transaction (atomic) or a lease (leased).
#[derive(Debug)]
pub struct SqliteClaim {
    store: SqliteStore,
    id: RecordId,
    token: i64,
    retention: Retention,
    handle: Option<TxHandle<Sqlite>>,
    /// Atomic: this process's duplicates queue on it until the claim is settled.
    gate: Option<Gate>,
    settled: bool,
}

impl SqliteClaim {
    fn new(
        store: &SqliteStore,
        request: &BeginRequest<'_>,
        token: i64,
        handle: Option<TxHandle<Sqlite>>,
        gate: Option<Gate>,
    ) -> Self {
        Self {
            store: store.clone(),
            id: *request.id,
            token,
            retention: request.retention,
            handle,
            gate,
            settled: false,
        }
    }

    fn finish_query(
        &self,
        state: &'static str,
        response: &StoredResponse,
    ) -> sqlx::query::Query<'static, Sqlite, SqliteArguments> {
        let now = now_ms();
        let response_until = now.saturating_add(millis(self.retention.response));
        let forget_at = response_until.saturating_add(millis(self.retention.tombstone));
        sqlx::query(self.store.sql.finish.clone())
            .bind(self.id.digest().to_vec())
            .bind(self.token)
            .bind(state)
            .bind(i64::from(response.status.as_u16()))
            .bind(response.encode_fields())
            .bind(response.body.to_vec())
            .bind(response_until)
            .bind(forget_at)
            .bind(now)
    }

    async fn finish_atomic(&self, handle: &TxHandle<Sqlite>, outcome: Outcome) -> Result<(), FinishError> {
        let mut tx = handle.take_to_finish().await?;
        let (state, response) = match outcome {
            Outcome::Release => {
                tx.discard().await;
                return Ok(());
            }
            Outcome::Complete(response) => ("completed", response),
            Outcome::Reject(response) => {
                sqlx::raw_sql(ROLLBACK_TO_CLAIM)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| FinishError::Store(unavailable(e)))?;
                ("failed", response)
            }
        };
        let updated = self.finish_query(state, &response).execute(&mut *tx).await;
        match updated {
            Ok(done) if done.rows_affected() == 1 => {}
            Ok(_) => {
                tx.discard().await;
                return Err(FinishError::ClaimLost);
            }
            Err(error) => {
                tx.discard().await;
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
            Outcome::Reject(response) => self.finish_query("failed", &response).execute(&self.store.pool).await,
        };
        // A busy write lock means the update never ran.
        sql::fenced_write(done.map(|done| done.rows_affected()), is_busy)
    }
}

impl Claim for SqliteClaim {
    type Handle = TxHandle<Sqlite>;

    fn handle(&self) -> Option<TxHandle<Sqlite>> {
        self.handle.clone()
    }

    /// Leased claims only: an atomic claim is fenced by its transaction.
    fn fencing_token(&self) -> Option<u64> {
        (self.store.mode == CouplingMode::Leased).then_some(self.token as u64)
    }

    async fn finish(mut self, outcome: Outcome) -> Result<(), FinishError> {
        self.settled = true;
        let finished = match self.handle.take() {
            Some(handle) => self.finish_atomic(&handle, outcome).await,
            None => self.finish_leased(outcome).await,
        };
        // The gate (atomic) opens only now, after the COMMIT or rollback: a duplicate that gets
        // through it reads the outcome.
        drop(self.gate.take());
        finished
    }
}

impl Drop for SqliteClaim {
    /// Atomic: the transaction rolls back (a handler that still locks the handle keeps it
    /// until it lets go). Leased: the lease is given up at once (in the background), so the
    /// next retry applies the stale-lease policy without waiting it out.
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
            let _ = sqlx::query(sql).bind(id.digest().to_vec()).bind(token).bind(now_ms()).execute(&pool).await;
        });
    }
}

/// The identities this store's atomic claims hold in this process, each with a FIFO lock that
/// duplicates queue on.
#[derive(Debug, Default)]
struct Gates(Mutex<HashMap<[u8; 32], Arc<tokio::sync::Mutex<()>>>>);

impl Gates {
    /// Enters the gate of `key`, waiting until `deadline` at most (an open gate is entered
    /// even when the deadline has passed). `None`: still held by someone else.
    async fn enter(self: &Arc<Self>, key: [u8; 32], deadline: Instant) -> Option<Gate> {
        let lock = self.0.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_default().clone();
        let mut gate = Gate { gates: self.clone(), key, guard: None };
        // Dropping `gate` (on timeout or cancellation) tidies the map.
        gate.guard = tokio::time::timeout_at(deadline, lock.lock_owned()).await.ok();
        gate.guard.is_some().then_some(gate)
    }

    /// Forgets `key`'s gate once nobody holds or waits on it.
    fn tidy(&self, key: &[u8; 32]) {
        let mut gates = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if gates.get(key).is_some_and(|lock| Arc::strong_count(lock) == 1) {
            gates.remove(key);
        }
    }
}

/// A place in an identity's gate (held once `guard` is set).
struct Gate {
    gates: Arc<Gates>,
    key: [u8; 32],
    guard: Option<OwnedMutexGuard<()>>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("held", &self.guard.is_some()).finish_non_exhaustive()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.gates.tidy(&self.key);
    }
}

struct Statements {
    bump: SqlStr,
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
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        // Every statement takes "now" (unix milliseconds) as a parameter: SQLite has no
        // timestamptz, and one value per statement keeps its comparisons consistent.
        Self {
            // The next fencing token. Run in the claim's write transaction, so tokens follow the
            // order in which claims take the write lock.
            bump: sql(format!("UPDATE \"{table}_fencing\" SET last = last + 1 WHERE id = 1 RETURNING last")),
            // Claims a new identity, or takes over a forgotten record, or (when the route is
            // re-executable) a dead holder's lease on the same request. Any other existing row
            // returns nothing. Run holding the write lock: such a row is always committed.
            claim: sql(format!(
                "INSERT INTO {t} (record_id, state, fingerprint_version, fingerprint, fencing_token, lease_until, \
                                  created_at, updated_at) \
                 VALUES (?1, 'processing', ?2, ?3, ?4, ?5, ?6, ?6) \
                 ON CONFLICT (record_id) DO UPDATE SET \
                     state = 'processing', fingerprint_version = excluded.fingerprint_version, \
                     fingerprint = excluded.fingerprint, fencing_token = excluded.fencing_token, \
                     lease_until = excluded.lease_until, response_status = NULL, response_headers = NULL, \
                     response_body = NULL, response_until = NULL, forget_at = NULL, \
                     created_at = excluded.created_at, updated_at = excluded.updated_at \
                 WHERE {t}.forget_at <= ?6 \
                    OR (?7 AND {t}.state = 'processing' AND {t}.lease_until <= ?6 \
                        AND {t}.fingerprint = excluded.fingerprint) \
                 RETURNING fencing_token"
            )),
            // The time comparisons decide() needs, done against the bound "now".
            read: sql(format!(
                "SELECT state, fingerprint_version, fingerprint, fencing_token, \
                        lease_until - ?2, \
                        COALESCE(response_until <= ?2, 0), \
                        COALESCE(forget_at <= ?2, 0), \
                        response_status, response_headers, response_body \
                 FROM {t} WHERE record_id = ?1"
            )),
            mark_unknown: sql(format!(
                "UPDATE {t} SET state = 'unknown', updated_at = ?3 \
                 WHERE record_id = ?1 AND fencing_token = ?2 AND state = 'processing' AND lease_until <= ?3"
            )),
            // Fenced and state-checked: zero rows means the claim is no longer ours.
            finish: sql(format!(
                "UPDATE {t} SET state = ?3, response_status = ?4, response_headers = ?5, response_body = ?6, \
                     lease_until = NULL, response_until = ?7, forget_at = ?8, updated_at = ?9 \
                 WHERE record_id = ?1 AND fencing_token = ?2 AND state = 'processing'"
            )),
            release: sql(format!(
                "DELETE FROM {t} WHERE record_id = ?1 AND fencing_token = ?2 AND state = 'processing'"
            )),
            abandon: sql(format!(
                "UPDATE {t} SET lease_until = ?3, updated_at = ?3 \
                 WHERE record_id = ?1 AND fencing_token = ?2 AND state = 'processing'"
            )),
            // Bounded batches (SQLite has no SKIP LOCKED, nor needs it: the purge holds the
            // write lock for one statement).
            purge_forget: sql(format!(
                "DELETE FROM {t} WHERE record_id IN ( \
                     SELECT record_id FROM {t} WHERE forget_at <= ?1 LIMIT ?2)"
            )),
            purge_expire: sql(format!(
                "UPDATE {t} SET state = 'expired', response_status = NULL, response_headers = NULL, \
                     response_body = NULL, updated_at = ?1 \
                 WHERE record_id IN ( \
                     SELECT record_id FROM {t} WHERE state IN ('completed', 'failed') AND response_until <= ?1 \
                     LIMIT ?2)"
            )),
        }
    }
}

/// Now, in unix milliseconds, from the wall clock but never earlier than a value this process
/// has already used (a clock step back must not revive a lease or a response).
fn now_ms() -> i64 {
    static LAST: AtomicI64 = AtomicI64::new(0);
    let wall = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, millis);
    LAST.fetch_max(wall, Ordering::Relaxed).max(wall)
}

fn record_row(row: &SqliteRow) -> Result<RecordRow, StoreError> {
    let corrupt = |e: sqlx::Error| StoreError::Corrupt(e.to_string());
    let small = |value: i64, what: &str| {
        i16::try_from(value).map_err(|_| StoreError::Corrupt(format!("{what} {value} is out of range")))
    };
    let version: i64 = row.try_get(1).map_err(corrupt)?;
    let status: Option<i64> = row.try_get(7).map_err(corrupt)?;
    Ok(RecordRow {
        state: row.try_get(0).map_err(corrupt)?,
        fingerprint_version: small(version, "fingerprint version")?,
        fingerprint: row.try_get(2).map_err(corrupt)?,
        fencing_token: row.try_get(3).map_err(corrupt)?,
        lease_left_ms: row.try_get(4).map_err(corrupt)?,
        response_expired: row.try_get(5).map_err(corrupt)?,
        forgotten: row.try_get(6).map_err(corrupt)?,
        response_status: status.map(|s| small(s, "response status")).transpose()?,
        response_headers: row.try_get(8).map_err(corrupt)?,
        response_body: row.try_get(9).map_err(corrupt)?,
    })
}

fn unavailable(error: sqlx::Error) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

/// `SQLITE_BUSY` (and its extended codes) or `SQLITE_LOCKED`: the lock was not free in time.
fn is_busy(error: &sqlx::Error) -> bool {
    let code = error.as_database_error().and_then(|e| e.code()).and_then(|code| code.parse::<i32>().ok());
    matches!(code.map(|c| c & 0xff), Some(5 | 6))
}
