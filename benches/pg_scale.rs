//! The PostgreSQL store with millions of records in its table (issue 16; `docs/scale.md` draws its
//! plan for 3 billion rows from this benchmark's numbers).
//!
//! In a database of its own (created at the start, dropped at the end, also after a panic is
//! printed), two atomic stores: `small`, whose table holds only what the benchmark itself
//! writes, and `big`, whose table is filled by SQL (`INSERT ... SELECT generate_series`, not
//! through the layer) to `PG_SCALE_ROWS` records (default 10 million): SHA-256 identities and
//! fingerprints, a 300-byte stored body and the two headers of a created order, the labels the
//! store writes with every record (operation, scope digest of one of 1000 tenants, operation
//! id), in three groups:
//!
//! - 70% live records (`completed`, replayable);
//! - 10% records past their response retention (the purge turns them into tombstones);
//! - 20% tombstones past their time (the purge deletes them: enough for the paced rounds).
//!
//! It then measures, printing each figure as it goes:
//!
//! 1. **bytes per record on disk**: heap + indexes + TOAST of the records that carry an answer,
//!    and what a tombstone adds;
//! 2. **claim and replay latency** through the store (`Store::begin` and, for a new key,
//!    `Claim::finish` with the 300-byte answer; a replay is `begin` on a completed key), with
//!    `CLIENTS` concurrent clients, on `big` against `small`, in rounds whose order alternates,
//!    p50 and p99 per round and their ratios (median and range), then the log a claim writes;
//! 3. **the purge alone**: batches of 500 (the recovery worker's default) back to back for a
//!    second, then of 5,000 for two (a tenth of the fill's records at most, so that the paced
//!    purge below still has records to delete on a small fill), with nothing else running:
//!    records a second, and
//!    PostgreSQL's CPU per purged record (the backends of the benchmark's database,
//!    `support/pg_cpu.rs`), which says how much of the database's CPU a purge at the aim's rate
//!    takes from serving. Then the purge on `small`, where nothing is due: PostgreSQL's CPU a
//!    call (on partitions, the probes that look into every partition);
//! 4. **purge throughput while serving**: the same claims as traffic, windows without a purge
//!    against windows with a task calling `Store::purge(batch)` back to back, for each batch
//!    size: records purged per second, and the serving throughput with the purge over the one
//!    without (the window before it), and the whole server's CPU in each (`support/pg_cpu.rs`);
//!    first with the purge paced at the aim's rate by the recovery worker
//!    (`RecoveryWorker::purge_rate(50_000)`, calls of 5,000: one every 100 ms) in
//!    `PACED_ROUNDS` rounds whose two windows alternate in order (median and range of the
//!    ratios), then flat out, then paced again in rounds (by then making tombstones);
//! 5. **making tombstones against its floor** (`support/purge_cost.rs`): the purge alone, the
//!    bare UPDATE alone, CPU a record of each, then that floor paced at the aim's rate while serving.
//!
//! Run with `cargo bench --bench pg_scale --all-features` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server). `PG_SCALE_ROWS` chooses fewer records for a quick run.
//! `PG_SCALE_PARTITIONS=n` runs the same measurement with both tables hash partitioned into `n`
//! partitions (`PostgresStore::hash_partitions`), sizes summed over the partitions, so that one
//! table and partitions can be compared run against run. `PG_SCALE_LAYOUT=apart` runs it with
//! both stores' answers apart (`PostgresStore::answers_apart`): the fill writes the answers into
//! `big_answers`, sizes include that table, a tombstone is a record whose answer the purge
//! deleted, and the fill's groups are 35 % live, 45 % past their response retention and 20 %
//! deletable (the purge gets through the second group much faster, and the last paced rounds
//! and the tombstones alone need some left). The two may be set together: partitions with their
//! answers apart. `PG_SCALE_PLAN_CACHE_MODE=force_generic_plan` runs every statement on connections
//! that set PostgreSQL's `plan_cache_mode` (`docs/scale.md`, "What partitions cost a request").
//! Not run by CI.

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/meter.rs"]
mod meter;
#[path = "support/pg_cpu.rs"]
mod pg_cpu;
#[path = "support/purge_cost.rs"]
mod purge_cost;
#[path = "support/purge_serving.rs"]
mod purge_serving;
#[path = "support/ratios.rs"]
mod ratios;
#[path = "support/scale_fill.rs"]
mod scale_fill;
#[path = "support/stored_answer.rs"]
mod stored_answer;
#[path = "support/table_size.rs"]
mod table_size;
#[path = "support/wal.rs"]
mod wal;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bench_db::BenchDatabase;
use ratios::ratio_line;
use scale_fill::{Groups, OPERATION};
use sqlx::PgPool;
use stored_answer::answer;
use tower_idempotency::{
    Begin, BeginRequest, Claim, CouplingMode, Fingerprint, IdempotencyKey, Outcome, PostgresStore, RecordId, Scope,
    Store,
};

