//! The record lifecycle's costs, on PostgreSQL and SQLite (leased mode), in one run.
//!
//! **The recovery worker's throughput** at `RECOVERY_RECORDS` records (default 100 000): the
//! table is filled with `processing` records whose lease has run out (one bulk INSERT, as a
//! crash of that many requests would leave them), then three passes of
//! [`RecoveryWorker::run_once`] are timed, each doing one kind of work:
//!
//! 1. `mark`: every stale lease becomes `unknown` (no reconciler registered);
//! 2. `reconcile`: a reconciler that answers "completed" at once settles every record (each a
//!    fenced, state-checked UPDATE);
//! 3. `purge`: with every record made past its tombstone time, the purge deletes them all.
//!
//! Each pass runs in batches of `RECOVERY_BATCH` (default 500), with `RECOVERY_CONCURRENCY`
//! (default 8, the worker's default) reconciler calls and settlements at once. As a baseline in the same run,
//! `bulk mark` times one plain `UPDATE ... SET state = 'unknown'` over the same number of
//! stale rows: the ratio shows what bounded, fenced batches cost against doing it in one go.
//!
//! **The heartbeat's cost**: leased requests through the layer on PostgreSQL, each handler
//! sleeping 40 ms under a 60 ms lease (the heartbeat renews every 20 ms, twice per request),
//! `HEARTBEAT_CLIENTS` (32) at once, with the heartbeat on and off, alternating, for
//! `RECOVERY_ROUNDS` rounds of 3 s each. Without the heartbeat the handler still finishes within
//! its lease, so both answer 201; the ratio is the renewals' cost.
//!
//! Run with `cargo bench --bench recovery --features postgres,sqlite`. `RECOVERY_ROUNDS`
//! (default 3) sets the rounds of each part.

#[path = "support/bench_db.rs"]
mod bench_db;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bench_db::BenchDatabase;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use tower::{Layer, ServiceExt};
use tower_idempotency::recovery::{Reconciliation, RecoveryWorker};
use tower_idempotency::store::{Admin, RecordInfo};
use tower_idempotency::{CouplingMode, IdempotencyLayer, PostgresStore, SqliteStore, Store, StoredResponse};

const OPERATION: &str = "POST /bench";

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One database the worker runs over: how to fill it with stale leases, how to make every
/// record past its tombstone time, and the baseline's one-statement mark.
trait Bench: Store + Admin {
    fn name(&self) -> &'static str;
    async fn seed_stale(&self, records: usize);
    async fn make_forgotten(&self);
    async fn bulk_mark(&self) -> u64;
    async fn clear(&self);
}

impl Bench for PostgresStore {
    fn name(&self) -> &'static str {
        "PostgreSQL"
    }

    async fn seed_stale(&self, records: usize) {
        let tag = format!("{:?}", SystemTime::now());
        sqlx::query(
            "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                 lease_until, created_at, updated_at, operation, scope_digest, operation_id, response_until, forget_at) \
             SELECT sha256(('r' || i || $2)::bytea), 'processing', 2, sha256(('f' || i)::bytea), i, \
                 clock_timestamp() - interval '1 second', clock_timestamp(), clock_timestamp(), 'POST /bench', \
                 sha256('s'::bytea), substring(sha256(('o' || i || $2)::bytea) from 1 for 16), \
                 clock_timestamp() + interval '30 days', clock_timestamp() + interval '37 days' \
             FROM generate_series(1, $1) AS i",
        )
        .bind(records as i64)
        .bind(tag)
        .execute(self.pool())
        .await
        .expect("seed");
        sqlx::query("ANALYZE idempotency_records").execute(self.pool()).await.expect("analyze");
    }

    async fn make_forgotten(&self) {
        sqlx::query(
            "UPDATE idempotency_records SET response_until = clock_timestamp() - interval '2 seconds', \
                 forget_at = clock_timestamp() - interval '1 second'",
        )
        .execute(self.pool())
        .await
        .expect("age");
    }

    async fn bulk_mark(&self) -> u64 {
        sqlx::query(
            "UPDATE idempotency_records SET state = 'unknown', updated_at = clock_timestamp() \
             WHERE state = 'processing' AND lease_until <= clock_timestamp() AND NOT reexecutable",
        )
        .execute(self.pool())
        .await
        .expect("bulk mark")
        .rows_affected()
    }

    async fn clear(&self) {
        sqlx::query("DELETE FROM idempotency_records").execute(self.pool()).await.expect("clear");
        sqlx::query("VACUUM ANALYZE idempotency_records").execute(self.pool()).await.expect("vacuum");
    }
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis() as i64
}

