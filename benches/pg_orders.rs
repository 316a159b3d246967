//! `POST /orders` on PostgreSQL under concurrent load, in one run, through real sockets:
//!
//! - `no layer`: the handler writes the order in its own transaction, no idempotency;
//! - `floor`: no layer; the handler writes the order and, in the same transaction, a row of its
//!   answer in a table of the layer's shape, with prepared statements. It does none of the
//!   layer's work (no read that answers retries, no wait for a concurrent duplicate, no
//!   fingerprint, no buffering): only the extra row that keeps the answer with the order. So
//!   `floor / no layer` is what that row alone costs on this machine, and bounds what
//!   `atomic / no layer` can reach here;
//! - `floor+read`: the floor, and what no claim can skip either: BEGIN travels with a read of the
//!   record by its primary key (one round trip, as the store's claim goes), and the record
//!   carries the labels the store keeps (operation, scope digest, operation id). No lock, no
//!   function, no layer. `atomic / floor+read` is what the claim's wait for a concurrent
//!   duplicate, its function call and the layer cost beyond that read;
//! - `floor+prep`: the same, with the cheapest read sqlx can send instead: `BEGIN`, then the
//!   record read by a prepared statement (parsed and planned once per connection) in a round
//!   trip of its own;
//! - `memory`: the layer over `MemoryStore`, the handler writing in its own transaction: the
//!   layer's own work (buffering, fingerprint, capture, replay bookkeeping) with no store round
//!   trips, so `memory / no layer` is what that work costs;
//! - `atomic`: the layer in atomic mode; the handler writes through the claim's transaction.
//!   Its store chooses whether to read a record before it claims (`ReadBeforeClaim::Adaptive`,
//!   the default): with every request a new key, it claims first;
//! - `read first`: the same, with the store told always to read first
//!   (`ReadBeforeClaim::Always`, the path before the choice existed): `atomic / read first` is
//!   what claiming first gives new keys;
//! - `leased`: the layer in leased mode; the handler writes in its own transaction;
//! - `replay`: the layer in atomic mode, every request a retry of a completed key, through a
//!   store of its own on the same table (which, seeing only retries, reads first);
//! - `apart` and `replay apart`: `atomic` and `replay` on a records table of their own with its
//!   answers apart (`PostgresStore::answers_apart`): `apart / atomic` is what the layout costs a
//!   new request (the answer's row beside the record's), `replay apart / replay` what it costs a
//!   retry (the read's join to the answer).
//!
//! Each scenario gets a warm-up, then `ROUNDS` measuring windows with `CONCURRENCY` keep-alive
//! clients, one window per scenario per round, the order rotated each round. It prints
//! throughput, p50 and p99 latency over all windows, and the ratios the project tracks: overall,
//! and the median and range of the per-round ratios (windows of one round run minutes apart at
//! most, so they share the machine's mood). `PG_ORDERS_ROUNDS` overrides the number of rounds.
//!
//! Each window also reads **PostgreSQL's CPU per request** (`support/pg_cpu.rs`): the user +
//! system CPU time of the benchmark database's backends over the window, divided by the
//! window's requests, and the same for every process of the server (postmaster, its children,
//! and the reaped children's cumulative time). Where the database is the shared, scarce machine
//! and API servers scale out, this decides how many requests a cluster takes; throughput on one
//! small box, where client, server and database share the CPUs, hides it. The CPU ratios are
//! reported like the throughput ratios: overall, and the per-round median and range.
//! `PG_ORDERS_PROFILE=<scenario>` (`atomic`, `floor`, ...) drives that scenario alone for 20 s after
//! the warm-up, for a profiler attached to the server meanwhile (`perf record -a -g`), and stops.
//! Run with `cargo bench --bench pg_orders --all-features` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server, default `postgres://postgres@127.0.0.1:5432/test`).

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/http_load.rs"]
mod http_load;
#[path = "support/orders_app.rs"]
mod orders_app;
#[path = "support/pg_cpu.rs"]
mod pg_cpu;
#[path = "support/scenarios.rs"]
mod scenarios;

use std::time::Duration;

use bench_db::BenchDatabase;
use orders_app::{serve, serve_floor, serve_floor_with_prepared_read, serve_floor_with_read};
use pg_cpu::PgCpu;
use scenarios::{Scenario, print_cpu_ratio, print_table, print_throughput_ratio, retries_of, unique};
use tower_idempotency::store::postgres::ReadBeforeClaim;
use tower_idempotency::{CouplingMode, IdempotencyLayer, MemoryStore, PostgresStore};

const WARM_UP: Duration = Duration::from_secs(2);
/// One measured window; each scenario gets one per round.
const MEASURE: Duration = Duration::from_secs(3);
/// How long `PG_ORDERS_PROFILE` drives its scenario.
const PROFILE: Duration = Duration::from_secs(20);
/// Rounds, unless `PG_ORDERS_ROUNDS` says otherwise.
const ROUNDS: usize = 5;
const POOL: u32 = 40;

