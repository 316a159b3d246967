//! Recovery in the reference service, as a child process:
//!
//! - the crash test: the service runs its crash drill (`ORDERS_CRASH_DRILL=1`, a leased route
//!   whose effect is written outside the idempotency record's transaction, and a reconciler
//!   that looks for it), two instances on one database, each with its recovery worker; clients
//!   send requests and retry each key until a 201 arrives, every attempt at the other
//!   instance; one instance or the other is SIGKILLed at random moments (mid-handler, before
//!   or after the effect) and restarted, many times. Afterwards every key has exactly one effect, every record is
//!   settled (none `processing` or `unknown`, by the operator routes' counts), and a final
//!   retry of every key replays the body its client saw. On PostgreSQL and on SQLite.
//! - its negative control: the same storm with the route declared re-executable and no
//!   reconciler (`ORDERS_CRASH_DRILL=blind`) does effects twice, so the count above can fail;
//! - invalid lifecycle settings stop the start; SIGTERM stops the service and its recovery
//!   worker cleanly.
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite", feature = "testkit"))]

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use support::server::{Reply, Server, exchange, free_port, fresh_database, orders_binary};
use tower_idempotency::{IdempotencyKey, RecordId, Scope};

const CLIENTS: usize = 8;
const KILLS: usize = 20;
const ACCOUNT: &str = "drill-account";
const ADMIN_TOKEN: &str = "drill-operator-token-0123";
/// Generous bound for anything to happen at all (never a timing assertion).
const LIVENESS: Duration = Duration::from_secs(60);

/// What one client learned about one key.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// The first 201 body the client received.
    acknowledged: Option<Vec<u8>>,
    /// Whether a retry was told the outcome was unknown: the record waited for recovery.
    saw_unknown: bool,
    attempts: usize,
}

fn operation_id(key: &str) -> String {
    RecordId::new(&Scope::new(ACCOUNT), "drill.effect", &IdempotencyKey::new(key).unwrap()).operation_id()
}

