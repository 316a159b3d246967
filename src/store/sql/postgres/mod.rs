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
//! 2. On the same connection, `BEGIN` and migration 1's `<table>_claim` function in one round
//!    trip: a transaction-scoped advisory lock on the identity, taken at once when nobody holds
//!    it and otherwise waited for, at most the in-flight wait (`lock_timeout`, not a sleep
//!    loop), then a check that no record appeared meanwhile. A concurrent duplicate therefore
//!    waits for the first request's COMMIT or ROLLBACK, then sees its outcome. A record that
//!    the read found forgotten (or a dead lease, on a re-executable route) is deleted here,
//!    under the lock, in the same round trip.
//! 3. The handler's own statements, on the transaction's connection ([`TxHandle`](crate::tx::TxHandle)).
//! 4. The record, written once with its outcome by a prepared INSERT (parsed and planned once
//!    per connection, its values bound in binary), then `COMMIT`. Atomic mode never commits a
//!    `processing` row. The primary key decides here: if another record holds the identity, the
//!    INSERT fails, the COMMIT does not run and the business write rolls back. (Migrations 1 and
//!    3's `<table>_store` functions, which did this write in one round trip with the COMMIT, are
//!    no longer called: their call, a statement of literals parsed and planned on every request,
//!    cost PostgreSQL more than the round trip it saved. They stay for the binaries of a rolling
//!    upgrade.)
//!
//! Against a bare `BEGIN; INSERT; COMMIT` this costs two more round trips (the read and the
//! record's INSERT), a lock, an index probe and the record's row; `benches/pg_orders.rs`
//! measures what that comes to.
//!
//! **Step 1 is a choice** ([`PostgresStore::read_before_claim`], [`ReadBeforeClaim`]). The read
//! makes a retry cheap and costs a new key a statement and a round trip. When few requests find
//! a record (by default: fewer than a third of the store's recent atomic requests), the store
//! skips it and sends `BEGIN` with `<table>_claim_first` (migration 8, as migration 14 has it)
//! at once. That function tries the lock first: when it is free (most often), one look at the
//! record under it decides, refusing a live record and deleting what the read would have had
//! step 2 delete. When the lock is held, it refuses a live record before it waits (a probe of the
//! primary key, so that retries of one identity do not queue on each other's lock), then waits,
//! bounded, and looks again. A refused claim is rolled back and the record read in one round
//! trip, as after a lost wait; a claim whose wait runs out reads the record too, and answers from
//! it if there is one. In `pg_orders`, PostgreSQL's CPU for a new key was 0.85x to 1.02x that of
//! reading first over six runs (median 0.87x), each ratio from one run, with migration 8's
//! function (which looked before the lock and again under it: two probes for a new key);
//! in instructions (`benches/pg_instructions.rs`), migration 14's single look took 9% off a new
//! key.
//!
//! What is left over a bare write is the read: `pg_orders` also measures the floor (the handler
//! writing its answer's row itself) with a plain read of that row sent with `BEGIN`
//! (`floor+read`), and atomic mode took 0.99x, 1.06x and 1.09x its PostgreSQL CPU per request
//! in three runs: the lock and the function add at most a few percent beyond that read, within
//! the noise of those runs.
//!
//! `floor+prep` reads the row by a prepared statement after `BEGIN` instead, the cheapest read
//! sqlx can send: in four runs it took 1.11x to 1.17x the floor's PostgreSQL CPU per request
//! (per-round medians 1.08x to 1.16x) and made 0.88x to 0.92x its requests a second; atomic
//! mode took 1.12x and 1.23x the CPU of `floor+prep` in two of them. A claim must read the
//! identity's row, so the aim of 1.15x the floor's CPU is about what the cheapest read alone
//! costs here.
//!
//! `benches/pg_claim_parts.rs` takes those transactions apart, as plain sqlx transactions with
//! no layer and no HTTP (five runs, per-round medians). The floor's statements with the row read
//! first by a prepared statement, the cheapest read sqlx can send, took 1.17x to 1.27x the
//! floor's PostgreSQL CPU (the labels alone 1.01x to 1.09x); with the read sent with `BEGIN`,
//! as `floor+read` does, 1.36x to 1.44x; atomic mode's own statements 1.31x to 1.49x, and
//! 0.99x to 1.06x those of `floor+read`. A prepared read by primary key cost 26 to 35 µs over a
//! bare `BEGIN`/`COMMIT`, the same read parsed with `BEGIN` 56 to 73 µs, the claim function 54
//! to 65 µs. So no claim that reads the record can come within 1.15x of the floor here. Tried
//! against atomic mode's statements in the same runs, and not kept:
//!
//! - the claim function called by a prepared statement after a `BEGIN` of its own: 0.93x to
//!   1.02x;
//! - the lock's try sent with `BEGIN`, then the record read by a prepared statement (a claim
//!   with no function): 0.96x and 0.97x in two runs. Built into the store for a claim made
//!   first (the function called only when another session held the lock), it passed every
//!   PostgreSQL suite, and in two `pg_orders` runs took 0.88x and 0.87x the PostgreSQL CPU of
//!   reading first (per-round medians), where the function had taken 0.85x to 1.02x over six
//!   runs (median 0.87x); atomic / floor stayed at 1.31x and 1.28x. No gain, so not kept; a
//!   retry would also have cost a third round trip;
//! - a claim by the primary key's own wait (the record's row inserted first, the answer written
//!   over it at the end): 1.31x to 1.45x the floor, no better than the lock;
//! - the record's INSERT written as literals and sent with `COMMIT` (`INSERT ...; COMMIT;
//!   BEGIN`, the empty transaction's `ROLLBACK` queued for the pool's release check): in
//!   `pg_orders`, atomic mode's CPU per request rose from 1.01x to 1.27x that of `floor+read`
//!   (two runs minutes apart), the INSERT's parse and plan costing more than the round trip.
//!
//! Counted in instructions of the backend (`benches/pg_instructions.rs`, a server under
//! callgrind: the same count on a quiet machine or a loaded one), a new key took 450,378
//! before migrations 12 and 14 and 334,569 after (0.74x): 12 drops the table's two CHECK
//! constraints, which PostgreSQL 15 rebuilt from their text form for every INSERT and UPDATE,
//! and 14 has the claim try the lock first and look at the record once. In `pg_orders` that
//! took atomic mode's CPU per request from 2.52x and 2.54x that of no layer to 2.29x and 2.41x
//! (runs alternating the two builds). The first two claims above count fewer instructions than
//! today's (299,693 and 302,316 against 337,054 for the same statements), each for a round
//! trip more, which the count leaves out with the rest of the kernel's part.
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
//!
//! # Hash partitions
//!
//! For tables of hundreds of millions of records (`docs/scale.md`),
//! [`PostgresStore::hash_partitions`] has [`migrate`](PostgresStore::migrate) create the records
//! table `PARTITION BY HASH (record_id)` with `n` partitions, `<table>_p000` to
//! `<table>_p<n-1>`, so that vacuum, freezing and index rebuilds work on a partition at a time.
//!
//! - **Uniqueness stays global.** The primary key is `record_id`, which is the partition key:
//!   PostgreSQL enforces it in each partition, and an identity can only ever hash to one
//!   partition. The constraint keeps its name, `<table>_pkey`, on the partitioned table (the
//!   leased claim's `ON CONFLICT ON CONSTRAINT` names it); a violation names the partition's
//!   `<table>_pNNN_pkey`, which atomic mode recognises as the table's.
//! - **Every statement is the same**, on the partitioned table, except the purge: reads,
//!   claims, outcomes and settlements name `record_id`, so PostgreSQL prunes them to one
//!   partition. The purge walks the partitions with the one-table statements, one partition at a
//!   time, and only those that one probe of them all (each partition's first due entry, in one
//!   statement) finds rows due in: on the partitioned table, PostgreSQL would plan its batch as
//!   a join with a scan of every partition. The recovery batches (lease sweep, checkout of unknown records) stay one
//!   statement on the partitioned table, ordered across it; each record of their batch costs a
//!   probe of every partition's primary key.
//! - **The migration.** A partitioned store's migration 1 is `0001_create_records.sql` with its
//!   `CREATE TABLE` ending in `PARTITION BY HASH (record_id)`, and the partitions
//!   (`0001_hash_partition.sql`, once per remainder) created right after it; the rest of 0001,
//!   and migrations 2 and 3, run unchanged on the partitioned table (PostgreSQL creates each index
//!   on every partition, and on partitions added later). It is a variant of migration 1 rather
//!   than a migration of its own, because a table's layout is fixed when it is created:
//!   PostgreSQL cannot partition a table in place, so a later migration could only create a
//!   second table. The migration's checksum is that of the partitioned text, so the history
//!   itself tells the layouts apart, and before it runs anything `migrate` checks the table in
//!   the database: one that exists with another layout (one table, another count, another
//!   partitioning) is refused with a [`LayoutMismatch`], never silently kept. Moving a table
//!   to partitions means a new table (another [`table`](PostgresStore::table) name) and a copy.
//! - **The count is fixed** with the table: choose it for the size the table will reach (64 for
//!   the 3 billion records of `docs/scale.md`, about 47 million each).
//! - **Each statement is planned afresh** by PostgreSQL 15 on a partitioned table: the generic
//!   plan of a prepared statement, costed over every partition, never looks cheaper than one
//!   planned for its `record_id`, and planning (with the locks it takes on every partition)
//!   costs more than the statement. So a request costs the database more CPU on partitions than
//!   on one table, and more with more partitions (`benches/pg_partitions.rs`). Connections that
//!   set `plan_cache_mode = force_generic_plan` keep one plan per statement, which prunes to the
//!   partition when it runs: measured, that gives back most of a replay's price and part of a
//!   new request's (`docs/scale.md`, "What partitions cost a request"). The store does not set
//!   it, since it is the session's and applies to every statement on the pool, the
//!   application's own as well: set it on the store's pool where that suits them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
//! use tower_idempotency::store::postgres::PostgresStore;
//!
//! let options: PgConnectOptions = "postgres://postgres@127.0.0.1/app".parse()?;
//! // Every prepared statement of this pool planned once, pruned to its partition when it runs.
//! let options = options.options([("plan_cache_mode", "force_generic_plan")]);
//! let pool = PgPoolOptions::new().connect_with(options).await?;
//! let store = PostgresStore::new(pool).hash_partitions(16)?.answers_apart();
//! store.migrate().await?;
//! # Ok(()) }
//! ```
//!
//! # Answers apart
//!
//! With [`PostgresStore::answers_apart`], a record's answer (status, fields, body) is a row of
//! `<table>_answers`, numbered in the order answers are written and carrying the time its replay
//! ends; the record points at it (`answer_seq`) and takes that time as its response retention.
//! A record past that time is a tombstone by its time alone (every read compares it), so the
//! purge makes tombstones by deleting the answers that are due, through an index on that time,
//! and never rewrites a record and its index entries as an in-place tombstone does
//! (`docs/scale.md`, "Answers apart").
//!
//! - **The same**: uniqueness (the records table's primary key), the atomic and leased paths.
//!   The answer and the record are written by one statement, in the claim's transaction.
//! - **Different**: a read joins the record to its answer (two index probes instead of one);
//!   records past their tombstone time go through an index on `forget_at` over every record; a
//!   record whose answer is gone is a tombstone, whatever its time says.
//! - **The migration** (11, run only with `answers_apart`) adds the answers table, the
//!   record's `answer_seq` and the purge's indexes, and copies nothing: records written before
//!   keep their answers inline, replay from them and are made tombstones in place.
//! - **One way**: once migrated, every store on the table must say `answers_apart`
//!   (`migrate` refuses one that does not, with a [`LayoutMismatch`]; one that never migrates
//!   fails a request for a record written apart rather than replay an empty answer).
//! - **With [`hash_partitions`](PostgresStore::hash_partitions)** (in either order): the records
//!   partitioned, the answers one table beside them; migration 11 runs on the partitioned table
//!   as it is. Each partition's walk starts where its own last walk reached.

