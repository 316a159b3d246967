//! # A webhook receiver that processes each event exactly once
//!
//! The consumer of the orders service's webhooks (`ORDERS_WEBHOOK_URL`): it checks each
//! delivery's Standard Webhooks signature, deduplicates deliveries by `webhook-id` with
//! `tower-idempotency` (an atomic `SqliteStore`: the event is recorded in the layer's own
//! transaction, with the answer that replays), and keeps its events in SQLite, so that it
//! survives its own restarts. A redelivered event gets the first answer again
//! (`Idempotent-Replayed: true`) and is not processed again.
//!
//! ```text
//! SINK_SECRET=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw cargo run --features outbox --example webhook_sink
//! ```
//!
//! It prints `listening on HOST:PORT` once bound. Environment:
//!
//! - `SINK_ADDR`: where to listen (default `127.0.0.1:3200`; port `0` picks a free one).
//! - `SINK_SECRET`: the `whsec_` secret the sender signs with (required).
//! - `SINK_DATABASE_URL`: the SQLite file (`sqlite:PATH` or a plain path; default `sink.db` in the
//!   working directory), created if missing.
//! - `SINK_FAIL_RATE` (0 to 1, default 0): the share of deliveries answered 500 without being
//!   processed, after the signature check.
//! - `SINK_AMBIGUOUS_RATE` (0 to 1, default 0): the share of deliveries processed and committed,
//!   then left unanswered (the connection is dropped), after the signature check.
//!
//! Routes:
//!
//! - `POST /webhooks`: a delivery. A missing or bad signature, or a `webhook-timestamp` more than
//!   5 minutes from now: 401 `invalid_signature` / `stale_timestamp`, nothing processed. Else
//!   the delivery is counted, deduplicated by `webhook-id` (one sender, one scope), the event is
//!   recorded (processed) and the answer is 204. A delivery that reuses an id with another body is
//!   refused with 422 `idempotency_key_reused`, not processed.
//! - `GET /events`: `{"events": [{"id", "type", "order_id", "processed", "deliveries"}]}`, where
//!   `processed` counts the times the event was processed and `deliveries` the times it was
//!   received with a valid signature.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::str::FromStr;

use sqlx::sqlite::SqliteConnectOptions;
use tower_idempotency::BoxError;
use tower_idempotency::outbox::WebhookSecret;

mod app;
mod db;
mod serve;

use app::SinkConfig;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("webhook_sink: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let address = std::env::var("SINK_ADDR").unwrap_or_else(|_| "127.0.0.1:3200".to_owned());
    let secret = std::env::var("SINK_SECRET").map_err(|_| "SINK_SECRET must be set to the sender's whsec_ secret")?;
    // Not echoed: it is a secret.
    let secret = WebhookSecret::parse(&secret).map_err(|_| "SINK_SECRET must be whsec_ and base64 of 16+ bytes")?;
    let config = SinkConfig {
        secret,
        fail_rate: rate("SINK_FAIL_RATE")?,
        ambiguous_rate: rate("SINK_AMBIGUOUS_RATE")?,
        dedup: true,
    };
    let database = std::env::var("SINK_DATABASE_URL").unwrap_or_else(|_| "sink.db".to_owned());
    let options = match database.strip_prefix("sqlite:") {
        Some(_) => SqliteConnectOptions::from_str(&database)?,
        None => SqliteConnectOptions::new().filename(&database),
    };
    let pool = db::open(options).await?;
    let router = app::app(pool, config).await?;
    let listener = tokio::net::TcpListener::bind(&address).await?;
    let local: SocketAddr = listener.local_addr()?;
    println!("listening on {local}");
    serve::serve(listener, router).await
}

/// A fault rate from `name`: unset means 0; else a number from 0 to 1.
fn rate(name: &str) -> Result<f64, BoxError> {
    match std::env::var(name) {
        Err(_) => Ok(0.0),
        Ok(text) => text
            .parse::<f64>()
            .ok()
            .filter(|rate| (0.0..=1.0).contains(rate))
            .ok_or_else(|| format!("{name} must be a number from 0 to 1").into()),
    }
}
