//! A transactional outbox and Standard Webhooks (feature `outbox`): effects that leave the
//! service, delivered at least once, recognisable on every redelivery.
//!
//! The idempotency layer makes one execution of a handler commit. When that execution must also
//! tell the outside world (a webhook, a message), the telling cannot be in the same transaction,
//! and a crash between COMMIT and the send would lose it. The outbox closes that gap: the handler
//! writes the event to a table **through the request's [`TxHandle`](crate::tx::TxHandle)**, so it
//! commits with the business write and the stored answer, or not at all; a [`Relay`] delivers
//! committed events afterwards and retries until it succeeds or gives up. Delivery may repeat, so
//! every event carries a stable id ([`EventId::for_operation`], derived from the operation id) and
//! the receiver deduplicates by it (below).
//!
//! # The outbox's states
//!
//! ```text
//! enqueue (in the request's transaction) ─► pending ─► claimed under a lease ─► delivered
//!                                            ▲              │ failure: retry at now + full-jitter backoff
//!                                            └──────────────┘ failure past the deadline ─► dead
//! ```
//!
//! - **pending**: committed, not yet delivered. A relay *claims* due events in a batch: it moves
//!   their `available_at` to the end of a lease and bumps their lease token, in one statement. On
//!   PostgreSQL the claim selects with `FOR UPDATE SKIP LOCKED`, so relays running at once take
//!   disjoint batches without waiting for each other. SQLite has no `SKIP LOCKED` and needs none:
//!   the claim is one `UPDATE … RETURNING` statement, which runs under the database's single write
//!   lock, so a second relay's claim runs after the first's and sees its leases (it waits for the
//!   lock up to the connection's busy timeout).
//! - An event is delivered again only after its **lease** ran out: a relay that crashed mid-batch
//!   leaves its events to be claimed again 30 s (by default) later. Each attempt finishes under
//!   the token it was claimed with, so a relay whose lease ran out changes nothing.
//! - **delivered** after a 2xx. A failure (non-2xx, transport error, timeout) schedules the next
//!   attempt after an exponential backoff with full jitter (1 s doubling to a 30 s cap, by
//!   default: [`RelayConfig`]); a failure after the **deadline** (24 h after enqueue) parks the
//!   event as **dead**, counted (`outbox_events_total{result="dead"}`) and left for an operator.
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn demo(pool: sqlx::PgPool, tx: tower_idempotency::TxHandle<sqlx::Postgres>,
//! #              context: tower_idempotency::IdempotencyContext) -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::outbox::{NewEvent, PostgresOutbox, Relay, RelayConfig, WebhookSecret, WebhookSender};
//!
//! let outbox = PostgresOutbox::new(pool);
//! outbox.migrate().await?;
//!
//! // In the handler, on the claim's transaction: commits with the order, or not at all.
//! let event = NewEvent::for_operation(&context, "order.created", &serde_json::json!({"order_id": "…"}))?;
//! outbox.enqueue(&tx, &event).await?;
//!
//! // Beside the service: delivers committed events as signed webhooks.
//! let secret = WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
//! let sender = WebhookSender::new("http://127.0.0.1:3200/webhooks".parse()?, secret);
//! let relay = tokio::spawn(Relay::new(outbox, sender, RelayConfig::default()).run(std::future::pending()));
//! # drop(relay); Ok(()) }
//! ```
//!
//! # Webhooks
//!
//! [`WebhookSender`] follows the Standard Webhooks specification: a `POST` of the event's body
//! with `webhook-id` (the event id), `webhook-timestamp` (the attempt's time, unix seconds) and
//! `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, keyed with a `whsec_`
//! secret ([`WebhookSecret`]). It runs on hyper-util's pooled client: plain HTTP out of the box,
//! any other hyper connector (TLS, a proxy) through [`WebhookSender::with_client`].
//!
//! # Receiving webhooks exactly once
//!
//! A receiver gets each event at least once, so it deduplicates by `webhook-id` with this
//! crate's own layer: keyed on that header instead of `Idempotency-Key`, scoped by the sender,
//! and **after** the signature check, so only the sender's genuine deliveries are recorded. The
//! first delivery runs the handler (in the layer's transaction, with an atomic store); a
//! redelivery replays its stored 2xx without running it again; a delivery that reuses an id with
//! another body is refused with 422 `idempotency_key_reused` and not processed.
//!
//! ```
//! use axum::{Router, extract::Request, middleware::{self, Next}, response::{IntoResponse, Response}};
//! use axum::routing::post;
//! use http::{HeaderName, StatusCode};
//! use tower_idempotency::outbox::{WebhookSecret, WebhookVerifier};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
//!
//! async fn verify(verifier: WebhookVerifier, request: Request, next: Next) -> Response {
//!     let (parts, body) = request.into_parts();
//!     let Ok(body) = axum::body::to_bytes(body, 1 << 20).await else {
//!         return StatusCode::PAYLOAD_TOO_LARGE.into_response();
//!     };
//!     if verifier.verify(&parts.headers, &body).is_err() {
//!         return StatusCode::UNAUTHORIZED.into_response(); // nothing recorded, nothing processed
//!     }
//!     let mut request = Request::from_parts(parts, axum::body::Body::from(body));
//!     // One sender, one scope: ids of different senders never meet.
//!     request.extensions_mut().insert(Scope::new("sender:orders"));
//!     next.run(request).await
//! }
//!
//! let secret = WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
//! let verifier = WebhookVerifier::new(secret);
//! let dedup = IdempotencyLayer::new(MemoryStore::new()) // an atomic SqliteStore in the example
//!     .header(HeaderName::from_static("webhook-id"))
//!     .operation("webhooks.receive");
//! let app: Router = Router::new()
//!     .route("/webhooks", post(|| async { StatusCode::NO_CONTENT }).layer(dedup))
//!     // Outside the route's layer: the signature is checked first.
//!     .layer(middleware::from_fn(move |request, next| verify(verifier.clone(), request, next)));
//! # drop(app);
//! ```
//!
//! The `webhook_sink` example is such a receiver, with its events in SQLite.

mod event;
#[cfg(feature = "postgres")]
mod postgres;
mod relay;
mod retry;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
mod webhook;

use std::future::Future;
use std::time::Duration;

pub use event::{EventId, NewEvent, PendingEvent};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::PostgresOutbox;
pub use relay::{BatchReport, Relay};
pub use retry::RelayConfig;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sqlite::SqliteOutbox;
pub use webhook::{
    InvalidSecret, SIGNATURE_HEADER, TIMESTAMP_HEADER, VerifiedWebhook, VerifyError, WEBHOOK_ID_HEADER, WebhookSecret,
    WebhookSender, WebhookVerifier,
};

/// An outbox operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The database failed or could not be reached; nothing was written.
    #[error("the outbox's database is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The request's transaction was already finished when the event was enqueued.
    #[error("the request's transaction is already finished")]
    TransactionFinished,
    /// A row of the outbox table is not what the migration makes.
    #[error("the outbox table holds a row it cannot have: {0}")]
    Corrupt(String),
}