const DEFAULT_ROWS: u64 = 10_000_000;
const CLIENTS: usize = 8;
const POOL: u32 = 24;
/// One latency window.
const WINDOW: Duration = Duration::from_secs(3);
const ROUNDS: usize = 3;

/// Latencies of one window, sorted, and how long the window ran.
struct Window {
    latencies: Vec<Duration>,
    elapsed: Duration,
    /// The whole PostgreSQL server's CPU over the window, in cores (purge windows only).
    server_cores: Option<f64>,
}

impl Window {
    fn quantile(&self, q: f64) -> Duration {
        self.latencies[((self.latencies.len() as f64 * q) as usize).min(self.latencies.len() - 1)]
    }

    fn throughput(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }
}

/// What the clients do.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Work {
    /// New keys: `begin` then `finish` with the answer.
    Claim,
    /// `begin` on keys this store completed earlier (the first `REPLAY_KEYS` of its claims).
    Replay,
}

const REPLAY_KEYS: u64 = 1_000;
/// The scope every claim carries (its operation is the fill's, `scale_fill::OPERATION`), as a
/// route's under an authentication layer's scope does.
const SCOPE: &str = "scale";

/// A store and the count of keys its clients have used.
struct Target {
    name: &'static str,
    store: PostgresStore,
    next: Arc<AtomicU64>,
}

impl Target {
    fn id(&self, n: u64) -> RecordId {
        RecordId::new(&Scope::new(SCOPE), OPERATION, &IdempotencyKey::new(format!("{}-{n}", self.name)).unwrap())
    }

    async fn run(&self, work: Work, window: Duration) -> Window {
        let deadline = Instant::now() + window;
        let started = Instant::now();
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            let (store, next, name) = (self.store.clone(), self.next.clone(), self.name);
            clients.push(tokio::spawn(async move {
                let fingerprint = Fingerprint::from_parts(tower_idempotency::fingerprint::FINGERPRINT_VERSION, [7; 32]);
                let scope = Scope::new(SCOPE);
                let target = Target { name, store, next: next.clone() };
                let mut latencies = Vec::new();
                let mut replay = 0u64;
                while Instant::now() < deadline {
                    let n = match work {
                        Work::Claim => next.fetch_add(1, Ordering::Relaxed),
                        Work::Replay => {
                            replay += 1;
                            replay % REPLAY_KEYS
                        }
                    };
                    let id = target.id(n);
                    let started = Instant::now();
                    let request = BeginRequest::new(&id, &fingerprint).labels(&scope, OPERATION);
                    let begun = target.store.begin(request).await.expect("begin");
                    match (work, begun) {
                        (Work::Claim, Begin::Claimed(claim)) => {
                            claim.finish(Outcome::Complete(answer())).await.expect("finish");
                        }
                        (Work::Replay, Begin::Existing(record)) => assert!(record.response.is_some(), "a replay"),
                        (work, other) => panic!("{name}: unexpected answer from the store to {work:?}: {other:?}"),
                    }
                    latencies.push(started.elapsed());
                }
                latencies
            }));
        }
        let mut latencies = Vec::new();
        for client in clients {
            latencies.extend(client.await.expect("client"));
        }
        latencies.sort_unstable();
        Window { latencies, elapsed: started.elapsed(), server_cores: None }
    }
}

