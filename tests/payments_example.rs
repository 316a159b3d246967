//! The payment routes of the orders service, answer by answer, against the fake provider, both
//! as child processes (SQLite; the chaos test covers PostgreSQL too): 201 with `Location` and
//! its replay, 402 stored, 503 `payment_provider_unavailable` released with the attempt kept
//! pending, 202 unknown with `Location: /operations/{id}` and the record `unknown` until the
//! reconciler settles it, 404, both 409s, 503 `payments_unavailable` without `PSP_URL`, and the
//! operator's settlement of an unknown attempt when the provider has no idempotency. Built with
//! `outbox`: each settled payment (handler, reconciler, operator) leaves exactly one
//! `payment.succeeded` / `payment.declined` event and a replay none, on SQLite and PostgreSQL.
#![cfg(all(feature = "axum", feature = "sqlite", feature = "testkit"))]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::server::{Reply, Server, exchange, free_port, get, orders_binary, post_order};

const ALICE: &str = "acct_alice";
const BOB: &str = "acct_bob";
const ADMIN_TOKEN: &str = "payments-operator-token-01";
const LIVENESS: Duration = Duration::from_secs(60);

struct Psp {
    child: Child,
    addr: SocketAddr,
}

impl Psp {
    fn start(env: &[(&str, &str)]) -> Psp {
        let exe = std::env::current_exe().expect("test executable");
        let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
        let binary = profile.join("examples").join(format!("psp{}", std::env::consts::EXE_SUFFIX));
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

    async fn charges(&self) -> Vec<Value> {
        let request = format!("GET /v1/charges HTTP/1.1\r\nhost: {}\r\nconnection: close\r\n\r\n", self.addr);
        let reply = exchange(self.addr, request).await.expect("audit");
        json(&reply)["charges"].as_array().expect("charges").clone()
    }
}

impl Drop for Psp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The service on a fresh SQLite file, paying through `psp` (or with no provider).
struct Service {
    server: Server,
    url: String,
    _cleanup: support::Cleanup,
}

fn service(psp: Option<&Psp>, env: &[(&str, &str)]) -> Service {
    let (path, cleanup) = support::sqlite_path("tidem_payments_api");
    let url = format!("sqlite:{}?mode=rwc", path.display());
    Service { server: service_on(&url, psp, env), url, _cleanup: cleanup }
}

/// A provider call timeout far below the test provider's `PSP_STALL_MS`, so a stalled charge ends
/// as an unknown outcome.
const TIMES_OUT: (&str, &str) = ("ORDERS_PSP_TIMEOUT_MS", "300");

/// The service on the database at `url`, paying through `psp` (or with no provider).
fn service_on(url: &str, psp: Option<&Psp>, env: &[(&str, &str)]) -> Server {
    let psp_url = psp.map(|psp| format!("http://{}", psp.addr)).unwrap_or_default();
    let mut all = vec![
        ("PSP_URL", psp_url.as_str()),
        // Generous: a loaded machine must not turn a provider's answer into an unknown outcome.
        // Tests of unknown outcomes ask for `TIMES_OUT`.
        ("ORDERS_PSP_TIMEOUT_MS", "5000"),
        ("ORDERS_RECONCILE_SECS", "0.2"),
        ("ORDERS_LEASE_SECS", "1"),
        ("ORDERS_ADMIN_TOKEN", ADMIN_TOKEN),
    ];
    all.extend_from_slice(env);
    Server::start_with(url, free_port(), &all)
}

fn json(reply: &Reply) -> Value {
    serde_json::from_slice(&reply.body).unwrap_or(Value::Null)
}

fn code(reply: &Reply) -> String {
    json(reply)["code"].as_str().unwrap_or_default().to_owned()
}

async fn order(addr: SocketAddr, account: &str, amount: u64) -> String {
    let body = format!(r#"{{"sku":"book","quantity":1,"amount_minor":{amount},"currency":"JPY"}}"#);
    let reply = post_order(addr, account, &format!("order-{amount}-{account}"), &body).await.expect("an order");
    assert_eq!(reply.status, 201, "{}", reply.text());
    json(&reply)["order_id"].as_str().unwrap().to_owned()
}

async fn pay_with(addr: SocketAddr, account: &str, order_id: &str, key: &str, body: &str, json_body: bool) -> Reply {
    let content_type = if json_body { "content-type: application/json\r\n" } else { "" };
    let request = format!(
        "POST /orders/{order_id}/payments HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {account}\r\n\
         idempotency-key: {key}\r\n{content_type}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(addr, request).await.expect("an answer")
}

async fn pay(addr: SocketAddr, order_id: &str, key: &str) -> Reply {
    pay_with(addr, ALICE, order_id, key, "{}", true).await
}

async fn payments(addr: SocketAddr, order_id: &str) -> Vec<Value> {
    let reply = get(addr, ALICE, &format!("/orders/{order_id}/payments")).await.expect("list");
    assert_eq!(reply.status, 200, "{}", reply.text());
    json(&reply)["payments"].as_array().unwrap().clone()
}

async fn operator_settle(admin: SocketAddr, payment_id: &str, body: &str, token: &str) -> Reply {
    let request = format!(
        "POST /admin/payments/{payment_id}/settle HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(admin, request).await.expect("an answer")
}

/// Retries `key` until its answer is not a 409 `idempotency_outcome_unknown`, within LIVENESS.
async fn until_settled(addr: SocketAddr, order_id: &str, key: &str) -> Reply {
    let started = Instant::now();
    loop {
        let reply = pay(addr, order_id, key).await;
        if !(reply.status == 409 && code(&reply) == "idempotency_outcome_unknown") {
            return reply;
        }
        assert!(started.elapsed() < LIVENESS, "never settled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn a_payment_succeeds_once_replays_and_the_order_is_then_paid() {
    tower_idempotency::testkit::run(async {
        let psp = Psp::start(&[]);
        let service = service(Some(&psp), &[]);
        let addr = service.server.addr;
        let order_id = order(addr, ALICE, 1200).await;

        let first = pay(addr, &order_id, "pay-1").await;
        assert_eq!(first.status, 201, "{}", first.text());
        let body = json(&first);
        assert_eq!((body["status"].as_str(), body["order_id"].as_str()), (Some("succeeded"), Some(order_id.as_str())));
        assert_eq!((body["amount_minor"].as_u64(), body["currency"].as_str()), (Some(1200), Some("JPY")));
        let payment_id = body["payment_id"].as_str().unwrap();
        assert_eq!(first.header("location"), Some(format!("/orders/{order_id}/payments/{payment_id}").as_str()));
        let charges = psp.charges().await;
        assert_eq!(charges.len(), 1);
        assert_eq!(charges[0]["charge_id"], body["charge_id"]);
        assert_eq!(charges[0]["reference"], order_id.as_str());

        let again = pay(addr, &order_id, "pay-1").await;
        assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")));
        assert_eq!(again.body, first.body);
        let other_key = pay(addr, &order_id, "pay-2").await;
        assert_eq!((other_key.status, code(&other_key)), (409, "order_already_paid".to_owned()));
        assert_eq!(psp.charges().await.len(), 1, "no second charge");

        let listed = payments(addr, &order_id).await;
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0]["status"], "succeeded");
        assert_eq!(listed[0]["charge_id"], body["charge_id"]);
        assert!(listed[0]["settled_at"].is_string());
        let one = get(addr, ALICE, &format!("/orders/{order_id}/payments/{payment_id}")).await.unwrap();
        assert_eq!((one.status, json(&one)["status"].as_str()), (200, Some("succeeded")));
    });
}

#[test]
fn a_declined_payment_is_stored_and_a_new_key_makes_a_new_attempt() {
    tower_idempotency::testkit::run(async {
        let psp = Psp::start(&[]);
        let service = service(Some(&psp), &[]);
        let addr = service.server.addr;
        let order_id = order(addr, ALICE, 5402).await;
        let declined = pay(addr, &order_id, "d-1").await;
        assert_eq!((declined.status, code(&declined)), (402, "payment_declined".to_owned()), "{}", declined.text());
        assert_eq!(declined.header("content-type"), Some("application/problem+json"));
        let replay = pay(addr, &order_id, "d-1").await;
        assert_eq!((replay.status, replay.header("idempotent-replayed")), (402, Some("true")));
        assert_eq!(replay.body, declined.body);
        let second = pay(addr, &order_id, "d-2").await;
        assert_eq!(second.status, 402);
        let listed = payments(addr, &order_id).await;
        assert_eq!(listed.iter().map(|p| p["status"].as_str().unwrap()).collect::<Vec<_>>(), ["declined", "declined"]);
        assert_eq!(psp.charges().await.len(), 2, "one charge per attempt");
    });
}

#[test]
fn a_provider_503_is_released_and_the_same_attempt_tries_again() {
    tower_idempotency::testkit::run(async {
        let psp = Psp::start(&[("PSP_FAIL_RATE", "1")]);
        let service = service(Some(&psp), &[]);
        let addr = service.server.addr;
        let order_id = order(addr, ALICE, 700).await;
        for _ in 0..2 {
            let refused = pay(addr, &order_id, "f-1").await;
            assert_eq!((refused.status, code(&refused)), (503, "payment_provider_unavailable".to_owned()));
            assert!(refused.header("retry-after").is_some());
            assert_eq!(refused.header("idempotent-replayed"), None, "released, not stored");
        }
        let listed = payments(addr, &order_id).await;
        assert_eq!(listed.len(), 1, "the retry kept its attempt: {listed:?}");
        assert_eq!(listed[0]["status"], "pending");
        let other = pay(addr, &order_id, "f-2").await;
        assert_eq!((other.status, code(&other)), (409, "payment_in_progress".to_owned()));
        assert!(psp.charges().await.is_empty());
    });
}

#[test]
fn an_unknown_payment_answers_202_and_is_reconciled_from_the_provider() {
    tower_idempotency::testkit::run(async {
        let psp = Psp::start(&[("PSP_AMBIGUOUS_RATE", "1"), ("PSP_STALL_MS", "1500")]);
        let service = service(Some(&psp), &[TIMES_OUT]);
        let addr = service.server.addr;
        let order_id = order(addr, ALICE, 900).await;
        let unknown = pay(addr, &order_id, "u-1").await;
        assert_eq!(unknown.status, 202, "{}", unknown.text());
        let body = json(&unknown);
        assert_eq!(body["status"], "unknown");
        let operation_id = body["operation_id"].as_str().unwrap();
        assert_eq!(unknown.header("location"), Some(format!("/operations/{operation_id}").as_str()));
        let other = pay(addr, &order_id, "u-2").await;
        assert_eq!((other.status, code(&other)), (409, "payment_in_progress".to_owned()));

        let settled = until_settled(addr, &order_id, "u-1").await;
        assert_eq!(settled.status, 201, "{}", settled.text());
        let charges = psp.charges().await;
        assert_eq!(charges.len(), 1, "the reconciler found the charge, and made no second: {charges:?}");
        assert_eq!(json(&settled)["charge_id"], charges[0]["charge_id"]);
        let operation = get(addr, ALICE, &format!("/operations/{operation_id}")).await.unwrap();
        assert_eq!(json(&operation)["state"], "succeeded", "{}", operation.text());
    });
}

#[test]
fn without_provider_idempotency_an_unknown_payment_waits_for_the_operator() {
    tower_idempotency::testkit::run(async {
        let psp = Psp::start(&[("PSP_MODE", "no_idempotency"), ("PSP_AMBIGUOUS_RATE", "1"), ("PSP_STALL_MS", "500")]);
        let service = service(Some(&psp), &[("ORDERS_PSP_IDEMPOTENT", "false"), TIMES_OUT]);
        let (addr, admin) = (service.server.addr, service.server.admin_addr);
        let order_id = order(addr, ALICE, 1100).await;
        let unknown = pay(addr, &order_id, "n-1").await;
        assert_eq!(unknown.status, 202, "{}", unknown.text());
        // Many reconcile periods later: still unknown, and never a second call.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let waiting = pay(addr, &order_id, "n-1").await;
        assert_eq!((waiting.status, code(&waiting)), (409, "idempotency_outcome_unknown".to_owned()));
        let charges = psp.charges().await;
        assert_eq!(charges.len(), 1, "{charges:?}");
        let payment_id = json(&unknown)["payment_id"].as_str().unwrap().to_owned();

        let refused = operator_settle(admin, &payment_id, r#"{"status":"succeeded"}"#, ADMIN_TOKEN).await;
        assert_eq!((refused.status, code(&refused)), (422, "invalid_settlement".to_owned()));
        let unauthenticated =
            operator_settle(admin, &payment_id, r#"{"status":"declined"}"#, "wrong-token-0123456789").await;
        assert_eq!(unauthenticated.status, 401);
        let missing = operator_settle(admin, "no-such-payment", r#"{"status":"declined"}"#, ADMIN_TOKEN).await;
        assert_eq!((missing.status, code(&missing)), (404, "payment_not_found".to_owned()));
        let body = format!(r#"{{"status":"succeeded","charge_id":{}}}"#, charges[0]["charge_id"]);
        let settled = operator_settle(admin, &payment_id, &body, ADMIN_TOKEN).await;
        assert_eq!(settled.status, 200, "{}", settled.text());
        assert_eq!(json(&settled)["status"], "succeeded");
        let twice = operator_settle(admin, &payment_id, &body, ADMIN_TOKEN).await;
        assert_eq!((twice.status, code(&twice)), (409, "payment_not_unknown".to_owned()));
        #[cfg(feature = "outbox")]
        {
            let events = payment_events(&service.url).await;
            assert_eq!(events.len(), 1, "the operator's settlement enqueued one event: {events:?}");
            assert_one_event(&events, &order_id, 1100, &payments(addr, &order_id).await[0]);
        }

        let replay = pay(addr, &order_id, "n-1").await;
        assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")), "{}", replay.text());
        assert_eq!(json(&replay)["charge_id"], charges[0]["charge_id"]);
        assert_eq!(psp.charges().await.len(), 1);
    });
}

#[test]
fn bad_requests_and_other_accounts_orders_are_refused() {
    tower_idempotency::testkit::run(async {
        let psp = Psp::start(&[]);
        let service = service(Some(&psp), &[]);
        let addr = service.server.addr;
        let order_id = order(addr, ALICE, 300).await;
        let not_found = pay(addr, "5b0e0000-0000-4000-8000-000000000000", "x-1").await;
        assert_eq!((not_found.status, code(&not_found)), (404, "order_not_found".to_owned()));
        let malformed = pay(addr, "not-a-uuid", "x-2").await;
        assert_eq!((malformed.status, code(&malformed)), (404, "order_not_found".to_owned()));
        let bobs = pay_with(addr, BOB, &order_id, "x-3", "{}", true).await;
        assert_eq!((bobs.status, code(&bobs)), (404, "order_not_found".to_owned()));
        let members = pay_with(addr, ALICE, &order_id, "x-4", r#"{"amount_minor":1}"#, true).await;
        assert_eq!((members.status, code(&members)), (422, "validation_failed".to_owned()));
        let not_json = pay_with(addr, ALICE, &order_id, "x-5", "{}", false).await;
        assert_eq!(not_json.status, 415);
        let no_key = exchange(
            addr,
            format!(
                "POST /orders/{order_id}/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ALICE}\r\n\
                 content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
            ),
        )
        .await
        .unwrap();
        assert_eq!((no_key.status, code(&no_key)), (400, "idempotency_key_missing".to_owned()));
        assert!(psp.charges().await.is_empty());
        // The refusals stored nothing: the same key pays once the request is right.
        assert_eq!(pay(addr, &order_id, "x-4").await.status, 201);
    });
}

#[test]
fn without_psp_url_the_payment_routes_answer_503() {
    tower_idempotency::testkit::run(async {
        let service = service(None, &[]);
        let addr = service.server.addr;
        let order_id = order(addr, ALICE, 100).await;
        let post = pay(addr, &order_id, "k").await;
        assert_eq!((post.status, code(&post)), (503, "payments_unavailable".to_owned()));
        let list = get(addr, ALICE, &format!("/orders/{order_id}/payments")).await.unwrap();
        assert_eq!((list.status, code(&list)), (503, "payments_unavailable".to_owned()));
    });
}

#[test]
fn invalid_payment_settings_stop_the_start() {
    for (name, value) in [
        ("ORDERS_PSP_IDEMPOTENT", "maybe"),
        ("ORDERS_PSP_TIMEOUT_MS", "0"),
        ("ORDERS_RECONCILE_SECS", "-1"),
        ("ORDERS_LEASE_SECS", "0"),
        ("PSP_URL", "ftp://psp"),
    ] {
        let output = Command::new(orders_binary())
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", "sqlite::memory:")
            .env(name, value)
            .output()
            .expect("run the orders example");
        assert!(!output.status.success(), "{name}={value} must stop the start");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(name), "{name}={value}: {stderr}");
        assert!(output.stdout.is_empty());
    }
}

#[test]
fn concurrent_first_payments_with_different_keys_make_one_attempt_and_one_charge() {
    tower_idempotency::testkit::run(async {
        let psp = Psp::start(&[("PSP_DELAY_MS", "100")]);
        let service = service(Some(&psp), &[]);
        let addr = service.server.addr;
        let order_id = order(addr, ALICE, 2500).await;
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
        let mut calls = Vec::new();
        for n in 0..8 {
            let (order_id, barrier) = (order_id.clone(), barrier.clone());
            calls.push(tokio::spawn(async move {
                barrier.wait().await;
                pay(addr, &order_id, &format!("tab-{n}")).await
            }));
        }
        let mut answers = Vec::new();
        for call in calls {
            let reply = call.await.unwrap();
            answers.push((reply.status, code(&reply)));
        }
        let paid = answers.iter().filter(|(status, _)| *status == 201).count();
        assert_eq!(paid, 1, "exactly one key pays: {answers:?}");
        for (status, code) in &answers {
            assert!(
                *status == 201 || (*status == 409 && (code == "payment_in_progress" || code == "order_already_paid")),
                "{answers:?}"
            );
        }
        assert_eq!(payments(addr, &order_id).await.len(), 1);
        assert_eq!(psp.charges().await.len(), 1);
    });
}

/// The `payment.*` events in the outbox of the database at `url`: (event id, type, body).
#[cfg(feature = "outbox")]
async fn payment_events(url: &str) -> Vec<(String, String, Value)> {
    const SQL: &str = "SELECT event_id, event_type, body FROM outbox_events WHERE event_type LIKE 'payment.%'";
    let rows: Vec<(String, String, Vec<u8>)> = if url.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        {
            let pool = sqlx::PgPool::connect(url).await.expect("connect");
            let rows = sqlx::query_as(SQL).fetch_all(&pool).await.expect("read the outbox");
            pool.close().await;
            rows
        }
        #[cfg(not(feature = "postgres"))]
        unreachable!("no PostgreSQL in this build")
    } else {
        let pool = sqlx::SqlitePool::connect(url).await.expect("connect");
        let rows = sqlx::query_as(SQL).fetch_all(&pool).await.expect("read the outbox");
        pool.close().await;
        rows
    };
    rows.into_iter().map(|(id, kind, body)| (id, kind, serde_json::from_slice(&body).expect("JSON body"))).collect()
}

/// Asserts that `payment` (as `GET /orders/{order_id}/payments` lists it) left exactly one event,
/// `payment.<status>`, with the payment's id and its data.
#[cfg(feature = "outbox")]
fn assert_one_event(events: &[(String, String, Value)], order_id: &str, amount: u64, payment: &Value) {
    let payment_id = payment["payment_id"].as_str().expect("payment_id");
    let status = payment["status"].as_str().expect("status");
    let of_it: Vec<_> = events.iter().filter(|(.., body)| body["data"]["payment_id"] == payment_id).collect();
    assert_eq!(of_it.len(), 1, "one event for {payment_id}: {events:?}");
    let (id, kind, body) = of_it[0];
    assert_eq!(kind, &format!("payment.{status}"));
    assert_eq!(body["type"], kind.as_str());
    assert_eq!(id, &format!("evt_payment.{status}_{payment_id}"), "the id derived from the payment");
    let mut expected = payment.clone();
    let fields = expected.as_object_mut().expect("a payment object");
    fields.insert("order_id".into(), order_id.into());
    fields.insert("amount_minor".into(), amount.into());
    fields.insert("currency".into(), "JPY".into());
    assert_eq!(body["data"], expected, "the payment as listed, with its order and amount");
}

/// A succeeded payment, a declined one and one the reconciler settled each enqueue one event of
/// their type; replays enqueue none.
#[cfg(feature = "outbox")]
async fn settled_payments_enqueue_one_event_each(url: &str) {
    let mut settled = Vec::new();
    {
        let psp = Psp::start(&[]);
        let server = service_on(url, Some(&psp), &[]);
        let addr = server.addr;
        for (amount, key, status) in [(1200, "e-1", 201), (5402, "e-2", 402)] {
            let order_id = order(addr, ALICE, amount).await;
            assert_eq!(pay(addr, &order_id, key).await.status, status);
            let replay = pay(addr, &order_id, key).await;
            assert_eq!((replay.status, replay.header("idempotent-replayed")), (status, Some("true")));
            settled.push((order_id.clone(), amount, payments(addr, &order_id).await));
        }
    }
    {
        let psp = Psp::start(&[("PSP_AMBIGUOUS_RATE", "1"), ("PSP_STALL_MS", "1500")]);
        let server = service_on(url, Some(&psp), &[TIMES_OUT]);
        let addr = server.addr;
        let order_id = order(addr, ALICE, 900).await;
        assert_eq!(pay(addr, &order_id, "e-3").await.status, 202);
        assert_eq!(until_settled(addr, &order_id, "e-3").await.status, 201);
        let replay = pay(addr, &order_id, "e-3").await;
        assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")));
        settled.push((order_id.clone(), 900, payments(addr, &order_id).await));
    }
    let events = payment_events(url).await;
    assert_eq!(events.len(), 3, "one event per settled payment, none per replay: {events:?}");
    let statuses: Vec<_> = settled.iter().map(|(.., listed)| listed[0]["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["succeeded", "declined", "succeeded"]);
    for (order_id, amount, listed) in &settled {
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_one_event(&events, order_id, *amount, &listed[0]);
    }
}

#[cfg(feature = "outbox")]
#[test]
fn settled_payments_enqueue_one_event_each_on_sqlite() {
    tower_idempotency::testkit::run(async {
        let (path, cleanup) = support::sqlite_path("tidem_payments_events");
        settled_payments_enqueue_one_event_each(&format!("sqlite:{}?mode=rwc", path.display())).await;
        drop(cleanup);
    });
}

#[cfg(all(feature = "outbox", feature = "postgres"))]
#[test]
fn settled_payments_enqueue_one_event_each_on_postgres() {
    tower_idempotency::testkit::run(async {
        let url = support::server::fresh_database("tidem_payments_events").await;
        settled_payments_enqueue_one_event_each(&url).await;
    });
}
