//! Guards that remove what a test made on the test server and disk: a PostgreSQL schema, a
//! PostgreSQL database, a SQLite file. Dropping a [`Cleanup`] removes its thing, whether the
//! test passed or panicked.
//!
//! A helper that hands out a bare store (the suites take a store, not a guard) keeps the guard
//! with [`Cleanup::until_test_ends`]: in a thread-local of the test's thread, dropped when that
//! thread ends. The test harness runs each test on a thread of its own and joins it, thread
//! locals dropped, before it reports and exits, so this runs after a panic too.
//!
//! Only a test process that is killed leaves its things behind; the SQLite sweep of
//! `support::sqlite_store` picks up such files later.
#![allow(dead_code)]

use std::cell::RefCell;
use std::path::PathBuf;

/// Something a test made, removed when the guard drops.
#[must_use = "the thing is removed when the guard drops: keep it as long as the test uses it"]
pub struct Cleanup {
    made: Made,
}

enum Made {
    /// A schema in the test database, and the application name its pools connect with.
    PgSchema(String),
    /// A database on the test server.
    PgDatabase(String),
    /// A SQLite database file, with its `-wal` and `-shm` companions.
    SqliteFile(PathBuf),
}

thread_local! {
    /// What the current test made and handed out without a guard; dropped when its thread ends.
    static UNTIL_TEST_ENDS: RefCell<Vec<Cleanup>> = const { RefCell::new(Vec::new()) };
}

impl Cleanup {
    /// Drops schema `name` (`CASCADE`) from the test database. Pools made for it by
    /// `support::pg_pool` connect with `name` as their application name; their sessions are
    /// ended first, so that a test that panicked while holding locks does not block the drop.
    pub fn pg_schema(name: &str) -> Self {
        Self { made: Made::PgSchema(name.to_owned()) }
    }

    /// Drops database `name` from the test server, ending any session still connected to it
    /// (`WITH (FORCE)`: a child process the test started may still be connected).
    pub fn pg_database(name: &str) -> Self {
        Self { made: Made::PgDatabase(name.to_owned()) }
    }

    /// Deletes the SQLite database at `path` with its `-wal` and `-shm` files.
    pub fn sqlite_file(path: impl Into<PathBuf>) -> Self {
        Self { made: Made::SqliteFile(path.into()) }
    }

    /// Keeps the guard until the current test's thread ends.
    pub fn until_test_ends(self) {
        UNTIL_TEST_ENDS.with(|made| made.borrow_mut().push(self));
    }

    fn remove(&self) -> Result<(), String> {
        match &self.made {
            Made::SqliteFile(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut file = path.clone().into_os_string();
                    file.push(suffix);
                    match std::fs::remove_file(&file) {
                        Ok(()) => {}
                        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                        Err(error) => return Err(format!("{}: {error}", PathBuf::from(file).display())),
                    }
                }
                Ok(())
            }
            Made::PgSchema(name) => admin(vec![
                // Waiting on a lock must end, if only with a warning.
                "SET lock_timeout = '30s'".to_owned(),
                format!(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name = '{name}' AND pid <> pg_backend_pid()"
                ),
                format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"),
            ]),
            Made::PgDatabase(name) => admin(vec![format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")]),
        }
    }

    fn describe(&self) -> String {
        match &self.made {
            Made::PgSchema(name) => format!("schema {name}"),
            Made::PgDatabase(name) => format!("database {name}"),
            Made::SqliteFile(path) => format!("SQLite file {}", path.display()),
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        // Never panic here: a panic while the test is already unwinding aborts the run.
        if let Err(error) = self.remove() {
            eprintln!("warning: could not remove the test's {}: {error}", self.describe());
        }
    }
}

/// The PostgreSQL server the tests use (`DATABASE_URL`, as in `support::database_url`).
fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Runs `statements` on one admin connection to the test database, on a thread and runtime of
/// its own: a guard may drop inside a test's runtime, on a runtime's worker, or as its thread
/// ends, and must work in each.
#[cfg(feature = "postgres")]
fn admin(statements: Vec<String>) -> Result<(), String> {
    let run = move || -> Result<(), String> {
        use sqlx::Connection;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        runtime.block_on(async {
            let mut conn = sqlx::PgConnection::connect(&database_url()).await.map_err(|e| e.to_string())?;
            for statement in statements {
                sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(&mut conn).await.map_err(|e| e.to_string())?;
            }
            conn.close().await.map_err(|e| e.to_string())
        })
    };
    std::thread::spawn(run).join().unwrap_or_else(|_| Err("the cleanup thread panicked".to_owned()))
}

#[cfg(not(feature = "postgres"))]
fn admin(_statements: Vec<String>) -> Result<(), String> {
    Err(format!("this build has no PostgreSQL support to reach {}", database_url()))
}