use std::sync::Arc;

use sqlx::Postgres;
use sqlx::postgres::{PgPool, PgRow};
use tokio::time::Instant;

mod atomic;
mod dialect;
mod partitions;
mod read_first;

pub use self::partitions::{InvalidPartitions, LayoutMismatch, MAX_PARTITIONS, MIN_PARTITIONS};
pub use self::read_first::ReadBeforeClaim;

use self::atomic::{AtomicClaim, AtomicStatements, is_retryable};
use self::dialect::Pg;
use self::partitions::Layout;
use self::read_first::ReadFirst;
use super::answers::Answers;
use super::claim::{Held, sql_store_surface};
use super::dialect::{Dialect, bind_and_decode};
use super::leased::LeasedClaim;
use super::statements::Statements;
use super::{Records, acquire_by, check_identifier, migrator, millis, unavailable};
use crate::name::InvalidName;
use crate::store::{Begin, BeginRequest, CouplingMode, StoreError};

const MIGRATION_0001: &str = include_str!("../../../../migrations/postgres/0001_create_records.sql");
const MIGRATION_0002: &str = include_str!("../../../../migrations/postgres/0002_deployment_secret.sql");
const MIGRATION_0003: &str = include_str!("../../../../migrations/postgres/0003_record_lifecycle.sql");
const MIGRATION_0006: &str = include_str!("../../../../migrations/postgres/0006_shadow_record.sql");
const MIGRATION_0007: &str = include_str!("../../../../migrations/postgres/0007_operation_id_hash.sql");
const MIGRATION_0008: &str = include_str!("../../../../migrations/postgres/0008_claim_first.sql");
const MIGRATION_0009: &str = include_str!("../../../../migrations/postgres/0009_compact_records.sql");
const MIGRATION_0010: &str = include_str!("../../../../migrations/postgres/0010_tombstone_forget_index.sql");
const MIGRATION_0011: &str = include_str!("../../../../migrations/postgres/0011_answers_apart.sql");
const MIGRATION_0012: &str = include_str!("../../../../migrations/postgres/0012_record_checks_dropped.sql");
const MIGRATION_0013: &str = include_str!("../../../../migrations/postgres/0013_answers_apart_check_dropped.sql");
const MIGRATION_0014: &str = include_str!("../../../../migrations/postgres/0014_claim_first_lock_first.sql");

