//! The request the in-process benchmarks share: a POST of a 256-byte JSON order, and a trivial
//! handler that answers it 201 with a small JSON body.

#![allow(dead_code)] // Each benchmark takes the parts it needs.

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};

/// A 256-byte JSON order.
pub fn body() -> Bytes {
    let mut json =
        String::from("{\"sku\":\"SKU-000123\",\"quantity\":2,\"amount_minor\":129900,\"currency\":\"EUR\",\"note\":\"");
    while json.len() < 254 {
        json.push('x');
    }
    json.push_str("\"}");
    assert_eq!(json.len(), 256);
    Bytes::from(json)
}

/// `POST /orders` with `body`, under `key`.
pub fn request(key: &str, body: &Bytes) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .header("content-length", body.len())
        .body(Full::new(body.clone()))
        .expect("request")
}

/// Reads the order and answers 201 with its id and size.
pub async fn handler(request: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = request.into_body().collect().await?.to_bytes();
    let json = format!("{{\"order_id\":\"0f8fad5b-d9cb-469f-a165-70867728950e\",\"bytes\":{}}}", body.len());
    Ok(Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("location", "/orders/0f8fad5b-d9cb-469f-a165-70867728950e")
        .body(Full::new(Bytes::from(json)))
        .expect("response"))
}
