//! [`SqliteStore`] (feature `sqlite`): records in a SQLite table, in atomic or leased mode.
//!
//! - **Atomic** (the default): [`Store::begin`](crate::store::Store::begin) opens a write transaction (`BEGIN IMMEDIATE`),
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
//! **An exhausted pool** (every connection held, say by requests whose handlers are still
//! running) does not stretch the bounded wait: every connection the store takes on a request's
//! behalf is taken by the request's deadline, the in-flight wait (at least 1 s), not the pool's
//! own acquire timeout; after it, the request is answered 503 `idempotency_store_unavailable`
//! ([`StoreError::Unavailable`](crate::store::StoreError::Unavailable)) and nothing ran. A leased
//! claim's outcome and release wait for a connection until the claim's lease runs out.
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
//! out no token ([`Claim::fencing_token`](crate::store::Claim::fencing_token) is `None`: the transaction fences the handler) and
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

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr, Sqlite, Transaction};
use tokio::time::Instant;

use self::gates::{Gate, Gates};
use super::claim::{self, Held, sql_store_surface};
use super::dialect::{Bound, Dialect, bind_and_decode, run_bound_statements};
use super::leased::LeasedClaim;
use super::statements::Statements;
use super::tx::TxHandle;
use super::{Records, begin_by, check_identifier, migrator, millis, unavailable};
use crate::key::RecordId;
use crate::name::InvalidName;
use crate::record::RecordState;
use crate::store::{Begin, BeginRequest, CouplingMode, FinishError, Outcome, Retention, StoreError};

mod gates;
#[cfg(test)]
mod plans;

const MIGRATION_0001: &str = include_str!("../../../../migrations/sqlite/0001_create_records.sql");
const MIGRATION_0002: &str = include_str!("../../../../migrations/sqlite/0002_deployment_secret.sql");
const MIGRATION_0003: &str = include_str!("../../../../migrations/sqlite/0003_record_lifecycle.sql");

/// The savepoint taken right after the claim, so a stored failure can roll the handler's
/// writes back and keep the claim.
const CLAIM_SAVEPOINT: &str = "SAVEPOINT tower_idempotency_claim";
const ROLLBACK_TO_CLAIM: &str = "ROLLBACK TO SAVEPOINT tower_idempotency_claim";

/// How long a duplicate turned away by the in-process gate is told to wait.
const GATE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// SQLite's SQL: `?n` parameters, "now" bound as unix milliseconds (SQLite has no
/// timestamptz, and one value per statement keeps its comparisons consistent), fencing tokens
/// from a counter row.
#[derive(Debug, Clone, Copy)]
struct Lite;

bind_and_decode!(Sqlite, SqliteRow);

impl Dialect for Lite {
    type Db = Sqlite;

    const SIGIL: &'static str = "?";

    const FALSE: &'static str = "0";

    // No BATCH_LOCK: SQLite has no SKIP LOCKED, nor needs it, as the purge holds the write lock
    // for one statement.

    fn now_value() -> Option<i64> {
        Some(now_ms())
    }

    fn millis_until(column: &str, now: &str) -> String {
        format!("{column} - {now}")
    }

    fn epoch_ms(column: &str) -> String {
        column.into()
    }

    const LEAST: &'static str = "MIN";

    fn plus_ms(now: &str, ms: &str) -> String {
        format!("{now} + ({ms})")
    }

    // `json_each` over the array; `unhex` turns the digests back into bytes.
    fn shadow_rows() -> String {
        "(SELECT unhex(e.value ->> '$[0]') AS id, e.value ->> '$[1]' AS state, e.value ->> '$[2]' AS version, \
                 unhex(e.value ->> '$[3]') AS fingerprint, e.value ->> '$[4]' AS status, \
                 e.value ->> '$[5]' AS keep_ms, e.value ->> '$[6]' AS forget_ms, X'' AS empty \
          FROM json_each(?1) AS e)"
            .into()
    }