/// A row as the store writes it (one labelled record with the answer, through `store`) against
/// one the fill wrote: the sizes above are the store's only if they are equal.
async fn row_sizes(pool: &PgPool, store: &PostgresStore) {
    let scope = Scope::new(SCOPE);
    let id = RecordId::new(&scope, OPERATION, &IdempotencyKey::new("row-size-probe").unwrap());
    let fingerprint = Fingerprint::from_parts(tower_idempotency::fingerprint::FINGERPRINT_VERSION, [7; 32]);
    let request = BeginRequest::new(&id, &fingerprint).labels(&scope, OPERATION);
    let Begin::Claimed(claim) = store.begin(request).await.expect("begin") else { panic!("a new key") };
    claim.finish(Outcome::Complete(answer())).await.expect("finish");
    let stored: i32 = sqlx::query_scalar("SELECT pg_column_size(b.*) FROM big b WHERE record_id = $1")
        .bind(id.digest().to_vec())
        .fetch_one(pool)
        .await
        .unwrap();
    // The fill's first row (g = 0) carries an answer.
    let filled: i32 =
        sqlx::query_scalar("SELECT pg_column_size(b.*) FROM big b WHERE record_id = sha256(int8send(0::bigint))")
            .fetch_one(pool)
            .await
            .unwrap();
    println!("  a record with its answer: {stored} bytes as the store writes it, {filled} as the fill did");
    assert_eq!(stored, filled, "the fill must write records as the store does");
}

fn main() {
    let rows: u64 = std::env::var("PG_SCALE_ROWS").ok().and_then(|r| r.parse().ok()).unwrap_or(DEFAULT_ROWS);
    let partitions: Option<u16> =
        std::env::var("PG_SCALE_PARTITIONS").ok().map(|n| n.parse().expect("PG_SCALE_PARTITIONS: a partition count"));
    let apart = match std::env::var("PG_SCALE_LAYOUT").as_deref() {
        Ok("apart") => true,
        Ok("one") | Err(_) => false,
        Ok(other) => panic!("PG_SCALE_LAYOUT: `one` (the default) or `apart`, not {other:?}"),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let database = BenchDatabase::create("tidem_scale", POOL).await;
        let pool = match std::env::var("PG_SCALE_PLAN_CACHE_MODE") {
            Ok(mode) => {
                println!("plan_cache_mode: {mode} (PG_SCALE_PLAN_CACHE_MODE)");
                database.pool_with_plan_cache_mode(&mode, POOL).await
            }
            Err(_) => database.pool.clone(),
        };
        let cpu = pg_cpu::PgCpu::of_database(database.name()).await;
        database.run_to_end(measure(pool, rows, partitions, apart, cpu)).await;
    });
}

