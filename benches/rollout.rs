//! Shadow mode's added latency against `off`, on SQLite and on PostgreSQL, in one run, and
//! against what recording every request in its own transaction would cost.
//!
//! The route is an atomic handler: it takes the `TxHandle` and inserts an order through it.
//! Four set-ups, each with a fresh key per request (and on SQLite two more, below):
//!
//! - `off`: the layer in `Off`: the handler gets the store's plain transaction.
//! - `shadow`: the layer in `Shadow`: it also buffers the body and computes the fingerprint,
//!   and once the answer has been produced queues the request for the layer's shadow log, whose
//!   writer records the queued requests every second, the layer's default
//!   (`ROLLOUT_SHADOW_MS` sets another interval), with one statement, beside the requests.
//! - `in-commit`: the layer in `Off`, and the handler itself inserts a row like a shadow record
//!   (the same table, with its indexes; a random 32-byte id) after its order, in the same
//!   transaction: what writing the record on the request's path would cost it (the design the
//!   log replaced).
//! - `shadow-unwritten`: `shadow`, with a log whose writer does not write while the benchmark
//!   runs (its interval outlasts the run; its queue holds every request). It is what shadow
//!   mode adds on the request's path alone; `shadow` less `shadow-unwritten` is what the
//!   records' writes cost the requests, on a machine whose cores the client, the server and
//!   the database share.
//!
//! - `shadow-own-file` (SQLite only): `shadow`, with shadow mode's records in a second SQLite
//!   file ([`IdempotencyLayer::shadow_store`]): its batches take that file's write lock, never
//!   the one the orders' INSERTs need.
//! - `off+records` (SQLite only): `off`, and beside it the benchmark's own writer, which every
//!   interval writes as many rows like shadow records (random ids) as requests were answered,
//!   1,024 a statement, into the same file: the writes shadow mode cannot do without, with none
//!   of the layer's work. On one file, shadow mode's cost cannot fall below this set-up's.
//!
//! After the set-ups, rows like shadow records are written in batches of 1,024 into the records
//! table as the run left it, nothing else running: what a record's write costs the database
//! alone, printed against `off`'s mean latency (on SQLite with its share of the checkpoints).
//!
//! SQLite runs twice, in WAL mode: with `synchronous = NORMAL` (no fsync at COMMIT), then with
//! `synchronous = FULL`, as the reference service runs it.
//!
//! One client sends requests one after another through the router (no sockets). Each round
//! measures each set-up for a window (10 s; `ROLLOUT_WINDOW_S` sets another), in rotated order,
//! with a pause after each window in which the shadow log records what that window queued
//! (else its last batch would be written in the next set-up's window and charged to it; so up
//! to an interval's worth of a window's records, a tenth at the defaults, is charged to none). It
//! prints the mean latency of each and
//! the per-round ratio of each to `off` (median and range), then the same of the median
//! latency, each set-up's p99, and the share of its time that went to requests slower than
//! 1 ms (on SQLite, a request that finds the write lock held sleeps in SQLite's busy handler,
//! 1 ms at first and longer steps after). Run with
//! `cargo bench --all-features --bench rollout` (PostgreSQL must be running; `DATABASE_URL`
//! overrides the server). `ROLLOUT_ROUNDS` sets the rounds (default 3).

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/sqlite_file.rs"]
mod sqlite_file;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlite_file::SqliteFile;
use sqlx::sqlite::SqliteSynchronous;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, PostgresStore, RolloutMode, RolloutSwitch, SqliteStore, TxHandle};

const WARM_UP: Duration = Duration::from_secs(1);

/// How long each set-up is measured in a round (`ROLLOUT_WINDOW_S`, default 10 s: ten of the
/// shadow log's default intervals, so the batch left to the pause is a tenth at most).
fn window() -> Duration {
    Duration::from_secs(std::env::var("ROLLOUT_WINDOW_S").ok().and_then(|s| s.parse().ok()).unwrap_or(10))
}

/// The shadow log's queue when `ROLLOUT_SHADOW_MS` sets its interval: the layer's default
/// capacity (which the benchmark cannot read), so that only the interval differs.
const SHADOW_CAPACITY: usize = 65_536;

/// The shadow log's interval: 1 s, the layer's default, or `ROLLOUT_SHADOW_MS`.
fn shadow_interval() -> Duration {
    let ms = std::env::var("ROLLOUT_SHADOW_MS").ok().and_then(|ms| ms.parse().ok()).unwrap_or(1000);
    Duration::from_millis(ms)
}

