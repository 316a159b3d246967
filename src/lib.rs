//! # tower-idempotency
//!
//! A Tower middleware that makes retries of dangerous API writes safe with the
//! `Idempotency-Key` header. For one *(scope, operation, key)*, at most one execution of the
//! handler's side effect commits, and every retry of the same request gets that execution's
//! stored answer, byte for byte, marked with `Idempotent-Replayed: true`.
//!
//! The way a request travels through [`IdempotencyService`]:
//!
//! ```text
//! request ─► key + scope + operation ─► buffer body (limit) ─► fingerprint
//!         ─► durable claim (Store) ──► existing record? ─► replay / reject
//!                                  └─► new claim ─► inner service (with context + handle)
//!         ─► classify response ─► finish the claim (store the answer) ─► response
//! ```
//!
//! What the crate promises to the clients of a guarded API (the key, the fingerprint, every
//! answer with its status and `code`, record states, retention) is written down in
//! [`contract`].
//!
//! Each step lives in its own module: [`key`], [`fingerprint`], [`store`], [`outcome`],
//! [`problem`], [`context`]; the path itself reads top to bottom in the service's future
//! (`src/service.rs`).
//!
//! ## Quick start
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
//! use tower_layer::Layer;
//! use tower_service::Service;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let handler = tower::service_fn(|_req: Request<Full<Bytes>>| async {
//!     Ok::<_, Infallible>(
//!         Response::builder()
//!             .status(StatusCode::CREATED)
//!             .body(Full::new(Bytes::from_static(b"{\"order_id\":1}")))
//!             .unwrap(),
//!     )
//! });
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     // Every caller shares one scope: fine for a single-tenant example only.
//!     .shared_scope("example");
//! let mut service = layer.layer(handler);
//!
//! let request = || {
//!     Request::post("/orders")
//!         .header("idempotency-key", "3f1c9a1e-7f43-4a55-9f0a-2d5a1c7e9b10")
//!         .header("content-type", "application/json")
//!         .body(Full::new(Bytes::from_static(b"{\"sku\":\"A\"}")))
//!         .unwrap()
//! };
//! let first = service.call(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! let retry = service.call(request()).await.unwrap();
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # });
//! ```
//!
//! ## Choices this crate makes where the contract is silent
//!
//! - A guarded request whose scope cannot be determined is refused with 401
//!   `idempotency_scope_missing` (an authentication layer placed after this one is a
//!   misconfiguration; the layer never falls back to a shared scope on its own).
//! - An inner service that returns an error, panics or is cancelled while holding a leased
//!   claim leaves the record for the stale-lease policy (by default it becomes `unknown`);
//!   in atomic mode the transaction simply rolls back.
//! - A leased claim whose fenced completion finds the lease lost answers 503
//!   `idempotency_commit_uncertain`: the answer could not be stored, so it is not acknowledged.
//! - A guarded request whose body cannot be read answers 400 `idempotency_body_unreadable`.
//! - A leased handler's heartbeat does not cancel the handler when it finds the lease lost: the
//!   handler may be mid-way through something it must finish or undo. It sees the loss through
//!   [`IdempotencyContext::lease_lost`], and its outcome is refused (503
//!   `idempotency_commit_uncertain`). A heartbeat whose renewals fail (the store unreachable)
//!   keeps trying until the lease it last renewed runs out, then counts the lease as lost.
//! - An unsettled record's retention (`Retention::unsettled`, 30 days) is counted from its claim,
//!   or from the moment its handler marked its outcome unknown; a reconciler that cannot decide
//!   does not extend it. The operation name kept with a record for reconcilers is the route's
//!   identity, never longer than 512 bytes (longer ones are not kept).
//! - A reconciler that does not answer within `RecoveryWorker::reconcile_timeout` (30 s) counts
//!   as "still unknown"; the record is asked about again after its backoff.
//!
//! ## Rolling out and operating
//!
//! A [`RolloutSwitch`] turns the layer to `Enforce`, `Shadow` or `Off` at run time, and a
//! [`Cohort`] enforces some tenants only; in `Shadow` and `Off` handlers take the old path and
//! still get their transaction (see [`rollout`]). What the layer reports (metrics, the
//! `idempotency` span) is in [`telemetry`].
//!
//! ## Stores and coupling modes
//!
//! | store | feature | modes |
//! |---|---|---|
//! | [`MemoryStore`] | — | leased (in process: tests, single-process tools) |
//! | `PostgresStore` | `postgres` | atomic (default) and leased |
//! | `SqliteStore` | `sqlite` (default) | atomic (default) and leased |
//!
//! In **atomic** mode the claim, the handler's business writes and the stored response are one
//! database transaction. The handler takes the transaction as a `TxHandle` (an axum extractor,
//! or from the request's extensions) and writes through it; the layer stores the response in
//! the same transaction and commits, and the response leaves only after COMMIT:
//!
//! ```ignore
//! async fn create_order(tx: TxHandle<sqlx::Postgres>, ctx: IdempotencyContext, body: String) -> StatusCode {
//!     let mut conn = tx.acquire().await.expect("open");
//!     sqlx::query("INSERT INTO orders (id, operation_id, body) VALUES ($1, $2, $3)")
//!         .bind(uuid::Uuid::new_v4()).bind(ctx.operation_id()).bind(body)
//!         .execute(&mut *conn).await.expect("insert");
//!     StatusCode::CREATED
//! } // the handle is dropped here, before the layer commits
//! ```
//!
//! In **leased** mode (for handlers that call the outside world) the claim commits first with a
//! lease and a fencing token, and the outcome is written by a fenced update; a retry that finds
//! a dead holder's lease marks the record `unknown` instead of running again, unless the route
//! declares itself re-executable ([`StaleLeasePolicy::Reexecute`]).
//!
//! ## Effects that leave the service, and webhook receivers
//!
//! A committed execution that must also tell the outside world writes an event to the outbox
//! in the same transaction (feature `outbox`); a relay delivers it at least once, as a signed
//! Standard Webhook whose `webhook-id` is derived from the operation id. On the receiving side,
//! the same layer deduplicates deliveries: keyed on `webhook-id` instead of `Idempotency-Key`
//! (`IdempotencyLayer::header`), scoped by the sender, behind the signature check, so a
//! redelivered event replays the first 2xx without being processed again and a reused id with
//! another body is refused (422 `idempotency_key_reused`). With the receiver's processing in the
//! layer's transaction (an atomic store), an event is processed by its consumer exactly once. The
//! `outbox` module's docs show both halves.
//!
//! ## Feature flags
//!
//! - `axum` (default): extractors for [`IdempotencyContext`] and `TxHandle`, and axum's
//!   `MatchedPath` as the operation.
//! - `sqlite` (default): `SqliteStore`.
//! - `postgres`: `PostgresStore`.
//! - `redis`: `FastPath`, a Redis lock and replay cache in front of any store (one node or a cluster).
//! - `tonic`: the same layer on a tonic server for the gRPC methods it names
//!   (`grpc_methods`, `into_tonic`): key from `idempotency-key` metadata, success from
//!   `grpc-status`, refusals as gRPC statuses. See `grpc`.
//! - `client`: the client half, `client::IdempotentRetryLayer` (and, with `tonic`,
//!   `client::GrpcIdempotentRetryLayer`): retries that keep their key, for hyper-style HTTP
//!   clients and tonic channels.
//! - `metrics`: metrics through the `metrics` facade: the layer's (requests by result, shadow
//!   counts, its own latency, store calls, stored sizes, the fast path's events; see
//!   [`telemetry`]), the recovery worker's (see [`recovery`]), the outbox relay's, and the client
//!   layers' attempts, retries and give-ups.
//! - `outbox`: `outbox`, a transactional outbox for the SQL stores (events enqueued through the
//!   request's `TxHandle`, a relay with leases, backoff and a deadline), a Standard Webhooks
//!   sender over hyper-util's client, and the signature check for receivers that deduplicate
//!   deliveries with this layer keyed on `webhook-id`.
//! - `testkit`: the conformance suites in `testkit` for your own stores and services.
//! - `full`: all of the above.
//! - `grpc-example`: not for library users; compiles the `.proto` files of this crate's own
//!   gRPC example, tests and benchmark (with protox: no system `protoc`).
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
mod budget;
mod buffer;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod config;
pub mod context;
pub mod contract {
    #![doc = include_str!("../docs/contract.md")]
}
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod fast_path;
pub mod fingerprint;
mod future;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub mod grpc;
mod guarded;
mod heartbeat;
mod hex;
mod join;
pub mod key;
mod layer;
mod lease_lost;
mod name;
mod old_path;
#[cfg(feature = "outbox")]
#[cfg_attr(docsrs, doc(cfg(feature = "outbox")))]
pub mod outbox;
pub mod outcome;
pub mod problem;
mod protocol;
pub mod record;
pub mod recovery;
mod request_body;
pub mod rollout;
mod service;
mod shadow;
mod shadow_log;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testkit")]
pub mod testkit;
mod verdict;

pub use body::IdempotencyBody;
pub use budget::BufferBudget;
pub use context::IdempotencyContext;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use fast_path::FastPath;
pub use fingerprint::{Fingerprint, FingerprintSpec};
pub use future::ResponseFuture;
pub use key::{IdempotencyKey, RecordId, Scope};
pub use layer::IdempotencyLayer;
pub use name::InvalidName;
pub use outcome::OutcomeClass;
pub use record::{Record, RecordState, StoredResponse};
pub use recovery::{Reconciliation, RecoveryReport, RecoveryWorker};
pub use rollout::{Cohort, RolloutMode, RolloutSwitch};
pub use service::IdempotencyService;
pub use service::REPLAYED_HEADER;
pub use store::StaleLeasePolicy;
pub use store::memory::MemoryStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::PostgresStore;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "sqlite"))))]
pub use store::sql::tx;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::sqlite::SqliteStore;
pub use store::{Admin, Begin, BeginRequest, Claim, CouplingMode, Outcome, PlainTransaction, Retention, Store};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "sqlite"))))]
pub use tx::TxHandle;

/// The error type of boxed, type-erased errors used by bodies and stores.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
