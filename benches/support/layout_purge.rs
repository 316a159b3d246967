//! Making tombstones in the two layouts of `pg_layout`, with nothing else running, and the
//! answers deleted at the purge aim's rate while new records are written.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::meter::{Meter, Spent};
use crate::pg_cpu::PgCpu;
use crate::ratios::ratio_line;
use crate::{CLIENTS, DAYS, Layout, ROUNDS, Work, window};

/// Records a tombstone statement handles.
pub const BATCH: usize = 5_000;
/// Making `$2` tombstones in `apart`: their answers deleted in order, from sequence number `$1`.
const DELETE_ANSWERS: &str = "DELETE FROM answers WHERE seq >= $1 AND seq < $1 + $2";
/// How long each tombstone measure runs.
const ALONE: Duration = Duration::from_secs(2);

/// Making tombstones with nothing else running, from a fresh checkpoint each: the floor on
/// `one`, the DELETE in order and a day's partition dropped on `apart`.
/// Returns the sequence number of the first answer left.
pub async fn tombstones(pool: &PgPool, cpu: &PgCpu, rows: u64, by_day: bool) -> i64 {
    println!("\nmaking tombstones, nothing else running (batches of {BATCH}):");
    // Records of the fill's first day only, so that its second day is whole for the drop.
    let batches = (rows / DAYS / BATCH as u64).min(60) as i64;
    // The floor: the store's UPDATE on the rows whose replay ends first, found beforehand.
    let ctids: Vec<String> = sqlx::query_scalar("SELECT ctid::text FROM one ORDER BY response_until LIMIT $1")
        .bind(batches * BATCH as i64)
        .fetch_all(pool)
        .await
        .expect("the first rows");
    let floor = timed(pool, cpu, ctids.chunks(BATCH), |batch| {
        sqlx::query(
            "UPDATE one SET state = 'expired', response_status = NULL, response_headers = NULL, \
                 response_body = NULL, updated_at = now() WHERE ctid = ANY($1::tid[])",
        )
        .bind(batch)
    })
    .await;
    report("one, the floor (UPDATE by ctid)", &floor);
    // Apart: the answers of the same first records, deleted in their order.
    let starts: Vec<i64> = (0..batches).map(|n| 1 + n * BATCH as i64).collect();
    let deleted =
        timed(pool, cpu, starts.chunks(1), |start| sqlx::query(DELETE_ANSWERS).bind(start[0]).bind(BATCH as i64)).await;
    report("apart, DELETE of answers in order", &deleted);
    if let Some((d, f)) = deleted.cpu_us().zip(floor.cpu_us()) {
        println!("  apart DELETE / one floor: CPU {:.3}x, log {:.3}x", d / f, deleted.wal() / floor.wal());
    }
    let next_seq = 1 + batches * BATCH as i64;
    if !by_day {
        println!("  (a day's partition dropped: with PG_LAYOUT_ANSWERS=by-day)");
        return next_seq;
    }
    // Apart: a whole day of answers (the second day's partition, untouched above).
    let in_partition: i64 = sqlx::query_scalar("SELECT count(*) FROM answers_d1").fetch_one(pool).await.unwrap();
    let meter = Meter::start(pool, cpu).await;
    sqlx::raw_sql("DROP TABLE answers_d1").execute(pool).await.expect("drop a day");
    let dropped = meter.stop(pool, cpu, in_partition as u64).await;
    println!(
        "  apart, a day's partition dropped ({in_partition} answers: the fill's second day and what the claims above \
         wrote): {:.1?}, PostgreSQL CPU {} ns and {:.3} B of log an answer",
        dropped.elapsed,
        dropped.cpu_us().map_or_else(|| "n/a".to_owned(), |us| format!("{:.1}", us * 1_000.0)),
        dropped.wal()
    );
    next_seq
}

