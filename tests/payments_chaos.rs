//! Payments through a provider under chaos, end to end, as child processes: the fake provider
//! (`examples/psp.rs`) charging with faults (30 % of fresh charges committed and then stalled
//! past the caller's timeout, 10 % refused with 503 without executing, a little latency on
//! every charge), and the orders service paying through it, SIGKILLed and restarted several
//! times while its provider calls are in flight. Clients pay dozens of orders at once, two
//! clients per order with the same key, and retry every answer that is not final (transport
//! errors, 202 unknown, 409, 503) with that same key.
//!
//! Verdicts, from the provider's own audit (`GET /v1/charges`) and the service's payments:
//!
//! - every order has at most one charge at the provider (by `reference`);
//! - every client that got 201 holds the provider's `charge_id` for its order;
//! - every attempt is settled (none `pending` or `unknown`) within a generous liveness bound
//!   (one lease plus a few reconcile periods, plus slack for a loaded machine) after the last
//!   kill: a bound for "it happens at all", never a timing assertion.
//!
//! On PostgreSQL and SQLite; the same against a provider without idempotency
//! (`PSP_MODE=no_idempotency`, `ORDERS_PSP_IDEMPOTENT=false`), run for longer than a lease after
//! the last kill, where unknown payments wait for the operator and the provider never executes
//! two charges for one attempt; and a negative control: a client that retries with a fresh key
//! each time is caught by the same verdicts.
#![cfg(all(feature = "axum", feature = "postgres", feature = "sqlite", feature = "testkit"))]

mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::server::{Reply, Server, exchange, free_port, fresh_database, get, post_order};

const ACCOUNT: &str = "payer";
const ADMIN_TOKEN: &str = "payments-operator-token-01";
/// Orders paid in one storm; every eighth one is declined by the provider (its amount ends in 402).
const ORDERS: usize = 40;
/// Clients per order, all with the order's one key.
const CLIENTS_PER_ORDER: usize = 2;
const KILLS: usize = 6;
/// Between the first payments of two orders: the payments spread over the kills.
const STAGGER: Duration = Duration::from_millis(70);
/// The payment route's lease and the reconcile period the service runs with.
const LEASE: Duration = Duration::from_secs(1);
const RECONCILE: Duration = Duration::from_millis(300);
/// Slack on top of one lease and a few reconcile periods, for a machine shared with other
/// builds: the liveness bound is generous on purpose.
const SLACK: Duration = Duration::from_secs(45);

fn liveness() -> Duration {
    LEASE + RECONCILE * 5 + SLACK
}

// ---------------------------------------------------------------------------------------------
// The provider
// ---------------------------------------------------------------------------------------------

/// The fake provider, listening; killed when dropped.
struct Psp {
    child: Child,
    addr: SocketAddr,
}

