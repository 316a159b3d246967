//! PostgreSQL's work for an atomic request counted in instructions: the backend's side of each
//! transaction of `pg_claim_parts`, and of the store's own requests, run against a server of the
//! benchmark's own under `valgrind --tool=callgrind` (`support/callgrind_postgres.rs`).
//!
//! `pg_orders` and `pg_claim_parts` read PostgreSQL's CPU time, which on a shared 2-core machine
//! moves by a tenth between rounds, so a lever worth a few per cent cannot be seen in them. An
//! instruction count is the same on a quiet machine or a loaded one: this benchmark counts what
//! one transaction costs the backend that runs it, and prints the ratios issue 16's PostgreSQL
//! aims are stated in. It does not count the kernel's part (the socket's and the WAL's system
//! calls), nor the server's background processes (WAL writer, checkpointer), nor time spent
//! waiting; instructions are not cycles either (a cache miss costs many). It is the backends'
//! share of the CPU, counted the same way for every scenario.
//!
//! Each scenario runs on one connection, a fresh backend each time: a warm-up (its statements
//! prepared, the catalog cached, the store's choice of reading first settled), then `LOW` or
//! `HIGH` transactions; the connection closes and the backend's file gives its count. The
//! difference of the two counts divided by `HIGH - LOW` is one transaction, the backend's
//! start, warm-up and exit cancelling out. The scenarios are:
//!
//! - every part of `pg_claim_parts` (its module documentation says what each one sends);
//! - `no layer`: `BEGIN`, the order's INSERT, `COMMIT`: what `pg_orders`' handler sends
//!   without the layer;
//! - `store, new key`: a new key through `PostgresStore`'s atomic mode, as the layer drives it:
//!   `begin` (claiming first, as the store chooses when few requests find a record), the
//!   order written on the claim's `TxHandle`, `finish` with a 300-byte answer;
//! - `store, read first`: the same with `ReadBeforeClaim::Always`;
//! - `store, replay`: a retry of a finished request (the store reads first, as it chooses when
//!   retries are many), answered from the record;
//! - `store, leased`: a new key through `PostgresStore`'s leased mode: the claim committed at
//!   once, the order in a transaction of its own, the outcome written by a fenced update.
//!
//! Run with `cargo bench --features postgres --bench pg_instructions` (valgrind and PostgreSQL's
//! binaries must be installed; `callgrind_postgres.rs` says how the server is started). It
//! takes about ten minutes. `PG_INSTRUCTIONS_ONLY` names the scenarios to run, separated by
//! semicolons (`PG_INSTRUCTIONS_ONLY=store` runs the store's scenarios and the floors they are
//! compared with, the ratios' scenarios); `PG_INSTRUCTIONS_KEEP` keeps the server's callgrind
//! files (`support/callgrind_postgres.rs`); `PG_INSTRUCTIONS_SQL` is run once after the
//! migrations, to price a change of the schema (an index or a constraint dropped, say) before
//! it is made.

#[path = "support/callgrind_postgres.rs"]
mod callgrind_postgres;
#[path = "support/claim_parts.rs"]
mod claim_parts;
#[path = "support/stored_answer.rs"]
mod stored_answer;

use std::sync::atomic::{AtomicU64, Ordering};

use callgrind_postgres::CallgrindPostgres;
use claim_parts::{PARTS, Part, transaction};
use sqlx::{ConnectOptions, Connection, PgPool};
use tower_idempotency::fingerprint::FINGERPRINT_VERSION;
use tower_idempotency::store::postgres::ReadBeforeClaim;
use tower_idempotency::store::{Begin, BeginRequest, Claim, Outcome, Store};
use tower_idempotency::{CouplingMode, Fingerprint, IdempotencyKey, PostgresStore, RecordId, Scope};

/// Transactions before the count that matters: statements prepared, caches warm, and the
/// store's adaptive choice past its own warm-up of 32 requests.
const WARM_UP: u64 = 100;
/// The two transaction counts whose difference is measured.
const LOW: u64 = 200;
const HIGH: u64 = 600;

