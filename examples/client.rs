//! # Creating orders with retries that keep their key
//!
//! The client half of `tower-idempotency`: hyper-util's client behind
//! [`IdempotentRetryLayer`], creating orders on the reference service (`cargo run --example orders`).
//! Each order is one logical request: the layer gives it a fresh `Idempotency-Key` and sends
//! that same key, and the same bytes, on every retry, so a retry after a lost answer gets the
//! stored answer instead of creating a second order. Each attempt is printed as it goes.
//!
//! ## Run it
//!
//! ```text
//! cargo run --example orders                      # in one terminal: the service
//! cargo run --features client --example client    # in another: this client
//! ```
//!
//! Stop and restart the service while the client runs (or start the client first): the
//! attempts fail, the layer waits with jittered backoff and tries again with the same key, and
//! every order is created once.
//!
//! Environment:
//!
//! - `ORDERS_URL`: the service (default `http://127.0.0.1:3000`).
//! - `ORDERS_ACCOUNT`: the account to create orders for (default `acct_1`), sent as
//!   `Authorization: Bearer <account>`.
//! - `ORDERS_COUNT`: how many orders (default 3).
//!
//! At the end it sends the first order again with the key the layer chose for it: the service
//! answers with the stored order, marked as a replay, and creates nothing.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::ServiceExt;
use tower_idempotency::IdempotencyKey;
use tower_idempotency::client::{IdempotentRetryLayer, RetryPolicy, RetryReport};
use tower_layer::Layer;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let base = std::env::var("ORDERS_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".to_owned());
    let account = std::env::var("ORDERS_ACCOUNT").unwrap_or_else(|_| "acct_1".to_owned());
    let count: usize = std::env::var("ORDERS_COUNT").ok().and_then(|n| n.parse().ok()).unwrap_or(3);

    // hyper-util's client, with every attempt printed on its way out and back.
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let printed = tower::service_fn(move |request: Request<Full<Bytes>>| {
        let key = request.headers().get("idempotency-key").map(|v| v.to_str().unwrap_or("?").to_owned());
        println!(
            "  attempt: {} {} (Idempotency-Key: {})",
            request.method(),
            request.uri(),
            key.as_deref().unwrap_or("-")
        );
        let answer = http.request(request);
        async move {
            let answer = answer.await;
            match &answer {
                Ok(response) => println!("    -> {}", response.status()),
                Err(error) => println!("    -> failed: {error}"),
            }
            answer
        }
    });

    let policy = RetryPolicy::new()
        .max_attempts(8)
        .base_delay(Duration::from_millis(200))
        .max_delay(Duration::from_secs(3))
        .attempt_timeout(Duration::from_secs(5))
        .deadline(Duration::from_secs(30));
    let client = IdempotentRetryLayer::new().policy(policy).layer(printed);

    let mut first = None;
    for n in 0..count {
        let body = format!("{{\"sku\":\"book-{n}\",\"quantity\":1,\"amount_minor\":1250,\"currency\":\"EUR\"}}");
        println!("order {n}: {body}");
        let (key, text) = create(&client, &base, &account, &body, None).await?;
        println!("  created: {text}");
        first.get_or_insert((key, body));
    }

    if let Some((key, body)) = first {
        println!("order 0 again, with its key {key}:");
        let (_, text) = create(&client, &base, &account, &body, Some(IdempotencyKey::new(key)?)).await?;
        println!("  answer: {text}");
    }
    Ok(())
}

/// Sends one logical `POST /orders` through the layer; prints its report; answers with the key
/// it used and the body of its final answer.
async fn create<S>(
    client: &S,
    base: &str,
    account: &str,
    body: &str,
    key: Option<IdempotencyKey>,
) -> Result<(String, String), Error>
where
    S: tower_service::Service<
            Request<Full<Bytes>>,
            Response = http::Response<tower_idempotency::client::ResponseBody<hyper::body::Incoming>>,
            Error = tower_idempotency::client::RetryError,
        > + Clone,
{
    let mut request = Request::post(format!("{base}/orders"))
        .header("authorization", format!("Bearer {account}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))?;
    if let Some(key) = key {
        request.extensions_mut().insert(key);
    }
    let response = match client.clone().oneshot(request).await {
        Ok(response) => response,
        Err(error) => {
            println!("  gave up: {error} (retry later with key {:?})", error.key());
            return Err(error.into());
        }
    };
    let report = response.extensions().get::<RetryReport>().cloned().ok_or("no report")?;
    println!(
        "  {} after {} attempt(s){}{}",
        response.status(),
        report.attempts(),
        if report.replayed() { ", a replay of the stored answer" } else { "" },
        if report.gave_up() { ", still busy when the attempts ran out" } else { "" },
    );
    let text = String::from_utf8_lossy(&response.into_body().collect().await?.to_bytes()).into_owned();
    Ok((report.key().unwrap_or_default().to_owned(), text))
}
