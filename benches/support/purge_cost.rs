//! What a purged record costs PostgreSQL, for `pg_scale` (issue 16's purge aim: 50,000 records
//! a second while serving, serving dropping at most 10 %).
//!
//! Four measures, each with nothing else running, each as records a second, PostgreSQL's CPU per
//! record (the backends of the benchmark's database, `pg_cpu.rs`) and the bytes of write-ahead
//! log per record (the whole server's):
//!
//! - [`purge_idle`]: `Store::purge` on a table with nothing due: its cost a call (per call, not
//!   per record);
//! - [`purge_alone`]: `Store::purge` while the fill's deletable tombstones are there (deletes),
//!   for one second in the recovery worker's default batch (500), then in batches of 5,000;
//! - [`tombstones_alone`]: `Store::purge` once they are gone, so every purged record is one made
//!   a tombstone (an UPDATE);
//! - [`floor_alone`]: the **floor** under making tombstones: the store's own UPDATE (the same
//!   columns set, the same table and indexes) on rows already found, named by their addresses
//!   (`ctid`), with no search, no ordering and no row lock taken before it. No purge can make a
//!   tombstone in place for less; the store's CPU over the floor's is what its pick costs. Run
//!   a second time with the log's full-page images compressed, and one batch explained by
//!   PostgreSQL (its buffers and log), to show where the floor's cost lies.
//!
//! Each measure starts on a fresh checkpoint: in a table far larger than one checkpoint cycle
//! touches, as at 3 billion records, nearly every page a record changes is a first touch.
//!
//! [`FloorTask`] runs the floor paced while claims are served, so that the serving drop at the
//! aim's rate can be read for the floor as for the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tower_idempotency::{PostgresStore, Store};

use crate::meter::{Meter, Spent};
use crate::pg_cpu::PgCpu;

/// How long each measure runs.
const ALONE: Duration = Duration::from_secs(2);
/// Records per statement: the purge's batch of the other measures.
pub const BATCH: usize = 5_000;
/// The recovery worker's batch unless told otherwise (`RecoveryWorker::batch`): on partitions,
/// each call of the purge pays its probe for this many records.
const WORKER_BATCH: usize = 500;
/// At most this many rows for [`floor_alone`] (it stops at [`ALONE`] if sooner).
const FLOOR_ALONE_ROWS: usize = 150_000;

/// The rows the floor turns into tombstones: records past their response retention that are not
/// tombstones yet, oldest first (the order the purge picks them), by address.
pub async fn stale_rows(pool: &PgPool, limit: usize) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT ctid::text FROM big WHERE state <> 'expired' AND response_until <= now() \
         ORDER BY response_until LIMIT $1",
    )
    .bind(limit as i64)
    .fetch_all(pool)
    .await
    .expect("stale rows")
}

/// The store's UPDATE that makes tombstones, on the rows at the addresses bound as `$1`.
const FLOOR_UPDATE: &str = "UPDATE big SET state = 'expired', response_status = NULL, response_headers = NULL, \
     response_body = NULL, updated_at = now() WHERE ctid = ANY($1::tid[])";

/// The floor's statement on one batch: the store's UPDATE, on the rows at `ctids`; with
/// `compressed`, in a transaction whose log compresses full-page images (`wal_compression =
/// lz4`, which a deployment can set for the whole server).
async fn expire(pool: &PgPool, ctids: &[String], compressed: bool) -> u64 {
    let update = sqlx::query(FLOOR_UPDATE).bind(ctids);
    let mut tx = pool.begin().await.expect("begin");
    if compressed {
        sqlx::raw_sql("SET LOCAL wal_compression = lz4").execute(&mut *tx).await.expect("wal_compression");
    }
    let expired = update.execute(&mut *tx).await.expect("floor update").rows_affected();
    tx.commit().await.expect("commit");
    expired
}

/// Records a second, µs of PostgreSQL CPU and bytes of log a record, printed as one line under
/// `label`; returns the CPU.
fn report(label: &str, spent: Spent) -> Option<f64> {
    let (records, elapsed, rate) = (spent.records, spent.elapsed, spent.per_second());
    let Some(per_record_us) = spent.cpu_us() else {
        println!("  {label}: {records} records in {elapsed:.1?} ({rate:.0}/s); no CPU reading");
        return None;
    };
    println!(
        "  {label}: {rate:>7.0} records/s ({records} in {elapsed:.1?}); PostgreSQL CPU {per_record_us:.1} µs and \
         {:.0} bytes of log a record; 50,000 a second takes {:.2} cores of the database",
        spent.wal(),
        per_record_us * 50_000.0 / 1e6,
    );
    Some(per_record_us)
}

/// `Store::purge` in batches of `batch` for up to `time`, and `most` records at most.
async fn purge_for(big: &PostgresStore, pool: &PgPool, cpu: &PgCpu, batch: usize, time: Duration, most: u64) -> Spent {
    let (meter, mut records) = (Meter::start(pool, cpu).await, 0u64);
    while meter.elapsed() < time && records < most {
        match big.purge(batch).await.expect("purge") {
            0 => break,
            n => records += n as u64,
        }
    }
    meter.stop(pool, cpu, records).await
}

/// How many calls [`purge_idle`] makes.
const IDLE_CALLS: u64 = 200;

