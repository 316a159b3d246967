//! The body of `POST /orders`: declared as JSON, read strictly (no unknown or duplicate
//! members, `amount_minor` kept as written), then checked by the order's rules.

use axum::http::HeaderMap;
use axum::http::header::CONTENT_TYPE;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::book::order::{AmountMinor, OrderDraft};
use super::problem::ApiProblem;

/// The body of `POST /orders` as JSON, before the rules that JSON types cannot say.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateOrderBody {
    sku: String,
    quantity: i64,
    amount_minor: Box<RawValue>,
    currency: String,
}

/// Parses and validates a request body; the error is the 422's `detail`.
pub(crate) fn draft_from_json(body: &[u8]) -> Result<OrderDraft, String> {
    // serde would also read a struct from a JSON array; an order is an object only.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err("the body must be a JSON object with sku, quantity, amount_minor and currency".to_owned());
    }
    let body: CreateOrderBody =
        serde_json::from_slice(body).map_err(|error| format!("the body is not a valid order: {error}"))?;
    OrderDraft::new(body.sku, body.quantity, AmountMinor::parse(body.amount_minor), body.currency)
}

/// Refuses a body that is not declared as JSON.
pub(crate) fn require_json(headers: &HeaderMap) -> Result<(), ApiProblem> {
    let essence = headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(|value| value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase());
    match essence {
        Some(mime) if mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json")) => {
            Ok(())
        }
        _ => Err(ApiProblem::unsupported_media_type()),
    }
}
