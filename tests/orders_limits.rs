//! The reference service's limits, as a child process on SQLite: a client that stalls mid-body
//! gets 408 at `ORDERS_BODY_TIMEOUT_SECS`; while stalled bodies hold `ORDERS_BUFFER_BUDGET_BYTES`
//! the service refuses new ones with 503 and `Retry-After`, and admits again once they are
//! gone; it speaks HTTP/2 (h2c) beside HTTP/1.1; a bad limit stops the start.
#![cfg(all(feature = "axum", feature = "sqlite", feature = "testkit"))]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::server::{orders_binary, post_order};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Generous bound for anything to happen at all (never a timing assertion).
const LIVENESS: Duration = Duration::from_secs(30);
const ACCOUNT: &str = "acct_limits";

/// The example server with `env`, on a SQLite file of its own; killed and removed on drop.
struct Orders {
    child: Child,
    addr: SocketAddr,
    file: PathBuf,
}

impl Orders {
    fn start(env: &[(&str, &str)]) -> Orders {
        let file = std::env::temp_dir().join(support::unique_name("tidem_limits") + ".db");
        let mut command = Command::new(orders_binary());
        command
            .env("ORDERS_ADDR", "127.0.0.1:0")
            // A port of its own: the servers of this file's tests run at once.
            .env("ORDERS_ADMIN_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", format!("sqlite:{}?mode=rwc", file.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("start the orders example");
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        stdout.read_line(&mut line).expect("first line");
        // The second line (`admin listening on`) is read too: a pipe closed before it is
        // written would make the server's print fail, and the server stop.
        stdout.read_line(&mut String::new()).expect("second line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the server did not start: {line:?}"))
            .parse()
            .expect("address");
        Orders { child, addr, file }
    }
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.file.display()));
        }
    }
}

fn order(n: usize) -> String {
    format!("{{\"sku\":\"l-{n}\",\"quantity\":1,\"amount_minor\":{n},\"currency\":\"EUR\"}}")
}

/// A `POST /orders` that declares `declared` bytes, sends `sent` of them and then waits: the
/// connection stays open until the returned stream is dropped.
async fn stalled_post(addr: SocketAddr, key: &str, declared: usize, sent: &[u8]) -> TcpStream {
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {ACCOUNT}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(head.as_bytes()).await.expect("head");
    stream.write_all(sent).await.expect("part of the body");
    stream
}

/// Reads what the server answers on `stream` until it closes it, or until the headers and a
/// `code` member arrived.
async fn read_answer(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    let read = tokio::time::timeout(LIVENESS, async {
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
            }
            if String::from_utf8_lossy(&answer).contains("\"code\"") {
                break;
            }
        }
    })
    .await;
    assert!(read.is_ok(), "an answer within {LIVENESS:?}: {}", String::from_utf8_lossy(&answer));
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn a_stalled_body_gets_408_at_the_configured_deadline() {
    tower_idempotency::testkit::run(async {
        let orders = Orders::start(&[("ORDERS_BODY_TIMEOUT_SECS", "1")]);
        let body = order(1);
        let (most, _) = body.as_bytes().split_at(body.len() - 1);
        let mut stream = stalled_post(orders.addr, "stall-1", body.len(), most).await;
        let answer = read_answer(&mut stream).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("\"code\":\"idempotency_body_timeout\""), "{answer}");
        drop(stream);

        // Nothing was claimed: the same key, sent whole, creates the order.
        let whole = post_order(orders.addr, ACCOUNT, "stall-1", &body).await.unwrap();
        assert_eq!(whole.status, 201, "{}", whole.text());
    });
}

#[test]
fn the_buffer_budget_refuses_while_stalled_bodies_hold_it_and_admits_once_they_are_gone() {
    tower_idempotency::testkit::run(async {
        // The smallest budget: one largest body (1 MiB) fills it.
        let orders = Orders::start(&[("ORDERS_BUFFER_BUDGET_BYTES", "1048576")]);
        let mut holder = stalled_post(orders.addr, "holder-0", 1024 * 1024, b"{").await;

        // Once the stalled body is being read, it holds the whole budget: new requests are
        // refused before they are read. (A probe still in flight when the holder arrived makes
        // the holder itself refused: then a new holder takes its place.)
        let mut refused = None;
        let probing = tokio::time::timeout(LIVENESS, async {
            for n in 0.. {
                let reply = post_order(orders.addr, ACCOUNT, &format!("probe-{n}"), &order(n)).await.unwrap();
                if reply.status == 503 {
                    refused = Some(reply);
                    break;
                }
                assert_eq!(reply.status, 201, "{}", reply.text());
                let mut peek = [0u8; 1];
                if !matches!(holder.try_read(&mut peek), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock) {
                    holder = stalled_post(orders.addr, &format!("holder-{n}"), 1024 * 1024, b"{").await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(probing.is_ok(), "the budget never filled");
        let refused = refused.unwrap();
        assert!(refused.text().contains("\"code\":\"idempotency_buffer_budget_exhausted\""), "{}", refused.text());
        assert_eq!(refused.header("retry-after"), Some("1"));
        assert_eq!(refused.header("content-type"), Some("application/problem+json"));

        // The stalled client goes away: its share comes back, and the refused request runs.
        drop(holder);
        let admitted = tokio::time::timeout(LIVENESS, async {
            loop {
                let reply = post_order(orders.addr, ACCOUNT, "after", &order(10_000)).await.unwrap();
                if reply.status != 503 {
                    return reply;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("admitted again once the stalled body is gone");
        assert_eq!(admitted.status, 201, "{}", admitted.text());
    });
}

#[test]
fn the_service_speaks_http2_prior_knowledge_beside_http1() {
    tower_idempotency::testkit::run(async {
        use http_body_util::{BodyExt, Full};
        use hyper_util::rt::{TokioExecutor, TokioIo};

        let orders = Orders::start(&[]);
        let stream = TcpStream::connect(orders.addr).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let body = order(7);
        let request = http::Request::post(format!("http://{}/orders", orders.addr))
            .header("authorization", format!("Bearer {ACCOUNT}"))
            .header("idempotency-key", "h2-1")
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body.clone())))
            .unwrap();
        let response = tokio::time::timeout(LIVENESS, sender.send_request(request)).await.unwrap().unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.status(), 201);
        let first = response.into_body().collect().await.unwrap().to_bytes();

        let retry = post_order(orders.addr, ACCOUNT, "h2-1", &body).await.unwrap();
        assert_eq!((retry.status, retry.header("idempotent-replayed")), (201, Some("true")));
        assert_eq!(retry.body, first.to_vec(), "HTTP/1.1 replays what HTTP/2 created");
    });
}

#[test]
fn a_limit_that_is_not_a_number_or_too_small_stops_the_start() {
    for (name, value) in [
        ("ORDERS_BODY_TIMEOUT_SECS", "0"),
        ("ORDERS_BODY_TIMEOUT_SECS", "soon"),
        ("ORDERS_BUFFER_BUDGET_BYTES", "1024"),
        ("ORDERS_BUFFER_BUDGET_BYTES", "-1"),
    ] {
        let mut child = Command::new(orders_binary())
            .env("ORDERS_ADDR", "127.0.0.1:0")
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
        assert!(stderr.contains(name), "{name}={value}: {stderr}");
        assert!(output.stdout.is_empty(), "never listening: {}", String::from_utf8_lossy(&output.stdout));
    }
}
