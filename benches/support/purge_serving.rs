//! The purge while claims are served, for `pg_scale` (issue 16's purge aim: 50,000 records a
//! second while serving, serving dropping at most 10 %).
//!
//! Each measure is a pair of windows of claims on `big`: one with a purge running, one without.
//! The purge is a task calling `Store::purge(batch)` back to back (flat out), or the recovery
//! worker paced at the aim's rate (`RecoveryWorker::purge_rate`, calls of [`PACED_BATCH`]: what
//! an application runs). Printed per pair: records purged a second (how many deleted and how
//! many made tombstones), the serving throughput with the purge over the one without, the
//! claims' p99 and the whole server's CPU in each. The paced purge runs in [`PACED_ROUNDS`]
//! pairs whose two windows alternate in order, so that neither always has the fresher table or
//! the quieter moment; their ratios are given as a median and a range, as the latency rounds
//! are.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tower_idempotency::recovery::RecoveryWorker;
use tower_idempotency::{PostgresStore, Store};

use crate::pg_cpu::PgCpu;
use crate::ratios::ratio_line;
use crate::{CLIENTS, Target, Window, Work, purge_cost};

/// One serving window of the purge measurement.
pub const PURGE_WINDOW: Duration = Duration::from_secs(5);
/// The flat-out purges' batch sizes.
const BATCHES: [usize; 3] = [1_000, 5_000, 20_000];
/// The paced purge: the recovery worker in calls of this size, at most [`PACED_RATE`] records a
/// second (the aim's), so a call every `PACE` while it keeps up.
const PACED_BATCH: usize = 5_000;
const PACED_RATE: u32 = 50_000;
const PACE: Duration = Duration::from_millis(100);
/// Pairs of windows of the paced purge, each time it runs.
const PACED_ROUNDS: usize = 3;

/// Every purge-while-serving measure: paced in rounds first (the fill's deletable records are
/// there), flat out at each batch size, paced in rounds again (by then the flat-out windows
/// have deleted what was deletable, so it makes tombstones, the dearer half of the work), then
/// the floor under making tombstones.
pub async fn measure(serving: &Target, pool: &PgPool, cpu: &PgCpu, partitioned: bool) {
    println!("\npurge while serving claims on `big`, {CLIENTS} clients, windows of {PURGE_WINDOW:?}");
    paced_rounds(serving, pool, cpu, "deleting").await;
    for batch in BATCHES {
        pair(serving, pool, cpu, batch, false, false).await;
    }
    paced_rounds(serving, pool, cpu, "by now making tombstones").await;
    tombstones_against_floor(serving, pool, cpu, partitioned).await;
}

/// [`PACED_ROUNDS`] pairs of the paced purge, the window with the purge second in even rounds
/// and first in odd ones, then the median and range of their serving ratios.
async fn paced_rounds(serving: &Target, pool: &PgPool, cpu: &PgCpu, what: &str) {
    let mut ratios = Vec::new();
    for round in 0..PACED_ROUNDS {
        ratios.push(pair(serving, pool, cpu, PACED_BATCH, true, round % 2 == 1).await);
    }
    ratio_line(&format!("  paced, {what}: serving with / without"), ratios);
}

/// One pair of windows, one without a purge and one with a purge of `batch` (`paced` by the
/// worker, or flat out), the one with the purge first if `purge_first`. Prints the pair's line;
/// returns the serving ratio.
async fn pair(serving: &Target, pool: &PgPool, cpu: &PgCpu, batch: usize, paced: bool, purge_first: bool) -> f64 {
    let mut without = None;
    if !purge_first {
        without = Some(serve(serving, pool, cpu).await);
    }
    let (before, expired_before) = purge_cost::count(pool).await;
    let claimed_before = serving.next.load(Ordering::Relaxed);
    let stop = Arc::new(AtomicBool::new(false));
    let purger = match paced {
        true => tokio::spawn(paced_worker(serving.store.clone(), stop.clone())),
        false => tokio::spawn(purge_until(serving.store.clone(), batch, stop.clone())),
    };
    let with = serve(serving, pool, cpu).await;
    stop.store(true, Ordering::Relaxed);
    let (purged, elapsed) = purger.await.expect("purger");
    let (after, expired_after) = purge_cost::count(pool).await;
    let inserted = (serving.next.load(Ordering::Relaxed) - claimed_before) as i64;
    let deleted = before + inserted - after;
    let tombstoned = expired_after - (expired_before - deleted);
    // The worker reports a pass when it ends, and a paced pass outlasts the window: count from
    // the table.
    let purged = purged.unwrap_or((deleted + tombstoned) as usize);
    let without = match without {
        Some(without) => without,
        None => serve(serving, pool, cpu).await,
    };
    println!(
        "  batch {batch:>6}{}{}: {:>7.0} records/s purged ({deleted} deleted, {tombstoned} made tombstones in {elapsed:.1?}); {}",
        if paced { format!(", worker at {PACED_RATE}/s") } else { ", flat out".to_owned() },
        if purge_first { ", purge first" } else { "" },
        purged as f64 / elapsed.as_secs_f64(),
        serving_line(&with, &without)
    );
    with.window.throughput() / without.window.throughput()
}

/// Calls `Store::purge(batch)` back to back until `stop` is set or nothing is left. Returns the
/// records purged and the time taken.
async fn purge_until(store: PostgresStore, batch: usize, stop: Arc<AtomicBool>) -> (Option<usize>, Duration) {
    let (mut purged, started) = (0usize, Instant::now());
    while !stop.load(Ordering::Relaxed) {
        let n = store.purge(batch).await.expect("purge");
        purged += n;
        if n == 0 {
            break;
        }
    }
    (Some(purged), started.elapsed())
}