    /// A busy write lock means the write never ran.
    fn never_ran(error: &sqlx::Error) -> bool {
        is_busy(error)
    }

    run_bound_statements!(Sqlite);
}

/// A SQLite-backed [`Store`](crate::store::Store).
#[derive(Clone)]
pub struct SqliteStore {
    records: Records<Lite>,
    table: Arc<str>,
    /// Draws the next fencing token. Run in the claim's write transaction, so tokens follow
    /// the order in which claims take the write lock.
    next_token: SqlStr,
    gates: Arc<Gates>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = self.records.mode;
        f.debug_struct("SqliteStore").field("mode", &mode).field("table", &self.table).finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// An atomic-mode store over `pool`, table `idempotency_records`.
    pub fn new(pool: SqlitePool) -> Self {
        Self::build(pool, CouplingMode::Atomic, "idempotency_records")
    }

    /// The table's name (its counter table is `<table>_fencing`).
    pub fn table(self, table: &str) -> Result<Self, InvalidName> {
        check_identifier(table, "a table name")?;
        Ok(Self::build(self.records.pool, self.records.mode, table))
    }

    /// Creates or upgrades the table, the fencing counter and the indexes, and the deployment
    /// secret. Safe to run
    /// concurrently and repeatedly; its history is kept in `_<table>_migrations`, apart from the
    /// application's own sqlx migrations.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let table = &self.table;
        let sql = [MIGRATION_0001, MIGRATION_0002, MIGRATION_0003].map(|sql| sql.replace("{table}", table));
        let migrator = migrator(sql, Vec::new(), format!("\"_{table}_migrations\""));
        // sqlx takes no lock for SQLite migrations. Running the whole migrator inside one
        // write transaction makes concurrent migrate() calls (processes starting together)
        // queue on the write lock: the second one finds the first one's history. The
        // migrator's own transaction nests as a savepoint.
        let mut tx = self.records.pool.begin_with("BEGIN IMMEDIATE").await?;
        migrator.run(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    fn build(pool: SqlitePool, mode: CouplingMode, table: &str) -> Self {
        let qualified = format!("\"{table}\"");
        let statements = Statements::new(&qualified, "(record_id)", Lite::param);
        let next_token = format!("UPDATE \"{table}_fencing\" SET last = last + 1 WHERE id = 1 RETURNING last");
        Self {
            records: Records { pool, mode, statements: Arc::new(statements) },
            table: table.into(),
            next_token: AssertSqlSafe(next_token).into_sql_str(),
            gates: Arc::default(),
        }
    }

    /// The secret the second migration drew ([`Store::deployment_secret`](crate::store::Store::deployment_secret)).
    async fn read_deployment_secret(&self) -> Result<Option<[u8; 32]>, StoreError> {
        super::deployment::sqlite(&self.records.pool, &self.table).await
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
            if let Some(answer) = self.records.resolve_existing(request, deadline, None).await? {
                return Ok(answer);
            }
            let mut tx =
                begin_by(&self.records.pool, "BEGIN IMMEDIATE".into_sql_str(), deadline).await.map_err(unavailable)?;
            match self.claim_in(&mut tx, request, None).await {
                Ok(Some(token)) => {
                    sqlx::raw_sql(CLAIM_SAVEPOINT).execute(&mut *tx).await.map_err(unavailable)?;
                    let claim = AtomicClaim {
                        records: self.records.clone(),
                        id: *request.id,
                        token,
                        retention: request.retention,
                        handle: Some(TxHandle::new(tx)),
                        gate: Some(gate),
                    };
                    return Ok(Begin::Claimed(SqliteClaim(Held::Atomic(claim))));
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
            if let Some(answer) = self.records.resolve_existing(request, deadline, None).await? {
                return Ok(answer);
            }
            // The counter bump and the claim are one short write transaction.
            let mut tx =
                begin_by(&self.records.pool, "BEGIN IMMEDIATE".into_sql_str(), deadline).await.map_err(unavailable)?;
            match self.claim_in(&mut tx, request, Some(request.lease)).await {
                Ok(Some(token)) => {
                    tx.commit().await.map_err(unavailable)?;
                    let claim = LeasedClaim::new(&self.records, request, token);
                    return Ok(Begin::Claimed(SqliteClaim(Held::Leased(claim))));
                }
                Ok(None) => drop(tx.rollback().await),
                Err(error) => {
                    drop(tx.rollback().await);
                    return Err(error);
                }
            }
        }
    }

    /// Draws a fencing token and claims the identity in `tx`, with a lease of `lease` (`None`
    /// for an atomic claim). `None`: a committed record is in the way (the rollback the caller
    /// does also gives the token back; it was never issued).
    async fn claim_in(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        request: &BeginRequest<'_>,
        lease: Option<Duration>,
    ) -> Result<Option<i64>, StoreError> {
        let next_token = Bound::new(&self.next_token, Vec::new(), None);
        let token = Lite::fetch_token(&mut **tx, next_token).await.map_err(unavailable)?;
        let token = token.ok_or_else(|| StoreError::Corrupt("the fencing counter row is missing".into()))?;
        let claim = self.records.statements.claim(request, lease, Some(token));
        let claimed = Lite::fetch_token(&mut **tx, claim).await.map_err(unavailable)?;
        Ok(claimed.map(|_| token))
    }
}

/// A claim on a [`SqliteStore`] record: a live write transaction (atomic) or a lease (leased).
#[derive(Debug)]
pub struct SqliteClaim(Held<AtomicClaim, Lite>);

sql_store_surface!(SqliteStore, SqlitePool, SqliteClaim, Sqlite, "BEGIN IMMEDIATE");

/// An atomic claim: the write transaction the handler writes in, holding the claim's row and
/// the identity's gate.
#[derive(Debug)]
struct AtomicClaim {
    records: Records<Lite>,
    id: RecordId,
    /// The token the claim's row carries; never handed out (the transaction fences).
    token: i64,
    retention: Retention,
    /// The transaction, until the claim is finished.
    handle: Option<TxHandle<Sqlite>>,
    /// This process's duplicates queue on it until the claim is finished.
    gate: Option<Gate>,
}

impl claim::AtomicClaim for AtomicClaim {
    type Db = Sqlite;

    fn handle(&self) -> Option<TxHandle<Sqlite>> {
        self.handle.clone()
    }

    async fn finish(mut self, outcome: Outcome) -> Result<(), FinishError> {
        let finished = self.store_and_commit(outcome).await;
        // The gate opens only now, after the COMMIT or rollback: a duplicate that gets through
        // it reads the outcome.
        drop(self.gate.take());
        finished
    }
}

impl AtomicClaim {
    async fn store_and_commit(&mut self, outcome: Outcome) -> Result<(), FinishError> {
        let Some((mut tx, state, response)) = claim::take_to_store(&mut self.handle, outcome).await? else {
            return Ok(());
        };
        if state == RecordState::Failed {
            // The handler's writes go back to the savepoint; the claim stays.
            let rollback = sqlx::raw_sql(ROLLBACK_TO_CLAIM).execute(&mut *tx).await;
            rollback.map_err(|e| FinishError::Store(unavailable(e)))?;
        }
        let finish = self.records.statements.finish(&self.id, self.token, state, &response, self.retention);
        match Lite::execute(&mut tx, finish).await {
            Ok(1) => {}
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
}

impl Drop for AtomicClaim {
    /// An unfinished claim's transaction rolls back (a handler that still locks the handle
    /// keeps it until it lets go).
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            drop(handle.try_take());
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

/// `SQLITE_BUSY` (and its extended codes) or `SQLITE_LOCKED`: the lock was not free in time.
fn is_busy(error: &sqlx::Error) -> bool {
    let code = error.as_database_error().and_then(|e| e.code()).and_then(|code| code.parse::<i32>().ok());
    matches!(code.map(|c| c & 0xff), Some(5 | 6))
}
