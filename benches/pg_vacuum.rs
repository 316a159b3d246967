//! Vacuum and freezing of the records, on one table and on hash partitions (issue 16: the plan
//! for 3 billion records in `docs/scale.md` partitions the table for its vacuum and freezing,
//! and takes those figures from this benchmark).
//!
//! Each layout in turn, one table and then `PG_VACUUM_PARTITIONS` hash partitions (default 64),
//! in a database of its own (created at the start, dropped at the end, also after a panic), with
//! the answers apart in both (the layout the plan recommends; `PG_VACUUM_LAYOUT=inline` keeps
//! them inline):
//!
//! 1. **The table at its steady state**: `big` filled by SQL (`support/scale_fill.rs`) to
//!    `PG_VACUUM_ROWS` records (default 3.2 million), shaped as 30 days of seed 004's load: a
//!    day's share (1/30) of live records, a day's share past their response retention, a day's
//!    share past their tombstone time and the rest tombstones still kept; then `VACUUM
//!    (ANALYZE)`, so that every row is visible to all and none is frozen. Autovacuum is off on
//!    each of its tables, so that only the benchmark's vacuums run.
//! 2. **Freezing**: from a fresh checkpoint, `VACUUM (FREEZE)` of each table, one at a time
//!    (each partition, then the answers table apart), what an anti-wraparound vacuum does to rows
//!    that are all visible but not frozen (a record is frozen once: an aggressive vacuum skips
//!    the pages already all frozen).
//! 3. **The purge**: `Store::purge` in batches of 5,000 until nothing is due: a day's share of
//!    records deleted and a day's share of answers gone, or `PG_VACUUM_DAYS` days' (the fill
//!    then makes that many days' shares due), as the purge leaves them for a vacuum that runs
//!    every so many days.
//! 4. **The vacuum after it**: from a fresh checkpoint, `VACUUM` of each table, one at a time.
//!
//! Before 2, on the filled table, what a recovery pass's counts cost: the census of every record
//! by state (`Admin::counts`) against the open records alone (`Admin::open_counts`).
//!
//! For 2 and 4, per table group (the records, the answers): the wall time, and the slowest
//! partition's; PostgreSQL's CPU (the backends of the benchmark's database, `support/pg_cpu.rs`);
//! the write-ahead log written and its full-page images, which from a fresh checkpoint count the
//! pages the vacuum changed (the whole server's, so with nothing else running); and the buffers
//! read or found in shared buffers, heap and index apart (`pg_statio_all_tables`; a vacuum visits
//! a heap page it works on twice, and its visibility map's pages count with the heap), each per
//! record of the table. Last, the partitions against the one table (sums and slowest partition)
//! and every figure carried to 3 billion records: each grows with the table (a vacuum reads
//! every index page whatever it deletes, and a day's purge is a thirtieth of the records).
//!
//! `PG_VACUUM_WAL_COMPRESSION=lz4` (or `pglz`, `zstd`, as the server was built) sets
//! `wal_compression` on the connection that vacuums, so that its log can be read with the
//! full-page images compressed.
//!
//! Run with `cargo bench --bench pg_vacuum --all-features` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server). The tables here fit in memory: the times and CPU are
//! those of cached pages, and the buffers touched are what carries to a table that does not fit.
//! Not run by CI.

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/pg_cpu.rs"]
mod pg_cpu;
#[path = "support/scale_fill.rs"]
mod scale_fill;
#[path = "support/stored_answer.rs"]
mod stored_answer;
#[path = "support/table_size.rs"]
mod table_size;
#[path = "support/wal.rs"]
mod wal;

use std::time::{Duration, Instant};

use bench_db::BenchDatabase;
use pg_cpu::PgCpu;
use scale_fill::Groups;
use sqlx::{PgConnection, PgPool};
use tower_idempotency::store::Admin;
use tower_idempotency::{CouplingMode, PostgresStore, Store};

