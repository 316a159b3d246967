//! [`PostgresStore`] (feature `postgres`): records in a PostgreSQL table, in atomic or leased
//! mode.
//!
//! - **Atomic** (the default): [`Store::begin`](crate::store::Store::begin) opens a transaction, claims the identity in it
//!   and hands the transaction to the handler as a [`TxHandle`](crate::tx::TxHandle). The handler's business writes,
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
//! 3. The handler's own statements, on the transaction's connection ([`TxHandle`](crate::tx::TxHandle)).
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
//! **An exhausted pool** (every connection held, say by requests whose handlers are still
//! running) does not stretch the bounded wait: every connection the store takes on a request's
//! behalf is taken by the request's deadline, the in-flight wait (at least 1 s), not the pool's
//! own acquire timeout; after it, the request is answered 503 `idempotency_store_unavailable`
//! ([`StoreError::Unavailable`](crate::store::StoreError::Unavailable)) and nothing ran. A leased
//! claim's outcome and release wait for a connection until the claim's lease runs out.
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

use sqlx::Postgres;
use sqlx::postgres::{PgPool, PgRow};
use tokio::time::Instant;

mod atomic;

use self::atomic::{AtomicClaim, AtomicStatements, is_retryable};
use super::claim::{Held, sql_store_surface};
use super::dialect::{Arg, Dialect, ShadowBatch, bind_and_decode, run_bound_statements};
use super::leased::LeasedClaim;
use super::statements::Statements;
use super::{Records, acquire_by, check_identifier, migrator, millis, unavailable};
use crate::name::InvalidName;
use crate::store::{Begin, BeginRequest, CouplingMode, StoreError};

const MIGRATION_0001: &str = include_str!("../../../../migrations/postgres/0001_create_records.sql");
const MIGRATION_0002: &str = include_str!("../../../../migrations/postgres/0002_deployment_secret.sql");
const MIGRATION_0003: &str = include_str!("../../../../migrations/postgres/0003_record_lifecycle.sql");

/// PostgreSQL's SQL: `$n` parameters, the database's `clock_timestamp()` for "now", times as
/// `timestamptz`, fencing tokens from a sequence.
#[derive(Debug, Clone, Copy)]
struct Pg;

impl Dialect for Pg {
    type Db = Postgres;

    const SIGIL: &'static str = "$";

    const FALSE: &'static str = "false";

    const BATCH_LOCK: &'static str = " FOR UPDATE SKIP LOCKED";

    fn now(_: usize) -> String {
        "clock_timestamp()".into()
    }

    fn later(n: usize) -> String {
        format!("clock_timestamp() + ${n}::float8 * interval '1 millisecond'")
    }

    fn later_arg(_: Option<i64>, after: Duration) -> Arg {
        Arg::Int(Some(millis(after)))
    }

    fn millis_until(column: &str, now: &str) -> String {
        format!("(EXTRACT(EPOCH FROM ({column} - {now})) * 1000)::bigint")
    }

    fn epoch_ms(column: &str) -> String {
        format!("(EXTRACT(EPOCH FROM {column}) * 1000)::bigint")
    }

    const LEAST: &'static str = "LEAST";

    const MATERIALIZED: &'static str = " MATERIALIZED";

    // An array of the picked ids, looked up on the primary key whatever the statistics say.
    const IN_PICKED: &'static str = "record_id = ANY(ARRAY(SELECT record_id FROM picked))";

    fn bigint(n: usize) -> String {
        format!("${n}::bigint")
    }

    fn plus_ms(now: &str, ms: &str) -> String {
        format!("{now} + ({ms}) * interval '1 millisecond'")
    }

    fn blob_literal(bytes: &[u8]) -> String {
        atomic::bytea_literal(&crate::hex::encode(bytes))
    }

    fn now_literal() -> String {
        "clock_timestamp()".into()
    }

    fn later_literal(ms: i64) -> String {
        format!("clock_timestamp() + {ms} * interval '1 millisecond'")
    }

