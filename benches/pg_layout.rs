//! The next layout for the PostgreSQL store priced before it is built (issue 16; `docs/scale.md`,
//! "Layout"): **answers apart**, a slim identity table beside the answers in a table of their
//! own, in the order they were written, against the store's one table today.
//!
//! In a database of its own (created at the start, dropped at the end, also after a panic), the
//! same `PG_LAYOUT_ROWS` records (default 5 million) are written by SQL into both layouts:
//!
//! - **one**: the store's own table (`PostgresStore::migrate`, atomic mode), each row with its
//!   answer, as `pg_scale` fills it;
//! - **apart**: `slim`, the same columns but the answer's headers and body, with the same
//!   primary key, operation-id index and partial indexes, and an index on `forget_at` (which
//!   the purge of forgotten records walks) in place of the two expiry indexes; and `answers`
//!   (a sequence number, its primary key, the time the replay ends, headers and body), found
//!   from `slim` by the sequence number and that time, which `slim` keeps. With
//!   `PG_LAYOUT_ANSWERS=by-day`, `answers` is partitioned by range of that time, a partition a
//!   day, its primary key `(seq, until)`. A tombstone is then the absence of the answer: making
//!   one writes nothing to `slim`. Answers are deleted in sequence order, which is the order
//!   their replay ends only while every route keeps its answers equally long (else by the
//!   time, through an index on it or the partitions).
//!
//! No store implements the second layout: each side is measured as the SQL a store would send,
//! from the benchmark's own connections. It prints, each side's figure and their ratio:
//!
//! 1. **bytes a record** on disk, heap and indexes of each table;
//! 2. **a new record** (the claim's write, in one statement: one `INSERT` into `one`; into
//!    `answers` and `slim` with a CTE in `apart`), `CLIENTS` clients in `ROUNDS` rounds of
//!    `WINDOW`, their order alternating, each from a fresh checkpoint: records a second,
//!    PostgreSQL's CPU a record (the backends of the benchmark's database, `support/pg_cpu.rs`)
//!    and the log a record writes;
//! 3. **a replay** (the record read with its answer by identity: one row of `one`, or `slim`
//!    joined to `answers`), the same way;
//! 4. **making tombstones**, from a fresh checkpoint: on `one`, the floor `pg_scale` measures
//!    (the store's UPDATE on rows found beforehand, by `ctid`, batches of 5,000); on `apart`, a
//!    DELETE of the answers in their order (batches of 5,000 by sequence), and (by day) a whole
//!    day's partition dropped; CPU and log a record;
//! 5. **the purge while serving**: new records written to `apart` with the answers deleted in
//!    order at the purge aim's rate (a batch of 5,000 every 100 ms) and without, in `ROUNDS`
//!    pairs of windows whose order alternates: the rate with over the rate without.
//!
//! Run with `cargo bench --bench pg_layout --all-features` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server). Not run by CI.

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/layout_purge.rs"]
mod layout_purge;
#[path = "support/meter.rs"]
mod meter;
#[path = "support/pg_cpu.rs"]
mod pg_cpu;
#[path = "support/ratios.rs"]
mod ratios;
#[path = "support/stored_answer.rs"]
mod stored_answer;
#[path = "support/wal.rs"]
mod wal;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bench_db::BenchDatabase;
use meter::{Meter, Spent};
use pg_cpu::PgCpu;
use ratios::ratio_line;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use stored_answer::{answer, answer_body, hex};
use tower_idempotency::{CouplingMode, PostgresStore};

const DEFAULT_ROWS: u64 = 5_000_000;
/// Rows per fill statement.
const CHUNK: u64 = 500_000;
/// The fill's replay ends spread over this many days, one partition of `answers` each.
const DAYS: u64 = 10;
const CLIENTS: usize = 8;
const WINDOW: Duration = Duration::from_secs(3);
const ROUNDS: usize = 3;

/// The two layouts.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Layout {
    One,
    Apart,
}

/// The SQL each layout needs, and what it does.
impl Layout {
    const BOTH: [Layout; 2] = [Layout::One, Layout::Apart];