/// The benchmark's database on the server under valgrind.
const DATABASE: &str = "tidem_instructions";
const OPERATION: &str = "POST /orders";

/// What one scenario sends for one transaction.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Part(Part),
    NoLayer,
    StoreNewKey,
    StoreReadFirst,
    StoreReplay,
    StoreLeased,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Part(part) => part.name(),
            Scenario::NoLayer => "no layer",
            Scenario::StoreNewKey => "store, new key",
            Scenario::StoreReadFirst => "store, read first",
            Scenario::StoreReplay => "store, replay",
            Scenario::StoreLeased => "store, leased",
        }
    }
}

/// The identities of new keys, unique across every scenario and run.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Where a scenario's transactions go: the connection's pool, and the store on it.
struct Target {
    pool: PgPool,
    store: PostgresStore,
    scope: Scope,
    fingerprint: Fingerprint,
}

impl Target {
    fn new(pool: PgPool, scenario: Scenario) -> Self {
        let policy =
            if scenario == Scenario::StoreReadFirst { ReadBeforeClaim::Always } else { ReadBeforeClaim::Adaptive };
        let mode = if scenario == Scenario::StoreLeased { CouplingMode::Leased } else { CouplingMode::Atomic };
        Self {
            store: PostgresStore::new(pool.clone()).mode(mode).read_before_claim(policy),
            pool,
            scope: Scope::new("bench-account"),
            fingerprint: Fingerprint::from_parts(FINGERPRINT_VERSION, [7; 32]),
        }
    }

    fn id(&self, n: u64) -> RecordId {
        RecordId::new(&self.scope, OPERATION, &IdempotencyKey::new(format!("key-{n}")).expect("a key"))
    }

    /// A new key through the store, its order written on the claim's transaction (atomic) or in
    /// one of its own (leased).
    async fn store_new_key(&self, n: u64) {
        let id = self.id(n);
        let request = BeginRequest::new(&id, &self.fingerprint).labels(&self.scope, OPERATION);
        let Begin::Claimed(claim) = self.store.begin(request).await.expect("begin") else { panic!("a new key") };
        match claim.handle() {
            Some(handle) => {
                let mut conn = handle.acquire().await.expect("the claim's transaction");
                claim_parts::insert_order(&mut conn).await;
            }
            // Leased: the handler writes in a transaction of its own.
            None => self.no_layer().await,
        }
        claim.finish(Outcome::Complete(stored_answer::answer())).await.expect("finish");
    }

    /// A retry of the finished request `n`.
    async fn store_replay(&self, n: u64) {
        let id = self.id(n);
        let request = BeginRequest::new(&id, &self.fingerprint).labels(&self.scope, OPERATION);
        match self.store.begin(request).await.expect("begin") {
            Begin::Existing(record) => assert!(record.response.is_some(), "a replay"),
            _ => panic!("a finished request"),
        }
    }

    async fn no_layer(&self) {
        let mut tx = self.pool.begin().await.expect("begin");
        claim_parts::insert_order(&mut tx).await;
        tx.commit().await.expect("commit");
    }

    /// One transaction of `scenario`; `replays` are the finished requests a replay picks from.
    async fn transaction(&self, scenario: Scenario, replays: &[u64], i: u64) {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        match scenario {
            Scenario::Part(part) => transaction(&self.pool, part, n).await,
            Scenario::NoLayer => self.no_layer().await,
            Scenario::StoreNewKey | Scenario::StoreReadFirst | Scenario::StoreLeased => self.store_new_key(n).await,
            Scenario::StoreReplay => self.store_replay(replays[(i % replays.len() as u64) as usize]).await,
        }
    }
}

/// The instructions of one backend that ran `scenario`'s warm-up and then `count` transactions.
async fn backend_count(server: &CallgrindPostgres, scenario: Scenario, replays: &[u64], count: u64) -> u64 {
    let (pool, pid) = server.one_connection(DATABASE).await;
    let target = Target::new(pool, scenario);
    for i in 0..WARM_UP + count {
        target.transaction(scenario, replays, i).await;
    }
    target.pool.close().await;
    if callgrind_postgres::keeps_files() {
        println!("  {} x {count}: backend {pid} (cg.{pid})", scenario.name());
    }
    server.instructions_of(pid).await
}

