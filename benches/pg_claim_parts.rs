//! Where PostgreSQL's CPU for an atomic request goes: the statements the store and the
//! `pg_orders` floors send, piece by piece, as plain sqlx transactions with no layer, no HTTP
//! and no handler, so that only PostgreSQL's side of each piece is measured.
//!
//! `pg_orders` measures whole requests: atomic mode against the floor (the handler writing its
//! answer's row itself) and against `floor+read` (the floor with a read of that row sent with
//! `BEGIN`). This benchmark takes those transactions apart. Each transaction is one of:
//!
//! - `begin/commit`: `BEGIN`, then `COMMIT` (sqlx's `begin` and `commit`): the bare cost of a
//!   transaction and its two round trips, which every other part is compared with;
//! - `begin+select`: `BEGIN; SELECT 1` in one round trip (the simple-query protocol, as the
//!   store sends its claim), then `COMMIT`: what any statement with a result costs in `BEGIN`'s
//!   round trip, whatever it does;
//! - `begin+read`: `BEGIN` with a read of a record by primary key (`SELECT 1 ... WHERE
//!   record_id = <literal>`), as `floor+read` sends it;
//! - `prepared read`: `BEGIN`, then the same read as a prepared statement in a round trip of its
//!   own (parsed and planned once per connection), then `COMMIT`;
//! - `begin+claim`: `BEGIN` with migration 8's `<table>_claim_first`, exactly as the store
//!   sends it for a new key (probe, advisory lock, probe again);
//! - `prepared claim`: `BEGIN` in a round trip of its own, then the same function called by a
//!   prepared statement, its values bound: the function's call no longer parsed and planned
//!   on every request, for one more round trip;
//! - `floor`: `BEGIN`, the order's INSERT, the answer's row without labels (both prepared),
//!   `COMMIT`: the statements of `pg_orders`' floor;
//! - `floor+labels`: the floor, its row carrying the labels the store keeps (operation, scope
//!   digest, operation id, whose hash index the row then joins);
//! - `floor+read`: `begin+read`, the order, the row with its labels, `COMMIT`: the statements
//!   of `pg_orders`' `floor+read`;
//! - `floor+prepared read`: the same with the prepared read instead: the cheapest way sqlx has
//!   to read the row before writing it;
//! - `atomic`: `begin+claim`, the order, the record with its labels (the store's prepared
//!   INSERT), `COMMIT`: the statements atomic mode sends for a new key;
//! - `atomic, prepared claim`: the same with the prepared claim;
//! - `insert claim`: a claim by the primary key's own wait instead of a lock: `BEGIN`, the
//!   record's row inserted first (`ON CONFLICT DO NOTHING`, with its labels and a placeholder
//!   answer; a concurrent claimant of the identity would wait on the primary key), the order,
//!   then the answer written over the row (only columns no index covers, so the update can be
//!   HOT), `COMMIT`;
//! - `lock, prepared read`: a claim with no function: `BEGIN` with the advisory lock's try in
//!   one round trip, then the prepared read (at READ COMMITTED its snapshot is taken after the
//!   lock is held, so it sees a claimant that committed before), the order, the record with its
//!   labels, `COMMIT`. (When the try fails, a claim would go on to wait as the function does;
//!   here every identity is new and nobody holds its lock.)
//!
//! Every transaction uses a new identity. Each part gets a warm-up, then `ROUNDS` windows with
//! `CONCURRENCY` connections, the order rotated each round. It prints PostgreSQL's CPU per
//! transaction (the benchmark database's backends, `support/pg_cpu.rs`), what each piece adds
//! to `begin/commit` (per-round median and range), and the ratios of the whole transactions.
//!
//! Run with `cargo bench --bench pg_claim_parts --features postgres` (PostgreSQL must be
//! running on this machine; `DATABASE_URL` overrides the server; `PG_CLAIM_PARTS_ROUNDS` the
//! number of rounds, default 5).

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/pg_cpu.rs"]
mod pg_cpu;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bench_db::BenchDatabase;
use pg_cpu::{CpuSpent, PgCpu};
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, PgPool};
use tower_idempotency::{PostgresStore, Scope};