/// The pause after each window, nothing measured: long enough for the shadow log to record
/// what a `shadow` window queued, so that its last batch is not written in the next set-up's
/// window. That batch's writes are charged to no set-up: up to one interval's worth of the
/// window's records.
fn settle() -> Duration {
    shadow_interval() + Duration::from_millis(200)
}
const BODY: &str = "{\"sku\":\"SKU-000123\",\"quantity\":2,\"amount_minor\":129900,\"currency\":\"EUR\"}";

async fn create_sqlite(tx: TxHandle<sqlx::Sqlite>, body: String) -> StatusCode {
    let mut conn = tx.acquire().await.expect("open");
    sqlx::query("INSERT INTO orders (body) VALUES (?1)").bind(body).execute(&mut *conn).await.expect("insert");
    StatusCode::CREATED
}

async fn create_pg(tx: TxHandle<sqlx::Postgres>, body: String) -> StatusCode {
    let mut conn = tx.acquire().await.expect("open");
    sqlx::query("INSERT INTO orders (body) VALUES ($1)").bind(body).execute(&mut *conn).await.expect("insert");
    StatusCode::CREATED
}

/// A random-looking 32-byte id (splitmix64 of a counter), as a digest would be.
fn row_id() -> Vec<u8> {
    static NEXT: AtomicU64 = AtomicU64::new(0x5eed);
    let mut state = NEXT.fetch_add(4, Ordering::Relaxed);
    (0..4)
        .flat_map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)).to_be_bytes()
        })
        .collect()
}

/// A row like a shadow record (a random id, completed, status only) on SQLite.
async fn record_row_sqlite<'e>(conn: impl sqlx::SqliteExecutor<'e>) -> Result<(), sqlx::Error> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as i64;
    sqlx::query(
        "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
             response_status, response_headers, response_body, response_until, forget_at, created_at, updated_at) \
         VALUES (?1, 'completed', 1, ?2, 0, 201, X'', X'', ?3 + 86400000, ?3 + 691200000, ?3, ?3)",
    )
    .bind(row_id())
    .bind(row_id())
    .bind(now)
    .execute(conn)
    .await
    .map(drop)
}

/// A row like a shadow record on PostgreSQL (see [`record_row_sqlite`]).
async fn record_row_pg<'e>(conn: impl sqlx::PgExecutor<'e>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
             response_status, response_headers, response_body, response_until, forget_at) \
         VALUES ($1, 'completed', 1, $2, 0, 201, '', '', clock_timestamp() + interval '1 day', \
                 clock_timestamp() + interval '8 days')",
    )
    .bind(row_id())
    .bind(row_id())
    .execute(conn)
    .await
    .map(drop)
}

/// `in-commit` on SQLite: the order, and a row like a shadow record, in one transaction.
async fn in_commit_sqlite(tx: TxHandle<sqlx::Sqlite>, body: String) -> StatusCode {
    let mut conn = tx.acquire().await.expect("open");
    sqlx::query("INSERT INTO orders (body) VALUES (?1)").bind(body).execute(&mut *conn).await.expect("insert");
    record_row_sqlite(&mut *conn).await.expect("record");
    StatusCode::CREATED
}

/// `in-commit` on PostgreSQL: the order, and a row like a shadow record, in one transaction.
async fn in_commit_pg(tx: TxHandle<sqlx::Postgres>, body: String) -> StatusCode {
    let mut conn = tx.acquire().await.expect("open");
    sqlx::query("INSERT INTO orders (body) VALUES ($1)").bind(body).execute(&mut *conn).await.expect("insert");
    record_row_pg(&mut *conn).await.expect("record");
    StatusCode::CREATED
}

/// Requests one after another for `window`: how long each took.
async fn measure(app: &Router, keys: &AtomicU64, window: Duration) -> Vec<Duration> {
    let started = Instant::now();
    let mut took = Vec::new();
    while started.elapsed() < window {
        let key = format!("key-{}", keys.fetch_add(1, Ordering::Relaxed));
        let request = Request::post("/orders")
            .header("idempotency-key", key)
            .header("x-tenant", "bench")
            .header("content-type", "application/json")
            .body(Body::from(BODY))
            .expect("request");
        let sent = Instant::now();
        let response = app.clone().oneshot(request).await.expect("answer");
        assert_eq!(response.status(), StatusCode::CREATED);
        let _ = response.into_body().collect().await.expect("body");
        took.push(sent.elapsed());
    }
    took
}

