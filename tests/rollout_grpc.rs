//! The kill switch keeps the old path over gRPC, on both SQL stores: in `Off` (and `Shadow`)
//! a handler written for atomic mode still gets a plain transaction from the store, committed
//! when its answer is OK and rolled back otherwise, with nothing claimed, stored or replayed.
#![cfg(all(feature = "grpc-example", feature = "postgres", feature = "sqlite"))]

#[path = "support/grpc.rs"]
mod grpc;
mod support;

use std::net::SocketAddr;

use sqlx::{Sqlite, SqlitePool};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use tower_idempotency::{CouplingMode, IdempotencyContext, IdempotencyLayer, RolloutMode, RolloutSwitch, TxHandle};

use grpc::proto::things_client::ThingsClient;
use grpc::proto::things_server::{Things, ThingsServer};
use grpc::proto::{CreateThing, Thing};
use grpc::{ThingsService, call, client, replayed, rows, thing};

const ACCOUNT: Option<&str> = Some("acct_1");

/// In `Off`, then `Shadow`: one key created twice (never replayed, the handler given its
/// context each time) and a call answered UNAVAILABLE (released, so its write rolls back).
async fn calls_on_the_old_path(client: &mut ThingsClient<Channel>, switch: &RolloutSwitch) {
    for mode in [RolloutMode::Off, RolloutMode::Shadow] {
        switch.set(mode);
        let key = format!("k-{}", mode.as_str());
        for _ in 0..2 {
            let answer = client.create(call(thing("pen", 1), ACCOUNT, &[&key])).await.expect("the old path answers");
            assert!(!replayed(answer.metadata()), "{mode:?}: never replayed");
            assert_eq!(answer.get_ref().operation_id.len(), 36, "the handler still gets its context");
        }
        let failed = client.fail(call(thing("pen", 1), ACCOUNT, &[&key])).await.expect_err("fails");
        assert_eq!(failed.code(), tonic::Code::Unavailable);
    }
}

#[tokio::test]
async fn postgres_off_and_shadow_give_the_handler_a_committed_plain_transaction() {
    let store = support::pg_store(CouplingMode::Atomic).await;
    grpc::create_table(store.pool()).await;
    let pool = store.pool().clone();
    let switch = RolloutSwitch::new(RolloutMode::Off);
    let addr = grpc::serve(grpc::layer(store).rollout(switch.clone()), ThingsService::new(pool.clone())).await;
    let mut client = client(addr).await;

    calls_on_the_old_path(&mut client, &switch).await;
    assert_eq!(rows(&pool, "create").await, 4, "an order per call, committed");
    assert_eq!(rows(&pool, "fail").await, 0, "a released answer rolls back");
    let in_tx: i64 =
        sqlx::query_scalar("SELECT count(*) FROM things WHERE in_claim_tx").fetch_one(&pool).await.expect("count");
    assert_eq!(in_tx, 4, "every write went through the handle");
    let enforced: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE state <> 'processing'")
        .fetch_one(&pool)
        .await
        .expect("records");
    assert!(enforced <= 1, "only shadow's record (if written yet), never one per call: {enforced}");

    // The negative control: enforced, the same key writes once and replays.
    switch.set(RolloutMode::Enforce);
    for _ in 0..2 {
        client.create(call(thing("pen", 1), ACCOUNT, &["k-enforce"])).await.expect("enforced");
    }
    assert_eq!(rows(&pool, "create").await, 5);
}

/// A `Things` service over SQLite: `Create` writes a row through the handle (and fails without
/// one), `Fail` writes one and answers UNAVAILABLE.
#[derive(Clone)]
struct SqliteThings;

impl SqliteThings {
    async fn write(request: Request<CreateThing>, method: &str) -> Result<Thing, Status> {
        let tx = request.extensions().get::<TxHandle<Sqlite>>().cloned();
        let context = request.extensions().get::<IdempotencyContext>().cloned();
        drop(request);
        let tx = tx.ok_or_else(|| Status::internal("no transaction"))?;
        let operation_id = context.map(|c| c.operation_id().to_owned()).unwrap_or_default();
        let mut conn = tx.acquire().await.map_err(|_| Status::internal("finished"))?;
        sqlx::query("INSERT INTO things (method, operation_id) VALUES (?1, ?2)")
            .bind(method)
            .bind(&operation_id)
            .execute(&mut *conn)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Thing { name: String::new(), amount: 0, execution: 0, operation_id })
    }
}

#[tonic::async_trait]
impl Things for SqliteThings {
    async fn create(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Ok(Response::new(Self::write(request, "create").await?))
    }
    async fn reject(&self, _: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Err(Status::unimplemented("reject"))
    }
    async fn fail(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Self::write(request, "fail").await?;
        Err(Status::unavailable("the downstream is down"))
    }
    async fn slow(&self, _: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Err(Status::unimplemented("slow"))
    }
    async fn unguarded(&self, _: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Err(Status::unimplemented("unguarded"))
    }
}

async fn sqlite_rows(pool: &SqlitePool, method: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM things WHERE method = ?1").bind(method).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn sqlite_off_and_shadow_give_the_handler_a_committed_plain_transaction() {
    let store = support::sqlite_store(CouplingMode::Atomic).await;
    let pool = store.pool().clone();
    sqlx::raw_sql("CREATE TABLE things (method TEXT NOT NULL, operation_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .expect("things table");
    let switch = RolloutSwitch::new(RolloutMode::Off);
    let layer = IdempotencyLayer::new(store).grpc_methods(grpc::GUARDED).rollout(switch.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let server = Server::builder()
        .layer(tonic::service::InterceptorLayer::new(grpc::authenticate))
        .layer(layer.into_tonic())
        .add_service(ThingsServer::new(SqliteThings))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("the gRPC test server") });
    let mut client = client(addr).await;

    calls_on_the_old_path(&mut client, &switch).await;
    assert_eq!(sqlite_rows(&pool, "create").await, 4, "a row per call, committed");
    assert_eq!(sqlite_rows(&pool, "fail").await, 0, "a released answer rolls back");
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records").fetch_one(&pool).await.unwrap();
    assert!(records <= 1, "only shadow's record (if written yet), never one per call: {records}");

    // The negative control: enforced, the same key writes once and replays.
    switch.set(RolloutMode::Enforce);
    client.create(call(thing("pen", 1), ACCOUNT, &["k2"])).await.expect("enforced");
    let retry = client.create(call(thing("pen", 1), ACCOUNT, &["k2"])).await.expect("enforced");
    assert!(replayed(retry.metadata()));
    assert_eq!(sqlite_rows(&pool, "create").await, 5);
}
