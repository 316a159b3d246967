//! What hash partitions cost a request, and what PostgreSQL's `plan_cache_mode` does to that,
//! in one run (issue 16; `docs/scale.md`, "What partitions cost a request"):
//! `POST /orders` through the layer in atomic mode, every store with its answers apart (the
//! layout `docs/scale.md` recommends for 3 billion records), on
//!
//! - `table`: one records table;
//! - `p64` and `p16`: a records table hash partitioned into 64 or 16 partitions
//!   (`PostgresStore::hash_partitions`);
//! - `p64 generic` and `p16 generic`: the same tables, through a pool of their own whose
//!   connections set `plan_cache_mode = force_generic_plan` (a connection option: the store does
//!   not set it, the pool is the application's). PostgreSQL 15 plans a statement on a
//!   partitioned table afresh on every execution, since its generic plan, costed over every
//!   partition, never looks cheaper; forced, the generic plan prunes at execution instead, but
//!   each execution locks every partition;
//! - `replay ...`: each of those with every request a retry of a key its scenario completed in
//!   its warm-up, through a store of its own (which, seeing only retries, reads first);
//! - `no layer`: the handler alone, for scale.
//!
//! The tables are nearly empty: what is measured is each statement's price on the layout, which
//! does not grow with the rows (`pg_scale` measures size). Scenarios run in rotated rounds like
//! `pg_orders` (`support/scenarios.rs`), each window reading PostgreSQL's CPU. Prints
//! throughput and CPU per request, and their ratios: each partitioned scenario against `table`,
//! and each generic one against its own layout planned as PostgreSQL chooses.
//! `PG_PARTITIONS_ROUNDS` overrides the number of rounds. Run with
//! `cargo bench --bench pg_partitions --all-features` (PostgreSQL must be running;
//! `DATABASE_URL` overrides the server). Not run by CI.

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
use orders_app::serve;
use pg_cpu::PgCpu;
use scenarios::{Scenario, print_cpu_ratio, print_table, print_throughput_ratio, retries_of, unique};
use sqlx::PgPool;
use tower_idempotency::{CouplingMode, IdempotencyLayer, PostgresStore};

const WARM_UP: Duration = Duration::from_secs(2);
/// One measured window; each scenario gets one per round.
const MEASURE: Duration = Duration::from_secs(3);
/// Rounds, unless `PG_PARTITIONS_ROUNDS` says otherwise.
const ROUNDS: usize = 5;
/// Connections of each of the two pools.
const POOL: u32 = 40;

/// An atomic store with its answers apart on `table`, hash partitioned into `partitions` if
/// that is not 0.
fn store(pool: &PgPool, table: &str, partitions: u16) -> PostgresStore {
    let store = PostgresStore::new(pool.clone()).table(table).expect("a valid table name");
    let store = if partitions == 0 { store } else { store.hash_partitions(partitions).expect("a valid count") };
    store.answers_apart().mode(CouplingMode::Atomic)
}

fn main() {
    let rounds = scenarios::rounds_from_env("PG_PARTITIONS_ROUNDS", ROUNDS);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let database = BenchDatabase::create("tidem_partitions", POOL).await;
        let pool = database.pool.clone();
        // Its connections plan every prepared statement generically.
        let generic = database.pool_with_plan_cache_mode("force_generic_plan", POOL).await;
        let cpu = PgCpu::of_database(database.name()).await;
        orders_app::create_orders_table(&pool).await;
        for (table, partitions) in [("records_table", 0), ("records_p64", 64), ("records_p16", 16)] {
            store(&pool, table, partitions).migrate().await.expect("migrate");
        }
        // Each scenario, and each replay, a server and a store of its own.
        let layered = |pool: &PgPool, table: &'static str, partitions: u16| {
            let (pool, store) = (pool.clone(), store(pool, table, partitions));
            async move { serve(pool, Some(IdempotencyLayer::new(store))).await }
        };
        let scenarios = [
            Scenario::new("no layer", serve::<PostgresStore>(pool.clone(), None).await, unique("bare")),
            Scenario::new("table", layered(&pool, "records_table", 0).await, unique("table")),
            Scenario::new("p64", layered(&pool, "records_p64", 64).await, unique("p64")),
            Scenario::new("p64 generic", layered(&generic, "records_p64", 64).await, unique("p64g")),
            Scenario::new("p16", layered(&pool, "records_p16", 16).await, unique("p16")),
            Scenario::new("p16 generic", layered(&generic, "records_p16", 16).await, unique("p16g")),
            Scenario::new("replay table", layered(&pool, "records_table", 0).await, retries_of("table")),
            Scenario::new("replay p64", layered(&pool, "records_p64", 64).await, retries_of("p64")),
            Scenario::new("replay p64 generic", layered(&generic, "records_p64", 64).await, retries_of("p64g")),
            Scenario::new("replay p16", layered(&pool, "records_p16", 16).await, retries_of("p16")),
            Scenario::new("replay p16 generic", layered(&generic, "records_p16", 16).await, retries_of("p16g")),
        ];
        scenarios::warm_up(&scenarios, WARM_UP).await;
        let results = scenarios::measure_in_rounds(&scenarios, rounds, MEASURE, &cpu).await;
        print_table(&results, rounds, MEASURE);
        let [bare, table, p64, p64g, p16, p16g, r_table, r_p64, r_p64g, r_p16, r_p16g] = &results[..] else {
            unreachable!("eleven scenarios")
        };
        let pairs = [
            ("p64 / table", p64, table),
            ("p16 / table", p16, table),
            ("p64 generic / p64", p64g, p64),
            ("p16 generic / p16", p16g, p16),
            ("p64 generic / table", p64g, table),
            ("p16 generic / table", p16g, table),
            ("replay p64 / replay table", r_p64, r_table),
            ("replay p16 / replay table", r_p16, r_table),
            ("replay p64 generic / replay p64", r_p64g, r_p64),
            ("replay p16 generic / replay p16", r_p16g, r_p16),
            ("table / no layer", table, bare),
            ("replay table / no layer", r_table, bare),
        ];
        for (label, numerator, denominator) in pairs {
            print_throughput_ratio(label, numerator, denominator, None);
        }
        println!("PostgreSQL CPU per request (database backends; whole server):");
        for (label, numerator, denominator) in pairs {
            print_cpu_ratio(label, numerator, denominator, None);
        }
        generic.close().await;
        database.drop().await;
    });
}
