//! The gRPC orders example (`examples/grpc_orders.rs`) as a real child process, driven by a
//! tonic client generated from the same `proto/orders.proto`: on a fresh PostgreSQL database,
//! and on a fresh SQLite file. On PostgreSQL the HTTP example is started on the same database
//! too, and reads the order the gRPC service created: one store for both.
#![cfg(all(feature = "grpc-example", feature = "postgres", feature = "axum", feature = "sqlite"))]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

mod proto {
    tonic::include_proto!("orders.v1");
}

use proto::orders_client::OrdersClient;
use proto::{CreateOrderRequest, GetOrderRequest};

/// The example, running; killed when dropped.
struct GrpcOrders {
    child: Child,
    addr: SocketAddr,
}

impl GrpcOrders {
    /// Starts the example on a free port with `DATABASE_URL=database_url`, and waits until it
    /// says it listens.
    fn start(database_url: &str) -> Self {
        let exe = std::env::current_exe().expect("test executable");
        let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
        let binary = profile.join("examples").join(format!("grpc_orders{}", std::env::consts::EXE_SUFFIX));
        assert!(binary.exists(), "{} is missing: run `cargo test --all-features`", binary.display());
        let mut child = Command::new(binary)
            .env("GRPC_ORDERS_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", database_url)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the gRPC orders example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("the first line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the first line of stdout must be `listening on <addr>`, got {line:?}"))
            .parse()
            .expect("an address");
        Self { child, addr }
    }

    async fn client(&self) -> OrdersClient<Channel> {
        OrdersClient::connect(format!("http://{}", self.addr)).await.expect("connect")
    }
}

impl Drop for GrpcOrders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn order(amount_minor: &str, quantity: i64) -> CreateOrderRequest {
    CreateOrderRequest {
        sku: "book-42".to_owned(),
        quantity,
        amount_minor: amount_minor.to_owned(),
        currency: "JPY".to_owned(),
    }
}

fn with<T>(message: T, account: Option<&str>, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(account) = account {
        let bearer = MetadataValue::try_from(format!("Bearer {account}")).expect("ascii");
        request.metadata_mut().insert("authorization", bearer);
    }
    if let Some(key) = key {
        request.metadata_mut().insert("idempotency-key", MetadataValue::try_from(key).expect("ascii"));
    }
    request
}

fn replayed(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.get("idempotent-replayed").is_some_and(|v| v == "true")
}

/// The example's contract, on whatever database it runs.
async fn create_order_contract(server: &GrpcOrders) -> proto::Order {
    let mut client = server.client().await;
    let amount = "9007199254740993";

    let first = client.create_order(with(order(amount, 1), Some("acct_1"), Some("key-1"))).await.expect("created");
    assert!(!replayed(first.metadata()));
    let created = first.into_inner();
    assert_eq!(created.amount_minor, amount, "the amount is kept exactly");
    assert_eq!((created.account_id.as_str(), created.quantity), ("acct_1", 1));
    assert_eq!(created.idempotency_operation_id.len(), 36);
    assert!(created.created_at.ends_with('Z'), "{}", created.created_at);

    let retry = client.create_order(with(order(amount, 1), Some("acct_1"), Some("key-1"))).await.expect("replayed");
    assert!(replayed(retry.metadata()), "the retry is marked as a replay");
    assert_eq!(retry.into_inner(), created, "the retry gets the first order");

    let other = client.create_order(with(order("9007199254740992", 1), Some("acct_1"), Some("key-1"))).await;
    let other = other.expect_err("the key with another amount");
    assert_eq!(other.code(), Code::FailedPrecondition);

    let unauthenticated = client.create_order(with(order(amount, 1), None, Some("key-2"))).await;
    assert_eq!(unauthenticated.expect_err("no account").code(), Code::Unauthenticated);

    let no_key = client.create_order(with(order(amount, 1), Some("acct_1"), None)).await.expect_err("no key");
    assert_eq!(no_key.code(), Code::InvalidArgument);
    assert_eq!(no_key.metadata().get("idempotency-code").map(|v| v.as_bytes()), Some(&b"idempotency_key_missing"[..]));

    // Bad input is released: the corrected call may reuse the key.
    for (bad, field) in
        [(order(amount, 0), "quantity"), (order("1.5", 1), "amount_minor"), (order("007", 1), "amount_minor")]
    {
        let refused = client.create_order(with(bad, Some("acct_1"), Some("key-3"))).await.expect_err("invalid");
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(refused.message().contains(field), "{field}: {}", refused.message());
    }
    let corrected = client.create_order(with(order("100", 2), Some("acct_1"), Some("key-3"))).await.expect("ok");
    assert!(!replayed(corrected.metadata()), "the invalid attempts stored nothing");

    // Another account's key is its own; reads are per account and not guarded.
    let theirs = client.create_order(with(order(amount, 1), Some("acct_2"), Some("key-1"))).await.expect("theirs");
    assert_ne!(theirs.get_ref().order_id, created.order_id);
    let get = GetOrderRequest { order_id: created.order_id.clone() };
    let read = client.get_order(with(get.clone(), Some("acct_1"), None)).await.expect("the owner reads it");
    assert_eq!(read.into_inner(), created);
    let foreign = client.get_order(with(get, Some("acct_2"), None)).await.expect_err("another account");
    assert_eq!(foreign.code(), Code::NotFound);
    created
}

#[tokio::test]
async fn grpc_example_on_postgres_creates_each_order_once_and_shares_the_store_with_the_http_example() {
    let database_url = support::server::fresh_database("tidem_grpc_example").await;
    let server = GrpcOrders::start(&database_url);
    let created = create_order_contract(&server).await;

    let pool = sqlx::PgPool::connect(&database_url).await.expect("connect");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE idempotency_operation_id = $1")
        .bind(&created.idempotency_operation_id)
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, 1, "one order row for the key, whatever the retries");
    pool.close().await;

    // The HTTP example on the same database reads the order the gRPC example created.
    let http = support::server::Server::start(&database_url, support::server::free_port());
    let reply = get(http.addr, &format!("/orders/{}", created.order_id), "acct_1").await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains(&format!("\"order_id\":\"{}\"", created.order_id)), "{reply}");
    assert!(reply.contains("\"amount_minor\":9007199254740993"), "{reply}");
}

#[tokio::test]
async fn grpc_example_on_sqlite_creates_each_order_once() {
    // Declared before the server, so dropped after it.
    let (path, _file) = support::sqlite_path("tidem_grpc_example");
    let server = GrpcOrders::start(&format!("sqlite:{}", path.display()));
    create_order_contract(&server).await;
    drop(server);
}

/// A plain HTTP/1.1 GET with the account's bearer token; the whole reply as text.
async fn get(addr: SocketAddr, path: &str, account: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request =
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {account}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await.expect("read");
    String::from_utf8_lossy(&reply).into_owned()
}
