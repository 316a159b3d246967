//! A database of the benchmark's own on the PostgreSQL server, created at the start and dropped
//! at the end, so a benchmark never sees another's rows.

use sqlx::PgPool;

/// `DATABASE_URL`, or the local server's `test` database.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A fresh database named `<prefix>_<process id>` and a pool of `max_connections` on it.
pub struct BenchDatabase {
    pub pool: PgPool,
    name: String,
}

impl BenchDatabase {
    /// Creates the database (dropping a leftover of the same name first) and connects to it.
    pub async fn create(prefix: &str, max_connections: u32) -> Self {
        let base = database_url();
        let name = format!("{prefix}_{}", std::process::id());
        let admin = PgPool::connect(&base).await.expect("PostgreSQL must be running");
        for statement in [format!("DROP DATABASE IF EXISTS \"{name}\""), format!("CREATE DATABASE \"{name}\"")] {
            sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&admin).await.expect("create the bench database");
        }
        admin.close().await;
        let url = format!("{}/{name}", &base[..base.rfind('/').expect("a database URL with a path")]);
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(max_connections).connect(&url).await;
        Self { pool: pool.expect("connect to the bench database"), name }
    }

    /// The database's name.
    #[allow(dead_code)] // Only the benchmarks that read PostgreSQL's CPU ask for it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Closes the pool and drops the database.
    pub async fn drop(self) {
        self.pool.close().await;
        let admin = PgPool::connect(&database_url()).await.expect("PostgreSQL must be running");
        let statement = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&admin).await.expect("drop the bench database");
    }
}
