//! The outbox tests' processes: the orders service with its webhook relay, and the
//! `webhook_sink` example, each a real child process; and the verdict the chaos tests reach.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// The webhook secret every test signs with (the Standard Webhooks specification's example).
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// The operator token of the orders service in these tests.
pub const ADMIN_TOKEN: &str = "outbox-test-admin-token";

/// An example binary that `cargo test` builds next to the tests.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let target_profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
    let binary = target_profile.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(binary.exists(), "{} is missing: run the tests with `cargo test --all-features`", binary.display());
    binary
}

/// A child process and the addresses it printed.
pub struct Process {
    child: Child,
    /// The first `listening on` address.
    pub addr: SocketAddr,
    /// The second line's address (`admin listening on`), for the orders service.
    pub admin: Option<SocketAddr>,
}

impl Process {
    /// The orders service on `database_url`, at fixed ports, delivering to `webhook` (if any)
    /// with [`SECRET`].
    pub fn orders(database_url: &str, port: u16, admin_port: u16, webhook: Option<&str>) -> Process {
        let mut command = Command::new(example_binary("orders"));
        command
            .env("ORDERS_ADDR", format!("127.0.0.1:{port}"))
            .env("ORDERS_ADMIN_ADDR", format!("127.0.0.1:{admin_port}"))
            .env("ORDERS_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("DATABASE_URL", database_url)
            .env("ORDERS_CURSOR_SECRET", "a-fixed-secret-for-restarts")
            .env_remove("ORDERS_WEBHOOK_URL")
            .env_remove("REDIS_URL");
        if let Some(url) = webhook {
            command.env("ORDERS_WEBHOOK_URL", url).env("ORDERS_WEBHOOK_SECRET", SECRET);
        }
        Self::start(command, 2)
    }

    /// The sink on `port`, its events in `database`, with the given fault rates.
    pub fn sink(port: u16, database: &Path, fail_rate: f64, ambiguous_rate: f64) -> Process {
        let mut command = Command::new(example_binary("webhook_sink"));
        command
            .env("SINK_ADDR", format!("127.0.0.1:{port}"))
            .env("SINK_SECRET", SECRET)
            .env("SINK_DATABASE_URL", format!("sqlite:{}", database.display()))
            .env("SINK_FAIL_RATE", fail_rate.to_string())
            .env("SINK_AMBIGUOUS_RATE", ambiguous_rate.to_string());
        Self::start(command, 1)
    }

    fn start(mut command: Command, lines: usize) -> Process {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("start the example");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut addresses = Vec::new();
        for _ in 0..lines {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read a line of the example's stdout");
            let addr = line.trim().rsplit_once("listening on ").map(|(_, addr)| addr.to_owned());
            let addr = addr.unwrap_or_else(|| panic!("the example did not start: {line:?}"));
            addresses.push(addr.parse().expect("an address"));
        }
        Process { child, addr: addresses[0], admin: addresses.get(1).copied() }
    }

    /// SIGKILL: no graceful shutdown, as a crash.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the sink's record says about a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// `order.created` events processed.
    pub events: usize,
    /// Deliveries of them with a valid signature.
    pub deliveries: u64,
}

/// The claim of the outbox tests: the `order.created` events the sink processed are exactly
/// the orders in the database, each processed once. `Err` says how it failed.
pub fn exactly_once(orders: &BTreeSet<String>, events: &Value) -> Result<Tally, String> {
    let events = events["events"].as_array().ok_or("GET /events has no events array")?;
    let mut processed: BTreeMap<String, i64> = BTreeMap::new();
    let mut deliveries = 0;
    for event in events.iter().filter(|event| event["type"] == "order.created") {
        let order_id = event["order_id"].as_str().ok_or_else(|| format!("an event without order_id: {event}"))?;
        let times = event["processed"].as_i64().ok_or("processed is not a number")?;
        deliveries += event["deliveries"].as_u64().ok_or("deliveries is not a number")?;
        if times > 0 && processed.insert(order_id.to_owned(), times).is_some() {
            return Err(format!("order {order_id} has two processed events"));
        }
    }
    let seen: BTreeSet<String> = processed.keys().cloned().collect();
    let missing: Vec<_> = orders.difference(&seen).collect();
    let unknown: Vec<_> = seen.difference(orders).collect();
    if !missing.is_empty() || !unknown.is_empty() {
        return Err(format!(
            "processed events and orders differ: {} orders never processed ({missing:?}), {} events of no order \
             ({unknown:?})",
            missing.len(),
            unknown.len()
        ));
    }
    let repeated: Vec<_> = processed.iter().filter(|(_, times)| **times != 1).collect();
    if !repeated.is_empty() {
        return Err(format!("{} events were processed more than once: {repeated:?}", repeated.len()));
    }
    Ok(Tally { events: processed.len(), deliveries })
}
