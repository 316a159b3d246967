//! A real tonic server on a loopback port, with the idempotency layer in front of a test
//! service (`proto/conformance.proto`) whose executions it counts, and a real tonic client.
//!
//! The server's stack, outermost first: an interceptor that turns `authorization: Bearer
//! <account>` into the request's `Scope` (UNAUTHENTICATED without it), the idempotency layer,
//! and a layer that adds a trailer, `x-trailer-seq` (a number per answer), to every answer that
//! has trailers, as a handler with trailing metadata would.
//!
//! Included with `#[path]` by the gRPC test files, which need the `grpc-example` feature (the
//! generated code) and `postgres`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use sqlx::{PgPool, Postgres};
use tokio::sync::Semaphore;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use tower_idempotency::grpc::reject;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, PostgresStore, Scope, TxHandle};

pub mod proto {
    tonic::include_proto!("conformance.v1");
}

use proto::things_client::ThingsClient;
use proto::things_server::{Things, ThingsServer};
use proto::{CreateThing, Thing};

/// The guarded methods (`Unguarded` is deliberately not named).
pub const GUARDED: [&str; 4] = [
    "/conformance.v1.Things/Create",
    "/conformance.v1.Things/Reject",
    "/conformance.v1.Things/Fail",
    "/conformance.v1.Things/Slow",
];

/// The message `Reject` answers with (percent-encoding matters: `%`, `:`, non-ASCII).
pub const REJECTION: &str = "card declined: 100% over the limit — ¥";

/// The test service: counts its executions per method, writes a row per execution through
/// the claim's transaction when it gets one (atomic mode), else through the pool.
#[derive(Clone)]
pub struct ThingsService {
    pool: PgPool,
    executions: Arc<Mutex<HashMap<&'static str, u64>>>,
    entered: Arc<Semaphore>,
    gate: Arc<Semaphore>,
}

impl ThingsService {
    /// A service on `pool`, which must hold the `things` table ([`create_table`]).
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            executions: Arc::default(),
            entered: Arc::new(Semaphore::new(0)),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    /// How many times `method` ran.
    pub fn executions(&self, method: &str) -> u64 {
        self.executions.lock().unwrap().get(method).copied().unwrap_or(0)
    }

    /// Waits until a `Slow` call has entered the handler.
    pub async fn slow_entered(&self) {
        self.entered.acquire().await.expect("open").forget();
    }

    /// Lets `n` waiting `Slow` calls finish.
    pub fn open_gate(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// One execution: count it, write its row, answer with the message.
    async fn execute(&self, method: &'static str, request: Request<CreateThing>) -> Result<Thing, Status> {
        let context = request.extensions().get::<IdempotencyContext>().cloned();
        let tx = request.extensions().get::<TxHandle<Postgres>>().cloned();
        // Dropping the request drops its extensions, the layer's clone of the handle among them.
        let message = request.into_inner();
        let execution = {
            let mut executions = self.executions.lock().unwrap();
            let count = executions.entry(method).or_default();
            *count += 1;
            *count
        };
        let operation_id = context.as_ref().map(|c| c.operation_id().to_owned()).unwrap_or_default();
        let insert =
            sqlx::query("INSERT INTO things (method, operation_id, name, in_claim_tx) VALUES ($1, $2, $3, $4)")
                .bind(method)
                .bind(&operation_id)
                .bind(&message.name)
                .bind(tx.is_some());
        match tx {
            Some(tx) => {
                let mut conn = tx.acquire().await.map_err(|_| Status::internal("the transaction is finished"))?;
                insert.execute(&mut *conn).await.map_err(|e| Status::internal(format!("insert: {e}")))?;
            }
            None => {
                insert.execute(&self.pool).await.map_err(|e| Status::internal(format!("insert: {e}")))?;
            }
        }
        Ok(Thing { name: message.name, amount: message.amount, execution, operation_id })
    }
}

#[tonic::async_trait]
impl Things for ThingsService {
    async fn create(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        let thing = self.execute("create", request).await?;
        let mut response = Response::new(thing.clone());
        let execution = MetadataValue::try_from(thing.execution.to_string()).expect("digits");
        // Declared with `store_header`: stored and replayed.
        response.metadata_mut().insert("x-thing-execution", execution);
        // Not declared: answered once, never replayed.
        response.metadata_mut().insert("x-not-stored", MetadataValue::from_static("first-answer-only"));
        Ok(response)
    }