const CONCURRENCY: usize = 8;
const WARM_UP: Duration = Duration::from_secs(1);
const WINDOW: Duration = Duration::from_secs(2);
const ROUNDS: usize = 5;

/// The records table `PostgresStore::new` migrates, and its claim function.
const RECORDS: &str = "\"public\".\"idempotency_records\"";
const CLAIM_FIRST: &str = "\"public\".\"idempotency_records_claim_first\"";

/// The order every transaction writes (the body `pg_orders` posts).
const ORDER: &str = "{\"sku\":\"book-42\",\"quantity\":1,\"amount_minor\":129900,\"currency\":\"EUR\"}";

/// The pieces, in the order they are printed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    BeginCommit,
    BeginSelect,
    BeginRead,
    PreparedRead,
    BeginClaim,
    PreparedClaim,
    Floor,
    FloorLabels,
    FloorRead,
    FloorPreparedRead,
    Atomic,
    AtomicPreparedClaim,
    InsertClaim,
    LockThenRead,
}

const PARTS: [Part; 14] = [
    Part::BeginCommit,
    Part::BeginSelect,
    Part::BeginRead,
    Part::PreparedRead,
    Part::BeginClaim,
    Part::PreparedClaim,
    Part::Floor,
    Part::FloorLabels,
    Part::FloorRead,
    Part::FloorPreparedRead,
    Part::Atomic,
    Part::AtomicPreparedClaim,
    Part::InsertClaim,
    Part::LockThenRead,
];

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::BeginCommit => "begin/commit",
            Part::BeginSelect => "begin+select",
            Part::BeginRead => "begin+read",
            Part::PreparedRead => "prepared read",
            Part::BeginClaim => "begin+claim",
            Part::PreparedClaim => "prepared claim",
            Part::Floor => "floor",
            Part::FloorLabels => "floor+labels",
            Part::FloorRead => "floor+read",
            Part::FloorPreparedRead => "floor+prepared read",
            Part::Atomic => "atomic",
            Part::AtomicPreparedClaim => "atomic, prepared claim",
            Part::InsertClaim => "insert claim",
            Part::LockThenRead => "lock, prepared read",
        }
    }
}

/// One transaction's identity: a record id, and the values derived from it as the store
/// derives them.
struct Identity {
    record_id: [u8; 32],
    hex: String,
}

impl Identity {
    fn new(n: u64) -> Self {
        let record_id: [u8; 32] = Sha256::digest(format!("parts-{}-{n}", std::process::id())).into();
        let hex = record_id.iter().map(|byte| format!("{byte:02x}")).collect();
        Self { record_id, hex }
    }

    fn literal(&self) -> String {
        format!("E'\\\\x{}'::bytea", self.hex)
    }

    /// `BEGIN` with the store's claim of a new key (a 10 s wait, not re-executable).
    fn begin_and_claim(&self) -> String {
        let lock_key = i64::from_be_bytes(self.record_id[..8].try_into().expect("8 bytes"));
        let fingerprint = format!("E'\\\\x{}'::bytea", "ab".repeat(32));
        format!("BEGIN; SELECT {CLAIM_FIRST}({}, {lock_key}, 10000, {fingerprint}, false)", self.literal())
    }

    fn begin_and_read(&self) -> String {
        format!("BEGIN; SELECT 1 FROM {RECORDS} WHERE record_id = {}", self.literal())
    }
}

/// Which labels the answer's row carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Labels {
    /// None, as the floor writes it.
    None,
    /// All three, as the store writes them.
    All,
}