/// The answers deleted in order at the purge aim's rate (a batch of [`BATCH`] every 100 ms)
/// while new records are written to `apart`, against the same writes without: `ROUNDS` pairs
/// of windows, the one with the deletes second, then first, then second.
pub async fn purge_while_serving(pool: &PgPool, cpu: &PgCpu, fresh: &Arc<AtomicU64>, first_seq: i64) {
    println!("\nanswers deleted at 50,000 a second while new records are written to `apart`, {CLIENTS} clients:");
    let serving = || Work::Insert(Layout::Apart, fresh.clone());
    let next_seq = Arc::new(AtomicI64::new(first_seq));
    let mut ratios = Vec::new();
    for round in 0..ROUNDS {
        let purge_first = round % 2 == 1;
        let mut without = None;
        if !purge_first {
            without = Some(window(pool, cpu, serving()).await);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let purger = tokio::spawn(paced_delete(pool.clone(), next_seq.clone(), stop.clone()));
        let with = window(pool, cpu, serving()).await;
        stop.store(true, Ordering::Relaxed);
        let (deleted, elapsed) = purger.await.expect("purger");
        let without = match without {
            Some(without) => without,
            None => window(pool, cpu, serving()).await,
        };
        println!(
            "  round {round}{}: {:.0} answers deleted a second; new records {:.0}/s with / {:.0}/s without = {:.2}x, \
             PostgreSQL CPU a record {} / {} µs",
            if purge_first { ", deletes first" } else { "" },
            deleted as f64 / elapsed.as_secs_f64(),
            with.per_second(),
            without.per_second(),
            with.per_second() / without.per_second(),
            with.cpu_us().map_or_else(|| "n/a".to_owned(), |us| format!("{us:.1}")),
            without.cpu_us().map_or_else(|| "n/a".to_owned(), |us| format!("{us:.1}")),
        );
        ratios.push(with.per_second() / without.per_second());
    }
    ratio_line("  new records with / without the deletes (aim >= 0.90x)", ratios);
}

/// Deletes the answers from `next_seq` on, a batch every 100 ms, until `stop`; the answers
/// deleted and the time taken.
async fn paced_delete(pool: PgPool, next_seq: Arc<AtomicI64>, stop: Arc<AtomicBool>) -> (u64, Duration) {
    let mut ticks = tokio::time::interval(Duration::from_millis(100));
    let (mut deleted, started) = (0, Instant::now());
    while !stop.load(Ordering::Relaxed) {
        ticks.tick().await;
        let from = next_seq.fetch_add(BATCH as i64, Ordering::Relaxed);
        let batch = sqlx::query(DELETE_ANSWERS).bind(from).bind(BATCH as i64);
        deleted += batch.execute(&pool).await.expect("delete answers").rows_affected();
    }
    (deleted, started.elapsed())
}

/// Runs `statement` on each of `batches` (each in its own transaction) for up to [`ALONE`], from
/// a fresh checkpoint; what it did and spent.
async fn timed<'a, T: 'a, I, F>(pool: &PgPool, cpu: &PgCpu, batches: I, statement: F) -> Spent
where
    I: Iterator<Item = &'a [T]>,
    F: Fn(&'a [T]) -> sqlx::query::Query<'a, sqlx::Postgres, sqlx::postgres::PgArguments>,
{
    let (meter, mut done) = (Meter::start(pool, cpu).await, 0);
    for batch in batches {
        if meter.elapsed() >= ALONE {
            break;
        }
        done += statement(batch).execute(pool).await.expect("tombstone batch").rows_affected();
    }
    meter.stop(pool, cpu, done).await
}

fn report(label: &str, spent: &Spent) {
    println!(
        "  {label:<36} {:>7.0} records/s ({} in {:.1?}); PostgreSQL CPU {} µs and {:.0} B of log a record",
        spent.per_second(),
        spent.records,
        spent.elapsed,
        spent.cpu_us().map_or_else(|| "n/a".to_owned(), |us| format!("{us:.1}")),
        spent.wal()
    );
}