    fn name(self) -> &'static str {
        match self {
            Layout::One => "one",
            Layout::Apart => "apart",
        }
    }

    /// The claim's write of a new record with its answer: `$1` identity, `$2` fingerprint,
    /// `$3` headers, `$4` body, `$5` operation id.
    fn insert(self) -> &'static str {
        match self {
            Layout::One => {
                "INSERT INTO one (record_id, state, fingerprint_version, fingerprint, response_status, \
                     response_headers, response_body, response_until, forget_at, operation, operation_id, \
                     updated_at, attempts) \
                 VALUES ($1, 'completed', 2, $2, 201, $3, $4, clock_timestamp() + interval '1 day', \
                     clock_timestamp() + interval '8 days', 'POST /orders', $5, NULL, NULL)"
            }
            Layout::Apart => {
                "WITH a AS (INSERT INTO answers (seq, until, response_headers, response_body) \
                     VALUES (nextval('answers_seq'), clock_timestamp() + interval '1 day', $3, $4) \
                     RETURNING seq, until) \
                 INSERT INTO slim (record_id, state, fingerprint_version, fingerprint, response_status, \
                     response_until, forget_at, operation, operation_id, answer_seq, updated_at, attempts) \
                 SELECT $1, 'completed', 2, $2, 201, a.until, a.until + interval '7 days', 'POST /orders', $5, a.seq, \
                     NULL, NULL \
                 FROM a"
            }
        }
    }

    /// A replay's read: the record and its answer by identity, `$1`.
    fn read(self) -> &'static str {
        match self {
            Layout::One => {
                "SELECT state, fingerprint, response_status, response_until <= now(), response_headers, \
                     response_body \
                 FROM one WHERE record_id = $1"
            }
            Layout::Apart => {
                "SELECT s.state, s.fingerprint, s.response_status, s.response_until <= now(), \
                     a.response_headers, a.response_body \
                 FROM slim s LEFT JOIN answers a ON a.seq = s.answer_seq AND a.until = s.response_until \
                 WHERE s.record_id = $1"
            }
        }
    }

    /// Heap, TOAST and indexes of the layout's tables (and their partitions), in bytes.
    async fn bytes(self, pool: &PgPool) -> i64 {
        let tables = match self {
            Layout::One => "SELECT 'one'::regclass AS rel",
            Layout::Apart => {
                "SELECT 'slim'::regclass AS rel UNION SELECT 'answers'::regclass \
                 UNION SELECT relid FROM pg_partition_tree('answers')"
            }
        };
        let sql = format!("SELECT sum(pg_total_relation_size(rel))::bigint FROM ({tables}) r");
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.expect("sizes")
    }
}

/// The identity of the benchmark's `n`th new record, and its operation id.
fn new_identity(n: u64) -> (Vec<u8>, Vec<u8>) {
    let id = Sha256::digest(format!("pg_layout new {n}")).to_vec();
    let operation_id = Sha256::digest([&id[..], b"op"].concat())[..16].to_vec();
    (id, operation_id)
}

/// The identity of the fill's `g`th record, as the fill's SQL makes it (`sha256(int8send(g))`).
fn filled_identity(g: u64) -> Vec<u8> {
    Sha256::digest(g.to_be_bytes()).to_vec()
}

fn main() {
    let rows: u64 = std::env::var("PG_LAYOUT_ROWS").ok().and_then(|r| r.parse().ok()).unwrap_or(DEFAULT_ROWS);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let database = BenchDatabase::create("tidem_layout", CLIENTS as u32 + 4).await;
        let pool = database.pool.clone();
        let cpu = PgCpu::of_database(database.name()).await;
        database.run_to_end(measure(pool, rows, cpu)).await;
    });
}

async fn measure(pool: PgPool, rows: u64, cpu: PgCpu) {
    let one = PostgresStore::new(pool.clone()).table("one").unwrap().mode(CouplingMode::Atomic);
    one.migrate().await.expect("migrate one");
    let by_day = std::env::var("PG_LAYOUT_ANSWERS").is_ok_and(|answers| answers == "by-day");
    create_apart(&pool, by_day).await;
    let answers = if by_day { format!("partitioned by day ({DAYS} with answers)") } else { "one table".to_owned() };
    println!("filling both layouts with {rows} records, answers over {DAYS} days; `answers`: {answers} ...");
    let started = Instant::now();
    fill(&pool, rows).await;
    sqlx::raw_sql("VACUUM (ANALYZE) one, slim, answers").execute(&pool).await.expect("vacuum");
    println!("filled in {:.0?}", started.elapsed());

    println!("\nbytes a record (heap, TOAST and indexes):");
    let one_bytes = Layout::One.bytes(&pool).await as f64 / rows as f64;
    let apart_bytes = Layout::Apart.bytes(&pool).await as f64 / rows as f64;
    let slim_bytes: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('slim')").fetch_one(&pool).await.unwrap();
    let slim_bytes = slim_bytes as f64 / rows as f64;
    println!("  one   {one_bytes:6.1}");
    println!(
        "  apart {apart_bytes:6.1} ({slim_bytes:.1} in slim, what a tombstone keeps; {:.1} in answers) = {:.2}x",
        apart_bytes - slim_bytes,
        apart_bytes / one_bytes
    );

    let fresh = Arc::new(AtomicU64::new(0));
    rounds("a new record", &pool, &cpu, |layout| Work::Insert(layout, fresh.clone())).await;
    rounds("a replay", &pool, &cpu, |layout| Work::Read(layout, rows)).await;
    let next_seq = layout_purge::tombstones(&pool, &cpu, rows, by_day).await;
    layout_purge::purge_while_serving(&pool, &cpu, &fresh, next_seq).await;
}