/// Instructions per transaction of `scenario`.
async fn per_transaction(server: &CallgrindPostgres, scenario: Scenario, replays: &[u64]) -> f64 {
    let low = backend_count(server, scenario, replays, LOW).await;
    let high = backend_count(server, scenario, replays, HIGH).await;
    (high as f64 - low as f64) / (HIGH - LOW) as f64
}

fn main() {
    if let Err(missing) = CallgrindPostgres::available() {
        println!("pg_instructions: {missing}; nothing measured");
        return;
    }
    let only = std::env::var("PG_INSTRUCTIONS_ONLY").ok();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let server = CallgrindPostgres::start().await;
        let mut admin = server.options("postgres").connect().await.expect("connect");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}")))
            .execute(&mut admin)
            .await
            .expect("create the database");
        admin.close().await.expect("close");
        let (pool, _) = server.one_connection(DATABASE).await;
        claim_parts::create_tables(&pool).await;
        if let Ok(sql) = std::env::var("PG_INSTRUCTIONS_SQL") {
            println!("after the migrations: {sql} (PG_INSTRUCTIONS_SQL)");
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await.expect("PG_INSTRUCTIONS_SQL");
        }
        // The finished requests the replays retry.
        let setup = Target::new(pool, Scenario::StoreNewKey);
        let mut replays = Vec::new();
        for _ in 0..64 {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            setup.store_new_key(n).await;
            replays.push(n);
        }
        setup.pool.close().await;

        let ratios = [
            Scenario::NoLayer,
            Scenario::Part(Part::Floor),
            Scenario::Part(Part::FloorPreparedRead),
            Scenario::Part(Part::Atomic),
            Scenario::StoreNewKey,
            Scenario::StoreReadFirst,
            Scenario::StoreReplay,
            Scenario::StoreLeased,
        ];
        let every = ratios.into_iter().chain(PARTS.into_iter().map(Scenario::Part).filter(|s| !ratios.contains(s)));
        let scenarios: Vec<Scenario> = match only.as_deref() {
            None => every.collect(),
            Some("store") => ratios.to_vec(),
            Some(names) => every.filter(|s| names.split(';').any(|name| name.trim() == s.name())).collect(),
        };
        println!(
            "PostgreSQL instructions per transaction (one backend under callgrind; {HIGH} less {LOW} transactions, after {WARM_UP})"
        );
        let mut counts = Vec::new();
        for scenario in scenarios {
            let count = per_transaction(&server, scenario, &replays).await;
            println!("{:<24}{count:>12.0}", scenario.name());
            counts.push((scenario, count));
        }
        let of = |scenario: Scenario| counts.iter().find(|(s, _)| *s == scenario).map(|(_, c)| *c);
        for (a, b, what) in [
            (Scenario::StoreNewKey, Scenario::Part(Part::Floor), "a new key through the store / the floor (aim <= 1.15x)"),
            (Scenario::StoreNewKey, Scenario::Part(Part::FloorPreparedRead), "a new key through the store / the floor with a prepared read"),
            (Scenario::Part(Part::FloorPreparedRead), Scenario::Part(Part::Floor), "the floor with a prepared read / the floor"),
            (Scenario::Part(Part::Atomic), Scenario::Part(Part::Floor), "atomic's statements / the floor"),
            (Scenario::StoreReadFirst, Scenario::StoreNewKey, "reading first / claiming first, a new key"),
            (Scenario::StoreReplay, Scenario::NoLayer, "a replay / a new request without the layer (aim <= 0.5x)"),
            (Scenario::StoreLeased, Scenario::NoLayer, "a new key in leased mode / a new request without the layer"),
        ] {
            if let (Some(a), Some(b)) = (of(a), of(b)) {
                println!("{what}: {:.3}x", a / b);
            }
        }
        drop(server);
    });
}