    // An error aborts a PostgreSQL transaction: the shadow write goes in a savepoint, so that
    // its failure can be undone alone and the handler's writes still commit.
    fn shadow_batch(upsert: String) -> Option<ShadowBatch> {
        Some(ShadowBatch {
            sql: format!("SAVEPOINT tidem_shadow; {upsert}; RELEASE SAVEPOINT tidem_shadow; COMMIT; BEGIN"),
            undo: Some("ROLLBACK TO SAVEPOINT tidem_shadow"),
        })
    }

    run_bound_statements!(Postgres);
}

bind_and_decode!(Postgres, PgRow);

/// A PostgreSQL-backed [`Store`](crate::store::Store).
#[derive(Clone)]
pub struct PostgresStore {
    records: Records<Pg>,
    schema: Arc<str>,
    table: Arc<str>,
    atomic: Arc<AtomicStatements>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("mode", &self.records.mode)
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
    pub fn schema(self, schema: &str) -> Result<Self, InvalidName> {
        check_identifier(schema, "a schema name")?;
        Ok(Self::build(self.records.pool, self.records.mode, schema, &self.table))
    }

    /// The table's name.
    pub fn table(self, table: &str) -> Result<Self, InvalidName> {
        check_identifier(table, "a table name")?;
        Ok(Self::build(self.records.pool, self.records.mode, &self.schema, table))
    }

    /// Creates or upgrades the schema, table, sequence and indexes, and the deployment secret. Safe to run concurrently and
    /// repeatedly; its history is kept in `<schema>._<table>_migrations`, apart from the
    /// application's own sqlx migrations.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let (schema, table) = (&self.schema, &self.table);
        let sql = [MIGRATION_0001, MIGRATION_0002, MIGRATION_0003]
            .map(|sql| sql.replace("{schema}", schema).replace("{table}", table));
        let mut migrator = migrator(sql, format!("\"{schema}\".\"_{table}_migrations\""));
        migrator.create_schema(format!("\"{schema}\""));
        migrator.run(&self.records.pool).await
    }

    /// The secret the second migration drew ([`Store::deployment_secret`](crate::store::Store::deployment_secret)).
    async fn read_deployment_secret(&self) -> Result<Option<[u8; 32]>, StoreError> {
        super::deployment::postgres(&self.records.pool, &self.schema, &self.table).await
    }

    fn build(pool: PgPool, mode: CouplingMode, schema: &str, table: &str) -> Self {
        let qualified = format!("\"{schema}\".\"{table}\"");
        let conflict_target = format!("ON CONSTRAINT \"{table}_pkey\"");
        let sequence = format!("nextval('\"{schema}\".\"{table}_fencing_seq\"')");
        let statements = Statements::new(&qualified, &conflict_target, |_| sequence.clone());
        let atomic = Arc::new(AtomicStatements::new(schema, table, &statements.columns));
        let records = Records { pool, mode, statements: Arc::new(statements) };
        Self { records, schema: schema.into(), table: table.into(), atomic }
    }

    async fn begin_leased(&self, request: &BeginRequest<'_>) -> Result<Begin<PgClaim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        // As in atomic mode: a retry of a finished request costs one read and no write (the
        // claim statement would lock the existing row even when it changes nothing).
        if let Some(answer) = self.records.resolve_existing(request, deadline, None).await? {
            return Ok(answer);
        }
        loop {
            let claim = self.records.statements.claim(request, Some(request.lease), None);
            let claimed = match acquire_by(&self.records.pool, deadline).await {
                Ok(mut conn) => Pg::fetch_token(&mut conn, claim).await,
                Err(error) => Err(error),
            };
            match claimed {
                Ok(Some(token)) => {
                    let claim = LeasedClaim::new(&self.records, request, token);
                    return Ok(Begin::Claimed(PgClaim(Held::Leased(claim))));
                }
                Ok(None) => {}
                Err(error) if is_retryable(&error) && Instant::now() < deadline => continue,
                Err(error) => return Err(unavailable(error)),
            }
            if let Some(answer) = self.records.resolve_existing(request, deadline, None).await? {
                return Ok(answer);
            }
        }
    }
}

/// A claim on a [`PostgresStore`] record: a live transaction (atomic) or a lease (leased).
#[derive(Debug)]
pub struct PgClaim(Held<AtomicClaim, Pg>);

sql_store_surface!(PostgresStore, PgPool, PgClaim, Postgres, "BEGIN");