/// The answer's row, as the floor writes it (no labels) or as the store does (with labels).
async fn insert_record(conn: &mut sqlx::PgConnection, id: &Identity, labels: Labels) {
    let body = format!("{{\"order_id\":\"{}\",\"body\":{ORDER}}}", uuid::Uuid::new_v4());
    let headers = b"content-type: application/json\nlocation: /orders/0f8fad5b-d9cb-469f-a165-70867728950e".to_vec();
    let fingerprint = Sha256::digest(ORDER.as_bytes()).to_vec();
    let query = if labels != Labels::None {
        sqlx::query(
            "INSERT INTO \"public\".\"idempotency_records\" (record_id, state, fingerprint_version, fingerprint, \
                 fencing_token, response_status, response_headers, response_body, response_until, forget_at, \
                 operation, scope_digest, operation_id) \
             VALUES ($1, 'completed', 1, $2, 0, 201, $3, $4, clock_timestamp() + ($5) * interval '1 millisecond', \
                 clock_timestamp() + ($6) * interval '1 millisecond', $7, $8, $9)",
        )
        .bind(id.record_id.to_vec())
        .bind(fingerprint)
        .bind(headers)
        .bind(body.into_bytes())
        .bind(86_400_000_i64)
        .bind(172_800_000_i64)
        .bind("POST /orders")
        .bind(Scope::new("bench-account").digest().to_vec())
        .bind(id.record_id[..16].to_vec())
    } else {
        sqlx::query(
            "INSERT INTO \"public\".\"idempotency_records\" (record_id, state, fingerprint_version, fingerprint, \
                 fencing_token, response_status, response_headers, response_body, response_until, forget_at) \
             VALUES ($1, 'completed', 1, $2, 0, 201, $3, $4, clock_timestamp() + interval '1 day', \
                 clock_timestamp() + interval '2 days')",
        )
        .bind(id.record_id.to_vec())
        .bind(fingerprint)
        .bind(headers)
        .bind(body.into_bytes())
    };
    query.execute(conn).await.expect("insert the record");
}

/// The claim as the record's own row: inserted first, with its labels and a placeholder
/// answer (a concurrent claimant of the identity would wait on the primary key), and the answer
/// written over it at the end (only columns no index covers, so the update can be HOT).
async fn insert_claim(conn: &mut sqlx::PgConnection, id: &Identity) {
    let inserted = sqlx::query(
        "INSERT INTO \"public\".\"idempotency_records\" (record_id, state, fingerprint_version, fingerprint, \
             fencing_token, response_status, response_until, forget_at, operation, scope_digest, operation_id) \
         VALUES ($1, 'completed', 1, $2, 0, 0, clock_timestamp() + ($3) * interval '1 millisecond', \
             clock_timestamp() + ($4) * interval '1 millisecond', $5, $6, $7) \
         ON CONFLICT DO NOTHING",
    )
    .bind(id.record_id.to_vec())
    .bind(Sha256::digest(ORDER.as_bytes()).to_vec())
    .bind(86_400_000_i64)
    .bind(172_800_000_i64)
    .bind("POST /orders")
    .bind(Scope::new("bench-account").digest().to_vec())
    .bind(id.record_id[..16].to_vec())
    .execute(conn)
    .await
    .expect("claim by insert");
    assert_eq!(inserted.rows_affected(), 1, "a new identity");
}

async fn update_answer(conn: &mut sqlx::PgConnection, id: &Identity) {
    let body = format!("{{\"order_id\":\"{}\",\"body\":{ORDER}}}", uuid::Uuid::new_v4());
    sqlx::query(
        "UPDATE \"public\".\"idempotency_records\" SET response_status = 201, response_headers = $2, \
             response_body = $3 WHERE record_id = $1",
    )
    .bind(id.record_id.to_vec())
    .bind(b"content-type: application/json\nlocation: /orders/0f8fad5b-d9cb-469f-a165-70867728950e".to_vec())
    .bind(body.into_bytes())
    .execute(conn)
    .await
    .expect("write the answer");
}