/// What `measure` saw of one set-up: its requests' latencies, sorted.
#[derive(Default)]
struct Seen(Vec<Duration>);

impl Seen {
    /// All the time its requests took, in seconds.
    fn total(&self) -> f64 {
        self.0.iter().map(Duration::as_secs_f64).sum()
    }

    fn mean(&self) -> f64 {
        self.total() / self.0.len() as f64
    }

    fn quantile(&self, q: f64) -> f64 {
        self.0[((self.0.len() - 1) as f64 * q) as usize].as_secs_f64()
    }

    /// The share of all the time its requests took that went to requests of more than
    /// `STALLED` (a wait for SQLite's write lock sleeps in steps of 1 ms and more).
    fn stalled_share(&self) -> f64 {
        let stalled: f64 = self.0.iter().filter(|took| **took > STALLED).map(Duration::as_secs_f64).sum();
        stalled / self.total()
    }
}

/// A request slower than this counts as stalled (see [`Seen::stalled_share`]).
const STALLED: Duration = Duration::from_millis(1);

/// Median and range of `ratios`.
fn spread(ratios: &mut [f64]) -> String {
    ratios.sort_by(f64::total_cmp);
    format!("median {:.3} (range {:.3}–{:.3})", ratios[ratios.len() / 2], ratios[0], ratios[ratios.len() - 1])
}

/// The set-ups in rotated order, `rounds` times; prints each one's mean latency and, per
/// round, its ratio to the first (`off`); then the same of the median latency, each one's p99,
/// and how much of its time went to stalled requests.
async fn compare(name: &str, apps: Vec<(&str, Router)>, rounds: usize) -> Duration {
    let keys = AtomicU64::new(0);
    for (_, app) in &apps {
        measure(app, &keys, WARM_UP).await;
        tokio::time::sleep(settle()).await;
    }
    let n = apps.len();
    let mut all: Vec<Seen> = (0..n).map(|_| Seen::default()).collect();
    let (mut mean_ratios, mut median_ratios) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for round in 0..rounds {
        let mut this_round: Vec<Seen> = (0..n).map(|_| Seen::default()).collect();
        for step in 0..n {
            let index = (step + round) % n;
            let mut took = measure(&apps[index].1, &keys, window()).await;
            tokio::time::sleep(settle()).await;
            took.sort_unstable();
            all[index].0.extend_from_slice(&took);
            this_round[index] = Seen(took);
        }
        for (index, seen) in this_round.iter().enumerate() {
            mean_ratios[index].push(seen.mean() / this_round[0].mean());
            median_ratios[index].push(seen.quantile(0.5) / this_round[0].quantile(0.5));
        }
    }
    for seen in &mut all {
        seen.0.sort_unstable();
    }
    let latencies: Vec<String> = apps
        .iter()
        .zip(&all)
        .map(|((label, _), seen)| format!("{label} {:.1} µs/request", seen.mean() * 1e6))
        .collect();
    let per_round = |ratios: &mut [Vec<f64>]| -> String {
        let labels = apps.iter().map(|(label, _)| label).skip(1);
        let ratios =
            labels.zip(ratios.iter_mut().skip(1)).map(|(label, ratios)| format!("{label}/off {}", spread(ratios)));
        ratios.collect::<Vec<_>>().join(", ")
    };
    println!("{name}: {}; per round, {} ({rounds} rounds)", latencies.join(", "), per_round(&mut mean_ratios));
    let tails: Vec<String> = apps
        .iter()
        .zip(&all)
        .map(|((label, _), seen)| {
            format!(
                "{label} p50 {:.1} µs, p99 {:.1} µs, {:.1}% of its time in requests over {STALLED:?}",
                seen.quantile(0.5) * 1e6,
                seen.quantile(0.99) * 1e6,
                seen.stalled_share() * 100.0
            )
        })
        .collect();
    println!("{name}, latency: {}; per round, p50 {}", tails.join(", "), per_round(&mut median_ratios));
    Duration::from_secs_f64(all[0].mean())
}

/// Records written per batch by [`records_alone`]: what the shadow log writes with one
/// statement at most, which at this benchmark's rate is what it writes every second, its
/// default interval.
const ALONE_BATCH: i64 = 1_024;
/// Batches [`records_alone`] writes.
const ALONE_BATCHES: u32 = 10;