impl Bench for SqliteStore {
    fn name(&self) -> &'static str {
        "SQLite"
    }

    async fn seed_stale(&self, records: usize) {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
             INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                 lease_until, created_at, updated_at, operation, scope_digest, operation_id, response_until, forget_at) \
             SELECT randomblob(32), 'processing', 2, randomblob(32), i, ?2 - 1000, ?2, ?2, 'POST /bench', \
                 randomblob(32), randomblob(16), ?2 + 2592000000, ?2 + 3196800000 FROM n",
        )
        .bind(records as i64)
        .bind(now_ms())
        .execute(self.pool())
        .await
        .expect("seed");
        sqlx::query("ANALYZE").execute(self.pool()).await.expect("analyze");
    }

    async fn make_forgotten(&self) {
        sqlx::query("UPDATE idempotency_records SET response_until = ?1 - 2000, forget_at = ?1 - 1000")
            .bind(now_ms())
            .execute(self.pool())
            .await
            .expect("age");
    }

    async fn bulk_mark(&self) -> u64 {
        sqlx::query(
            "UPDATE idempotency_records SET state = 'unknown', updated_at = ?1 \
             WHERE state = 'processing' AND lease_until <= ?1 AND NOT reexecutable",
        )
        .bind(now_ms())
        .execute(self.pool())
        .await
        .expect("bulk mark")
        .rows_affected()
    }

    async fn clear(&self) {
        sqlx::query("DELETE FROM idempotency_records").execute(self.pool()).await.expect("clear");
    }
}

/// Records per second of each phase, one entry per round.
#[derive(Default)]
struct Rates {
    mark: Vec<f64>,
    reconcile: Vec<f64>,
    purge: Vec<f64>,
    bulk_mark: Vec<f64>,
}

fn rate(records: usize, elapsed: Duration) -> f64 {
    records as f64 / elapsed.as_secs_f64()
}

async fn worker_round<S: Bench>(store: &S, records: usize, batch: usize, concurrency: usize, rates: &mut Rates) {
    // The baseline: one statement over the same number of stale rows.
    store.seed_stale(records).await;
    let started = Instant::now();
    assert_eq!(store.bulk_mark().await as usize, records);
    rates.bulk_mark.push(rate(records, started.elapsed()));
    store.clear().await;

    store.seed_stale(records).await;
    let marker = RecoveryWorker::new(store.clone()).batch(batch);
    let started = Instant::now();
    let report = marker.run_once().await.expect("mark pass");
    rates.mark.push(rate(records, started.elapsed()));
    assert_eq!(report.marked_unknown, records, "{report:?}");
    eprintln!("{}: marked {records} in {:?}", store.name(), started.elapsed());

    let reconciler = RecoveryWorker::new(store.clone()).batch(batch).concurrency(concurrency).reconciler(
        OPERATION,
        |_record: RecordInfo| async {
            Reconciliation::Completed(StoredResponse::new(StatusCode::CREATED, "{\"reconciled\":true}"))
        },
    );
    let started = Instant::now();
    let report = reconciler.run_once().await.expect("reconcile pass");
    rates.reconcile.push(rate(records, started.elapsed()));
    assert_eq!(report.reconciled, records, "{report:?}");
    eprintln!("{}: reconciled {records} in {:?}", store.name(), started.elapsed());

    store.make_forgotten().await;
    let started = Instant::now();
    let report = marker.run_once().await.expect("purge pass");
    rates.purge.push(rate(records, started.elapsed()));
    assert_eq!(report.purged, records, "{report:?}");
}

/// Median and range.
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    (sorted[sorted.len() / 2], sorted[0], sorted[sorted.len() - 1])
}

fn report_worker(name: &str, records: usize, batch: usize, concurrency: usize, rates: &Rates) {
    println!(
        "\nrecovery worker on {name}, {records} records, batches of {batch}, {concurrency} reconciler calls at once, \
         {} rounds",
        rates.mark.len()
    );
    for (phase, values) in [
        ("mark", &rates.mark),
        ("reconcile", &rates.reconcile),
        ("purge", &rates.purge),
        ("bulk mark", &rates.bulk_mark),
    ] {
        let (median, low, high) = spread(values);
        println!("  {phase:<10} {median:>10.0} records/s (range {low:.0}..{high:.0})");
    }
    let ratios: Vec<f64> = rates.mark.iter().zip(&rates.bulk_mark).map(|(m, b)| m / b).collect();
    let (median, low, high) = spread(&ratios);
    println!("  mark / bulk mark: median {median:.2}x, range {low:.2}x..{high:.2}x");
}

