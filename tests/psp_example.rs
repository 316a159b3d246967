//! The fake payment provider (`examples/psp.rs`) as a real child process: charges replayed by
//! key, declined by the `402` hook, looked up by key, its faults (503 without executing; charged
//! then stalled, with the provider's own 409 meanwhile), and the provider with no idempotency.
#![cfg(feature = "axum")]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The provider, listening; killed when dropped.
struct Psp {
    child: Child,
    addr: SocketAddr,
}

impl Psp {
    fn start(env: &[(&str, &str)]) -> Psp {
        let exe = std::env::current_exe().expect("test executable");
        let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
        let binary: PathBuf = profile.join("examples").join(format!("psp{}", std::env::consts::EXE_SUFFIX));
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
}

impl Drop for Psp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answer: status, the replay marker, and the body as JSON.
struct Answer {
    status: u16,
    replayed: bool,
    body: Value,
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn charge(addr: SocketAddr, key: Option<&str>, body: &str, timeout: Duration) -> Result<Answer, String> {
    let mut request =
        http::Request::post(format!("http://{addr}/v1/charges")).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let request = request.body(Full::new(Bytes::from(body.to_owned()))).expect("request");
    let exchange = async {
        let response = client().request(request).await.map_err(|error| error.to_string())?;
        let status = response.status().as_u16();
        let replayed = response.headers().get("idempotent-replayed").is_some();
        let bytes = response.into_body().collect().await.map_err(|error| error.to_string())?.to_bytes();
        let body = serde_json::from_slice(&bytes).map_err(|error| format!("{error}: {bytes:?}"))?;
        Ok(Answer { status, replayed, body })
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| "timed out".to_owned())?
}

async fn get(addr: SocketAddr, path: &str) -> Answer {
    let request = http::Request::get(format!("http://{addr}{path}")).body(Full::new(Bytes::new())).expect("request");
    let response = client().request(request).await.expect("GET");
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    Answer { status, replayed: false, body: serde_json::from_slice(&bytes).expect("JSON") }
}

const LIVENESS: Duration = Duration::from_secs(30);

fn charges(answer: &Answer) -> &Vec<Value> {
    answer.body["charges"].as_array().expect("charges")
}

#[tokio::test]
async fn a_charge_is_made_once_per_key_and_replayed() {
    let psp = Psp::start(&[]);
    let body = r#"{"amount_minor":1200,"currency":"JPY","reference":"order-1"}"#;
    let first = charge(psp.addr, Some("pay-1"), body, LIVENESS).await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(first.body["status"], "succeeded");
    assert_eq!(first.body["reference"], "order-1");
    assert_eq!(first.body["amount_minor"], 1200);
    assert!(first.body["charge_id"].as_str().unwrap().starts_with("ch_"));

    let again = charge(psp.addr, Some("pay-1"), body, LIVENESS).await.unwrap();
    assert_eq!((again.status, again.replayed), (201, true));
    assert_eq!(again.body, first.body, "a retry gets the first answer");

    let other =
        charge(psp.addr, Some("pay-1"), r#"{"amount_minor":1300,"currency":"JPY","reference":"order-1"}"#, LIVENESS)
            .await
            .unwrap();
    assert_eq!((other.status, other.body["code"].as_str()), (422, Some("idempotency_key_reused")));
    let missing = charge(psp.addr, None, body, LIVENESS).await.unwrap();
    assert_eq!((missing.status, missing.body["code"].as_str()), (400, Some("idempotency_key_missing")));
    let invalid = charge(psp.addr, Some("pay-2"), r#"{"amount_minor":1.5,"currency":"JPY","reference":"x"}"#, LIVENESS)
        .await
        .unwrap();
    assert_eq!((invalid.status, invalid.body["code"].as_str()), (422, Some("validation_failed")));

    let found = get(psp.addr, "/v1/charges?idempotency_key=pay-1").await;
    assert_eq!(charges(&found).len(), 1);
    assert_eq!(charges(&found)[0]["charge_id"], first.body["charge_id"]);
    assert!(charges(&get(psp.addr, "/v1/charges?idempotency_key=nope").await).is_empty());
    assert_eq!(charges(&get(psp.addr, "/v1/charges").await).len(), 1, "one charge for three calls with pay-1");
}

#[tokio::test]
async fn an_amount_ending_in_402_is_declined() {
    let psp = Psp::start(&[]);
    let declined = charge(psp.addr, Some("k"), r#"{"amount_minor":5402,"currency":"USD","reference":"o"}"#, LIVENESS)
        .await
        .unwrap();
    assert_eq!((declined.status, declined.body["status"].as_str()), (201, Some("declined")));
}

#[tokio::test]
async fn a_failure_executes_nothing_and_the_same_key_may_try_again() {
    let psp = Psp::start(&[("PSP_FAIL_RATE", "1")]);
    let body = r#"{"amount_minor":100,"currency":"EUR","reference":"o-f"}"#;
    for _ in 0..3 {
        let failed = charge(psp.addr, Some("f-1"), body, LIVENESS).await.unwrap();
        assert_eq!((failed.status, failed.body["code"].as_str()), (503, Some("provider_unavailable")));
    }
    assert!(charges(&get(psp.addr, "/v1/charges").await).is_empty(), "a 503 executes nothing");
}

#[tokio::test]
async fn an_ambiguous_charge_is_committed_then_held_and_its_key_answers_in_flight_meanwhile() {
    let psp = Psp::start(&[("PSP_AMBIGUOUS_RATE", "1"), ("PSP_STALL_MS", "1500")]);
    let body = r#"{"amount_minor":700,"currency":"JPY","reference":"o-a"}"#;
    // The caller gives up long before the answer comes.
    let lost = charge(psp.addr, Some("a-1"), body, Duration::from_millis(300)).await;
    assert!(lost.is_err(), "the first call must time out");
    // Committed: the lookup sees it while the answer is still held.
    let found = get(psp.addr, "/v1/charges?idempotency_key=a-1").await;
    assert_eq!(charges(&found).len(), 1);
    let charge_id = charges(&found)[0]["charge_id"].clone();
    let meanwhile = charge(psp.addr, Some("a-1"), body, LIVENESS).await.unwrap();
    assert_eq!((meanwhile.status, meanwhile.body["code"].as_str()), (409, Some("idempotency_request_in_flight")));
    // After the stall the answer is stored although its caller hung up: a retry replays it.
    let deadline = tokio::time::Instant::now() + LIVENESS;
    let replay = loop {
        let answer = charge(psp.addr, Some("a-1"), body, LIVENESS).await.unwrap();
        if answer.status != 409 {
            break answer;
        }
        assert!(tokio::time::Instant::now() < deadline, "still 409 after {LIVENESS:?}: {}", answer.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!((replay.status, replay.replayed), (201, true));
    assert_eq!(replay.body["charge_id"], charge_id);
    assert_eq!(charges(&get(psp.addr, "/v1/charges").await).len(), 1);
}

#[tokio::test]
async fn without_idempotency_every_call_charges_and_there_is_no_lookup() {
    let psp = Psp::start(&[("PSP_MODE", "no_idempotency")]);
    let body = r#"{"amount_minor":100,"currency":"EUR","reference":"o-n"}"#;
    let first = charge(psp.addr, Some("n-1"), body, LIVENESS).await.unwrap();
    let second = charge(psp.addr, Some("n-1"), body, LIVENESS).await.unwrap();
    assert_eq!((first.status, second.status, second.replayed), (201, 201, false));
    assert_ne!(first.body["charge_id"], second.body["charge_id"]);
    let lookup = get(psp.addr, "/v1/charges?idempotency_key=n-1").await;
    assert_eq!((lookup.status, lookup.body["code"].as_str()), (501, Some("lookup_unsupported")));
    assert_eq!(charges(&get(psp.addr, "/v1/charges").await).len(), 2);
}