/// `slim`, `answers` (one table, or by day from today to the fill's last day and two more if
/// `by_day`) and its sequence.
async fn create_apart(pool: &PgPool, by_day: bool) {
    let mut sql = String::from(
        "CREATE TABLE slim (LIKE one INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
         ALTER TABLE slim DROP COLUMN response_headers, DROP COLUMN response_body, ADD COLUMN answer_seq bigint,
             ADD PRIMARY KEY (record_id);
         CREATE INDEX slim_operation_id_hash ON slim USING hash (operation_id) WHERE operation_id IS NOT NULL;
         CREATE INDEX slim_forget_idx ON slim (forget_at);
         CREATE INDEX slim_open_idx ON slim (lease_until) WHERE state IN ('processing', 'unknown');
         CREATE INDEX slim_unknown_idx ON slim (operation, created_at) WHERE state = 'unknown';
         CREATE INDEX slim_unknown_age_idx ON slim (created_at) WHERE state = 'unknown';
         CREATE SEQUENCE answers_seq;
         CREATE TABLE answers (seq bigint NOT NULL, until timestamptz NOT NULL, response_headers bytea,
             response_body bytea, ",
    );
    if by_day {
        // A partitioned table's primary key must hold its partition key.
        sql.push_str("PRIMARY KEY (seq, until)) PARTITION BY RANGE (until);");
        for day in 0..DAYS + 2 {
            sql.push_str(&format!(
                "CREATE TABLE answers_d{day} PARTITION OF answers FOR VALUES \
                 FROM ('today'::timestamptz + interval '{day} days') TO ('today'::timestamptz + interval '{next} days');",
                next = day + 1
            ));
        }
    } else {
        sql.push_str("PRIMARY KEY (seq));");
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.expect("create slim and answers");
}

/// Writes `rows` records into both layouts, alike: SHA-256 identities and fingerprints (random
/// order in the primary keys), the 300-byte answer varied in its first 16 bytes, and replay
/// ends spread evenly over [`DAYS`] days from today, a microsecond apart at least.
async fn fill(pool: &PgPool, rows: u64) {
    let headers = hex(&answer().encode_fields());
    let body = hex(answer_body().as_bytes());
    let until =
        format!("'today'::timestamptz + (g * {:.6}) * interval '1 second'", (DAYS * 86_400) as f64 / rows as f64);
    let mut from = 0;
    while from < rows {
        let to = (from + CHUNK).min(rows);
        let series = format!("FROM generate_series({from}::bigint, {to}::bigint - 1) g");
        let identity = "sha256(int8send(g)), 'completed', 2, sha256(int8send(-g))";
        let answer = format!("overlay('\\x{body}'::bytea placing decode(md5(g::text), 'hex') from 1)");
        // The rows take the form the store writes: no fencing token, attempts, scope digest or
        // `updated_at` (`pg_scale` checks that form against the store's own rows).
        let labels = "now() - interval '1 day' + g * interval '1 microsecond', \
                      'POST /orders', substr(sha256(int8send(g) || '\\x01'::bytea), 1, 16), NULL, NULL";
        let statement = format!(
            "INSERT INTO one (record_id, state, fingerprint_version, fingerprint, response_status, response_headers, \
                 response_body, response_until, forget_at, created_at, operation, operation_id, updated_at, attempts) \
             SELECT {identity}, 201, '\\x{headers}'::bytea, {answer}, {until}, {until} + interval '7 days', {labels} \
             {series};
             INSERT INTO answers (seq, until, response_headers, response_body) \
             SELECT g + 1, {until}, '\\x{headers}'::bytea, {answer} {series};
             INSERT INTO slim (record_id, state, fingerprint_version, fingerprint, response_status, response_until, \
                 forget_at, created_at, operation, operation_id, updated_at, attempts, answer_seq) \
             SELECT {identity}, 201, {until}, {until} + interval '7 days', {labels}, g + 1 {series};"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(pool).await.expect("fill");
        from = to;
    }
    sqlx::query("SELECT setval('answers_seq', $1)").bind(rows as i64).execute(pool).await.expect("setval");
}

/// What a replay reads: state, fingerprint, status, whether the replay has ended, headers, body.
type Replayed = (String, Vec<u8>, i16, bool, Option<Vec<u8>>, Option<Vec<u8>>);

/// What the clients of one window do.
#[derive(Clone)]
enum Work {
    /// New records, numbered from the shared counter.
    Insert(Layout, Arc<AtomicU64>),
    /// Replays of the fill's records, out of the first `u64`.
    Read(Layout, u64),
}

/// `CLIENTS` clients doing `work` for `WINDOW`, from a fresh checkpoint.
async fn window(pool: &PgPool, cpu: &PgCpu, work: Work) -> Spent {
    let meter = Meter::start(pool, cpu).await;
    let deadline = Instant::now() + WINDOW;
    let mut clients = Vec::new();
    for client in 0..CLIENTS as u64 {
        let (pool, work) = (pool.clone(), work.clone());
        clients.push(tokio::spawn(async move {
            let mut connection = pool.acquire().await.expect("a connection");
            let (headers, body) = (answer().encode_fields(), answer_body().into_bytes());
            let mut done = 0u64;
            while Instant::now() < deadline {
                match &work {
                    Work::Insert(layout, next) => {
                        let (id, operation_id) = new_identity(next.fetch_add(1, Ordering::Relaxed));
                        sqlx::query(layout.insert())
                            .bind(&id)
                            .bind(&[7u8; 32][..])
                            .bind(&headers)
                            .bind(&body)
                            .bind(&operation_id)
                            .execute(&mut *connection)
                            .await
                            .expect("insert");
                    }
                    Work::Read(layout, filled) => {
                        let g = (done * CLIENTS as u64 + client) * 7_919 % filled;
                        let row: Replayed = sqlx::query_as(layout.read())
                            .bind(filled_identity(g))
                            .fetch_one(&mut *connection)
                            .await
                            .expect("read");
                        assert_eq!(
                            row.5.map(|body| body.len()),
                            Some(body.len()),
                            "{layout:?}: the answer of record {g}"
                        );
                    }
                }
                done += 1;
            }
            done
        }));
    }
    let mut done = 0;
    for client in clients {
        done += client.await.expect("client");
    }
    meter.stop(pool, cpu, done).await
}

/// `ROUNDS` rounds of one window a layout, their order alternating; per round each side's
/// figures, then apart / one: rate, CPU and log (median and range of the rounds' ratios).
async fn rounds(what: &str, pool: &PgPool, cpu: &PgCpu, work: impl Fn(Layout) -> Work) {
    println!("\n{what}, {CLIENTS} clients, {ROUNDS} rounds of {WINDOW:?}, each window from a fresh checkpoint:");
    let mut ratios: [Vec<f64>; 3] = Default::default();
    for round in 0..ROUNDS {
        let mut order = Layout::BOTH;
        if round % 2 == 1 {
            order.reverse();
        }
        let mut spent = Vec::new();
        for layout in order {
            let window = window(pool, cpu, work(layout)).await;
            println!(
                "  round {round} {:<5} {:>7.0}/s, PostgreSQL CPU {} µs, log {:>6.0} B a record",
                layout.name(),
                window.per_second(),
                window.cpu_us().map_or_else(|| "n/a".to_owned(), |us| format!("{us:5.1}")),
                window.wal()
            );
            spent.push((layout, window));
        }
        spent.sort_by_key(|(layout, _)| *layout == Layout::Apart);
        let (one, apart) = (&spent[0].1, &spent[1].1);
        ratios[0].push(apart.per_second() / one.per_second());
        if let Some((a, o)) = apart.cpu_us().zip(one.cpu_us()) {
            ratios[1].push(a / o);
        }
        // A read writes no log (but what the server writes beside it): no ratio of nothing.
        if one.wal() >= 1.0 {
            ratios[2].push(apart.wal() / one.wal());
        }
    }
    for (label, ratios) in ["rate", "CPU a record", "log a record"].into_iter().zip(ratios) {
        ratio_line(&format!("  apart / one, {label}"), ratios);
    }
}
