//! A PostgreSQL server of the benchmark's own, run under `valgrind --tool=callgrind`, so that
//! what a backend does for a transaction is counted in instructions: the same count whatever
//! else the machine is doing.
//!
//! The server gets a fresh data directory (made by `initdb` in the system's temporary
//! directory, removed again when the value is dropped) and a port of its own on 127.0.0.1. Its
//! binaries are those `pg_config --bindir` names (`PG_BINDIR` overrides). PostgreSQL refuses to
//! run as root: run as root, the benchmark runs the server as the user `PG_INSTRUCTIONS_USER`
//! names (default `postgres`), through `runuser`.
//!
//! Every process of the server writes its own callgrind file, `cg.<pid>`, when it exits. A
//! backend's pid is its connection's `pg_backend_pid()`, so a connection's count is read once
//! the connection is closed and its backend has exited ([`CallgrindPostgres::instructions_of`]).
//! With `PG_INSTRUCTIONS_KEEP` set, the files stay (the directory is printed at the end), for
//! `callgrind_annotate` to say where a backend's instructions went.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// How long the server under valgrind may take to start, and a backend to write its file.
const PATIENCE: Duration = Duration::from_secs(180);

/// A PostgreSQL server under callgrind, and its data directory.
pub struct CallgrindPostgres {
    dir: PathBuf,
    port: u16,
    server: Child,
}

impl CallgrindPostgres {
    /// Whether this machine has what the server needs (valgrind and PostgreSQL's binaries);
    /// `Err` says what is missing.
    pub fn available() -> Result<(), String> {
        if Command::new("valgrind").arg("--version").output().is_err() {
            return Err("valgrind is not installed".into());
        }
        let bindir = bindir().ok_or("PostgreSQL's binaries were not found (pg_config, or PG_BINDIR)")?;
        if !bindir.join("initdb").exists() || !bindir.join("postgres").exists() {
            return Err(format!("no initdb or postgres in {}", bindir.display()));
        }
        Ok(())
    }

    /// Makes a fresh cluster and starts it under callgrind; waits until it takes connections.
    pub async fn start() -> Self {
        let bindir = bindir().expect("PostgreSQL's binaries");
        let dir = std::env::temp_dir().join(format!("tidem_pg_instructions_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let user = server_user();
        if let Some(user) = &user {
            let status = Command::new("chown").arg(user).arg(&dir).status().expect("chown");
            assert!(status.success(), "hand the server's directory to {user}");
        }
        let data = dir.join("data");
        let initdb = as_server_user(&user, &bindir.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .status()
            .expect("run initdb");
        assert!(initdb.success(), "initdb failed");
        let port = free_port();
        let server = as_server_user(&user, Path::new("valgrind"))
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}/cg.%p", dir.display()))
            .arg("--vgdb=no")
            .arg(bindir.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1", "-k"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("server.log")).expect("the server's log"))
            .spawn()
            .expect("start PostgreSQL under valgrind");
        let server = Self { dir, port, server };
        let deadline = Instant::now() + PATIENCE;
        while server.options("postgres").connect().await.is_err() {
            assert!(Instant::now() < deadline, "the server under valgrind did not start");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        server
    }

    /// Options for a connection to `database` as `postgres`.
    pub fn options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new().host("127.0.0.1").port(self.port).username("postgres").database(database)
    }

    /// A pool of one connection to `database`, and the pid of that connection's backend. The
    /// pool never replaces its connection, so everything sent through it is that backend's.
    pub async fn one_connection(&self, database: &str) -> (PgPool, u32) {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(self.options(database))
            .await
            .expect("connect to the server under valgrind");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&pool).await.expect("the backend");
        (pool, u32::try_from(pid).expect("a pid"))
    }

    /// The instructions backend `pid` executed in its whole life. Closes nothing itself: its
    /// connection must have been closed (its pool's `close`); waits for the backend to exit and
    /// write its file.
    pub async fn instructions_of(&self, pid: u32) -> u64 {
        let file = self.dir.join(format!("cg.{pid}"));
        let deadline = Instant::now() + PATIENCE;
        loop {
            if !Path::new(&format!("/proc/{pid}")).exists()
                && let Some(total) = std::fs::read_to_string(&file).ok().as_deref().and_then(summary)
            {
                return total;
            }
            assert!(Instant::now() < deadline, "backend {pid} did not write its count");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for CallgrindPostgres {
    fn drop(&mut self) {
        // SIGINT: PostgreSQL's fast shutdown.
        let _ = Command::new("kill").args(["-INT", &self.server.id().to_string()]).status();
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline && matches!(self.server.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
        if keeps_files() {
            println!("the server's callgrind files are kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Whether the server's callgrind files stay when it is dropped (`PG_INSTRUCTIONS_KEEP`).
pub fn keeps_files() -> bool {
    std::env::var_os("PG_INSTRUCTIONS_KEEP").is_some()
}

/// The `summary:` line of a callgrind file: the instructions of the whole run.
fn summary(file: &str) -> Option<u64> {
    file.lines().find_map(|line| line.strip_prefix("summary:")).and_then(|n| n.trim().parse().ok())
}

fn bindir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BINDIR") {
        return Some(dir.into());
    }
    let output = Command::new("pg_config").arg("--bindir").output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().into())
}

/// The user the server runs as when the benchmark runs as root; `None` otherwise.
fn server_user() -> Option<String> {
    let uid = Command::new("id").arg("-u").output().expect("id -u");
    (String::from_utf8_lossy(&uid.stdout).trim() == "0")
        .then(|| std::env::var("PG_INSTRUCTIONS_USER").unwrap_or_else(|_| "postgres".into()))
}

fn as_server_user(user: &Option<String>, program: &Path) -> Command {
    match user {
        Some(user) => {
            let mut command = Command::new("runuser");
            command.args(["-u", user, "--"]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// A port nobody listens on now (the server binds it moments later).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}