    async fn reject(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        self.execute("reject", request).await?;
        Err(reject(Status::failed_precondition(REJECTION)))
    }

    async fn fail(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        self.execute("fail", request).await?;
        Err(Status::unavailable("the downstream is down"))
    }

    async fn slow(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        self.entered.add_permits(1);
        self.gate.acquire().await.map_err(|_| Status::internal("gate closed"))?.forget();
        Ok(Response::new(self.execute("slow", request).await?))
    }

    async fn unguarded(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Ok(Response::new(self.execute("unguarded", request).await?))
    }
}

/// Creates the `things` table in the pool's schema.
pub async fn create_table(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS things (
            id bigserial PRIMARY KEY, method text NOT NULL, operation_id text NOT NULL, name text NOT NULL,
            in_claim_tx boolean NOT NULL)",
    )
    .execute(pool)
    .await
    .expect("things table");
}

/// Rows written by `method`.
pub async fn rows(pool: &PgPool, method: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM things WHERE method = $1")
        .bind(method)
        .fetch_one(pool)
        .await
        .expect("count")
}

/// The interceptor before the idempotency layer: the bearer token is the account, and the
/// account is the scope. No token: UNAUTHENTICATED, and the layer never sees the call.
pub fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let account = request
        .metadata()
        .get("authorization")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::to_owned)
        .ok_or_else(|| Status::unauthenticated("send authorization: Bearer <account>"))?;
    request.extensions_mut().insert(Scope::new(account));
    Ok(request)
}

/// Adds `x-trailer-seq` to the trailers of every answer that has trailers.
fn add_trailer(response: http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> {
    static SEQ: AtomicU64 = AtomicU64::new(1);
    let seq = http::HeaderValue::from(SEQ.fetch_add(1, Ordering::Relaxed));
    response.map(|body| {
        tonic::body::Body::new(body.map_frame(move |frame: Frame<Bytes>| match frame.into_trailers() {
            Ok(mut trailers) => {
                trailers.insert("x-trailer-seq", seq.clone());
                Frame::trailers(trailers)
            }
            Err(frame) => frame,
        }))
    })
}

/// The layer every test starts from: the guarded methods, `x-thing-execution` stored.
pub fn layer(store: PostgresStore) -> IdempotencyLayer<PostgresStore> {
    IdempotencyLayer::new(store).grpc_methods(GUARDED).store_header(http::HeaderName::from_static("x-thing-execution"))
}

/// Serves `service` behind `layer` on a fresh loopback port until the runtime ends.
pub async fn serve(layer: IdempotencyLayer<PostgresStore>, service: ThingsService) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let server = Server::builder()
        .layer(tonic::service::InterceptorLayer::new(authenticate))
        .layer(layer.into_tonic())
        .layer(tower::util::MapResponseLayer::new(add_trailer))
        .add_service(ThingsServer::new(service))
        .serve_with_incoming(incoming);
    tokio::spawn(async move { server.await.expect("the gRPC test server") });
    addr
}

/// A client on one HTTP/2 connection to `addr`.
pub async fn client(addr: SocketAddr) -> ThingsClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}")).expect("uri").connect().await.expect("connect");
    ThingsClient::new(channel)
}

/// A call's request: `message` with `authorization: Bearer <account>` (if any) and the keys
/// given (each its own `idempotency-key` field).
pub fn call(message: CreateThing, account: Option<&str>, keys: &[&str]) -> Request<CreateThing> {
    let mut request = Request::new(message);
    if let Some(account) = account {
        let bearer = MetadataValue::try_from(format!("Bearer {account}")).expect("ascii");
        request.metadata_mut().insert("authorization", bearer);
    }
    for key in keys {
        request.metadata_mut().append("idempotency-key", MetadataValue::try_from(*key).expect("ascii key"));
    }
    request
}

/// A message.
pub fn thing(name: &str, amount: i64) -> CreateThing {
    CreateThing { name: name.to_owned(), amount }
}

/// Whether an answer's metadata says it is a replay.
pub fn replayed(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.get("idempotent-replayed").is_some_and(|v| v == "true")
}