bind_and_decode!(Postgres, PgRow);

/// A PostgreSQL-backed [`Store`](crate::store::Store).
#[derive(Clone)]
pub struct PostgresStore {
    records: Records<Pg>,
    schema: Arc<str>,
    table: Arc<str>,
    layout: Layout,
    atomic: Arc<AtomicStatements>,
    read_first: Arc<ReadFirst>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("mode", &self.records.mode)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("partitions", &self.layout.partitions())
            .field("read_before_claim", &self.read_first.policy())
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// An atomic-mode store over `pool`, in schema `public`, table `idempotency_records`.
    pub fn new(pool: PgPool) -> Self {
        Self::build(pool, CouplingMode::Atomic, "public", "idempotency_records", Layout::default())
    }

    /// The schema that holds the table (created by [`migrate`](Self::migrate) if missing).
    pub fn schema(self, schema: &str) -> Result<Self, InvalidName> {
        check_identifier(schema, "a schema name")?;
        Ok(self.rebuilt(schema, &self.table, self.layout))
    }

    /// The table's name.
    pub fn table(self, table: &str) -> Result<Self, InvalidName> {
        check_identifier(table, "a table name")?;
        Ok(self.rebuilt(&self.schema, table, self.layout))
    }

    /// The records table hash partitioned by `record_id` into `partitions` partitions
    /// ([`MIN_PARTITIONS`] to [`MAX_PARTITIONS`]), named `<table>_p000`, `<table>_p001`, ...
    /// (see [Hash partitions](self#hash-partitions)). [`migrate`](Self::migrate) creates the
    /// table so; it refuses a table that already exists with another layout, one table or
    /// another count ([`LayoutMismatch`]). Every store on the table must say the same count.
    /// It combines with [`answers_apart`](Self::answers_apart), in either order. Every
    /// statement costs the database more on partitions than on one table; connections that
    /// set `plan_cache_mode = force_generic_plan` give most of that back (see
    /// [Hash partitions](self#hash-partitions), with an example).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{IdempotencyLayer, store::postgres::PostgresStore};
    ///
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
    /// let store = PostgresStore::new(pool).schema("idempotency")?.hash_partitions(64)?;
    /// store.migrate().await?;
    /// let layer = IdempotencyLayer::new(store);
    /// # drop(layer); Ok(()) }
    /// ```
    pub fn hash_partitions(self, partitions: u16) -> Result<Self, InvalidPartitions> {
        let partitions = partitions::check_count(partitions)?;
        Ok(self.rebuilt(&self.schema, &self.table, self.layout.with_partitions(partitions)))
    }

