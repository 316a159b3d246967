//! The gRPC service the gRPC benchmarks share: `proto/conformance.proto`'s `Things`, with a
//! `Create` that does no work (a call's cost is then the transport's and the layer's), and the
//! authentication interceptor that gives every call the scope `bench`.

#![allow(dead_code)] // Each benchmark takes the parts it needs.

use std::net::SocketAddr;

use tonic::transport::Server;
use tonic::{Request, Response, Status};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};

pub mod proto {
    tonic::include_proto!("conformance.v1");
}

use proto::things_server::{Things, ThingsServer};
use proto::{CreateThing, Thing};

/// `Create` echoes the message back; the other methods are not used.
pub struct Echo;

#[tonic::async_trait]
impl Things for Echo {
    async fn create(&self, request: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        let message = request.into_inner();
        Ok(Response::new(Thing {
            name: message.name,
            amount: message.amount,
            execution: 1,
            operation_id: String::new(),
        }))
    }
    async fn reject(&self, _: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn fail(&self, _: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn slow(&self, _: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn unguarded(&self, _: Request<CreateThing>) -> Result<Response<Thing>, Status> {
        Err(Status::unimplemented("bench"))
    }
}

/// The interceptor both servers run: every call gets the scope `bench`.
pub fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    request.extensions_mut().insert(Scope::new("bench"));
    Ok(request)
}

/// A tonic server of [`Echo`] on loopback, on the current runtime, behind [`authenticate`]:
/// without the layer (`guarded: None`), or with it over `MemoryStore` guarding the named method.
pub async fn serve_in_memory(guarded: Option<&'static str>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let mut builder = Server::builder().layer(tonic::service::InterceptorLayer::new(authenticate));
    match guarded {
        None => {
            let server = builder.add_service(ThingsServer::new(Echo)).serve_with_incoming(incoming);
            tokio::spawn(async move { server.await.expect("server") });
        }
        Some(method) => {
            let server = builder
                .layer(IdempotencyLayer::new(MemoryStore::new()).grpc_methods([method]).into_tonic())
                .add_service(ThingsServer::new(Echo))
                .serve_with_incoming(incoming);
            tokio::spawn(async move { server.await.expect("server") });
        }
    }
    addr
}
