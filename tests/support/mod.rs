//! Shared set-up for tests against the real databases on this machine.
//!
//! Every call makes its own PostgreSQL schema (or SQLite file), so tests run in parallel and
//! never see each other's rows. `DATABASE_URL` overrides the PostgreSQL server
//! (default `postgres://postgres@127.0.0.1:5432/test`).
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

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

/// A pool on the test server with room for `connections`, whose connections look in `schema`
/// first.
#[cfg(feature = "postgres")]
pub async fn pg_pool(schema: &str, connections: u32) -> sqlx::PgPool {
    use sqlx::ConnectOptions;
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().expect("DATABASE_URL");
    let options = options.options([("search_path", schema)]).log_statements(tracing_level());
    let admin = sqlx::PgPool::connect_with(options.clone()).await.expect("PostgreSQL must be running for these tests");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"")))
        .execute(&admin)
        .await
        .expect("create the test schema");
    admin.close().await;
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("connect")
}

#[cfg(feature = "postgres")]
fn tracing_level() -> tracing::log::LevelFilter {
    tracing::log::LevelFilter::Trace
}

/// A migrated PostgreSQL store in a schema of its own.
#[cfg(feature = "postgres")]
pub async fn pg_store(mode: tower_idempotency::CouplingMode) -> tower_idempotency::PostgresStore {
    let schema = unique_name("tidem");
    let pool = pg_pool(&schema, 48).await;
    let store = tower_idempotency::PostgresStore::new(pool).schema(&schema).expect("schema name").mode(mode);
    store.migrate().await.expect("migrate");
    store
}