impl Psp {
    fn start(env: &[(&str, &str)]) -> Psp {
        let exe = std::env::current_exe().expect("test executable");
        let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
        let binary = profile.join("examples").join(format!("psp{}", std::env::consts::EXE_SUFFIX));
        assert!(binary.exists(), "{} is missing: run `cargo test --all-features`", binary.display());
        let mut command = Command::new(binary);
        command.env("PSP_ADDR", "127.0.0.1:0").stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("start the psp example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("first line");
        let addr = line.trim().strip_prefix("listening on ").expect("`listening on <addr>`").parse().expect("addr");
        Psp { child, addr }
    }

    /// The provider's audit: every charge it executed.
    async fn audit(&self) -> Vec<Value> {
        let reply = exchange(
            self.addr,
            format!("GET /v1/charges HTTP/1.1\r\nhost: {}\r\nconnection: close\r\n\r\n", self.addr),
        )
        .await
        .expect("the provider's audit");
        assert_eq!(reply.status, 200, "{}", reply.text());
        let audit: Value = serde_json::from_slice(&reply.body).expect("JSON audit");
        audit["charges"].as_array().expect("charges").clone()
    }
}

impl Drop for Psp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The faults of every storm: ambiguous 30 %, refused 10 %, stalls well past the service's
/// 200 ms timeout, a little latency so that kills land mid-call.
fn chaos_provider(extra: &[(&str, &str)]) -> Psp {
    let mut env = vec![
        ("PSP_AMBIGUOUS_RATE", "0.3"),
        ("PSP_FAIL_RATE", "0.1"),
        ("PSP_STALL_MS", "600"),
        ("PSP_DELAY_MS", "60"),
        ("PSP_SEED", "14"),
    ];
    env.extend_from_slice(extra);
    Psp::start(&env)
}

// ---------------------------------------------------------------------------------------------
// The verdicts (shared by the storms and the negative control)
// ---------------------------------------------------------------------------------------------

/// The provider's charges per reference.
fn charges_by_reference(audit: &[Value]) -> HashMap<String, Vec<&Value>> {
    let mut by_reference: HashMap<String, Vec<&Value>> = HashMap::new();
    for charge in audit {
        by_reference.entry(charge["reference"].as_str().expect("a reference").to_owned()).or_default().push(charge);
    }
    by_reference
}

/// References the provider charged more than once.
fn double_charges(audit: &[Value]) -> Vec<String> {
    charges_by_reference(audit).into_iter().filter(|(_, charges)| charges.len() > 1).map(|(r, _)| r).collect()
}

/// Clients whose 201 does not carry the provider's one charge of their order: `(reference,
/// the client's charge id)`.
fn clients_without_the_charge(audit: &[Value], acknowledged: &HashMap<String, Vec<String>>) -> Vec<(String, String)> {
    let by_reference = charges_by_reference(audit);
    let mut wrong = Vec::new();
    for (reference, charge_ids) in acknowledged {
        let theirs = by_reference.get(reference).map(Vec::as_slice).unwrap_or_default();
        for charge_id in charge_ids {
            let held = matches!(theirs, [one] if one["charge_id"] == *charge_id && one["status"] == "succeeded");
            if !held {
                wrong.push((reference.clone(), charge_id.clone()));
            }
        }
    }
    wrong
}

// ---------------------------------------------------------------------------------------------
// The service and its clients
// ---------------------------------------------------------------------------------------------

fn start_service(database_url: &str, port: u16, psp: SocketAddr, idempotent: bool) -> Server {
    let lease = format!("{}", LEASE.as_secs_f64());
    let reconcile = format!("{}", RECONCILE.as_secs_f64());
    Server::start_with(
        database_url,
        port,
        &[
            ("PSP_URL", &format!("http://{psp}")),
            ("ORDERS_PSP_TIMEOUT_MS", "200"),
            ("ORDERS_RECONCILE_SECS", &reconcile),
            ("ORDERS_LEASE_SECS", &lease),
            ("ORDERS_JANITOR_SECS", "0.5"),
            ("ORDERS_PSP_IDEMPOTENT", if idempotent { "true" } else { "false" }),
            ("ORDERS_ADMIN_TOKEN", ADMIN_TOKEN),
        ],
    )
}

async fn post_payment(addr: SocketAddr, order_id: &str, key: &str) -> Result<Reply, String> {
    let body = "{}";
    let request = format!(
        "POST /orders/{order_id}/payments HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {ACCOUNT}\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(addr, request).await
}

fn json(reply: &Reply) -> Value {
    serde_json::from_slice(&reply.body).unwrap_or(Value::Null)
}

/// Creates the orders (before the chaos); returns their ids.
async fn create_orders(addr: SocketAddr, prefix: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for n in 0..ORDERS {
        // Every eighth amount ends in 402: declined by the provider.
        let amount = if n % 8 == 0 { 10_402 + n * 1000 } else { 1_000 + n };
        let body = format!(r#"{{"sku":"book","quantity":1,"amount_minor":{amount},"currency":"JPY"}}"#);
        let reply = post_order(addr, ACCOUNT, &format!("{prefix}-order-{n}"), &body).await.expect("create an order");
        assert_eq!(reply.status, 201, "{}", reply.text());
        ids.push(json(&reply)["order_id"].as_str().expect("order_id").to_owned());
    }
    ids
}

/// What the clients saw, summed.
#[derive(Default)]
struct Tally {
    accepted_unknown: AtomicUsize,
    outcome_unknown: AtomicUsize,
    provider_unavailable: AtomicUsize,
    transport: AtomicUsize,
    other_409: AtomicUsize,
    /// Orders for which a client got 202 (the handler saw the provider's answer missing).
    answered_unknown: Mutex<std::collections::HashSet<String>>,
    /// Orders for which a retry was told the outcome was unknown.
    told_unknown: Mutex<std::collections::HashSet<String>>,
}

impl Tally {
    /// Orders left unknown by a kill: retries were told so, but no client ever got the 202 a
    /// live handler gives.
    fn unknown_by_kill(&self) -> usize {
        let answered = self.answered_unknown.lock().unwrap();
        self.told_unknown.lock().unwrap().iter().filter(|order| !answered.contains(*order)).count()
    }
}

/// Final answers per order: the 201s' charge ids, and how many 402s.
#[derive(Default)]
struct Finals {
    acknowledged: HashMap<String, Vec<String>>,
    declined: HashMap<String, usize>,
}

/// One client paying `order_id` with `key` until a final answer (201, 402), or until `give_up`
/// says so. Panics on an answer no retry may get.
async fn pay_until_final(
    addr: SocketAddr,
    order_id: &str,
    key: &str,
    tally: &Tally,
    give_up: impl Fn() -> bool,
) -> Option<Reply> {
    loop {
        match post_payment(addr, order_id, key).await {
            Ok(reply) if reply.status == 201 || reply.status == 402 => return Some(reply),
            Ok(reply) if reply.status == 202 => {
                assert_eq!(json(&reply)["status"], "unknown", "{}", reply.text());
                tally.accepted_unknown.fetch_add(1, Ordering::Relaxed);
                tally.answered_unknown.lock().unwrap().insert(order_id.to_owned());
            }
            Ok(reply) if reply.status == 409 => {
                let code = json(&reply)["code"].as_str().unwrap_or_default().to_owned();
                match code.as_str() {
                    "idempotency_outcome_unknown" => {
                        tally.told_unknown.lock().unwrap().insert(order_id.to_owned());
                        tally.outcome_unknown.fetch_add(1, Ordering::Relaxed)
                    }
                    "idempotency_request_in_flight" => tally.other_409.fetch_add(1, Ordering::Relaxed),
                    _ => panic!("a retry with the order's one key got {code}: {}", reply.text()),
                };
            }
            Ok(reply) if reply.status == 503 => {
                let code = json(&reply)["code"].as_str().unwrap_or_default().to_owned();
                if code == "payment_provider_unavailable" {
                    tally.provider_unavailable.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(reply) => panic!("a payment may only be told to wait, got {} {}", reply.status, reply.text()),
            Err(_transport) => {
                tally.transport.fetch_add(1, Ordering::Relaxed);
            }
        }
        if give_up() {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
}

fn record_final(finals: &Mutex<Finals>, order_id: &str, reply: &Reply) {
    let mut finals = finals.lock().unwrap();
    if reply.status == 201 {
        let body = json(reply);
        assert_eq!(body["order_id"], order_id, "{body}");
        assert_eq!(body["status"], "succeeded", "{body}");
        let location = reply.header("location").unwrap_or_default();
        assert!(location.starts_with(&format!("/orders/{order_id}/payments/")), "{location}");
        let charge_id = body["charge_id"].as_str().expect("a charge_id").to_owned();
        finals.acknowledged.entry(order_id.to_owned()).or_default().push(charge_id);
    } else {
        assert_eq!(json(reply)["code"], "payment_declined", "{}", reply.text());
        *finals.declined.entry(order_id.to_owned()).or_default() += 1;
    }
}

/// Where the storm's service keeps its data.
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
}

/// What a storm leaves: the running service, the client finals, the tally, and when the last
/// kill was.
struct Storm {
    server: Server,
    orders: Vec<String>,
    finals: Finals,
    tally: Arc<Tally>,
    last_kill: Instant,
    unfinished: usize,
}

/// The storm: orders created, then `CLIENTS_PER_ORDER` clients per order paying with the order's
/// key while the service is SIGKILLed `KILLS` times and restarted on the same port. Clients run
/// until a final answer, or (when `stop_after` is given) until that long after the last kill.
async fn storm(database: &Database, psp: &Psp, idempotent: bool, prefix: &str, stop_after: Option<Duration>) -> Storm {
    let url = database.url();
    let port = free_port();
    let server = start_service(&url, port, psp.addr, idempotent);
    let addr = server.addr;
    let orders = create_orders(addr, prefix).await;
    let server = Arc::new(Mutex::new(Some(server)));
    let tally = Arc::new(Tally::default());
    let finals = Arc::new(Mutex::new(Finals::default()));
    let chaos_over = Arc::new(Mutex::new(None::<Instant>));
    let unfinished = Arc::new(AtomicUsize::new(0));

    let mut clients = Vec::new();
    for (n, order_id) in orders.iter().enumerate() {
        // Spread over the chaos, so that kills land while payments are in flight.
        let start = STAGGER * n as u32;
        for _ in 0..CLIENTS_PER_ORDER {
            let (order_id, key) = (order_id.clone(), format!("{prefix}-pay-{order_id}"));
            let (tally, finals, chaos_over, unfinished) =
                (tally.clone(), finals.clone(), chaos_over.clone(), unfinished.clone());
            clients.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                let give_up = || {
                    let over = *chaos_over.lock().unwrap();
                    match (over, stop_after) {
                        (Some(over), Some(after)) => over.elapsed() > after,
                        (Some(over), None) => {
                            assert!(
                                over.elapsed() < liveness(),
                                "order {order_id} got no final answer within {:?} of the last kill",
                                liveness()
                            );
                            false
                        }
                        (None, _) => false,
                    }
                };
                match pay_until_final(addr, &order_id, &key, &tally, give_up).await {
                    Some(reply) => record_final(&finals, &order_id, &reply),
                    None => {
                        unfinished.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }

    let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
    for _ in 0..KILLS {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(300 + rng % 500)).await;
        if let Some(old) = server.lock().unwrap().take() {
            old.kill();
        }
        let (url, psp) = (url.clone(), psp.addr);
        let fresh = tokio::task::spawn_blocking(move || start_service(&url, port, psp, idempotent)).await.unwrap();
        *server.lock().unwrap() = Some(fresh);
    }
    let last_kill = Instant::now();
    *chaos_over.lock().unwrap() = Some(last_kill);
    for client in clients {
        client.await.expect("client");
    }
    let server = server.lock().unwrap().take().expect("a running server");
    let finals = std::mem::take(&mut *finals.lock().unwrap());
    Storm { server, orders, finals, tally, last_kill, unfinished: unfinished.load(Ordering::Relaxed) }
}

/// The order's attempts as the service lists them.
async fn payments_of(addr: SocketAddr, order_id: &str) -> Vec<Value> {
    let reply = get(addr, ACCOUNT, &format!("/orders/{order_id}/payments")).await.expect("list payments");
    assert_eq!(reply.status, 200, "{}", reply.text());
    json(&reply)["payments"].as_array().expect("payments").clone()
}

/// Waits (bounded by the liveness bound, from the last kill) until every attempt is settled;
/// returns how long after the last kill that was.
async fn all_settled(storm: &Storm) -> Duration {
    loop {
        let mut open = 0;
        for order_id in &storm.orders {
            open += payments_of(storm.server.addr, order_id)
                .await
                .iter()
                .filter(|p| p["status"] == "pending" || p["status"] == "unknown")
                .count();
        }
        let elapsed = storm.last_kill.elapsed();
        if open == 0 {
            return elapsed;
        }
        assert!(elapsed < liveness(), "{open} attempts still unsettled {elapsed:?} after the last kill");
        tokio::time::sleep(RECONCILE).await;
    }
}

fn summary(name: &str, storm: &Storm, audit: &[Value], settled_after: Duration) -> String {
    let declined = audit.iter().filter(|c| c["status"] == "declined").count();
    let t = &storm.tally;
    format!(
        "{name}: {} orders, {KILLS} kills, {} clients; unknown answers: {} 202 + {} 409 outcome_unknown ({} orders left \
         unknown by a kill); {} provider 503s; \
         {} transport errors; provider charges: {} ({declined} declined); every attempt settled {:.2} s after the last kill",
        storm.orders.len(),
        storm.orders.len() * CLIENTS_PER_ORDER,
        t.accepted_unknown.load(Ordering::Relaxed),
        t.outcome_unknown.load(Ordering::Relaxed),
        t.unknown_by_kill(),
        t.provider_unavailable.load(Ordering::Relaxed),
        t.transport.load(Ordering::Relaxed),
        audit.len(),
        settled_after.as_secs_f64(),
    )
}

/// The storm against an idempotent provider, and its verdicts.
async fn no_order_is_charged_twice_and_every_201_holds_the_charge(database: Database, prefix: &str) {
    let psp = chaos_provider(&[]);
    let storm = storm(&database, &psp, true, prefix, None).await;
    let settled_after = all_settled(&storm).await;
    let audit = psp.audit().await;

    assert_eq!(double_charges(&audit), Vec::<String>::new(), "orders charged more than once");
    let wrong = clients_without_the_charge(&audit, &storm.finals.acknowledged);
    assert!(wrong.is_empty(), "clients whose 201 is not the provider's charge: {wrong:?}");
    // Every order got its final answer, all its clients the same one, and the attempts agree
    // with the provider.
    let by_reference = charges_by_reference(&audit);
    for order_id in &storm.orders {
        let acknowledged = storm.finals.acknowledged.get(order_id).map_or(0, Vec::len);
        let declined = storm.finals.declined.get(order_id).copied().unwrap_or(0);
        assert_eq!(acknowledged + declined, CLIENTS_PER_ORDER, "order {order_id}: every client answered");
        let attempts = payments_of(storm.server.addr, order_id).await;
        assert_eq!(attempts.len(), 1, "one attempt per order and key: {attempts:?}");
        let charge = by_reference.get(order_id).and_then(|c| c.first()).expect("a charge for every order");
        assert_eq!(attempts[0]["charge_id"], charge["charge_id"], "{attempts:?} vs {charge}");
        assert_eq!(attempts[0]["status"], charge["status"], "{attempts:?} vs {charge}");
    }
    let unknown_seen =
        storm.tally.accepted_unknown.load(Ordering::Relaxed) + storm.tally.outcome_unknown.load(Ordering::Relaxed);
    assert!(unknown_seen > 0, "no payment was ever unknown: the storm proved nothing");
    assert!(storm.tally.unknown_by_kill() > 0, "no kill left a payment unknown mid-call: the storm proved nothing");
    println!("{}", summary(prefix, &storm, &audit, settled_after));
}

#[test]
fn chaos_payments_on_postgres_charge_each_order_at_most_once() {
    tower_idempotency::testkit::run(async {
        let url = fresh_database("tidem_payments").await;
        no_order_is_charged_twice_and_every_201_holds_the_charge(Database::Postgres(url), "pg").await;
    });
}

#[test]
fn chaos_payments_on_sqlite_charge_each_order_at_most_once() {
    tower_idempotency::testkit::run(async {
        let (path, cleanup) = support::sqlite_path("tidem_payments");
        no_order_is_charged_twice_and_every_201_holds_the_charge(Database::Sqlite(path), "lite").await;
        drop(cleanup);
    });
}

/// Settles every unknown attempt as the operator would, from the provider's audit; returns how
/// many it settled.
async fn operator_settles_from_the_audit(storm: &Storm, audit: &[Value]) -> usize {
    let by_reference = charges_by_reference(audit);
    let mut settled = 0;
    for order_id in &storm.orders {
        for attempt in payments_of(storm.server.addr, order_id).await {
            if attempt["status"] != "unknown" {
                continue;
            }
            let body = match by_reference.get(order_id).map(Vec::as_slice) {
                Some([charge]) if charge["status"] == "declined" => r#"{"status":"declined"}"#.to_owned(),
                Some([charge]) => format!(r#"{{"status":"succeeded","charge_id":{}}}"#, charge["charge_id"]),
                _ => r#"{"status":"not_executed"}"#.to_owned(),
            };
            let payment_id = attempt["payment_id"].as_str().expect("payment_id");
            let request = format!(
                "POST /admin/payments/{payment_id}/settle HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ADMIN_TOKEN}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let reply = exchange(storm.server.admin_addr, request).await.expect("settle");
            assert_eq!(reply.status, 200, "{}", reply.text());
            settled += 1;
        }
    }
    settled
}

#[test]
fn chaos_payments_without_provider_idempotency_never_charge_an_attempt_twice_on_sqlite() {
    tower_idempotency::testkit::run(async {
        let (path, cleanup) = support::sqlite_path("tidem_payments_noidem");
        without_idempotency_no_attempt_is_charged_twice(Database::Sqlite(path), "noidem-lite").await;
        drop(cleanup);
    });
}

#[test]
fn chaos_payments_without_provider_idempotency_never_charge_an_attempt_twice_on_postgres() {
    tower_idempotency::testkit::run(async {
        let url = fresh_database("tidem_payments_noidem").await;
        without_idempotency_no_attempt_is_charged_twice(Database::Postgres(url), "noidem-pg").await;
    });
}

/// The storm against a provider without idempotency, run for longer than a lease after the
/// last kill; then the operator settles what is left unknown, from the provider's audit.
async fn without_idempotency_no_attempt_is_charged_twice(database: Database, prefix: &str) {
    let psp = chaos_provider(&[("PSP_MODE", "no_idempotency")]);
    // Longer than a lease (and several reconcile periods) after the last kill.
    let storm = storm(&database, &psp, false, prefix, Some(LEASE * 3)).await;
    let audit = psp.audit().await;
    assert_eq!(double_charges(&audit), Vec::<String>::new(), "an attempt was charged twice");
    let wrong = clients_without_the_charge(&audit, &storm.finals.acknowledged);
    assert!(wrong.is_empty(), "clients whose 201 is not the provider's charge: {wrong:?}");
    assert!(storm.unfinished > 0, "no payment was left unknown for the operator: the storm proved nothing");

    // The operator settles what only the provider's audit can tell; the clients' retries
    // then get their final answers (a payment re-issued as not executed may turn unknown
    // again: the operator looks again), and still no attempt is charged twice.
    let tally = Arc::new(Tally::default());
    let mut acknowledged: HashMap<String, Vec<String>> = HashMap::new();
    let mut open: Vec<String> = storm.orders.clone();
    let mut settled = 0;
    let deadline = Instant::now() + liveness();
    while !open.is_empty() {
        assert!(Instant::now() < deadline, "{} orders still without a final answer", open.len());
        settled += operator_settles_from_the_audit(&storm, &psp.audit().await).await;
        let mut rounds = Vec::new();
        for order_id in open {
            let (addr, tally, prefix) = (storm.server.addr, tally.clone(), prefix.to_owned());
            rounds.push(tokio::spawn(async move {
                let key = format!("{prefix}-pay-{order_id}");
                let round = Instant::now() + LEASE * 2;
                let reply = pay_until_final(addr, &order_id, &key, &tally, || Instant::now() > round).await;
                (order_id, reply)
            }));
        }
        let mut still_open = Vec::new();
        for round in rounds {
            match round.await.expect("client") {
                (order_id, Some(reply)) if reply.status == 201 => {
                    let charge_id = json(&reply)["charge_id"].as_str().expect("charge_id").to_owned();
                    acknowledged.entry(order_id).or_default().push(charge_id);
                }
                (_, Some(_declined)) => {}
                (order_id, None) => still_open.push(order_id),
            }
        }
        open = still_open;
    }
    assert!(settled > 0, "the operator settled nothing");
    let audit = psp.audit().await;
    assert_eq!(double_charges(&audit), Vec::<String>::new(), "an attempt was charged twice");
    let wrong = clients_without_the_charge(&audit, &acknowledged);
    assert!(wrong.is_empty(), "clients whose 201 is not the provider's charge: {wrong:?}");
    let settled_after = storm.last_kill.elapsed();
    println!("{}; {settled} settled by the operator", summary(prefix, &storm, &audit, settled_after));
}

#[test]
fn negative_control_a_client_that_retries_with_a_fresh_key_is_caught() {
    tower_idempotency::testkit::run(async {
        // The wrong client path: paying the provider directly, a new key on every retry of an
        // answer that did not come in time.
        let psp = chaos_provider(&[]);
        let mut acknowledged: HashMap<String, Vec<String>> = HashMap::new();
        for n in 0..ORDERS {
            let reference = format!("control-order-{n}");
            let body = format!(r#"{{"amount_minor":{},"currency":"JPY","reference":"{reference}"}}"#, 1000 + n);
            for attempt in 0.. {
                let request = format!(
                    "POST /v1/charges HTTP/1.1\r\nhost: x\r\nidempotency-key: {reference}-{attempt}\r\n\
                     content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let sent = tokio::time::timeout(Duration::from_millis(200), exchange(psp.addr, request)).await;
                if let Ok(Ok(reply)) = sent
                    && reply.status == 201
                {
                    acknowledged
                        .entry(reference.clone())
                        .or_default()
                        .push(json(&reply)["charge_id"].as_str().unwrap().into());
                    break;
                }
                assert!(attempt < 100, "the provider never answered");
            }
        }
        let audit = psp.audit().await;
        let doubles = double_charges(&audit);
        let wrong = clients_without_the_charge(&audit, &acknowledged);
        println!(
            "negative control: {} orders, {} charges, {} charged twice or more",
            ORDERS,
            audit.len(),
            doubles.len()
        );
        assert!(!doubles.is_empty(), "a fresh key per retry charged no order twice: the verdict could not fail");
        assert!(!wrong.is_empty(), "the clients' 201s all matched a single charge: the verdict could not fail");
    });
}
