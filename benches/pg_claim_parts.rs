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
#[path = "support/claim_parts.rs"]
mod claim_parts;
#[path = "support/pg_cpu.rs"]
mod pg_cpu;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bench_db::BenchDatabase;
use claim_parts::{PARTS, Part, transaction};
use pg_cpu::{CpuSpent, PgCpu};
use sqlx::PgPool;

const CONCURRENCY: usize = 8;
const WARM_UP: Duration = Duration::from_secs(1);
const WINDOW: Duration = Duration::from_secs(2);
const ROUNDS: usize = 5;

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
        claim_parts::create_tables(&pool).await;
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
