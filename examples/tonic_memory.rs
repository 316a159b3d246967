//! A tonic service guarded by the idempotency layer, on the in-process `MemoryStore`: the
//! `orders.v1.Orders` service of `proto/orders.proto`, keeping its orders in memory.
//!
//! ```text
//! cargo run --features grpc-example --example tonic_memory
//! grpcurl -plaintext -import-path proto -proto orders.proto -H 'idempotency-key: key-1' \
//!   -d '{"sku":"book-42","quantity":1,"amount_minor":"100","currency":"JPY"}' \
//!   127.0.0.1:50052 orders.v1.Orders/CreateOrder
//! ```
//!
//! Call `CreateOrder` again with the same key and message: the same order, with
//! `idempotent-replayed: true` in the response metadata, and no second order. `GetOrder` is
//! not guarded.

use std::collections::HashMap;
use std::sync::Mutex;

use tonic::transport::Server;
use tonic::{Request, Response, Status};
use tower_idempotency::{BoxError, IdempotencyContext, IdempotencyLayer, MemoryStore};

/// The code generated from `proto/orders.proto` at build time (feature `grpc-example`).
mod proto {
    tonic::include_proto!("orders.v1");
}

use proto::orders_server::{Orders, OrdersServer};
use proto::{CreateOrderRequest, GetOrderRequest, Order};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // Only the methods named here are guarded; a gRPC method's operation is its path. One
    // scope for every caller: fine for a single-tenant example only.
    let idempotency = IdempotencyLayer::new(MemoryStore::new())
        .grpc_methods(["/orders.v1.Orders/CreateOrder"])
        .shared_scope("example");
    let addr = "127.0.0.1:50052".parse()?;
    println!("listening on {addr}; try, twice:");
    println!(
        "grpcurl -plaintext -import-path proto -proto orders.proto -H 'idempotency-key: key-1' \
         -d '{{\"sku\":\"book-42\",\"quantity\":1,\"amount_minor\":\"100\",\"currency\":\"JPY\"}}' \
         {addr} orders.v1.Orders/CreateOrder"
    );
    Server::builder()
        .layer(idempotency.into_tonic())
        .add_service(OrdersServer::new(InMemoryOrders::default()))
        .serve(addr)
        .await?;
    Ok(())
}

/// The orders, by id.
#[derive(Default)]
struct InMemoryOrders {
    orders: Mutex<HashMap<String, Order>>,
}

#[tonic::async_trait]
impl Orders for InMemoryOrders {
    /// Runs once per key: a retry gets the stored answer without calling it again.
    async fn create_order(&self, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        let context = request.extensions().get::<IdempotencyContext>().cloned();
        let operation_id = context.map(|context| context.operation_id().to_owned()).unwrap_or_default();
        let CreateOrderRequest { sku, quantity, amount_minor, currency } = request.into_inner();
        if quantity < 1 {
            // Any status but OK is released: the corrected call may reuse the key.
            return Err(Status::invalid_argument("quantity must be at least 1"));
        }
        let mut orders = self.orders.lock().map_err(|_| Status::internal("poisoned"))?;
        let order = Order {
            order_id: format!("order-{}", orders.len() + 1),
            account_id: "example".to_owned(),
            sku,
            quantity,
            amount_minor,
            currency,
            created_at: String::new(),
            idempotency_operation_id: operation_id,
        };
        orders.insert(order.order_id.clone(), order.clone());
        Ok(Response::new(order))
    }

    async fn get_order(&self, request: Request<GetOrderRequest>) -> Result<Response<Order>, Status> {
        let orders = self.orders.lock().map_err(|_| Status::internal("poisoned"))?;
        let order = orders.get(&request.get_ref().order_id).cloned();
        order.map(Response::new).ok_or_else(|| Status::not_found("no such order"))
    }
}
