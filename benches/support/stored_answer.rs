//! The answer the PostgreSQL scale benchmarks store with every record (`pg_scale`,
//! `pg_layout`): a created order's JSON body of about 300 bytes and its two headers.

use http::{HeaderName, HeaderValue, StatusCode};
use tower_idempotency::StoredResponse;

/// The body every stored answer carries: the "300-byte answer" of the figures, 299 bytes exactly.
pub fn answer_body() -> String {
    let mut body =
        String::from("{\"order_id\":\"6a321645-a23b-40c1-929b-813d72a6be46\",\"status\":\"accepted\",\"lines\":[");
    while body.len() < 296 {
        body.push_str("{\"sku\":\"book-42\",\"qty\":1},");
    }
    body.truncate(296);
    body.push_str("\"]}");
    body.truncate(300);
    body
}

/// The stored answer: 201, the body above, `content-type` and `location`.
pub fn answer() -> StoredResponse {
    let mut response = StoredResponse::new(StatusCode::CREATED, answer_body());
    response.headers = vec![
        (HeaderName::from_static("content-type"), HeaderValue::from_static("application/json")),
        (HeaderName::from_static("location"), HeaderValue::from_static("/orders/6a321645-a23b-40c1-929b-813d72a6be46")),
    ];
    response
}

/// `bytes` as lowercase hex, for a `'\x...'::bytea` literal.
#[allow(dead_code)] // Only the benchmarks that write literals ask for it.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