/// How many events are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Not yet delivered (due, leased or waiting for a retry).
    pub pending: u64,
    /// Delivered (a 2xx came back).
    pub delivered: u64,
    /// Given up after the deadline.
    pub dead: u64,
}

/// An event a relay claimed: the event and the lease token its attempt finishes under.
#[derive(Debug, Clone)]
pub struct Leased {
    /// The event to deliver.
    pub event: PendingEvent,
    /// The claim's token: finishing the attempt with another relay's (newer) token is refused.
    pub lease_token: i64,
}

/// How an attempt ended, as the relay writes it back.
#[derive(Debug, Clone)]
pub enum Finish {
    /// Delivered: the event is done.
    Delivered,
    /// Failed: try again after `after`.
    Retry {
        /// The backoff before the next attempt.
        after: Duration,
        /// What went wrong (a status or a transport error), for operators.
        error: String,
    },
    /// Failed past the deadline: park the event as dead.
    Dead {
        /// The last failure.
        error: String,
    },
}

/// The outbox table as a relay uses it; [`PostgresOutbox`] and [`SqliteOutbox`] implement it.
pub trait OutboxStore: Clone + Send + Sync + 'static {
    /// Claims up to `batch` due events under a lease of `lease`: none of them is claimed again
    /// before the lease runs out.
    fn claim(&self, batch: usize, lease: Duration) -> impl Future<Output = Result<Vec<Leased>, OutboxError>> + Send;

    /// Writes an attempt's end, if `leased` still holds the event (its token is the latest):
    /// whether it did.
    fn finish(&self, leased: &Leased, finish: &Finish) -> impl Future<Output = Result<bool, OutboxError>> + Send;

    /// Writes the ends of a batch's attempts in one transaction: for each, whether `leased`
    /// still held the event. If it fails, none is written (the events come back after their
    /// lease, and are delivered again).
    fn finish_all(&self, ends: &[(Leased, Finish)]) -> impl Future<Output = Result<Vec<bool>, OutboxError>> + Send;

    /// How many events are in each state.
    fn counts(&self) -> impl Future<Output = Result<Counts, OutboxError>> + Send;

    /// How long the oldest pending event has waited since it was enqueued; `None` when none is
    /// pending.
    fn oldest_pending(&self) -> impl Future<Output = Result<Option<Duration>, OutboxError>> + Send;
}

/// Delivers an event: what the relay calls for each claimed event.
pub trait Sender: Send + Sync + 'static {
    /// Delivers `event` once. `Ok` means the receiver took it (a 2xx); an `Err` is retried with
    /// backoff. Must not outlast the relay's send timeout (the relay cuts it off there).
    fn send(&self, event: &PendingEvent) -> impl Future<Output = Result<(), SendError>> + Send;
}

/// A delivery failed; the relay will try again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The receiver answered with a status other than 2xx.
    #[error("the receiver answered {0}")]
    Status(http::StatusCode),
    /// The request could not be sent or its answer not read (connection refused or dropped).
    #[error("transport error: {0}")]
    Transport(String),
    /// The delivery took longer than the send timeout.
    #[error("timed out")]
    Timeout,
}