async fn insert_order(conn: &mut sqlx::PgConnection) {
    sqlx::query("INSERT INTO bench_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(ORDER)
        .execute(conn)
        .await
        .expect("insert the order");
}

async fn prepared_claim(conn: &mut sqlx::PgConnection, id: &Identity) {
    let lock_key = i64::from_be_bytes(id.record_id[..8].try_into().expect("8 bytes"));
    sqlx::query(AssertSqlSafe(format!("SELECT {CLAIM_FIRST}($1, $2, $3, $4, $5)")))
        .bind(id.record_id.to_vec())
        .bind(lock_key)
        .bind(10_000_i32)
        .bind(vec![0xab_u8; 32])
        .bind(false)
        .execute(conn)
        .await
        .expect("claim");
}

async fn prepared_read(conn: &mut sqlx::PgConnection, id: &Identity) {
    let found = sqlx::query("SELECT 1 FROM \"public\".\"idempotency_records\" WHERE record_id = $1")
        .bind(id.record_id.to_vec())
        .fetch_optional(conn)
        .await
        .expect("read");
    assert!(found.is_none(), "every transaction is a new identity");
}

/// `statement` (which begins the transaction) in one round trip; it must find no record.
async fn simple(conn: &mut sqlx::PgConnection, statement: String) {
    let rows = sqlx::raw_sql(AssertSqlSafe(statement)).fetch_all(conn).await.expect("begin");
    assert!(rows.len() <= 1, "a new identity");
}

async fn commit(conn: &mut sqlx::PgConnection) {
    sqlx::raw_sql("COMMIT").execute(conn).await.expect("commit");
}

/// One transaction of `part`, for identity `n`.
async fn transaction(pool: &PgPool, part: Part, n: u64) {
    let id = Identity::new(n);
    match part {
        Part::BeginCommit
        | Part::PreparedRead
        | Part::Floor
        | Part::FloorLabels
        | Part::FloorPreparedRead
        | Part::PreparedClaim
        | Part::AtomicPreparedClaim
        | Part::InsertClaim => {
            let mut tx = pool.begin().await.expect("begin");
            if part == Part::InsertClaim {
                insert_claim(&mut tx, &id).await;
                insert_order(&mut tx).await;
                update_answer(&mut tx, &id).await;
            }
            if matches!(part, Part::PreparedClaim | Part::AtomicPreparedClaim) {
                prepared_claim(&mut tx, &id).await;
            }
            if matches!(part, Part::PreparedRead | Part::FloorPreparedRead) {
                prepared_read(&mut tx, &id).await;
            }
            let labels = match part {
                Part::Floor => Some(Labels::None),
                Part::FloorLabels | Part::FloorPreparedRead | Part::AtomicPreparedClaim => Some(Labels::All),
                _ => None,
            };
            if let Some(labels) = labels {
                insert_order(&mut tx).await;
                insert_record(&mut tx, &id, labels).await;
            }
            tx.commit().await.expect("commit");
        }
        Part::BeginSelect
        | Part::BeginRead
        | Part::BeginClaim
        | Part::FloorRead
        | Part::Atomic
        | Part::LockThenRead => {
            let mut conn = pool.acquire().await.expect("a connection");
            let begin = match part {
                Part::BeginSelect => "BEGIN; SELECT 1".to_owned(),
                Part::BeginRead | Part::FloorRead => id.begin_and_read(),
                Part::LockThenRead => format!(
                    "BEGIN; SELECT pg_try_advisory_xact_lock({})",
                    i64::from_be_bytes(id.record_id[..8].try_into().expect("8 bytes"))
                ),
                _ => id.begin_and_claim(),
            };
            simple(&mut conn, begin).await;
            if part == Part::LockThenRead {
                prepared_read(&mut conn, &id).await;
            }
            if matches!(part, Part::FloorRead | Part::Atomic | Part::LockThenRead) {
                insert_order(&mut conn).await;
                insert_record(&mut conn, &id, Labels::All).await;
            }
            commit(&mut conn).await;
        }
    }
}

/// Runs `part` on `CONCURRENCY` connections for `window`; the transactions done.
async fn drive(pool: &PgPool, part: Part, counter: &Arc<AtomicU64>, window: Duration) -> u64 {
    let deadline = Instant::now() + window;
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (pool, counter) = (pool.clone(), counter.clone());
            tokio::spawn(async move {
                let mut done = 0;
                while Instant::now() < deadline {
                    transaction(&pool, part, counter.fetch_add(1, Ordering::Relaxed)).await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for worker in workers {
        total += worker.await.expect("a worker");
    }
    total
}

/// One window of one part.
struct Window {
    transactions: u64,
    elapsed: Duration,
    cpu: CpuSpent,
}

impl Window {
    /// Microseconds of the database's backends per transaction.
    fn cpu_us(&self) -> Option<f64> {
        self.cpu.database_ns.map(|ns| ns as f64 / 1000.0 / self.transactions as f64)
    }
}

fn median_and_range(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2], values[0], values[values.len() - 1])
}

/// Per-round values of `f` over the windows of two parts, by round.
fn per_round(windows: &[Vec<Window>], a: Part, b: Part, f: impl Fn(f64, f64) -> f64) -> Option<(f64, f64, f64)> {
    let index = |part: Part| PARTS.iter().position(|p| *p == part).expect("a part");
    let values = windows[index(a)]
        .iter()
        .zip(&windows[index(b)])
        .map(|(x, y)| Some(f(x.cpu_us()?, y.cpu_us()?)))
        .collect::<Option<Vec<f64>>>()?;
    Some(median_and_range(values))
}

fn main() {
    let rounds: usize = std::env::var("PG_CLAIM_PARTS_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(ROUNDS);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let database = BenchDatabase::create("tidem_parts", CONCURRENCY as u32).await;
        let pool = database.pool.clone();
        let cpu = PgCpu::of_database(database.name()).await;
        PostgresStore::new(pool.clone()).migrate().await.expect("migrate the records table");
        sqlx::raw_sql(
            "CREATE TABLE bench_orders (order_id text PRIMARY KEY, operation_id text NOT NULL, body text NOT NULL, \
             created_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&pool)
        .await
        .expect("create bench_orders");
        let counter = Arc::new(AtomicU64::new(0));
        for part in PARTS {
            drive(&pool, part, &counter, WARM_UP).await;
        }
        let mut windows: Vec<Vec<Window>> = PARTS.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            for i in 0..PARTS.len() {
                let at = (i + round) % PARTS.len();
                let before = cpu.sample().await;
                let started = Instant::now();
                let transactions = drive(&pool, PARTS[at], &counter, WINDOW).await;
                let elapsed = started.elapsed();
                let spent = before.until(&cpu.sample().await);
                windows[at].push(Window { transactions, elapsed, cpu: spent });
            }
        }
        report(&windows, rounds);
        database.drop().await;
    });
}

fn report(windows: &[Vec<Window>], rounds: usize) {
    println!(
        "PostgreSQL CPU per transaction (the benchmark database's backends), {CONCURRENCY} connections, \
         {rounds} rounds of {WINDOW:?} per part"
    );
    println!("{:<22}{:>10}{:>14}{:>26}", "part", "tx/s", "cpu/tx", "over begin/commit");
    for (part, runs) in PARTS.iter().zip(windows) {
        let transactions: u64 = runs.iter().map(|w| w.transactions).sum();
        let elapsed: Duration = runs.iter().map(|w| w.elapsed).sum();
        let mut spent = CpuSpent::default();
        for run in runs {
            spent += run.cpu;
        }
        let cpu = spent
            .database_ns
            .map_or_else(|| "n/a".to_owned(), |ns| format!("{:.1}us", ns as f64 / 1000.0 / transactions as f64));
        let over = per_round(windows, *part, Part::BeginCommit, |a, b| a - b)
            .map_or_else(|| "n/a".to_owned(), |(m, lo, hi)| format!("{m:+.1}us ({lo:+.1}..{hi:+.1})"));
        println!("{:<22}{:>10.0}{:>14}{:>26}", part.name(), transactions as f64 / elapsed.as_secs_f64(), cpu, over);
    }
    println!("CPU per transaction, per-round median and range:");
    for (a, b) in [
        (Part::Atomic, Part::Floor),
        (Part::FloorLabels, Part::Floor),
        (Part::FloorRead, Part::Floor),
        (Part::FloorRead, Part::FloorLabels),
        (Part::Atomic, Part::FloorLabels),
        (Part::Atomic, Part::FloorRead),
        (Part::FloorPreparedRead, Part::FloorRead),
        (Part::AtomicPreparedClaim, Part::Atomic),
        (Part::AtomicPreparedClaim, Part::Floor),
        (Part::InsertClaim, Part::Floor),
        (Part::LockThenRead, Part::Floor),
        (Part::LockThenRead, Part::Atomic),
        (Part::InsertClaim, Part::FloorLabels),
        (Part::FloorPreparedRead, Part::Floor),
    ] {
        if let Some((median, lo, hi)) = per_round(windows, a, b, |x, y| x / y) {
            println!("{} / {}: {median:.2}x ({lo:.2}x..{hi:.2}x)", a.name(), b.name());
        }
    }
}