    /// Keeps each record's answer in a table of its own, `<table>_answers`, so that a record
    /// past its response retention becomes a tombstone without being written (see
    /// [Answers apart](self#answers-apart)). [`migrate`](Self::migrate) adds it to a new or
    /// existing records table, one table or hash partitioned; from then on every store on the
    /// table must say so. It combines with [`hash_partitions`](Self::hash_partitions), in
    /// either order.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{IdempotencyLayer, store::postgres::PostgresStore};
    ///
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
    /// let store = PostgresStore::new(pool).schema("idempotency")?.answers_apart();
    /// store.migrate().await?;
    /// let layer = IdempotencyLayer::new(store);
    /// # drop(layer); Ok(()) }
    /// ```
    pub fn answers_apart(self) -> Self {
        self.rebuilt(&self.schema, &self.table, self.layout.with_answers_apart())
    }

    /// When an atomic claim reads the request's record first: [`ReadBeforeClaim::Adaptive`]
    /// (the default) decides from the requests the store has seen lately. Every choice keeps
    /// every guarantee; see [`ReadBeforeClaim`] for what each costs.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::postgres::{PostgresStore, ReadBeforeClaim};
    ///
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
    /// // An API whose clients rarely retry: every new key saves a statement and a round trip.
    /// let store = PostgresStore::new(pool).read_before_claim(ReadBeforeClaim::Never);
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn read_before_claim(mut self, policy: ReadBeforeClaim) -> Self {
        self.read_first = Arc::new(ReadFirst::new(policy));
        self
    }