/// The recovery worker as an application runs it on a large table, purging in calls of
/// [`PACED_BATCH`] at most [`PACED_RATE`] records a second, no census, a pass a second once one
/// runs dry (while the purge keeps finding a whole batch, a pass does not end), until `stop` is
/// set. Returns the time taken (the records purged are counted from the table).
async fn paced_worker(store: PostgresStore, stop: Arc<AtomicBool>) -> (Option<usize>, Duration) {
    let started = Instant::now();
    let worker = RecoveryWorker::new(store)
        .purge_batch(PACED_BATCH)
        .purge_rate(PACED_RATE)
        .without_census()
        .every(Duration::from_secs(1));
    let stopped = async {
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    worker.run(stopped).await;
    (None, started.elapsed())
}

/// Making tombstones (the purge's dearer half): the store's purge against its floor.
async fn tombstones_against_floor(serving: &Target, pool: &PgPool, cpu: &PgCpu, partitioned: bool) {
    println!("\nmaking tombstones, nothing else running (batch {}):", purge_cost::BATCH);
    let store_us = purge_cost::tombstones_alone(&serving.store, pool, cpu).await;
    if partitioned {
        println!("  no floor with partitions: a `ctid` names a row only within its partition");
        return;
    }
    if crate::table_size::answers_apart(pool).await {
        println!("  no floor with answers apart: a tombstone is a deleted answer, not an UPDATE");
        return;
    }
    let floor_us = purge_cost::floor_alone(pool, cpu).await;
    if let Some((store_us, floor_us)) = store_us.zip(floor_us) {
        println!("  store / floor, PostgreSQL CPU a tombstone: {:.2}x", store_us / floor_us);
    }
    // Enough rows for the whole window at the pace, or the window would end without the floor.
    let needed = (PURGE_WINDOW.as_millis() / PACE.as_millis() + 1) as usize * purge_cost::BATCH;
    let rows = purge_cost::stale_rows(pool, needed).await;
    if rows.len() < needed {
        println!(
            "  floor paced while serving: not run, {} records left to make tombstones ({needed} needed)",
            rows.len()
        );
        return;
    }
    let without = serve(serving, pool, cpu).await;
    let floor = purge_cost::FloorTask::start(pool.clone(), rows, PACE);
    let with = serve(serving, pool, cpu).await;
    let (expired, elapsed) = floor.stop().await;
    println!(
        "  floor paced ({} every {PACE:?}) while serving: {:.0} tombstones/s ({expired} in {elapsed:.1?}); {}",
        purge_cost::BATCH,
        expired as f64 / elapsed.as_secs_f64(),
        serving_line(&with, &without)
    );
}

/// One window of claims, and what the server's log took meanwhile.
struct Served {
    window: Window,
    log: LogUse,
}

/// What the server's write-ahead log took over a window: bytes (from the insert position,
/// exact), full-page images (from `pg_stat_wal`, which backends report about once a second, so
/// to within a second's worth) and checkpoints begun. The whole server's, so only with nothing
/// else running.
#[derive(Clone, Copy)]
struct LogUse {
    bytes: i64,
    full_pages: i64,
    checkpoints: i64,
}

impl LogUse {
    /// The log's counters now.
    async fn mark(pool: &PgPool) -> Self {
        let (bytes, full_pages, checkpoints): (i64, i64, i64) = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint, \
                    (SELECT wal_fpi FROM pg_stat_wal), \
                    (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)",
        )
        .fetch_one(pool)
        .await
        .expect("the log's counters");
        Self { bytes, full_pages, checkpoints }
    }

    /// What was taken from `self` to `later`.
    fn until(self, later: Self) -> Self {
        Self {
            bytes: later.bytes - self.bytes,
            full_pages: later.full_pages - self.full_pages,
            checkpoints: later.checkpoints - self.checkpoints,
        }
    }
}

/// Claims for one window of the purge measurement, with the server's CPU and log over it.
async fn serve(serving: &Target, pool: &PgPool, cpu: &PgCpu) -> Served {
    let (before, log_before) = (cpu.sample().await, LogUse::mark(pool).await);
    let mut window = serving.run(Work::Claim, PURGE_WINDOW).await;
    let spent = before.until(&cpu.sample().await);
    let log = log_before.until(LogUse::mark(pool).await);
    window.server_cores = spent.server_ns.map(|ns| ns as f64 / window.elapsed.as_nanos() as f64);
    Served { window, log }
}

/// Serving throughput with a purge over without one, the claims' p99, and the server's CPU and
/// log in each.
fn serving_line(with: &Served, without: &Served) -> String {
    let cores = |window: &Window| window.server_cores.map_or_else(|| "n/a".to_owned(), |cores| format!("{cores:.2}"));
    let per_second = |served: &Served, n: i64| n as f64 / served.window.elapsed.as_secs_f64();
    let (w, wo) = (&with.window, &without.window);
    format!(
        "serving {:.0}/s with / {:.0}/s without = {:.2}x (aim >= 0.90x), claim p99 {:.2?} / {:.2?}, \
         PostgreSQL {} / {} cores, log {:.1} / {:.1} MB/s, {:.0} / {:.0} full-page images/s, \
         checkpoints begun {} / {}",
        w.throughput(),
        wo.throughput(),
        w.throughput() / wo.throughput(),
        w.quantile(0.99),
        wo.quantile(0.99),
        cores(w),
        cores(wo),
        per_second(with, with.log.bytes) / 1e6,
        per_second(without, without.log.bytes) / 1e6,
        per_second(with, with.log.full_pages),
        per_second(without, without.log.full_pages),
        with.log.checkpoints,
        without.log.checkpoints,
    )
}
