//! A SQLite file of the benchmark's own in the temporary directory, in WAL mode, removed again
//! with its WAL and shared-memory files at the end.

use std::path::PathBuf;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

/// A fresh file named `<name>_<process id>.db` and a pool of connections to it.
pub struct SqliteFile {
    pub pool: SqlitePool,
    path: PathBuf,
}

impl SqliteFile {
    /// Creates the file, in WAL mode with `synchronous` and a busy timeout of 5 s, with a pool
    /// of at most `connections`.
    pub async fn create(name: &str, synchronous: SqliteSynchronous, connections: u32) -> Self {
        let path = std::env::temp_dir().join(format!("{name}_{}.db", std::process::id()));
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new().max_connections(connections).connect_with(options).await.expect("sqlite");
        Self { pool, path }
    }

    /// Closes the pool and removes the file, its WAL and its shared memory.
    pub async fn remove(self) {
        self.pool.close().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.path.display()));
        }
    }
}