async fn measure(pool: PgPool, rows: u64, partitions: Option<u16>, apart: bool, cpu: pg_cpu::PgCpu) {
    let layout = |store: PostgresStore| {
        let store = match partitions {
            Some(n) => store.hash_partitions(n).expect("PG_SCALE_PARTITIONS: 2 to 1024"),
            None => store,
        };
        if apart { store.answers_apart() } else { store }
    };
    let small = layout(PostgresStore::new(pool.clone()).table("small").unwrap().mode(CouplingMode::Atomic));
    let big = layout(PostgresStore::new(pool.clone()).table("big").unwrap().mode(CouplingMode::Atomic));
    small.migrate().await.expect("migrate small");
    big.migrate().await.expect("migrate big");
    match (partitions, apart) {
        (Some(n), false) => println!("layout: both tables hash partitioned into {n} partitions"),
        (Some(n), true) => println!("layout: both tables hash partitioned into {n} partitions, answers apart"),
        (None, true) => println!("layout: one table each, answers apart (PG_SCALE_LAYOUT=apart)"),
        (None, false) => println!("layout: one table each (PG_SCALE_PARTITIONS and PG_SCALE_LAYOUT unset)"),
    }
    println!("filling `big` to {rows} records ...");
    let started = Instant::now();
    let groups = Groups {
        live: rows * if apart { 35 } else { 70 } / 100,
        stale: rows * if apart { 45 } else { 10 } / 100,
        kept_tombstones: 0,
    };
    let answered = groups.answered();
    let answered_bytes = scale_fill::fill(&pool, rows, groups, apart).await;
    table_size::vacuum(&pool).await;
    let bytes = table_size::total_bytes(&pool).await;
    println!("filled {rows} records in {:.0?}; {} bytes per record with tombstones", started.elapsed(), bytes / rows);
    table_size::print_sizes(&pool, rows).await;
    row_sizes(&pool, &big).await;
    if let Some(per_tombstone) = bytes.saturating_sub(answered_bytes).checked_div(rows - answered) {
        println!("  a tombstone adds about {per_tombstone} bytes");
    }

    let targets = [
        Target { name: "small", store: small, next: Arc::new(AtomicU64::new(0)) },
        Target { name: "big", store: big.clone(), next: Arc::new(AtomicU64::new(0)) },
    ];
    // Warm-up: the replayed keys, and the connections' statement caches.
    for target in &targets {
        while target.next.load(Ordering::Relaxed) < REPLAY_KEYS {
            target.run(Work::Claim, Duration::from_secs(1)).await;
        }
        target.run(Work::Replay, Duration::from_millis(300)).await;
    }

    println!(
        "\nclaim (begin + finish, new key) and replay (begin, completed key), {CLIENTS} clients, {ROUNDS} rounds of {WINDOW:?}"
    );
    let mut ratios: [Vec<f64>; 4] = Default::default();
    for round in 0..ROUNDS {
        for work in [Work::Claim, Work::Replay] {
            let order: Vec<&Target> =
                if round % 2 == 0 { targets.iter().collect() } else { targets.iter().rev().collect() };
            let mut windows = Vec::new();
            for target in order {
                let window = target.run(work, WINDOW).await;
                let what = if work == Work::Claim { "claim " } else { "replay" };
                println!(
                    "  round {round} {what} {:<5} p50 {:>8.2?} p99 {:>8.2?} {:>7.0}/s",
                    target.name,
                    window.quantile(0.5),
                    window.quantile(0.99),
                    window.throughput()
                );
                windows.push((target.name, window));
            }
            let (small, big) = match (&windows[0], &windows[1]) {
                ((name, first), (_, second)) if *name == "small" => (first, second),
                ((_, first), (_, second)) => (second, first),
            };
            let base = if work == Work::Claim { 0 } else { 2 };
            ratios[base].push(big.quantile(0.5).as_secs_f64() / small.quantile(0.5).as_secs_f64());
            ratios[base + 1].push(big.quantile(0.99).as_secs_f64() / small.quantile(0.99).as_secs_f64());
        }
    }
    let [claim50, claim99, replay50, replay99] = ratios;
    println!("{rows} records / empty table (aim <= 1.2x):");
    ratio_line("  claim  p50", claim50);
    ratio_line("  claim  p99", claim99);
    ratio_line("  replay p50", replay50);
    ratio_line("  replay p99", replay99);

    claim_log(&targets, &pool).await;
    purge_cost::purge_alone(&big, &pool, &cpu, rows).await;
    purge_cost::purge_idle(&targets[0].store, &pool, &cpu).await;

    purge_serving::measure(&targets[1], &pool, &cpu, partitions.is_some()).await;
}

/// The log a claim writes on each table: claims for a window from a fresh checkpoint (as the
/// purge's measures start), the server's log bytes over the window divided by the claims.
async fn claim_log(targets: &[Target], pool: &PgPool) {
    println!("\nlog written a claim, {CLIENTS} clients, {WINDOW:?} from a fresh checkpoint:");
    for target in targets {
        wal::checkpoint(pool).await;
        let before = wal::wal_position(pool).await;
        let claims = target.run(Work::Claim, WINDOW).await.latencies.len() as i64;
        let bytes = wal::wal_position(pool).await - before;
        println!("  {:<5} {:>6} bytes a claim ({claims} claims)", target.name, bytes / claims.max(1));
    }
}