const DEFAULT_ROWS: u64 = 3_200_000;
const DEFAULT_PARTITIONS: u16 = 64;
/// The records of the plan: seed 004's 100 million a day, kept 30 days.
const PLAN_RECORDS: f64 = 3e9;
/// The days a record is kept: a day's share of the table is one of them.
const DAYS: u64 = 30;
const PURGE_BATCH: usize = 5_000;
const PAGE_BYTES: f64 = 8192.0;

/// One table of `big`: its oid and its name, as `VACUUM` takes it.
struct Table {
    oid: i64,
    name: String,
}

/// What vacuuming a group of tables, one at a time, took.
struct Pass {
    records: u64,
    wall: Duration,
    slowest: Duration,
    tables: usize,
    cpu_ns: Option<u64>,
    wal_bytes: i64,
    /// Buffers of the heaps (and their visibility maps) read or found in shared buffers.
    heap_buffers: i64,
    /// Buffers of their indexes, the same.
    index_buffers: i64,
    /// Full-page images written to the log (the whole server's): from a fresh checkpoint, the
    /// pages the vacuum changed.
    full_pages: i64,
}

impl Pass {
    fn per_record(&self, value: f64) -> f64 {
        value / self.records as f64
    }

    fn print(&self, what: &str) {
        let cpu = self.cpu_ns.map_or("n/a".into(), |ns| format!("{:.2} µs", self.per_record(ns as f64 / 1e3)));
        println!(
            "  {what:<28} {:>7.2?} (slowest of {} tables {:>7.2?}), per record: CPU {cpu}, log {:.1} B, \
             heap buffers {:.4}, index buffers {:.4}, full pages logged {:.4}",
            self.wall,
            self.tables,
            self.slowest,
            self.per_record(self.wal_bytes as f64),
            self.per_record(self.heap_buffers as f64),
            self.per_record(self.index_buffers as f64),
            self.per_record(self.full_pages as f64),
        );
    }
}

/// Everything measured on one layout.
struct Measured {
    layout: String,
    /// What was asked (the figures carry to the plan's records from its `rows`).
    run: Run,
    partitions: usize,
    freeze_records: Pass,
    freeze_answers: Option<Pass>,
    vacuum_records: Pass,
    vacuum_answers: Option<Pass>,
}

fn main() {
    let env = |name: &str| std::env::var(name).ok();
    let rows: u64 = env("PG_VACUUM_ROWS").map_or(DEFAULT_ROWS, |r| r.parse().expect("PG_VACUUM_ROWS: a count"));
    let partitions: u16 =
        env("PG_VACUUM_PARTITIONS").map_or(DEFAULT_PARTITIONS, |n| n.parse().expect("PG_VACUUM_PARTITIONS: a count"));
    let apart = match env("PG_VACUUM_LAYOUT").as_deref() {
        Some("apart") | None => true,
        Some("inline") => false,
        Some(other) => panic!("PG_VACUUM_LAYOUT: `apart` (the default) or `inline`, not {other:?}"),
    };
    let days: u64 = env("PG_VACUUM_DAYS").map_or(1, |d| d.parse().expect("PG_VACUUM_DAYS: a count of days"));
    assert!((1..=9).contains(&days), "PG_VACUUM_DAYS: 1 to 9");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut measured = Vec::new();
        for partitions in [None, Some(partitions)] {
            let database = BenchDatabase::create("tidem_vacuum", 4).await;
            let cpu = PgCpu::of_database(database.name()).await;
            let pool = database.pool.clone();
            let run = Run { rows, partitions, apart, days };
            measured.push(database.run_to_end(measure(pool, run, cpu)).await);
        }
        compare(&measured[0], &measured[1]);
    });
}

/// What one layout's run is asked for.
#[derive(Clone, Copy)]
struct Run {
    rows: u64,
    partitions: Option<u16>,
    apart: bool,
    /// The days of purge between two vacuums.
    days: u64,
}