/// `Store::purge` on a table with nothing due (`store`, the benchmark's `small`), nothing else
/// running: what each call of a recovery pass's purge costs PostgreSQL when it finds nothing,
/// and what it costs on top of the rows it purges when it does. On partitions that is the
/// probes (one statement that looks into every partition, for each step that walks them).
pub async fn purge_idle(store: &PostgresStore, pool: &PgPool, cpu: &PgCpu) {
    let meter = Meter::start(pool, cpu).await;
    for _ in 0..IDLE_CALLS {
        assert_eq!(store.purge(BATCH).await.expect("purge"), 0, "nothing due on this table");
    }
    let spent = meter.stop(pool, cpu, IDLE_CALLS).await;
    let per_call = spent.elapsed / IDLE_CALLS as u32;
    match spent.cpu_us() {
        Some(us) => println!(
            "  a purge that finds nothing due ({IDLE_CALLS} calls): PostgreSQL CPU {us:.0} µs a call ({per_call:.2?} each)"
        ),
        None => println!("  a purge that finds nothing due ({IDLE_CALLS} calls, {per_call:.2?} each); no CPU reading"),
    }
}

/// The purge with nothing else running, while the fill's deletable records are there: in all at
/// most a tenth of the fill's `rows`, so that the paced purge while serving still finds records
/// to delete afterwards (on a small fill the purge alone would otherwise take them all).
pub async fn purge_alone(big: &PostgresStore, pool: &PgPool, cpu: &PgCpu, rows: u64) {
    println!("\nthe purge alone (nothing else running):");
    let label = format!("store, deleting, batch {WORKER_BATCH} (the recovery worker's default)");
    report(&label, purge_for(big, pool, cpu, WORKER_BATCH, ALONE / 2, rows / 40).await);
    report(&format!("store, deleting, batch {BATCH}"), purge_for(big, pool, cpu, BATCH, ALONE, rows / 40 * 3).await);
}

/// The purge with nothing else running once nothing is left to delete: every record it purges
/// is made a tombstone (the line says so if some were deleted after all: then the figure mixes).
/// Returns the CPU a record, in µs.
pub async fn tombstones_alone(big: &PostgresStore, pool: &PgPool, cpu: &PgCpu) -> Option<f64> {
    let (rows_before, _) = count(pool).await;
    let spent = purge_for(big, pool, cpu, BATCH, ALONE, u64::MAX).await;
    let (rows_after, _) = count(pool).await;
    let label = match rows_before - rows_after {
        0 => "store, making tombstones".to_owned(),
        deleted => format!("store, making tombstones ({deleted} of them deleted)"),
    };
    report(&label, spent)
}

/// The floor with nothing else running: its UPDATE on batches of [`BATCH`] stale rows found
/// beforehand (the finding is not timed), for up to [`ALONE`], then one more batch explained.
/// Returns the CPU a record, in µs.
pub async fn floor_alone(pool: &PgPool, cpu: &PgCpu) -> Option<f64> {
    let mut plain_us = None;
    for compressed in [false, true] {
        let rows = stale_rows(pool, FLOOR_ALONE_ROWS).await;
        let (meter, mut records) = (Meter::start(pool, cpu).await, 0u64);
        for batch in rows.chunks(BATCH) {
            if meter.elapsed() >= ALONE {
                break;
            }
            records += expire(pool, batch, compressed).await;
        }
        let spent = meter.stop(pool, cpu, records).await;
        if compressed {
            report("floor, full-page images compressed (lz4)", spent);
        } else {
            plain_us = report("floor (the UPDATE alone, rows found beforehand)", spent);
        }
    }
    explain_floor_batch(pool).await;
    plain_us
}

/// Where one more floor batch's work goes: PostgreSQL's own account of it (`EXPLAIN (ANALYZE,
/// BUFFERS, WAL)`), the UPDATE node's lines: pages found in and read into shared buffers, pages
/// dirtied and written out, log records, full-page images and bytes.
async fn explain_floor_batch(pool: &PgPool) {
    let rows = stale_rows(pool, BATCH).await;
    let explain = format!("EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF) {FLOOR_UPDATE}");
    let plan: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(explain)).bind(&rows).fetch_all(pool).await.expect("explain the floor");
    println!("  one floor batch of {} records, as PostgreSQL accounts for it:", rows.len());
    // The first node's lines: the UPDATE itself, its buffers and its log.
    for line in plan.iter().take_while(|line| !line.trim_start().starts_with("->")) {
        println!("    {}", line.trim());
    }
}

/// The floor running as a task: a batch every `pace`, until stopped or out of rows.
pub struct FloorTask {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(u64, Duration)>,
}

impl FloorTask {
    /// Starts the floor on `rows` (from [`stale_rows`]), [`BATCH`] every `pace`.
    pub fn start(pool: PgPool, rows: Vec<String>, pace: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let (mut expired, started) = (0u64, Instant::now());
            let mut ticks = tokio::time::interval(pace);
            for batch in rows.chunks(BATCH) {
                ticks.tick().await;
                if stopped.load(Ordering::Relaxed) {
                    break;
                }
                expired += expire(&pool, batch, false).await;
            }
            (expired, started.elapsed())
        });
        Self { stop, task }
    }

    /// Stops the task; returns the records it made tombstones and for how long it ran.
    pub async fn stop(self) -> (u64, Duration) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("floor task")
    }
}

/// Records in `big`, and tombstones among them (with answers apart: every record of the fill
/// and of the claims has an answer until the purge deletes it, so the records less the answers).
pub async fn count(pool: &PgPool) -> (i64, i64) {
    let sql = if crate::table_size::answers_apart(pool).await {
        "SELECT count(*), count(*) - (SELECT count(*) FROM big_answers) FROM big"
    } else {
        "SELECT count(*), count(*) FILTER (WHERE state = 'expired') FROM big"
    };
    sqlx::query_as(sql).fetch_one(pool).await.unwrap()
}