async fn sleepy(_request: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    tokio::time::sleep(Duration::from_millis(40)).await;
    Ok(Response::builder().status(StatusCode::CREATED).body(Full::new(Bytes::from_static(b"{}"))).expect("response"))
}

/// Leased requests answered 201 per second over `window`, `clients` at once, fresh keys.
async fn leased_throughput(store: &PostgresStore, heartbeat: bool, clients: usize, window: Duration) -> (f64, u64) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let layer = IdempotencyLayer::new(store.clone())
        .shared_scope("bench")
        .lease(Duration::from_millis(60))
        .heartbeat(heartbeat);
    let service = layer.layer(tower::service_fn(sleepy));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let deadline = Instant::now() + window;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (service, ok, failed) = (service.clone(), ok.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let key = format!("hb-{}", NEXT.fetch_add(1, Ordering::Relaxed));
                let request = Request::post("/orders")
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from_static(b"{\"sku\":\"A\"}")))
                    .expect("request");
                let response = service.clone().oneshot(request).await.expect("answer");
                let status = response.status();
                let _ = response.into_body().collect().await;
                if status == StatusCode::CREATED { &ok } else { &failed }.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for task in tasks {
        task.await.expect("client");
    }
    (ok.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64(), failed.load(Ordering::Relaxed))
}

fn main() {
    let records = env("RECOVERY_RECORDS", 100_000);
    let batch = env("RECOVERY_BATCH", 500);
    let rounds = env("RECOVERY_ROUNDS", 3).max(1);
    let clients = env("HEARTBEAT_CLIENTS", 32);
    let concurrency = env("RECOVERY_CONCURRENCY", 8);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let database = BenchDatabase::create("tidem_bench_recovery", 20).await;
        let pg = PostgresStore::new(database.pool.clone()).mode(CouplingMode::Leased);
        pg.migrate().await.expect("migrate");

        let path = std::env::temp_dir().join(format!("tidem_bench_recovery_{}.db", std::process::id()));
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await.expect("sqlite");
        let sqlite = SqliteStore::new(pool).mode(CouplingMode::Leased);
        sqlite.migrate().await.expect("migrate");

        let (mut pg_rates, mut sqlite_rates) = (Rates::default(), Rates::default());
        for _ in 0..rounds {
            worker_round(&pg, records, batch, concurrency, &mut pg_rates).await;
            worker_round(&sqlite, records, batch, concurrency, &mut sqlite_rates).await;
        }
        report_worker(pg.name(), records, batch, concurrency, &pg_rates);
        report_worker(sqlite.name(), records, batch, concurrency, &sqlite_rates);

        let window = Duration::from_secs(3);
        leased_throughput(&pg, true, clients, Duration::from_secs(1)).await;
        let (mut on, mut off, mut ratios, mut failures) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for round in 0..rounds.max(3) {
            // Alternate which goes first, so a slow stretch falls on both alike.
            let order = if round % 2 == 0 { [true, false] } else { [false, true] };
            let mut this = [0.0; 2];
            for heartbeat in order {
                let (rate, failed) = leased_throughput(&pg, heartbeat, clients, window).await;
                failures += failed;
                this[usize::from(heartbeat)] = rate;
            }
            off.push(this[0]);
            on.push(this[1]);
            ratios.push(this[1] / this[0]);
        }
        let ((on_median, ..), (off_median, ..), (median, low, high)) = (spread(&on), spread(&off), spread(&ratios));
        println!(
            "\nleased requests on PostgreSQL (40 ms handler, 60 ms lease), {clients} clients, {} rounds of {window:?}",
            ratios.len()
        );
        println!("  heartbeat on  {on_median:>8.0} req/s (median)");
        println!("  heartbeat off {off_median:>8.0} req/s (median)");
        println!("  on / off: median {median:.3}x, range {low:.3}x..{high:.3}x; non-201 answers: {failures}");

        drop(sqlite);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
        database.drop().await;
    });
}