/// Rows like shadow records (random ids, completed, status only), `ALONE_BATCH` a statement,
/// `ALONE_BATCHES` statements one after another into the records table as the run left it,
/// nothing else running: the time a record's write takes the database (with its share of
/// SQLite's checkpoints), printed against `off`'s mean latency.
async fn records_alone<F, Fut>(name: &str, off: Duration, mut batch: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let started = Instant::now();
    for _ in 0..ALONE_BATCHES {
        batch().await;
    }
    let per_record = started.elapsed() / (ALONE_BATCHES * ALONE_BATCH as u32);
    println!(
        "{name}, shadow records alone: {:.1} µs a record in batches of {ALONE_BATCH} = {:.1}% of off's mean latency",
        per_record.as_secs_f64() * 1e6,
        per_record.as_secs_f64() / off.as_secs_f64() * 100.0
    );
}

/// [`records_alone`]'s batch on SQLite.
const SQLITE_RECORDS: &str = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
     INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
         response_status, response_headers, response_body, response_until, forget_at, created_at, updated_at) \
     SELECT randomblob(32), 'completed', 1, randomblob(32), 0, 201, X'', X'', \
            unixepoch('subsec') * 1000 + 86400000, unixepoch('subsec') * 1000 + 691200000, \
            unixepoch('subsec') * 1000, unixepoch('subsec') * 1000 \
     FROM n WHERE true ON CONFLICT DO NOTHING";

/// [`records_alone`]'s batch on PostgreSQL.
const PG_RECORDS: &str = "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, \
         fencing_token, response_status, response_headers, response_body, response_until, forget_at) \
     SELECT decode(md5(random()::text) || md5(random()::text), 'hex'), 'completed', 1, \
            decode(md5(random()::text) || md5(random()::text), 'hex'), 0, 201, '', '', \
            clock_timestamp() + interval '1 day', clock_timestamp() + interval '8 days' \
     FROM generate_series(1, $1) ON CONFLICT DO NOTHING";

fn layer<St: tower_idempotency::Store>(store: St, mode: RolloutMode) -> IdempotencyLayer<St> {
    let layer = IdempotencyLayer::new(store)
        .operation("orders.create")
        .scope_with(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(tower_idempotency::Scope::new))
        .rollout(RolloutSwitch::new(mode));
    match std::env::var("ROLLOUT_SHADOW_MS") {
        Ok(_) => layer.shadow_log(shadow_interval(), SHADOW_CAPACITY),
        Err(_) => layer,
    }
}