async fn measure(pool: PgPool, run: Run, cpu: PgCpu) -> Measured {
    let Run { rows, partitions, apart, days } = run;
    let store = PostgresStore::new(pool.clone()).table("big").unwrap().mode(CouplingMode::Atomic);
    let store = match partitions {
        Some(n) => store.hash_partitions(n).expect("PG_VACUUM_PARTITIONS: 2 to 1024"),
        None => store,
    };
    let store = if apart { store.answers_apart() } else { store };
    store.migrate().await.expect("migrate");
    let layout = format!(
        "{}, answers {}",
        partitions.map_or("one table".into(), |n| format!("{n} hash partitions")),
        if apart { "apart" } else { "inline" }
    );
    println!("\n== {layout}: {rows} records ==");
    let (records, answers) = tables(&pool).await;
    for table in records.iter().chain(&answers) {
        let sql = format!("ALTER TABLE {} SET (autovacuum_enabled = off, toast.autovacuum_enabled = off)", table.name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await.expect("autovacuum off");
    }

    let share = rows / DAYS;
    let groups = Groups { live: share, stale: days * share, kept_tombstones: rows - (1 + 2 * days) * share };
    let started = Instant::now();
    scale_fill::fill(&pool, rows, groups, apart).await;
    table_size::vacuum(&pool).await;
    println!("filled and vacuumed in {:.0?}", started.elapsed());
    table_size::print_sizes(&pool, rows).await;
    let answer_rows = if apart { groups.answered() } else { rows };
    count_cost(&store, &cpu, rows).await;

    let mut connection = pool.acquire().await.expect("a connection");
    if let Ok(method) = std::env::var("PG_VACUUM_WAL_COMPRESSION") {
        // A session setting (superuser): only the vacuums' full-page images are compressed.
        let sql = format!("SET wal_compression = {method}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *connection).await.expect("PG_VACUUM_WAL_COMPRESSION");
        println!("the vacuums' connection compresses its full-page images: wal_compression = {method}");
    }
    wal::checkpoint(&pool).await;
    println!("freezing (VACUUM (FREEZE), each table in turn, from a fresh checkpoint):");
    let (freeze_records, freeze_answers) =
        vacuum_each(&mut connection, &cpu, (&records, answers.as_ref()), "FREEZE", (rows, answer_rows)).await;

    let count = |sql: &'static str| {
        let pool = &pool;
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await.expect("count") }
    };
    let records_before = count("SELECT count(*) FROM big").await;
    let answers_before = if apart { count("SELECT count(*) FROM big_answers").await } else { 0 };
    let started = Instant::now();
    let mut purged = 0;
    loop {
        let batch = store.purge(PURGE_BATCH).await.expect("purge");
        purged += batch;
        if batch == 0 {
            break;
        }
    }
    let records_deleted = records_before - count("SELECT count(*) FROM big").await;
    let answers_deleted = if apart { answers_before - count("SELECT count(*) FROM big_answers").await } else { 0 };
    println!(
        "{days} day(s) of purge: {purged} records purged in {:.1?} ({records_deleted} records deleted, \
         {answers_deleted} answers deleted; a day's share is {share})",
        started.elapsed()
    );

    wal::checkpoint(&pool).await;
    println!("the vacuum after it (VACUUM, each table in turn, from a fresh checkpoint):");
    let (vacuum_records, vacuum_answers) =
        vacuum_each(&mut connection, &cpu, (&records, answers.as_ref()), "", (rows, answer_rows)).await;
    Measured { layout, run, partitions: records.len(), freeze_records, freeze_answers, vacuum_records, vacuum_answers }
}

