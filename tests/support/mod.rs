//! Shared set-up for tests against the real databases on this machine.
//!
//! Every call makes its own PostgreSQL schema (or SQLite file), so tests run in parallel and
//! never see each other's rows, and removes it when the test ends, passed or panicked (see
//! [`cleanup`]). `DATABASE_URL` overrides the PostgreSQL server
//! (default `postgres://postgres@127.0.0.1:5432/test`).
#![allow(dead_code)]

#[cfg(feature = "postgres")]
pub mod apart;
pub mod cleanup;
#[cfg(feature = "metrics")]
pub mod recorder;

pub use cleanup::Cleanup;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Stamps out the store suite and the HTTP contract suite in both coupling modes (modules
/// `atomic` and `leased`), each case on a fresh store from `$store(mode)`.
#[allow(unused_macros)] // Only the conformance test binaries stamp the suites out.
macro_rules! suites_in_both_modes {
    ($store:path) => {
        mod atomic {
            use tower_idempotency::CouplingMode;
            tower_idempotency::store_suite!(atomic, $store(CouplingMode::Atomic));

            mod lifecycle {
                use tower_idempotency::CouplingMode;
                tower_idempotency::lifecycle_suite!(atomic, $store(CouplingMode::Atomic));
            }

            mod http {
                use tower_idempotency::CouplingMode;
                tower_idempotency::http_contract_suite!($store(CouplingMode::Atomic));
            }
        }

        mod leased {
            use tower_idempotency::CouplingMode;
            tower_idempotency::store_suite!(leased, $store(CouplingMode::Leased));

            mod lifecycle {
                use tower_idempotency::CouplingMode;
                tower_idempotency::lifecycle_suite!(leased, $store(CouplingMode::Leased));
            }

            mod http {
                use tower_idempotency::CouplingMode;
                tower_idempotency::http_contract_suite!($store(CouplingMode::Leased));
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use suites_in_both_modes;

/// For each of `keys` keys, `duplicates` identical calls, `keys_at_once` keys at a time, every
/// call of a batch released together. `call(k, d, barrier)` makes call `d` of key `k`: it
/// prepares its request, waits on `barrier`, sends, and answers with the key's name and what
/// it got. The answers come back grouped by key.
pub async fn released_together<A, F, Fut>(
    keys: usize,
    duplicates: usize,
    keys_at_once: usize,
    call: F,
) -> std::collections::HashMap<String, Vec<A>>
where
    A: Send + 'static,
    F: Fn(usize, usize, std::sync::Arc<tokio::sync::Barrier>) -> Fut,
    Fut: std::future::Future<Output = (String, A)> + Send + 'static,
{
    let mut answers: std::collections::HashMap<String, Vec<A>> = std::collections::HashMap::new();
    for batch in (0..keys).collect::<Vec<_>>().chunks(keys_at_once) {
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(batch.len() * duplicates));
        let mut tasks = Vec::new();
        for &k in batch {
            for d in 0..duplicates {
                tasks.push(tokio::spawn(call(k, d, barrier.clone())));
            }
        }
        for task in tasks {
            let (key, answer) = task.await.expect("call task");
            answers.entry(key).or_default().push(answer);
        }
    }
    answers
}

/// For each of `keys` fresh identities, `duplicates` identical begins on `store`, released
/// together four keys at a time ([`released_together`]); a contender that claims stores the
/// answer `once`, one that finds the record checks it is that answer. How many times each key
/// was executed, and each key's answers (`claimed`, `replayed`, `in flight`).
#[cfg(feature = "testkit")]
pub async fn begins_released_together<S>(
    store: &S,
    keys: usize,
    duplicates: usize,
) -> (Vec<usize>, std::collections::HashMap<String, Vec<&'static str>>)
where
    S: tower_idempotency::Store + Clone + 'static,
{
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
    use tower_idempotency::{Begin, BeginRequest, Claim, Outcome, RecordState};

    let ids: Arc<Vec<_>> = Arc::new((0..keys).map(|_| fresh_id("released")).collect());
    let executions: Arc<Vec<AtomicUsize>> = Arc::new((0..keys).map(|_| AtomicUsize::new(0)).collect());
    let answers = released_together(keys, duplicates, 4, |k, _, barrier| {
        let (store, ids, executions) = (store.clone(), ids.clone(), executions.clone());
        async move {
            let fp = fingerprint(9);
            let request = BeginRequest::new(&ids[k], &fp).wait(std::time::Duration::from_secs(10));
            barrier.wait().await;
            let answer = match store.begin(request).await.expect("begin") {
                Begin::Claimed(claim) => {
                    executions[k].fetch_add(1, Ordering::SeqCst);
                    claim.finish(Outcome::Complete(answer("once"))).await.expect("finish");
                    "claimed"
                }
                Begin::Existing(record) => {
                    assert_eq!(record.state, RecordState::Completed);
                    assert_eq!(record.response.expect("the stored answer").body, "once");
                    "replayed"
                }
                Begin::InFlight { .. } => "in flight",
            };
            (k.to_string(), answer)
        }
    })
    .await;
    (executions.iter().map(|n| n.load(Ordering::SeqCst)).collect(), answers)
}

/// [`begins_released_together`] on `store`, asserting what it must give: an answer for every
/// key, and each key executed (claimed) exactly once. `label` names the case in a failure.
#[cfg(feature = "testkit")]
pub async fn each_identity_claimed_once<S>(store: &S, keys: usize, duplicates: usize, label: &str)
where
    S: tower_idempotency::Store + Clone + 'static,
{
    let (executions, answers) = begins_released_together(store, keys, duplicates).await;
    assert_eq!(answers.len(), keys, "{label}: every key answered");
    for (k, executions) in executions.iter().enumerate() {
        assert_eq!(*executions, 1, "{label}: key {k} must be executed exactly once");
    }
    for (key, answers) in &answers {
        assert_eq!(answers.iter().filter(|a| **a == "claimed").count(), 1, "{label}: key {key}: {answers:?}");
    }
}

/// The PostgreSQL server the tests use.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A name no other test of any run uses.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{prefix}_{}_{}_{nanos}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Creates schema `schema` in the test database; the guard drops it (with everything in it).
#[cfg(feature = "postgres")]
pub async fn pg_schema(schema: &str) -> Cleanup {
    let admin = sqlx::PgPool::connect(&database_url()).await.expect("PostgreSQL must be running for these tests");
    // The guard first: whatever happens next, the schema goes when the test ends.
    let cleanup = Cleanup::pg_schema(schema);
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"")))
        .execute(&admin)
        .await
        .expect("create the test schema");
    admin.close().await;
    cleanup
}

/// A pool on the test server with room for `connections`, whose connections look in `schema`
/// first. The schema is created if need be and dropped when the test ends; the pool's
/// connections carry `schema` as their application name, so that the drop can end them.
#[cfg(feature = "postgres")]
pub async fn pg_pool(schema: &str, connections: u32) -> sqlx::PgPool {
    pg_pool_with(schema, connections, Duration::from_secs(30)).await
}

/// [`pg_pool`], with the pool's own acquire timeout.
#[cfg(feature = "postgres")]
pub async fn pg_pool_with(schema: &str, connections: u32, acquire_timeout: Duration) -> sqlx::PgPool {
    pg_pool_setting(schema, connections, acquire_timeout, &[]).await
}

/// [`pg_pool`], its connections planning every prepared statement generically
/// (`plan_cache_mode = force_generic_plan`, the connection option `docs/scale.md` recommends
/// for a store on hash partitions).
#[cfg(feature = "postgres")]
pub async fn pg_generic_plan_pool(schema: &str, connections: u32) -> sqlx::PgPool {
    pg_pool_setting(schema, connections, Duration::from_secs(30), &[("plan_cache_mode", "force_generic_plan")]).await
}

/// [`pg_generic_plan_pool`], each connection also sending the client the plan of every statement
/// it runs, nested ones (in functions) too, as it finishes: PostgreSQL's `auto_explain` loaded
/// into the session, logging at `LOG`, which `client_min_messages = log` sends to the client
/// (sqlx hands such notices to `tracing`, target `sqlx::postgres::notice`, at `TRACE`).
#[cfg(feature = "postgres")]
pub async fn pg_explained_generic_plan_pool(schema: &str, connections: u32) -> sqlx::PgPool {
    let settings = [
        ("plan_cache_mode", "force_generic_plan"),
        ("session_preload_libraries", "auto_explain"),
        ("auto_explain.log_min_duration", "0"),
        ("auto_explain.log_nested_statements", "on"),
        ("client_min_messages", "log"),
    ];
    pg_pool_setting(schema, connections, Duration::from_secs(30), &settings).await
}

/// [`pg_pool_with`], each connection also setting the server parameters `settings`.
#[cfg(feature = "postgres")]
async fn pg_pool_setting(
    schema: &str,
    connections: u32,
    acquire_timeout: Duration,
    settings: &[(&str, &str)],
) -> sqlx::PgPool {
    use sqlx::ConnectOptions;
    pg_schema(schema).await.until_test_ends();
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().expect("DATABASE_URL");
    let options = options.options([("search_path", schema)]).options(settings.iter().copied());
    let options = options.application_name(schema).log_statements(tracing_level());
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(acquire_timeout)
        .connect_with(options)
        .await
        .expect("connect")
}

#[cfg(feature = "postgres")]
fn tracing_level() -> tracing::log::LevelFilter {
    tracing::log::LevelFilter::Trace
}

/// How many connections each test store's pool may open: two tests run at once, and the server
/// allows 100 connections in all.
#[cfg(feature = "postgres")]
const STORE_CONNECTIONS: u32 = 24;

/// A store in mode `mode` on `pool`, in `schema` (the pool's own), laid out by `layout`, migrated.
#[cfg(feature = "postgres")]
async fn migrated_store(
    pool: sqlx::PgPool,
    schema: &str,
    mode: tower_idempotency::CouplingMode,
    layout: impl FnOnce(tower_idempotency::PostgresStore) -> tower_idempotency::PostgresStore,
) -> tower_idempotency::PostgresStore {
    let store = tower_idempotency::PostgresStore::new(pool).schema(schema).expect("schema name");
    let store = layout(store).mode(mode);
    store.migrate().await.expect("migrate");
    store
}

/// A migrated PostgreSQL store in a schema of its own.
#[cfg(feature = "postgres")]
pub async fn pg_store(mode: tower_idempotency::CouplingMode) -> tower_idempotency::PostgresStore {
    let schema = unique_name("tidem");
    migrated_store(pg_pool(&schema, STORE_CONNECTIONS).await, &schema, mode, |store| store).await
}

/// How many hash partitions [`pg_partitioned_store`] gives its table: enough that a test's
/// records spread over several, few enough that creating a schema per test stays quick.
#[cfg(feature = "postgres")]
pub const TEST_PARTITIONS: u16 = 8;

/// A migrated PostgreSQL store in a schema of its own, its table hash partitioned into
/// [`TEST_PARTITIONS`] partitions.
#[cfg(feature = "postgres")]
pub async fn pg_partitioned_store(mode: tower_idempotency::CouplingMode) -> tower_idempotency::PostgresStore {
    let schema = unique_name("tidem");
    let partitioned = |store: tower_idempotency::PostgresStore| store.hash_partitions(TEST_PARTITIONS).expect("count");
    migrated_store(pg_pool(&schema, STORE_CONNECTIONS).await, &schema, mode, partitioned).await
}

/// A migrated PostgreSQL store in a schema of its own, its answers apart
/// (`PostgresStore::answers_apart`).
#[cfg(feature = "postgres")]
pub async fn pg_apart_store(mode: tower_idempotency::CouplingMode) -> tower_idempotency::PostgresStore {
    let schema = unique_name("tidem");
    let apart = |store: tower_idempotency::PostgresStore| store.answers_apart();
    migrated_store(pg_pool(&schema, STORE_CONNECTIONS).await, &schema, mode, apart).await
}

/// A migrated PostgreSQL store in a schema of its own, its table hash partitioned into
/// [`TEST_PARTITIONS`] partitions and its answers apart.
#[cfg(feature = "postgres")]
pub async fn pg_partitioned_apart_store(mode: tower_idempotency::CouplingMode) -> tower_idempotency::PostgresStore {
    let store = pg_partitioned_store(mode).await;
    let store = store.answers_apart();
    store.migrate().await.expect("migrate to answers apart");
    store
}

/// The layout `docs/scale.md` recommends for billions of records, as it recommends deploying
/// it: a migrated PostgreSQL store in a schema of its own, its table hash partitioned into
/// [`TEST_PARTITIONS`] partitions and its answers apart, on a [`pg_generic_plan_pool`].
#[cfg(feature = "postgres")]
pub async fn pg_generic_plan_store(mode: tower_idempotency::CouplingMode) -> tower_idempotency::PostgresStore {
    let schema = unique_name("tidem");
    let recommended = |store: tower_idempotency::PostgresStore| {
        store.hash_partitions(TEST_PARTITIONS).expect("count").answers_apart()
    };
    migrated_store(pg_generic_plan_pool(&schema, STORE_CONNECTIONS).await, &schema, mode, recommended).await
}
pub mod server;
#[cfg(feature = "axum")]
pub mod storm;

/// A fresh path for a SQLite database file in the system temp dir, and the guard that deletes
/// the file (with its `-wal` and `-shm` companions). The first call of a run also deletes the
/// files that killed runs left (older than ten minutes).
pub fn sqlite_path(prefix: &str) -> (std::path::PathBuf, Cleanup) {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(|| {
        let stale = |entry: &std::fs::DirEntry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours = name.starts_with("tidem_") && [".db", ".db-wal", ".db-shm"].iter().any(|e| name.ends_with(e));
            let age = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
            ours && age.is_some_and(|age| age > Duration::from_secs(600))
        };
        for entry in std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
            if stale(&entry) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    });
    let path = std::env::temp_dir().join(unique_name(prefix) + ".db");
    let cleanup = Cleanup::sqlite_file(&path);
    (path, cleanup)
}

/// A migrated SQLite store on a database file of its own in the system temp dir, in WAL mode,
/// with room for the suites' concurrent cases: 32 connections, and a 10 s busy timeout for
/// writers queueing on the write lock. The file is deleted when the test ends.
#[cfg(feature = "sqlite")]
pub async fn sqlite_store(mode: tower_idempotency::CouplingMode) -> tower_idempotency::SqliteStore {
    sqlite_store_with(mode, 32, Duration::from_secs(30)).await
}

/// [`sqlite_store`] with room for `connections`, and the pool's own acquire timeout.
#[cfg(feature = "sqlite")]
pub async fn sqlite_store_with(
    mode: tower_idempotency::CouplingMode,
    connections: u32,
    acquire_timeout: Duration,
) -> tower_idempotency::SqliteStore {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
    let (path, cleanup) = sqlite_path("tidem");
    cleanup.until_test_ends();
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(10))
        .foreign_keys(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(acquire_timeout)
        .connect_with(options)
        .await
        .expect("open the SQLite test database");
    let store = tower_idempotency::SqliteStore::new(pool).mode(mode);
    store.migrate().await.expect("migrate");
    store
}

#[cfg(feature = "redis")]
pub mod redis;