fn main() {
    let rounds = scenarios::rounds_from_env("PG_ORDERS_ROUNDS", ROUNDS);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let database = BenchDatabase::create("tidem_bench", POOL).await;
        let pool = database.pool.clone();
        let cpu = PgCpu::of_database(database.name()).await;
        orders_app::create_orders_table(&pool).await;
        let atomic = PostgresStore::new(pool.clone()).mode(CouplingMode::Atomic);
        atomic.migrate().await.unwrap();
        let leased = atomic.clone().leased();

        let bare = serve::<PostgresStore>(pool.clone(), None).await;
        let floor = serve_floor(pool.clone()).await;
        let floor_with_read = serve_floor_with_read(pool.clone()).await;
        let floor_with_prepared_read = serve_floor_with_prepared_read(pool.clone()).await;
        let with_memory = serve(pool.clone(), Some(IdempotencyLayer::new(MemoryStore::new()))).await;
        let with_atomic = serve(pool.clone(), Some(IdempotencyLayer::new(atomic.clone()))).await;
        let reading =
            PostgresStore::new(pool.clone()).mode(CouplingMode::Atomic).read_before_claim(ReadBeforeClaim::Always);
        let with_reading = serve(pool.clone(), Some(IdempotencyLayer::new(reading))).await;
        let with_leased = serve(pool.clone(), Some(IdempotencyLayer::new(leased))).await;
        // The retries go to a server of their own on the same table: a store chooses whether to
        // read before it claims from the requests it sees (`ReadBeforeClaim::Adaptive`), and
        // the windows of the two scenarios alternate, as no one service's traffic does.
        let replaying = PostgresStore::new(pool.clone()).mode(CouplingMode::Atomic);
        let with_replaying = serve(pool.clone(), Some(IdempotencyLayer::new(replaying))).await;
        // Answers apart: a table of its own, and (as for `replay`) a store of its own for the
        // retries.
        let apart = || {
            PostgresStore::new(pool.clone())
                .table("idempotency_records_apart")
                .unwrap()
                .answers_apart()
                .mode(CouplingMode::Atomic)
        };
        apart().migrate().await.unwrap();
        let with_apart = serve(pool.clone(), Some(IdempotencyLayer::new(apart()))).await;
        let with_replaying_apart = serve(pool.clone(), Some(IdempotencyLayer::new(apart()))).await;
        let scenarios = [
            Scenario::new("no layer", bare, unique("bare")),
            Scenario::new("floor", floor, unique("floor")),
            Scenario::new("floor+read", floor_with_read, unique("floor-read")),
            Scenario::new("floor+prep", floor_with_prepared_read, unique("floor-prepared-read")),
            Scenario::new("memory", with_memory, unique("memory")),
            Scenario::new("atomic", with_atomic, unique("atomic")),
            Scenario::new("read first", with_reading, unique("reading")),
            Scenario::new("leased", with_leased, unique("leased")),
            // Retries of 1000 keys the atomic scenario completed in its warm-up.
            Scenario::new("replay", with_replaying, retries_of("atomic")),
            Scenario::new("apart", with_apart, unique("apart")),
            // Retries of 1000 keys the apart scenario completed in its warm-up.
            Scenario::new("replay apart", with_replaying_apart, retries_of("apart")),
        ];
        scenarios::warm_up(&scenarios, WARM_UP).await;
        // `PG_ORDERS_PROFILE=<scenario>`: drive that scenario alone, for a profiler attached to
        // the server meanwhile, and stop.
        if let Ok(name) = std::env::var("PG_ORDERS_PROFILE") {
            let scenario = scenarios.iter().find(|s| s.name == name).expect("PG_ORDERS_PROFILE names a scenario");
            let requests = scenario.drive(PROFILE).await.len();
            println!("{name}: {requests} requests in {PROFILE:?}");
            database.drop().await;
            return;
        }
        // Rounds of one window per scenario, the order rotated each round, so that a slow
        // stretch of this shared machine falls on every scenario alike.
        let results = scenarios::measure_in_rounds(&scenarios, rounds, MEASURE, &cpu).await;
        print_table(&results, rounds, MEASURE);
        let [bare, floor, floor_read, floor_prepared, memory, atomic, reading, leased, replay, apart, replay_apart] =
            &results[..]
        else {
            unreachable!("eleven scenarios")
        };
        for (label, numerator, denominator, aim) in [
            ("atomic / no layer", atomic, bare, Some(0.75)),
            ("floor / no layer ", floor, bare, None),
            ("memory / no layer", memory, bare, None),
            ("atomic / floor   ", atomic, floor, Some(0.9)),
            ("read first / floor", reading, floor, None),
            ("atomic / read first", atomic, reading, None),
            ("floor+read / floor", floor_read, floor, None),
            ("atomic / floor+read", atomic, floor_read, None),
            ("floor+prep / floor", floor_prepared, floor, None),
            ("atomic / floor+prep", atomic, floor_prepared, None),
            ("atomic / leased  ", atomic, leased, Some(1.2)),
            ("replay / atomic  ", replay, atomic, Some(2.0)),
            ("apart / atomic   ", apart, atomic, None),
            ("apart / floor    ", apart, floor, None),
            ("replay apart / replay", replay_apart, replay, None),
        ] {
            print_throughput_ratio(label, numerator, denominator, aim);
        }
        println!("PostgreSQL CPU per request (database backends; whole server):");
        for (label, numerator, denominator, aim) in [
            ("atomic / floor   ", atomic, floor, Some(1.15)),
            ("read first / floor", reading, floor, None),
            ("atomic / read first", atomic, reading, None),
            ("floor+read / floor", floor_read, floor, None),
            ("atomic / floor+read", atomic, floor_read, None),
            ("floor+prep / floor", floor_prepared, floor, None),
            ("atomic / floor+prep", atomic, floor_prepared, None),
            ("atomic / no layer", atomic, bare, None),
            ("floor / no layer ", floor, bare, None),
            ("replay / no layer", replay, bare, Some(0.5)),
            ("apart / atomic   ", apart, atomic, None),
            ("apart / floor    ", apart, floor, Some(1.15)),
            ("replay apart / replay", replay_apart, replay, None),
            ("replay apart / no layer", replay_apart, bare, Some(0.5)),
        ] {
            print_cpu_ratio(label, numerator, denominator, aim);
        }

        database.drop().await;
    });
}