/// What the recovery worker's counts cost on this table: the census (`Admin::counts`, every
/// record by state) against the open records alone (`Admin::open_counts`), each three times,
/// the time of the fastest and PostgreSQL's CPU per call, and the census carried to the plan's
/// records.
async fn count_cost(store: &PostgresStore, cpu: &PgCpu, rows: u64) {
    println!("the recovery pass's counts, best of 3 (PostgreSQL's CPU per call):");
    for census in [true, false] {
        let (mut best, before) = (Duration::MAX, cpu.sample().await);
        for _ in 0..3 {
            let started = Instant::now();
            let counts = if census { store.counts().await } else { store.open_counts().await };
            counts.expect("counts");
            best = best.min(started.elapsed());
        }
        let spent = before.until(&cpu.sample().await).database_ns.map(|ns| ns as f64 / 3.0);
        let what = if census { "census (Admin::counts)" } else { "open records (Admin::open_counts)" };
        let cpu = spent.map_or("n/a".into(), |ns| format!("{:.1} ms", ns / 1e6));
        let carried = match spent {
            Some(ns) if census => {
                format!(", {:.0} s at {PLAN_RECORDS:.0} records", ns * PLAN_RECORDS / rows as f64 / 1e9)
            }
            _ => String::new(),
        };
        println!("  {what:<36} {best:>9.2?}, CPU {cpu}{carried}");
    }
}

/// The tables that hold `big`'s rows (itself, or each of its partitions) and its answers table,
/// if its answers are apart.
async fn tables(pool: &PgPool) -> (Vec<Table>, Option<Table>) {
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT c.oid::int8, c.oid::regclass::text FROM pg_class c \
         WHERE c.relkind = 'r' AND c.oid IN (SELECT 'big'::regclass UNION SELECT relid FROM pg_partition_tree('big')) \
         ORDER BY c.relname",
    )
    .fetch_all(pool)
    .await
    .expect("the records tables");
    let records = rows.into_iter().map(|(oid, name)| Table { oid, name }).collect();
    let answers: Option<(i64, String)> =
        sqlx::query_as("SELECT oid::int8, oid::regclass::text FROM pg_class WHERE oid = to_regclass('big_answers')")
            .fetch_optional(pool)
            .await
            .expect("the answers table");
    (records, answers.map(|(oid, name)| Table { oid, name }))
}

/// Vacuums the records' tables, then the answers table if there is one, one at a time with
/// `options`, and prints what each group took; `rows` are the records and the answers the
/// figures are divided by.
async fn vacuum_each(
    connection: &mut PgConnection,
    cpu: &PgCpu,
    (records, answers): (&[Table], Option<&Table>),
    options: &str,
    (rows, answer_rows): (u64, u64),
) -> (Pass, Option<Pass>) {
    let records = pass(connection, cpu, records, options, rows).await;
    records.print("records");
    let answers = match answers {
        Some(table) => Some(pass(connection, cpu, std::slice::from_ref(table), options, answer_rows).await),
        None => None,
    };
    if let Some(answers) = &answers {
        answers.print("answers");
    }
    (records, answers)
}

/// Vacuums `tables` one at a time with `options` on `connection`, and reads what it took; `records`
/// is the rows the figures are divided by.
async fn pass(connection: &mut PgConnection, cpu: &PgCpu, tables: &[Table], options: &str, records: u64) -> Pass {
    let oids: Vec<i64> = tables.iter().map(|table| table.oid).collect();
    let buffers_before = buffers(connection, &oids).await;
    let wal_before = wal::wal_position(&mut *connection).await;
    let cpu_before = cpu.sample().await;
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for table in tables {
        let one = Instant::now();
        let sql = if options.is_empty() {
            format!("VACUUM {}", table.name)
        } else {
            format!("VACUUM ({options}) {}", table.name)
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *connection).await.expect("vacuum");
        slowest = slowest.max(one.elapsed());
    }
    let wall = started.elapsed();
    let cpu_ns = cpu_before.until(&cpu.sample().await).database_ns;
    let wal_bytes = wal::wal_position(&mut *connection).await - wal_before;
    let (heap_after, index_after, full_pages_after) = buffers(connection, &oids).await;
    Pass {
        records,
        wall,
        slowest,
        tables: tables.len(),
        cpu_ns,
        wal_bytes,
        heap_buffers: heap_after - buffers_before.0,
        index_buffers: index_after - buffers_before.1,
        full_pages: full_pages_after - buffers_before.2,
    }
}

