//! The tonic client layer end to end: a generated tonic client on a real `Channel`, through
//! [`GrpcIdempotentRetryLayer`], against the gRPC orders example (`examples/grpc_orders.rs`)
//! as a child process on a fresh SQLite file. The call starts before the server does: the
//! layer retries the failed connections with one key until the server is up, and a later call
//! with that key is answered by a replay of the same order.
#![cfg(all(feature = "client", feature = "grpc-example", feature = "axum", feature = "sqlite"))]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tower_idempotency::client::{GrpcIdempotentRetryLayer, RetryPolicy, RetryReason, RetryReport};
use tower_layer::Layer;

mod proto {
    tonic::include_proto!("orders.v1");
}

use proto::CreateOrderRequest;
use proto::orders_client::OrdersClient;

/// The example, listening on `port`, on the SQLite file `path`; killed when dropped.
struct GrpcOrders(Child);

impl GrpcOrders {
    fn start(port: u16, path: &std::path::Path) -> Self {
        let exe = std::env::current_exe().expect("test executable");
        let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
        let binary = profile.join("examples").join(format!("grpc_orders{}", std::env::consts::EXE_SUFFIX));
        assert!(binary.exists(), "{} is missing: run `cargo test --all-features`", binary.display());
        let mut child = Command::new(binary)
            .env("GRPC_ORDERS_ADDR", format!("127.0.0.1:{port}"))
            .env("DATABASE_URL", format!("sqlite:{}", path.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the gRPC orders example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("the first line");
        assert!(line.starts_with("listening on "), "{line:?}");
        Self(child)
    }
}

impl Drop for GrpcOrders {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn create(amount_minor: &str, key: Option<&str>) -> tonic::Request<CreateOrderRequest> {
    let message = CreateOrderRequest {
        sku: "book-7".into(),
        quantity: 1,
        amount_minor: amount_minor.into(),
        currency: "EUR".into(),
    };
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("authorization", MetadataValue::from_static("Bearer acct_grpc_client"));
    if let Some(key) = key {
        request.metadata_mut().insert("idempotency-key", MetadataValue::try_from(key).unwrap());
    }
    request
}

#[tokio::test]
async fn a_tonic_client_keeps_its_key_until_the_server_answers() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let path = std::env::temp_dir().join(format!("tidem_client_grpc_{}_{port}.db", std::process::id()));
    let channel = Channel::from_shared(format!("http://127.0.0.1:{port}")).unwrap().connect_lazy();
    let policy = RetryPolicy::new()
        .max_attempts(1000)
        .base_delay(Duration::from_millis(20))
        .max_delay(Duration::from_millis(100))
        .deadline(Duration::from_secs(60));
    let mut client = OrdersClient::new(GrpcIdempotentRetryLayer::new().policy(policy).layer(channel));

    // The server comes up only after the first attempts have failed.
    let starter = tokio::spawn({
        let path = path.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            tokio::task::spawn_blocking(move || GrpcOrders::start(port, &path)).await.unwrap()
        }
    });
    let first = client.create_order(create("1250", None)).await.expect("created once the server is up");
    let _server = starter.await.unwrap();
    let report = first.extensions().get::<RetryReport>().cloned().expect("the report travels with the answer");
    assert!(report.retries().iter().all(|r| *r == RetryReason::ConnectionFailed), "{:?}", report.retries());
    assert!(!report.replayed());
    println!("client grpc: created after {} attempt(s)", report.attempts());
    let key = report.key().expect("a fresh key").to_owned();
    let order = first.into_inner();

    // The same logical request later, with the key the layer chose: the stored order.
    let again = client.create_order(create("1250", Some(&key))).await.expect("replayed");
    let report = again.extensions().get::<RetryReport>().cloned().unwrap();
    assert_eq!((report.attempts(), report.replayed(), report.key()), (1, true, Some(key.as_str())));
    assert_eq!(again.into_inner(), order);

    // The key with another request: definitive, handed back after one attempt.
    let reused = client.create_order(create("9999", Some(&key))).await.expect_err("the key is taken");
    assert_eq!(reused.code(), Code::FailedPrecondition);

    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}