async fn post_effect(addr: SocketAddr, key: &str) -> Result<Reply, String> {
    let body = "{}";
    let request = format!(
        "POST /drill/effects HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {ACCOUNT}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(addr, request).await
}

async fn operator_get(addr: SocketAddr, path: &str) -> Result<Reply, String> {
    let request = format!(
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {ADMIN_TOKEN}\r\nconnection: close\r\n\r\n"
    );
    exchange(addr, request).await
}

/// Where the drill's effects and the records live.
enum Database {
    Postgres(String),
    Sqlite(std::path::PathBuf),
}

impl Database {
    fn url(&self) -> String {
        match self {
            Self::Postgres(url) => url.clone(),
            Self::Sqlite(path) => format!("sqlite:{}?mode=rwc", path.display()),
        }
    }

    /// Effects per operation id.
    async fn effects(&self) -> HashMap<String, i64> {
        const SQL: &str = "SELECT operation_id, COUNT(*) FROM drill_effects GROUP BY operation_id";
        let rows: Vec<(String, i64)> = match self {
            Self::Postgres(url) => {
                let pool = sqlx::PgPool::connect(url).await.expect("connect to the service's database");
                let rows = sqlx::query_as(SQL).fetch_all(&pool).await.expect("count the effects");
                pool.close().await;
                rows
            }
            Self::Sqlite(path) => {
                let options = sqlx::sqlite::SqliteConnectOptions::new().filename(path);
                let pool = sqlx::SqlitePool::connect_with(options).await.expect("open the service's database");
                let rows = sqlx::query_as(SQL).fetch_all(&pool).await.expect("count the effects");
                pool.close().await;
                rows
            }
        };
        rows.into_iter().collect()
    }
}

/// The service on `database_url` with the drill in `mode`, a recovery pass every 0.2 s, and
/// the operator routes on.
fn start(database_url: &str, port: u16, mode: &str) -> Server {
    Server::start_with(
        database_url,
        port,
        &[("ORDERS_CRASH_DRILL", mode), ("ORDERS_JANITOR_SECS", "0.2"), ("ORDERS_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

/// The storm: two instances of the service run on one database, each with its recovery
/// worker; `CLIENTS` clients walk through new keys, retrying each until a 201 arrives, every
/// attempt at the other instance, while one instance or the other is SIGKILLed `KILLS` times
/// at random moments and restarted at once on the same port. Once the killing stops, every
/// client retries its last key until it is answered. Returns what the clients saw, and the
/// servers still running.
async fn storm(database: &Database, mode: &'static str, prefix: &str) -> (HashMap<String, Seen>, Vec<Server>) {
    let url = database.url();
    let ports = [free_port(), free_port()];
    let servers: Vec<_> =
        ports.iter().map(|&port| Arc::new(std::sync::Mutex::new(Some(start(&url, port, mode))))).collect();
    let addrs: Vec<SocketAddr> = ports.iter().map(|port| format!("127.0.0.1:{port}").parse().unwrap()).collect();
    let stop = Arc::new(AtomicBool::new(false));

    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (stop, addrs) = (stop.clone(), addrs.clone());
        let prefix = prefix.to_owned();
        clients.push(tokio::spawn(async move {
            let mut seen: HashMap<String, Seen> = HashMap::new();
            for n in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let key = format!("{prefix}-{client}-{n}-{}", std::process::id());
                let entry = seen.entry(key.clone()).or_default();
                // Set once the killing stopped: the server is up for good then.
                let mut deadline = None;
                loop {
                    entry.attempts += 1;
                    match post_effect(addrs[(client + entry.attempts) % addrs.len()], &key).await {
                        Ok(reply) if reply.status == 201 => {
                            entry.acknowledged = Some(reply.body);
                            break;
                        }
                        Ok(reply) if reply.status == 409 => {
                            entry.saw_unknown |= reply.text().contains("\"code\":\"idempotency_outcome_unknown\"");
                        }
                        Ok(reply) => assert_eq!(
                            reply.status,
                            503,
                            "a retry may only be told to wait (409, 503), got {} {}",
                            reply.status,
                            reply.text()
                        ),
                        Err(_transport) => {}
                    }
                    if stop.load(Ordering::Relaxed) {
                        let deadline = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + LIVENESS);
                        assert!(
                            tokio::time::Instant::now() < deadline,
                            "key {key} was not answered within {LIVENESS:?} of the last kill ({} attempts)",
                            entry.attempts
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            seen
        }));
    }

    let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
    for _ in 0..KILLS {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // Far enough apart that keys finish between kills, close enough that many die mid-way.
        tokio::time::sleep(Duration::from_millis(100 + rng % 400)).await;
        let victim = (rng >> 32) as usize % servers.len();
        if let Some(old) = servers[victim].lock().unwrap().take() {
            old.kill();
        }
        let (url, port) = (url.clone(), ports[victim]);
        let fresh = tokio::task::spawn_blocking(move || start(&url, port, mode)).await.unwrap();
        *servers[victim].lock().unwrap() = Some(fresh);
    }
    stop.store(true, Ordering::Relaxed);
    let mut seen = HashMap::new();
    for client in clients {
        seen.extend(client.await.expect("client"));
    }
    let servers = servers.iter().map(|server| server.lock().unwrap().take().expect("a running server")).collect();
    (seen, servers)
}

/// The crash test on `database`.
async fn killed_leased_requests_are_settled_with_no_duplicate_effects(database: Database, prefix: &str) {
    let (seen, servers) = storm(&database, "1", prefix).await;
    let server = &servers[0];

    // Every record settled: none left processing or unknown.
    let counts = operator_get(server.admin_addr, "/admin/idempotency/counts").await.expect("counts");
    assert_eq!(counts.status, 200, "{}", counts.text());
    let counts: serde_json::Value = serde_json::from_slice(&counts.body).expect("JSON counts");
    assert_eq!((counts["processing"].as_u64(), counts["unknown"].as_u64()), (Some(0), Some(0)), "{counts}");
    assert_eq!(counts["completed"].as_u64(), Some(seen.len() as u64), "one completed record per key: {counts}");

    // Exactly one effect per key, and a final retry replays the body its client saw.
    let effects = database.effects().await;
    for (key, seen) in &seen {
        let count = effects.get(&operation_id(key)).copied().unwrap_or(0);
        assert_eq!(count, 1, "key {key} has {count} effects");
        let acknowledged = seen.acknowledged.as_ref().expect("every key was answered");
        let replay = post_effect(server.addr, key).await.expect("final retry");
        assert_eq!(replay.status, 201, "final retry of {key}: {}", replay.text());
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(&replay.body, acknowledged, "the final retry of {key} replays the acknowledged body");
    }
    assert_eq!(effects.values().sum::<i64>(), seen.len() as i64, "effects that no key accounts for");
    let recovered = seen.values().filter(|s| s.saw_unknown).count();
    assert!(recovered > 0, "no request was ever left unknown by a kill: the test proved nothing");
    let retries: usize = seen.values().map(|s| s.attempts - 1).sum();
    println!(
        "drill: {KILLS} kills, {} keys, {recovered} left unknown by a kill and settled by recovery, {retries} retries",
        seen.len()
    );
}

#[test]
fn leased_requests_killed_mid_handler_are_settled_by_recovery_with_no_duplicate_effects_on_postgres() {
    tower_idempotency::testkit::run(async {
        let url = fresh_database("tidem_drill").await;
        killed_leased_requests_are_settled_with_no_duplicate_effects(Database::Postgres(url), "pg").await;
    });
}

#[test]
fn leased_requests_killed_mid_handler_are_settled_by_recovery_with_no_duplicate_effects_on_sqlite() {
    tower_idempotency::testkit::run(async {
        let (path, cleanup) = support::sqlite_path("tidem_drill");
        killed_leased_requests_are_settled_with_no_duplicate_effects(Database::Sqlite(path), "lite").await;
        drop(cleanup);
    });
}

#[test]
fn negative_control_without_the_reconciler_a_blind_reexecution_duplicates_effects() {
    tower_idempotency::testkit::run(async {
        let database = Database::Postgres(fresh_database("tidem_drill_blind").await);
        let (seen, _servers) = storm(&database, "blind", "blind").await;
        let effects = database.effects().await;
        let duplicated = seen.keys().filter(|key| effects.get(&operation_id(key)).copied().unwrap_or(0) > 1).count();
        println!("blind drill: {} keys, {duplicated} with more than one effect", seen.len());
        assert!(duplicated > 0, "the storm never killed a request after its effect: the crash test could not fail");
    });
}

// ---------------------------------------------------------------------------------------------
// Start and stop
// ---------------------------------------------------------------------------------------------

#[test]
fn an_invalid_retention_tombstone_or_janitor_period_stops_the_start() {
    for (name, value) in [
        ("ORDERS_RETENTION_SECS", "0"),
        ("ORDERS_RETENTION_SECS", "a day"),
        ("ORDERS_TOMBSTONE_SECS", "-5"),
        ("ORDERS_TOMBSTONE_SECS", "1e3"),
        ("ORDERS_JANITOR_SECS", "0.0"),
        ("ORDERS_JANITOR_SECS", "999999999999"),
        ("ORDERS_CENSUS_SECS", "0"),
        ("ORDERS_CENSUS_SECS", "an hour"),
        ("ORDERS_PURGE_RATE", "0"),
        ("ORDERS_PURGE_RATE", "fast"),
    ] {
        let mut child = Command::new(orders_binary())
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", "sqlite::memory:")
            .env(name, value)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run the orders example");
        // Bounded: a service that starts anyway is killed, and the case fails.
        let started = std::time::Instant::now();
        while child.try_wait().expect("wait").is_none() {
            if started.elapsed() > LIVENESS {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{name}={value}: the service started instead of stopping");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().expect("its output");
        assert!(!output.status.success(), "{name}={value} must stop the start");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(name) && stderr.contains(&format!("{value:?}")), "{name}={value}: {stderr}");
        assert!(output.stdout.is_empty(), "never listening: {}", String::from_utf8_lossy(&output.stdout));
    }
}

#[test]
fn sigterm_stops_the_service_and_its_recovery_worker_cleanly() {
    tower_idempotency::testkit::run(async {
        let (path, _cleanup) = support::sqlite_path("tidem_sigterm");
        let database = Database::Sqlite(path);
        // A worker that runs all the time, over a leased route with work for it.
        let server = start(&database.url(), free_port(), "1");
        let reply = post_effect(server.addr, "before-stop").await.expect("an answer");
        assert_eq!(reply.status, 201, "{}", reply.text());
        let status = server.terminate(LIVENESS);
        assert!(status.is_some_and(|status| status.success()), "SIGTERM ends the service with success: {status:?}");
    });
}