/// Heap and index buffers of the tables `oids` read or found in shared buffers so far, and the
/// full-page images the server has logged, once this connection's own counts are flushed to the
/// statistics (PostgreSQL flushes a session's counts when it next goes idle, at most once a
/// second unless asked to).
async fn buffers(connection: &mut PgConnection, oids: &[i64]) -> (i64, i64, i64) {
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *connection).await.expect("flush the statistics");
    sqlx::query_as(
        "SELECT COALESCE(sum(heap_blks_read + heap_blks_hit), 0)::int8, \
                COALESCE(sum(idx_blks_read + idx_blks_hit), 0)::int8, \
                (SELECT wal_fpi FROM pg_stat_wal) \
         FROM pg_statio_all_tables WHERE relid::int8 = ANY($1)",
    )
    .bind(oids)
    .fetch_one(connection)
    .await
    .expect("the pages read")
}

/// The partitioned layout against the one table, and both carried to [`PLAN_RECORDS`].
fn compare(one: &Measured, parts: &Measured) {
    println!("\n{} against {}:", parts.layout, one.layout);
    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}x", a / b) } else { "n/a".into() };
    let cpu = |pass: &Pass| pass.cpu_ns.map_or(f64::NAN, |ns| ns as f64);
    for (what, p, o) in [
        ("freezing the records", &parts.freeze_records, &one.freeze_records),
        ("vacuum after the purge", &parts.vacuum_records, &one.vacuum_records),
    ] {
        println!(
            "  {what:<28} all partitions / one table: wall {}, CPU {}, heap buffers {}, index buffers {}, log {}, full pages {}; \
             slowest partition / one table: wall {}",
            ratio(p.wall.as_secs_f64(), o.wall.as_secs_f64()),
            ratio(cpu(p), cpu(o)),
            ratio(p.heap_buffers as f64, o.heap_buffers as f64),
            ratio(p.index_buffers as f64, o.index_buffers as f64),
            ratio(p.wal_bytes as f64, o.wal_bytes as f64),
            ratio(p.full_pages as f64, o.full_pages as f64),
            ratio(p.slowest.as_secs_f64(), o.wall.as_secs_f64()),
        );
    }
    println!(
        "\ncarried to {PLAN_RECORDS:.0} records (each figure per record of this run times the records; the \
         answers table as measured on the one-table run, it is one table in both):"
    );
    let carried = |what: &str, pass: &Pass, per: usize| {
        let scale = PLAN_RECORDS / one.run.rows as f64 / per as f64;
        let cpu = pass.cpu_ns.map_or("n/a".into(), |ns| format!("{:.0} s", ns as f64 * scale / 1e9));
        println!(
            "  {what:<52} CPU {cpu:>7}, buffers heap {:>7.1} GiB, index {:>7.1} GiB, log {:>7.1} GiB, \
             {:>6.2} M pages changed",
            pass.heap_buffers as f64 * scale * PAGE_BYTES / 1073741824.0,
            pass.index_buffers as f64 * scale * PAGE_BYTES / 1073741824.0,
            pass.wal_bytes as f64 * scale / 1073741824.0,
            pass.full_pages as f64 * scale / 1e6,
        );
    };
    carried("freezing the records, one table", &one.freeze_records, 1);
    carried(
        &format!("freezing the records, each of {} partitions", parts.partitions),
        &parts.freeze_records,
        parts.partitions,
    );
    let after = format!("vacuum after {} day(s) of purge", one.run.days);
    carried(&format!("{after}, one table"), &one.vacuum_records, 1);
    carried(&format!("{after}, each of {} partitions", parts.partitions), &parts.vacuum_records, parts.partitions);
    if let (Some(freeze), Some(vacuum)) = (&one.freeze_answers, &one.vacuum_answers) {
        // The answers table holds a day's share of the records live and the days' past their
        // retention: at the plan's load 100 million answers a day, whatever the records.
        carried(&format!("freezing the answers ({} days' answers)", 1 + one.run.days), freeze, 1);
        carried("vacuum of the answers after the purge", vacuum, 1);
    }
}