/// The four set-ups on `store`: `create` behind the layer in `Off`, in `Shadow`, and in
/// `Shadow` with its records never written ([`unwritten`]); `in_commit` behind it in `Off`.
fn apps<St, C, CT, I, IT>(store: St, create: C, in_commit: I) -> Vec<(&'static str, Router)>
where
    St: tower_idempotency::Store,
    C: axum::handler::Handler<CT, ()>,
    I: axum::handler::Handler<IT, ()>,
    CT: 'static,
    IT: 'static,
{
    vec![
        ("off", Router::new().route("/orders", post(create.clone()).layer(layer(store.clone(), RolloutMode::Off)))),
        (
            "shadow",
            Router::new().route("/orders", post(create.clone()).layer(layer(store.clone(), RolloutMode::Shadow))),
        ),
        ("in-commit", Router::new().route("/orders", post(in_commit).layer(layer(store.clone(), RolloutMode::Off)))),
        ("shadow-unwritten", Router::new().route("/orders", post(create).layer(unwritten(store)))),
    ]
}

/// An interval no run of the benchmark outlasts, and a queue no run of it fills.
const UNWRITTEN_INTERVAL: Duration = Duration::from_secs(365 * 24 * 3600);
const UNWRITTEN_CAPACITY: usize = 4_000_000;

/// Shadow mode whose writer does not write while the benchmark runs: the `shadow-unwritten`
/// set-up of the module docs.
fn unwritten<St: tower_idempotency::Store>(store: St) -> IdempotencyLayer<St> {
    layer(store, RolloutMode::Shadow).shadow_log(UNWRITTEN_INTERVAL, UNWRITTEN_CAPACITY)
}

/// A migrated [`SqliteStore`] on a file of the benchmark's own (`name`), in WAL mode with
/// `synchronous`, and the file.
async fn sqlite_store(name: &str, synchronous: SqliteSynchronous) -> (SqliteStore, SqliteFile) {
    let file = SqliteFile::create(&format!("tidem_bench_rollout_{name}"), synchronous, 8).await;
    let store = SqliteStore::new(file.pool.clone());
    store.migrate().await.expect("migrate");
    (store, file)
}

/// The `off+records` set-up's writer: every [`shadow_interval`] it writes as many rows like
/// shadow records ([`SQLITE_RECORDS`], random ids) as `answered` counted since the last time,
/// at most 1,024 a statement, into `pool`'s file, as the shadow log writes its batches. It
/// stops when dropped.
struct RecordsBeside {
    answered: Arc<AtomicU64>,
    writer: tokio::task::JoinHandle<()>,
}

impl RecordsBeside {
    fn start(pool: sqlx::SqlitePool) -> Self {
        let answered = Arc::new(AtomicU64::new(0));
        let count = answered.clone();
        let writer = tokio::spawn(async move {
            loop {
                tokio::time::sleep(shadow_interval()).await;
                let mut left = count.swap(0, Ordering::Relaxed) as i64;
                while left > 0 {
                    let batch = left.min(ALONE_BATCH);
                    sqlx::query(SQLITE_RECORDS).bind(batch).execute(&pool).await.expect("a batch of records");
                    left -= batch;
                }
            }
        });
        Self { answered, writer }
    }

    /// `off`'s route, each answer counted for the writer.
    fn router(&self, store: SqliteStore) -> Router {
        let answered = self.answered.clone();
        let create = move |tx: TxHandle<sqlx::Sqlite>, body: String| async move {
            let status = create_sqlite(tx, body).await;
            answered.fetch_add(1, Ordering::Relaxed);
            status
        };
        Router::new().route("/orders", post(create).layer(layer(store, RolloutMode::Off)))
    }
}

impl Drop for RecordsBeside {
    fn drop(&mut self) {
        self.writer.abort();
    }
}

/// `off`, `shadow`, `in-commit`, `shadow-unwritten`, `shadow-own-file` and `off+records` on a
/// SQLite file of their own with `synchronous`. `shadow-own-file` records shadow mode's
/// requests in a second file ([`IdempotencyLayer::shadow_store`]), so its batches never hold
/// the orders' write lock. `off+records` is the floor of shadow mode on one file: `off`, with
/// the benchmark itself writing a row like a shadow record for each answered request, in
/// batches beside the requests ([`RecordsBeside`]), no layer work at all: what the records'
/// writes alone cost requests that share their file.
async fn compare_sqlite(name: &str, synchronous: SqliteSynchronous, rounds: usize) {
    let (store, file) = sqlite_store("orders", synchronous).await;
    let (shadow_store, shadow_file) = sqlite_store("shadow", synchronous).await;
    let pool = file.pool.clone();
    sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        .execute(&pool)
        .await
        .expect("orders");
    let mut apps = apps(store.clone(), create_sqlite, in_commit_sqlite);
    let store_for_floor = store.clone();
    let apart = layer(store, RolloutMode::Shadow).shadow_store(shadow_store);
    apps.push(("shadow-own-file", Router::new().route("/orders", post(create_sqlite).layer(apart))));
    let beside = RecordsBeside::start(pool.clone());
    apps.push(("off+records", beside.router(store_for_floor)));
    // The routers go with it; the shadow log's writer records what is left and ends.
    let off = compare(name, apps, rounds).await;
    drop(beside);
    records_alone(name, off, || async {
        sqlx::query(SQLITE_RECORDS).bind(ALONE_BATCH).execute(&pool).await.expect("a batch of records");
    })
    .await;
    file.remove().await;
    shadow_file.remove().await;
}

fn main() {
    let rounds = std::env::var("ROLLOUT_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(async {
        // SQLite: a file of the benchmark's own, in WAL mode; with `synchronous = NORMAL` (no
        // fsync at COMMIT), then `FULL`, as the reference service runs it (an answer sent after
        // COMMIT survives a power cut).
        for (name, synchronous) in [
            ("sqlite, synchronous = NORMAL", SqliteSynchronous::Normal),
            ("sqlite, synchronous = FULL", SqliteSynchronous::Full),
        ] {
            compare_sqlite(name, synchronous, rounds).await;
        }

        let db = bench_db::BenchDatabase::create("tidem_bench_rollout", 16).await;
        let store = PostgresStore::new(db.pool.clone());
        store.migrate().await.expect("migrate");
        sqlx::raw_sql("CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL)")
            .execute(&db.pool)
            .await
            .expect("orders");
        let off = compare("postgres", apps(store, create_pg, in_commit_pg), rounds).await;
        records_alone("postgres", off, || async {
            sqlx::query(PG_RECORDS).bind(ALONE_BATCH).execute(&db.pool).await.expect("a batch of records");
        })
        .await;
        db.drop().await;
    });
}
