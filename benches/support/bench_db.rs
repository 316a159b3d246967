//! A database of the benchmark's own on the PostgreSQL server, created at the start and dropped
//! at the end (also when the benchmark panics), so a benchmark never sees another's rows.

use sqlx::PgPool;

/// `DATABASE_URL`, or the local server's `test` database.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A fresh database named `<prefix>_<process id>` and a pool of `max_connections` on it.
pub struct BenchDatabase {
    pub pool: PgPool,
    name: String,
    /// Whether [`drop`](Self::drop) ran: else the database goes when the value does.
    dropped: bool,
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
        Self { pool: pool.expect("connect to the bench database"), name, dropped: false }
    }

    /// The database's name.
    #[allow(dead_code)] // Only the benchmarks that read PostgreSQL's CPU ask for it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Another pool of `max_connections` on the same database, whose connections set
    /// PostgreSQL's `plan_cache_mode` to `mode` (checked on one of them before it is returned).
    #[allow(dead_code)] // Only the benchmarks that compare plan cache modes ask for it.
    pub async fn pool_with_plan_cache_mode(&self, mode: &str, max_connections: u32) -> PgPool {
        let options = (*self.pool.connect_options()).clone().options([("plan_cache_mode", mode)]);
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(max_connections).connect_with(options).await;
        let pool = pool.expect("connect with the plan cache mode");
        let set: String = sqlx::query_scalar("SHOW plan_cache_mode").fetch_one(&pool).await.expect("read the mode");
        assert_eq!(set, mode, "the connection option must reach the session");
        pool
    }

    /// Runs `work` to its end as a task of its own, then drops the database, also when `work`
    /// panics (the panic is resumed once the database is gone).
    #[allow(dead_code)] // Only the benchmarks that run their measure as one task use it.
    pub async fn run_to_end<T: Send + 'static>(self, work: impl Future<Output = T> + Send + 'static) -> T {
        let outcome = tokio::spawn(work).await;
        self.drop().await;
        outcome.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))
    }

    /// Closes the pool and drops the database.
    pub async fn drop(mut self) {
        self.pool.close().await;
        drop_database(&self.name).await.expect("drop the bench database");
        self.dropped = true;
    }
}

impl Drop for BenchDatabase {
    /// A benchmark that panics, or returns before [`drop`](BenchDatabase::drop), still drops
    /// its database: from a thread and runtime of its own, since this may run while the
    /// benchmark's runtime unwinds.
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(drop_database(&name)).map_err(std::io::Error::other)
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop the bench database {}: drop it by hand", self.name);
        }
    }
}

/// Drops the database `name`, closing whatever connections it still has.
async fn drop_database(name: &str) -> Result<(), sqlx::Error> {
    let admin = PgPool::connect(&database_url()).await?;
    let statement = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&admin).await?;
    admin.close().await;
    Ok(())
}