    /// The store on another schema, table or layout, with the same pool, mode and choices.
    fn rebuilt(&self, schema: &str, table: &str, layout: Layout) -> Self {
        let store = Self::build(self.records.pool.clone(), self.records.mode, schema, table, layout);
        store.read_before_claim(self.read_first.policy())
    }

    /// Creates or upgrades the schema, table, sequence and indexes, and the deployment secret. Safe to run concurrently and
    /// repeatedly; its history is kept in `<schema>._<table>_migrations`, apart from the
    /// application's own sqlx migrations.
    ///
    /// If the table exists and is not laid out as the store is configured (one table or
    /// [`hash_partitions`](Self::hash_partitions) with the same count; its answers apart if it
    /// was migrated with [`answers_apart`](Self::answers_apart)), it changes nothing and
    /// fails with [`MigrateError::Source`](sqlx::migrate::MigrateError::Source) holding a
    /// [`LayoutMismatch`].
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let (schema, table) = (&self.schema, &self.table);
        partitions::check_layout(&self.records.pool, schema, table, self.layout).await?;
        let create_records = match self.layout.partitions() {
            0 => MIGRATION_0001.to_owned(),
            n => partitions::create_records(MIGRATION_0001, n),
        };
        let sql = [create_records.as_str(), MIGRATION_0002, MIGRATION_0003]
            .map(|sql| sql.replace("{schema}", schema).replace("{table}", table));
        let named = |sql: &str| sql.replace("{schema}", schema).replace("{table}", table);
        let mut later = vec![
            (6, "shadow record", named(MIGRATION_0006)),
            (7, "operation id hash index", named(MIGRATION_0007)),
            (8, "claim first", named(MIGRATION_0008)),
            (9, "compact records", named(MIGRATION_0009)),
            (10, "tombstone forget index", named(MIGRATION_0010)),
        ];
        if self.layout.answers_apart() {
            later.push((11, "answers apart", named(MIGRATION_0011)));
        }
        later.push((12, "record checks dropped", named(MIGRATION_0012)));
        if self.layout.answers_apart() {
            later.push((13, "answers apart check dropped", named(MIGRATION_0013)));
        }
        later.push((14, "claim first, lock first", named(MIGRATION_0014)));
        let mut migrator = migrator(sql, later, format!("\"{schema}\".\"_{table}_migrations\""));
        migrator.create_schema(format!("\"{schema}\""));
        migrator.run(&self.records.pool).await
    }

    /// The secret the second migration drew ([`Store::deployment_secret`](crate::store::Store::deployment_secret)).
    async fn read_deployment_secret(&self) -> Result<Option<[u8; 32]>, StoreError> {
        super::deployment::postgres(&self.records.pool, &self.schema, &self.table).await
    }

    fn build(pool: PgPool, mode: CouplingMode, schema: &str, table: &str, layout: Layout) -> Self {
        let qualified = format!("\"{schema}\".\"{table}\"");
        let conflict_target = format!("ON CONSTRAINT \"{table}_pkey\"");
        let sequence = format!("nextval('\"{schema}\".\"{table}_fencing_seq\"')");
        let partitions: Vec<String> = (0..layout.partitions())
            .map(|remainder| format!("\"{schema}\".\"{}\"", partitions::partition_name(table, remainder)))
            .collect();
        let answers = if layout.answers_apart() {
            Answers::Apart(format!("\"{schema}\".\"{table}_answers\""))
        } else {
            Answers::Inline
        };
        let statements = Statements::with_answers(&qualified, &conflict_target, |_| sequence.clone(), answers.clone())
            .with_partitions(&partitions);
        let atomic = AtomicStatements::new(schema, table, &statements.columns, &answers);
        let atomic = Arc::new(atomic.partitioned(layout.partitions()));
        let records = Records { pool, mode, statements: Arc::new(statements) };
        let read_first = Arc::new(ReadFirst::new(ReadBeforeClaim::default()));
        Self { records, schema: schema.into(), table: table.into(), layout, atomic, read_first }
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
