//! The gRPC service the gRPC benchmarks share: `proto/conformance.proto`'s `Things`, with a
//! `Create` that does no work (a call's cost is then the transport's and the layer's), and the
//! authentication interceptor that gives every call the scope `bench`.

#![allow(dead_code)] // Each benchmark takes the parts it needs.

use tonic::{Request, Response, Status};
use tower_idempotency::Scope;

pub mod proto {
    tonic::include_proto!("conformance.v1");
}

use proto::things_server::Things;
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
