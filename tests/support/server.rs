//! The reference service as a real child process, and a minimal HTTP/1.1 client for it.
//!
//! The client is deliberately small: one request per connection (`Connection: close`), a
//! timeout on every step, and every failure reported as an error the caller may retry.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The `orders` example binary that `cargo test` builds next to the tests.
pub fn orders_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let target_profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
    let binary = target_profile.join("examples").join(format!("orders{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.exists(),
        "{} is missing: run the tests with `cargo test --all-features`, which builds the examples",
        binary.display()
    );
    binary
}

/// A free loopback port, so every restart of the server listens at the same address.
///
/// Taken below the kernel's ephemeral range (`ip_local_port_range`): the kernel gives ports of
/// that range to every client connection and every `:0` bind, so a port taken there can be
/// handed to one of them between this pick and the server's bind, or while a killed server is
/// down ("Address already in use"). Below it only explicit binds compete: each candidate must
/// bind, and this process never hands out one port twice.
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::hash::BuildHasher;
    use std::sync::Mutex;

    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    const LOWEST: u32 = 20_000;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral.saturating_sub(LOWEST);
    assert!(span >= 1_000, "no room for test ports below the ephemeral range, which starts at {ephemeral}");
    // A random starting point, so that processes started together seldom try the same ports.
    let start = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    let mut given = GIVEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    for step in 0..u64::from(span) {
        let port = (LOWEST + (start.wrapping_add(step) % u64::from(span)) as u32) as u16;
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return port;
        }
    }
    panic!("no free loopback port between {LOWEST} and {ephemeral}");
}

/// The example server, running.
pub struct Server {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Where its operator listener listens (a free port of its own).
    pub admin_addr: SocketAddr,
}

impl Server {
    /// Starts the server on `port` with `DATABASE_URL=database_url`, and waits until it listens.
    pub fn start(database_url: &str, port: u16) -> Server {
        Self::start_with(database_url, port, &[])
    }

    /// [`start`](Self::start), with more environment variables.
    pub fn start_with(database_url: &str, port: u16, env: &[(&str, &str)]) -> Server {
        let mut command = Command::new(orders_binary());
        command
            .env("ORDERS_ADDR", format!("127.0.0.1:{port}"))
            // A port of its own: servers of tests running at once must not share one.
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", database_url)
            .env("ORDERS_CURSOR_SECRET", "a-fixed-secret-for-restarts")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("start the orders example");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut read_address = |prefix: &str| -> SocketAddr {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read the server's stdout");
            line.trim()
                .strip_prefix(prefix)
                .unwrap_or_else(|| {
                    panic!(
                        "the server did not start: {line:?} (if it says it lacks PostgreSQL support, the example was \
                         last built with default features: run `cargo test --all-features`)"
                    )
                })
                .parse()
                .expect("address")
        };
        let addr = read_address("listening on ");
        let admin_addr = read_address("admin listening on ");
        Server { child, addr, admin_addr }
    }

    /// SIGTERM, then waits up to `within` for the server to exit: its exit status, or `None` if
    /// it is still running (it is then killed when dropped).
    pub fn terminate(mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(sent.success(), "kill -TERM {pid}");
        let started = std::time::Instant::now();
        while started.elapsed() < within {
            if let Some(status) = self.child.try_wait().expect("wait for the server") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// SIGKILL: no graceful shutdown, no flushing, as a crash.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answer as a client saw it.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Reply {
    /// The first value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends one `POST /orders`. Any transport failure (refused, reset, timed out, cut short) is
/// an `Err`: the client does not know what happened and may retry with the same key.
pub async fn post_order(addr: SocketAddr, account: &str, key: &str, body: &str) -> Result<Reply, String> {
    let request = format!(
        "POST /orders HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {account}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(addr, request).await
}

/// Sends one `GET path` as `account`. Transport failures are an `Err`, as in [`post_order`].
pub async fn get(addr: SocketAddr, account: &str, path: &str) -> Result<Reply, String> {
    let request =
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {account}\r\nconnection: close\r\n\r\n");
    exchange(addr, request).await
}

/// Sends `request` (a whole HTTP/1.1 request with `connection: close`) on a connection of its
/// own and reads the whole reply, within 20 s. Transport failures are an `Err`.
pub async fn exchange(addr: SocketAddr, request: String) -> Result<Reply, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        stream.write_all(request.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.map_err(|e| format!("read: {e}"))?;
        parse_reply(&raw)
    };
    tokio::time::timeout(Duration::from_secs(20), exchange).await.map_err(|_| "timed out".to_owned())?
}

fn parse_reply(raw: &[u8]) -> Result<Reply, String> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no complete header block")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "header block is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or("no status line")?;
    let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or("bad status line")?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = raw[split + 4..].to_vec();
    let length = headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse::<usize>().ok());
    match length {
        Some(length) if body.len() != length => Err(format!("body cut short: {} of {length} bytes", body.len())),
        _ => Ok(Reply { status, headers, body }),
    }
}

/// A fresh PostgreSQL database on the test server, dropped when the test ends (passed or
/// panicked; sessions still connected to it, such as a server the test started, are ended);
/// returns its URL.
#[cfg(feature = "postgres")]
pub async fn fresh_database(prefix: &str) -> String {
    let name = super::unique_name(prefix);
    let admin = sqlx::PgPool::connect(&super::database_url()).await.expect("PostgreSQL must be running");
    super::Cleanup::pg_database(&name).until_test_ends();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\""))).execute(&admin).await.expect("create db");
    admin.close().await;
    let base = super::database_url();
    let cut = base.rfind('/').expect("a database URL with a path");
    format!("{}/{name}", &base[..cut])
}

/// How many orders each idempotency operation created, in the orders example's database at
/// `database_url`: the verdict of the tests that attack the example.
pub async fn orders_per_operation(database_url: &str) -> Vec<(String, i64)> {
    let pool = sqlx::PgPool::connect(database_url).await.expect("connect to the example's database");
    let rows = sqlx::query_as("SELECT idempotency_operation_id, count(*) FROM orders GROUP BY 1")
        .fetch_all(&pool)
        .await
        .expect("count the orders");
    pool.close().await;
    rows
}

/// The records of the example's database with their answer apart (`ORDERS_ANSWERS_APART`), and
/// with their answer inline.
pub async fn answers_apart_and_inline(database_url: &str) -> (i64, i64) {
    let pool = sqlx::PgPool::connect(database_url).await.expect("connect to the example's database");
    let counts = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE answer_seq IS NOT NULL), count(*) FILTER (WHERE response_body IS NOT NULL) \
         FROM idempotency_records",
    )
    .fetch_one(&pool)
    .await
    .expect("count the records");
    pool.close().await;
    counts
}
