//! # An orders service whose `POST /orders` is safe to retry
//!
//! The reference example of `tower-idempotency`: a small axum service that creates orders in
//! a database. A client that times out can send the same `POST /orders` again with the same
//! `Idempotency-Key`; the service creates the order at most once and answers every retry
//! with the first answer, byte for byte, marked `Idempotent-Replayed: true`.
//!
//! What it shows:
//!
//! - **One transaction for the order and its answer.** The idempotency store runs in atomic
//!   mode: the layer opens a database transaction, claims the key in it, and hands it to the
//!   handler as a [`TxHandle`]. The handler `INSERT`s the order on that transaction
//!   ([`OrderTx`]) and gives the handle back; the layer then stores the response in the same
//!   transaction and commits. The order row and the stored answer commit together or not at
//!   all, and the response leaves only after `COMMIT`: a crash before it leaves neither (the
//!   retry executes afresh), and every retry after it replays.
//! - **Per-route opt-in.** Only `POST /orders` is wrapped by [`IdempotencyLayer`] (with the
//!   explicit operation name `orders.create`); the `GET` routes are not.
//! - **Authentication before idempotency.** An axum middleware turns `Authorization: Bearer
//!   <account>` into the request's [`Scope`] (and an [`Account`]) *before* the idempotency
//!   layer runs, so a refused request stores nothing, and a key of one account never replays
//!   another account's answer.
//! - **The handler's context.** The create handler takes [`IdempotencyContext`] as an
//!   extractor and records `ctx.operation_id()` with the order.
//! - **Release on bad input.** A 422 `validation_failed` is released by the layer's default
//!   rule (4xx → release, the transaction rolls back): the client fixes the body and retries
//!   with the same key.
//! - **Exact money.** `amount_minor` is kept as the client's integer literal (any size), never
//!   through `f64` or `u64`, and stored as its digits.
//! - **Keyset pagination** with an opaque, HMAC-signed cursor, over an index.
//!
//! ## Storage
//!
//! The orders and the idempotency records live in the **same database**, so one transaction
//! covers both. `DATABASE_URL` chooses it:
//!
//! - unset: **SQLite**, the file `orders.db` in the working directory, created on first start.
//!   Nothing to install or set up.
//! - `sqlite:PATH` (`sqlite:orders.db`, `sqlite:///var/lib/orders/orders.db`): SQLite in that
//!   file, created if missing.
//! - `postgres://…` or `postgresql://…`: **PostgreSQL**, in a build with the `postgres`
//!   feature (`--features postgres`; without it the service refuses to start and says so).
//!   The database must exist; the tables go where the connection's `search_path` puts them
//!   (`public` by default).
//! - anything else is refused at start.
//!
//! SQLite runs in WAL mode (readers do not block the writer) with a 5 s busy timeout (a
//! writer waits for another instead of failing at once), and `synchronous = FULL`, so an
//! answer sent after `COMMIT` survives a power cut.
//!
//! On every start the service creates the `orders` table and its page index if they are
//! missing, and runs the idempotency store's migration (the `idempotency_records` table).
//! The SQL is in `sqlite_sql` and `postgres_sql`; each backend's code is one arm of a
//! `match`. Everything PostgreSQL-only (its variants, its arms, `postgres_sql`, `open_postgres`)
//! is marked `#[cfg(feature = "postgres")]`: a copy for SQLite alone deletes those items, a
//! copy for PostgreSQL alone deletes the SQLite ones.
//!
//! ## Run it
//!
//! ```text
//! cargo run --example orders
//! DATABASE_URL=postgres://postgres@127.0.0.1/orders cargo run --features postgres --example orders
//! ```
//!
//! The first runs on SQLite (`orders.db` in the working directory) with the crate's default
//! features; the second needs the `postgres` feature.
//!
//! It prints `listening on 127.0.0.1:3000` once bound, and stops cleanly on Ctrl-C or
//! SIGTERM. Environment:
//!
//! - `DATABASE_URL`: where orders and idempotency records live (see *Storage*).
//! - `ORDERS_ADDR`: the address to bind (default `127.0.0.1:3000`; port `0` picks a free one).
//! - `ORDERS_CURSOR_SECRET`: the key that signs pagination cursors, at least 16 bytes. Unset:
//!   a random key per process (cursors then stop working after a restart).
//! - `REDIS_URL` (`redis://127.0.0.1:6379/`, in a build with the `redis` feature): puts the
//!   Redis fast path in front of the idempotency store: replays answered from Redis, concurrent
//!   duplicates kept off the database. Redis is never what keeps the promise; while it is down
//!   the service runs on its database alone.
//!
//! Create an order:
//!
//! ```text
//! curl -i http://127.0.0.1:3000/orders \
//!   -H 'authorization: Bearer acct_1' \
//!   -H 'idempotency-key: 8e0c3c3a-4b7f-4a53-9d0e-1f6c2b8a7d11' \
//!   -H 'content-type: application/json' \
//!   -d '{"sku":"book-42","quantity":1,"amount_minor":9007199254740993,"currency":"JPY"}'
//! # HTTP/1.1 201 Created
//! # location: /orders/5b0e…
//! ```
//!
//! Send exactly the same request again: the same status, `Location` and body, plus
//! `idempotent-replayed: true`, and still only one order.
//!
//! Reuse the key with a different body (here another amount):
//!
//! ```text
//! curl -i http://127.0.0.1:3000/orders \
//!   -H 'authorization: Bearer acct_1' \
//!   -H 'idempotency-key: 8e0c3c3a-4b7f-4a53-9d0e-1f6c2b8a7d11' \
//!   -H 'content-type: application/json' \
//!   -d '{"sku":"book-42","quantity":1,"amount_minor":9007199254740992,"currency":"JPY"}'
//! # HTTP/1.1 422 Unprocessable Entity
//! # {"type":"urn:tower-idempotency:problem:idempotency_key_reused", …, "code":"idempotency_key_reused"}
//! ```
//!
//! List the account's orders, newest first, then follow `next_cursor`:
//!
//! ```text
//! curl -s 'http://127.0.0.1:3000/orders?limit=10' -H 'authorization: Bearer acct_1'
//! # {"orders":[…],"next_cursor":"eyJ2Ijox….Qm9n…"}
//! curl -s 'http://127.0.0.1:3000/orders?limit=10&cursor=eyJ2Ijox….Qm9n…' -H 'authorization: Bearer acct_1'
//! curl -s http://127.0.0.1:3000/orders/5b0e… -H 'authorization: Bearer acct_1'
//! ```
//!
//! ## The interface
//!
//! Every error is `application/problem+json` (RFC 9457: `type`, `title`, `status`, `detail`,
//! `code`). The idempotency layer's own answers (`idempotency_key_missing`,
//! `idempotency_key_reused`, …) come from the crate.
//!
//! A storage failure (a lost or terminated database connection, an aborted transaction, a
//! statement the database refuses) answers 503 `storage_unavailable` with `Retry-After: 1`,
//! on every route. On `POST /orders` the layer releases the 503 like any non-2xx answer: the
//! transaction rolls back, neither the order nor an answer is stored, and a retry with the
//! same `Idempotency-Key` executes afresh. A genuine bug (no transaction handle, a stored row
//! that is not a valid order) answers 500 `internal`. Either way the cause goes to stderr,
//! never to the client.
//!
//! - **Authentication**: `Authorization: Bearer <account>`, where the token *is* the account
//!   id (a stand-in for real authentication): 1 to 64 visible ASCII characters (`!` to `~`),
//!   the scheme matched case-insensitively. Missing, repeated or malformed: 401
//!   `unauthenticated` with `WWW-Authenticate: Bearer realm="orders"`, on every route.
//! - **`POST /orders`**, `Idempotency-Key` required. The body must be `application/json` (or
//!   `*+json`), else 415 `unsupported_media_type`. Members:
//!   - `sku`: a string of 1 to 64 characters, no control characters;
//!   - `quantity`: an integer from 1 to 2^63 − 1;
//!   - `amount_minor`: a JSON integer literal `>= 0` of any size, kept exactly as written
//!     (digits only: no sign, fraction or exponent; `1.0` and `1e2` are refused, not
//!     normalised). JSON itself forbids leading zeros, so `007` never arrives as a number;
//!     a string such as `"100"` is refused;
//!   - `currency`: three uppercase ASCII letters (`JPY`); not checked against ISO 4217.
//!
//!   Unknown members are **refused** (a misspelt `ammount_minor` must not be silently
//!   dropped from a payment), as are duplicate members. Any of this: 422
//!   `validation_failed` with a `detail` naming the problem; nothing is stored, so the
//!   corrected request may reuse the key. Success: 201, `Location: /orders/{order_id}`,
//!   `content-type: application/json` and the order.
//! - **An order** is `{"order_id", "account_id", "sku", "quantity", "amount_minor",
//!   "currency", "created_at", "idempotency_operation_id"}`. `order_id` is a UUID v4 in
//!   lowercase hyphenated form; `created_at` is RFC 3339 UTC with microseconds
//!   (`2025-01-02T03:04:05.000006Z`). `idempotency_operation_id` is the layer's stable id
//!   for *(account, `orders.create`, key)*: it is the same on every retry, shows which
//!   request created the order, and is derived one-way (it reveals neither key nor account).
//! - **`GET /orders/{order_id}`**: the order if it belongs to the caller. Another account's
//!   order, an unknown id and a malformed id all answer the same 404 `order_not_found`.
//! - **`GET /orders?limit=&cursor=`**: `{"orders": [...], "next_cursor": string | null}`,
//!   newest first by `(created_at, order_id)` descending. `limit` is 1 to 100 (default 20);
//!   anything else is 400 `invalid_limit`. `cursor` is the previous page's `next_cursor`;
//!   a tampered, malformed, empty or other account's cursor, or one of another version, is
//!   400 `invalid_cursor`. `next_cursor` is null on the last page. Unknown query
//!   parameters are ignored; a query that cannot be read (a repeated `limit`, say) is 400
//!   `invalid_query`.
//!
//! The cursor is `base64url(payload) "." base64url(HMAC-SHA256(secret, payload))` where the
//! payload is JSON `{"v":1,"created_at":<unix microseconds>,"order_id":"…","account":"…"}`
//! and `account` is a digest of the account id. The account is always the authenticated one;
//! the cursor only has to match it.

use std::fmt;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use tower_idempotency::tx::TxFinished;
use tower_idempotency::{BoxError, IdempotencyContext, IdempotencyLayer, Scope, SqliteStore, Store, TxHandle};
use uuid::Uuid;
// PostgreSQL: only in a build with `--features postgres`.
#[cfg(feature = "postgres")]
use sqlx::Postgres;
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgPool, PgPoolOptions};
#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;

/// The operation name of order creation: the route's stable identity for the idempotency layer.
pub const CREATE_OPERATION: &str = "orders.create";
/// Page size when the client gives none.
pub const DEFAULT_PAGE_SIZE: usize = 20;
/// The largest page a client may ask for.
pub const MAX_PAGE_SIZE: usize = 100;
/// The longest account id accepted in `Authorization: Bearer <account>`.
pub const MAX_ACCOUNT_LEN: usize = 64;
/// The longest `sku` accepted, in characters.
pub const MAX_SKU_LEN: usize = 64;
/// The shortest `ORDERS_CURSOR_SECRET` accepted, in bytes.
pub const MIN_CURSOR_SECRET_LEN: usize = 16;
/// The SQLite file used when `DATABASE_URL` is unset.
pub const DEFAULT_SQLITE_FILE: &str = "orders.db";
/// How long a SQLite writer waits for another before giving up.
pub const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const PROBLEM_TYPE_BASE: &str = "urn:orders:problem:";

// ---------------------------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> ExitCode {
    match serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Display, not Debug; no startup error repeats DATABASE_URL (it may hold a password).
            eprintln!("orders: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Opens the database, binds, announces `listening on <addr>` as the first line of stdout,
/// and serves until Ctrl-C or SIGTERM.
async fn serve() -> Result<(), BoxError> {
    let address = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let cursors = CursorCodec::from_env()?;
    let database_url = std::env::var("DATABASE_URL").ok().filter(|url| !url.is_empty());
    let (router, orders) = open(database_url.as_deref(), cursors, Arc::new(CreatedAt::now)).await?;
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, router).with_graceful_shutdown(shutdown_signal()).await?;
    // In-flight requests have finished (their transactions are committed or rolled back):
    // close the database connections.
    orders.close().await;
    Ok(())
}

/// Opens the database `database_url` names (see *Storage* above), creates what is missing,
/// and returns the service with its order book.
pub async fn open(
    database_url: Option<&str>,
    cursors: CursorCodec,
    clock: Clock,
) -> Result<(Router, OrderBook), BoxError> {
    match database_url {
        None => open_sqlite(SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE), cursors, clock).await,
        Some(url) if url.starts_with("sqlite:") => {
            open_sqlite(SqliteConnectOptions::from_str(url)?, cursors, clock).await
        }
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            open_postgres(url, cursors, clock).await
        }
        // Not echoed: the URL may carry a password.
        Some(_) => Err("DATABASE_URL must start with sqlite:, postgres:// or postgresql://".into()),
    }
}

/// SQLite: the file of `options`, created if missing.
async fn open_sqlite(
    options: SqliteConnectOptions,
    cursors: CursorCodec,
    clock: Clock,
) -> Result<(Router, OrderBook), BoxError> {
    eprintln!("orders: storage is SQLite, {}", options.get_filename().display());
    let pool = connect_sqlite(options).await?;
    // One store per database, cloned wherever it is needed: the SQLite store keeps the
    // in-process gate that tells a duplicate in flight from a busy database.
    let store = SqliteStore::new(pool.clone());
    store.migrate().await?;
    let orders = OrderBook::Sqlite(pool);
    orders.create_table().await?;
    Ok((with_fast_path(AppState { orders: orders.clone(), cursors, clock }, store).await?, orders))
}

/// PostgreSQL: the existing database `url` names.
#[cfg(feature = "postgres")]
async fn open_postgres(url: &str, cursors: CursorCodec, clock: Clock) -> Result<(Router, OrderBook), BoxError> {
    let pool = PgPoolOptions::new().max_connections(16).connect(url).await?;
    // Atomic is the store's default mode: the claim, the order and the answer are one
    // transaction.
    let store = PostgresStore::new(pool.clone());
    store.migrate().await?;
    let orders = OrderBook::Postgres(pool);
    orders.create_table().await?;
    eprintln!("orders: storage is PostgreSQL");
    Ok((with_fast_path(AppState { orders: orders.clone(), cursors, clock }, store).await?, orders))
}

/// PostgreSQL in a build without the `postgres` feature: refuse to start, and say how to fix it.
#[cfg(not(feature = "postgres"))]
async fn open_postgres(_url: &str, _cursors: CursorCodec, _clock: Clock) -> Result<(Router, OrderBook), BoxError> {
    Err("DATABASE_URL names a PostgreSQL database, but this build has no PostgreSQL support; \
         build with `--features postgres`: cargo run --features postgres --example orders"
        .into())
}

/// A pool on the SQLite file of `options`, created if missing, in WAL mode with a busy timeout.
pub async fn connect_sqlite(options: SqliteConnectOptions) -> Result<SqlitePool, sqlx::Error> {
    let options = options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(SQLITE_BUSY_TIMEOUT)
        // sqlx's default, said out loud: a COMMIT is on disk before the answer leaves.
        .synchronous(SqliteSynchronous::Full);
    SqlitePoolOptions::new().max_connections(8).connect_with(options).await
}

/// The service over `store`, behind the Redis fast path (a lock and replay cache in front of
/// the store) when `REDIS_URL` is set and the build has the `redis` feature.
async fn with_fast_path<St: Store>(state: AppState, store: St) -> Result<Router, BoxError> {
    #[cfg(feature = "redis")]
    if let Some(url) = std::env::var("REDIS_URL").ok().filter(|url| !url.is_empty()) {
        // Lazy: the service starts, on its database alone, even while Redis is down.
        let fast = tower_idempotency::FastPath::connect(store, &url)?;
        eprintln!("orders: Redis fast path on");
        return Ok(app(state, fast));
    }
    Ok(app(state, store))
}

/// Resolves on Ctrl-C or, on Unix, SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

// ---------------------------------------------------------------------------------------------
// The router
// ---------------------------------------------------------------------------------------------

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// Where orders are read (they are written through the request's transaction, [`OrderTx`]).
    pub orders: OrderBook,
    /// Signs and checks pagination cursors.
    pub cursors: CursorCodec,
    /// Where `created_at` comes from: the system clock, or a test's.
    pub clock: Clock,
}

/// The service: authentication on every route, idempotency on `POST /orders` only.
///
/// `idempotency_store` must be an atomic store on the same database as `state.orders`
/// (a `SqliteStore` beside `OrderBook::Sqlite`, a `PostgresStore` beside
/// `OrderBook::Postgres`): the create handler writes through its transaction.
pub fn app<St: Store>(state: AppState, idempotency_store: St) -> Router {
    let idempotency = IdempotencyLayer::new(idempotency_store).operation(CREATE_OPERATION);
    // `layer` on a method router wraps only the handlers added before it: POST is guarded,
    // the GET added afterwards is not.
    let orders = post(create_order).layer(idempotency).get(list_orders);
    Router::new()
        .route("/orders", orders)
        .route("/orders/{order_id}", get(get_order))
        // Router-wide layers run before the route's own, so an unauthenticated request never
        // reaches the idempotency layer and nothing is stored for it.
        .layer(middleware::from_fn(authenticate))
        .with_state(state)
}

// ---------------------------------------------------------------------------------------------
// Authentication
// ---------------------------------------------------------------------------------------------

/// The authenticated account: the idempotency scope, and the owner of orders.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Account(String);

impl Account {
    /// An account id, if it follows the rule: 1 to 64 visible ASCII characters.
    pub fn parse(id: &str) -> Option<Self> {
        let valid = (1..=MAX_ACCOUNT_LEN).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic());
        valid.then(|| Self(id.to_owned()))
    }

    /// The account id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The middleware that runs before everything else: finds the account, or answers 401.
async fn authenticate(mut request: Request, next: Next) -> Response {
    match account_from_headers(request.headers()) {
        Ok(account) => {
            request.extensions_mut().insert(Scope::new(account.as_str()));
            request.extensions_mut().insert(account);
            next.run(request).await
        }
        Err(problem) => problem.into_response(),
    }
}

/// Reads `Authorization: Bearer <account>`.
fn account_from_headers(headers: &HeaderMap) -> Result<Account, ApiProblem> {
    let mut fields = headers.get_all(AUTHORIZATION).iter();
    let (Some(field), None) = (fields.next(), fields.next()) else {
        return Err(ApiProblem::unauthenticated("send exactly one `Authorization: Bearer <account>` header"));
    };
    let token = field
        .to_str()
        .ok()
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start_matches(' '))
        .ok_or_else(|| ApiProblem::unauthenticated("the Authorization header must use the Bearer scheme"))?;
    Account::parse(token).ok_or_else(|| {
        ApiProblem::unauthenticated("the bearer token must be an account id of 1 to 64 visible ASCII characters")
    })
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = ApiProblem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Account>()
            .cloned()
            .ok_or_else(|| ApiProblem::unauthenticated("the request was not authenticated"))
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------

/// `POST /orders`: validates the body and inserts the order, with its operation id, in the
/// idempotency claim's transaction.
async fn create_order(
    State(state): State<AppState>,
    account: Account,
    context: IdempotencyContext,
    transaction: OrderTx,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiProblem> {
    // Any early return drops `transaction` unused; the layer then rolls back (a 4xx is
    // released, so the key stays free for the corrected request).
    require_json(&headers)?;
    let draft = OrderDraft::from_json(&body).map_err(ApiProblem::validation_failed)?;
    let order = Order::new(account, draft, context.operation_id(), (state.clock)());
    // `insert` consumes the handle, so it is given back before the answer: the layer stores
    // the answer in the same transaction and commits the order and the answer together. If
    // the database fails instead, the 503 is released: the layer rolls the transaction back,
    // and the client's retry with the same key executes afresh.
    transaction.insert(&order).await.map_err(StorageError::on_create)?;
    let location = HeaderValue::try_from(order.location()).map_err(|_| ApiProblem::internal())?;
    Ok((StatusCode::CREATED, [(LOCATION, location)], Json(order)).into_response())
}

/// `GET /orders/{order_id}`: the caller's order, or 404 for anything else.
async fn get_order(
    State(state): State<AppState>,
    account: Account,
    order_id: Result<Path<String>, PathRejection>,
) -> Result<Json<Order>, ApiProblem> {
    let order_id = order_id.ok().and_then(|Path(raw)| Uuid::try_parse(&raw).ok()).ok_or_else(ApiProblem::not_found)?;
    let order = state.orders.get(&account, order_id).await.map_err(StorageError::on_read)?;
    order.map(Json).ok_or_else(ApiProblem::not_found)
}

/// The query of `GET /orders`, parsed by hand for precise errors.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    limit: Option<String>,
    cursor: Option<String>,
}

/// One page of `GET /orders`.
#[derive(Debug, Serialize)]
pub struct OrderPage {
    orders: Vec<Order>,
    next_cursor: Option<String>,
}

/// `GET /orders?limit=&cursor=`: the caller's orders, newest first.
async fn list_orders(
    State(state): State<AppState>,
    account: Account,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<OrderPage>, ApiProblem> {
    let Query(query) = query.map_err(|rejection| ApiProblem::invalid_query(rejection.body_text()))?;
    let limit = parse_limit(query.limit.as_deref())?;
    let after = match query.cursor.as_deref() {
        Some(cursor) => Some(state.cursors.decode(cursor, &account).map_err(ApiProblem::invalid_cursor)?),
        None => None,
    };
    // One row more than asked tells whether another page follows.
    let mut orders = state.orders.page(&account, after, limit + 1).await.map_err(StorageError::on_read)?;
    let next_cursor = if orders.len() > limit {
        orders.truncate(limit);
        orders.last().map(|last| state.cursors.encode(&account, last.position()))
    } else {
        None
    };
    Ok(Json(OrderPage { orders, next_cursor }))
}

/// `limit`: absent means the default; otherwise an integer from 1 to [`MAX_PAGE_SIZE`].
fn parse_limit(raw: Option<&str>) -> Result<usize, ApiProblem> {
    let Some(raw) = raw else {
        return Ok(DEFAULT_PAGE_SIZE);
    };
    raw.parse::<usize>()
        .ok()
        .filter(|limit| (1..=MAX_PAGE_SIZE).contains(limit))
        .ok_or_else(|| ApiProblem::invalid_limit(format!("limit must be an integer from 1 to {MAX_PAGE_SIZE}")))
}

/// Refuses a body that is not declared as JSON.
fn require_json(headers: &HeaderMap) -> Result<(), ApiProblem> {
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

// ---------------------------------------------------------------------------------------------
// Orders and their validation
// ---------------------------------------------------------------------------------------------

/// An order as stored and as answered.
#[derive(Clone, Debug, Serialize)]
pub struct Order {
    /// A UUID v4, the unique tie-breaker of the listing order.
    #[serde(serialize_with = "as_display")]
    pub order_id: Uuid,
    /// The owner.
    pub account_id: Account,
    /// What was ordered.
    pub sku: String,
    /// How many.
    pub quantity: u64,
    /// The amount in minor units, exactly as the client wrote it.
    pub amount_minor: AmountMinor,
    /// Three uppercase letters.
    pub currency: String,
    /// When the order was recorded.
    #[serde(serialize_with = "as_display")]
    pub created_at: CreatedAt,
    /// The idempotency layer's stable id for the request that created the order.
    pub idempotency_operation_id: String,
}

impl Order {
    /// A new order of `account`: a fresh UUID v4, stamped `created_at`.
    pub fn new(account: Account, draft: OrderDraft, operation_id: &str, created_at: CreatedAt) -> Self {
        Self {
            order_id: Uuid::new_v4(),
            account_id: account,
            sku: draft.sku,
            quantity: draft.quantity,
            amount_minor: draft.amount_minor,
            currency: draft.currency,
            created_at,
            idempotency_operation_id: operation_id.to_owned(),
        }
    }

    /// Where the order can be read.
    pub fn location(&self) -> String {
        format!("/orders/{}", self.order_id)
    }

    /// The order's place in the listing.
    pub fn position(&self) -> PagePosition {
        PagePosition { created_at: self.created_at, order_id: self.order_id }
    }
}

fn as_display<T: fmt::Display, S: Serializer>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(value)
}

/// A validated `POST /orders` body: everything of an order that the client decides.
#[derive(Clone, Debug)]
pub struct OrderDraft {
    sku: String,
    quantity: u64,
    amount_minor: AmountMinor,
    currency: String,
}

/// The body of `POST /orders` as JSON, before the rules that JSON types cannot say.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateOrderBody {
    sku: String,
    quantity: i64,
    amount_minor: Box<RawValue>,
    currency: String,
}

impl OrderDraft {
    /// Parses and validates a request body; the error is the 422's `detail`.
    pub fn from_json(body: &[u8]) -> Result<Self, String> {
        // serde would also read a struct from a JSON array; an order is an object only.
        if body.trim_ascii_start().first() != Some(&b'{') {
            return Err("the body must be a JSON object with sku, quantity, amount_minor and currency".to_owned());
        }
        let body: CreateOrderBody =
            serde_json::from_slice(body).map_err(|error| format!("the body is not a valid order: {error}"))?;
        Ok(Self {
            sku: validate_sku(body.sku)?,
            quantity: validate_quantity(body.quantity)?,
            amount_minor: AmountMinor::parse(body.amount_minor)?,
            currency: validate_currency(body.currency)?,
        })
    }

    /// Validates fields that arrive already typed (the gRPC example's message), by the same
    /// rules; `amount_minor` is its decimal digits. The error names the field.
    pub fn from_fields(sku: String, quantity: i64, amount_minor: String, currency: String) -> Result<Self, String> {
        Ok(Self {
            sku: validate_sku(sku)?,
            quantity: validate_quantity(quantity)?,
            amount_minor: AmountMinor::from_digits(amount_minor)?,
            currency: validate_currency(currency)?,
        })
    }
}

fn validate_sku(sku: String) -> Result<String, String> {
    let length = sku.chars().count();
    if !(1..=MAX_SKU_LEN).contains(&length) || sku.chars().any(char::is_control) {
        return Err(format!("sku must be 1 to {MAX_SKU_LEN} characters without control characters"));
    }
    Ok(sku)
}

fn validate_quantity(quantity: i64) -> Result<u64, String> {
    u64::try_from(quantity)
        .ok()
        .filter(|q| *q > 0)
        .ok_or_else(|| format!("quantity must be at least 1, got {quantity}"))
}

fn validate_currency(currency: String) -> Result<String, String> {
    if currency.len() == 3 && currency.bytes().all(|b| b.is_ascii_uppercase()) {
        Ok(currency)
    } else {
        Err("currency must be three uppercase ASCII letters, such as \"JPY\"".to_owned())
    }
}

/// A non-negative amount in minor units, of any size, kept as the client's integer literal
/// and written back as a JSON number, so `9007199254740993` stays `9007199254740993`.
#[derive(Clone, Debug, Serialize)]
#[serde(transparent)]
pub struct AmountMinor(Box<RawValue>);

impl AmountMinor {
    /// Accepts a JSON integer literal of digits only (no sign, fraction or exponent).
    pub fn parse(raw: Box<RawValue>) -> Result<Self, String> {
        let literal = raw.get();
        if literal.starts_with('-') {
            return Err(format!("amount_minor must not be negative, got {literal}"));
        }
        if literal.starts_with('"') {
            return Err("amount_minor must be a JSON number, not a string".to_owned());
        }
        let digits_only = !literal.is_empty() && literal.bytes().all(|b| b.is_ascii_digit());
        let leading_zero = literal.len() > 1 && literal.starts_with('0');
        if !digits_only || leading_zero {
            return Err(format!(
                "amount_minor must be a whole number of minor units without fraction or exponent, got {literal}"
            ));
        }
        Ok(Self(raw))
    }

    /// An amount given as its decimal digits: a database column, or a gRPC field.
    pub fn from_digits(digits: String) -> Result<Self, String> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err("amount_minor must be a whole number of minor units, as decimal digits without a sign, \
                        fraction or exponent"
                .to_owned());
        }
        let raw =
            RawValue::from_string(digits).map_err(|error| format!("amount_minor is not a JSON number: {error}"))?;
        Self::parse(raw)
    }

    /// The digits, as the client wrote them.
    pub fn digits(&self) -> &str {
        self.0.get()
    }
}

// ---------------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------------

/// A point in time with microsecond precision, UTC; shown as RFC 3339.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CreatedAt(i64);

impl CreatedAt {
    /// From microseconds since the Unix epoch.
    pub const fn from_unix_micros(micros: i64) -> Self {
        Self(micros)
    }

    /// Microseconds since the Unix epoch.
    pub const fn unix_micros(self) -> i64 {
        self.0
    }

    /// The system clock, now.
    pub fn now() -> Self {
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Self(i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX))
    }
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
impl fmt::Display for CreatedAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MICROS_PER_DAY: i64 = 86_400_000_000;
        let days = self.0.div_euclid(MICROS_PER_DAY);
        let micros_of_day = self.0.rem_euclid(MICROS_PER_DAY);
        let (year, month, day) = civil_from_days(days);
        let seconds_of_day = micros_of_day / 1_000_000;
        let (hour, minute, second) = (seconds_of_day / 3600, seconds_of_day / 60 % 60, seconds_of_day % 60);
        let micros = micros_of_day % 1_000_000;
        write!(f, "{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{micros:06}Z")
    }
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Where `created_at` comes from; tests inject their own to force equal timestamps.
pub type Clock = Arc<dyn Fn() -> CreatedAt + Send + Sync>;
// ---------------------------------------------------------------------------------------------
// Storage: the orders table, read through the pool, written through the request's transaction
// ---------------------------------------------------------------------------------------------

/// An order's place in the listing: newest first by `created_at`, then by `order_id`
/// (compared bytewise), both descending. `order_id` is unique, so the order is total.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PagePosition {
    /// The order's creation time.
    pub created_at: CreatedAt,
    /// The order's id, the tie-breaker.
    pub order_id: Uuid,
}

/// The orders table, on the database that also holds the idempotency records.
///
/// Reads go through the pool. Writes do not: an order is inserted only by the create
/// handler, on the idempotency claim's transaction ([`OrderTx`]).
#[derive(Clone, Debug)]
pub enum OrderBook {
    /// SQLite: `order_id` is TEXT (see [`sqlite_sql`]).
    Sqlite(SqlitePool),
    /// PostgreSQL: `order_id` is `uuid` (see `postgres_sql`).
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
}

impl OrderBook {
    /// Creates the orders table and its page index if they are missing.
    pub async fn create_table(&self) -> Result<(), BoxError> {
        match self {
            Self::Sqlite(pool) => {
                sqlx::raw_sql(sqlite_sql::CREATE_TABLE).execute(pool).await?;
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => {
                sqlx::raw_sql(postgres_sql::CREATE_TABLE).execute(pool).await?;
            }
        }
        Ok(())
    }

    /// The order `order_id` if `account` owns it.
    pub async fn get(&self, account: &Account, order_id: Uuid) -> Result<Option<Order>, StorageError> {
        let (account, order_id) = (account.as_str(), order_id.to_string());
        let row: Option<OrderRow> = match self {
            Self::Sqlite(pool) => {
                sqlx::query_as(sqlite_sql::GET).bind(account).bind(order_id).fetch_optional(pool).await?
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => {
                sqlx::query_as(postgres_sql::GET).bind(account).bind(order_id).fetch_optional(pool).await?
            }
        };
        row.map(Order::try_from).transpose()
    }

    /// Up to `limit` of `account`'s orders, newest first, strictly after `after` in that order.
    pub async fn page(
        &self,
        account: &Account,
        after: Option<PagePosition>,
        limit: usize,
    ) -> Result<Vec<Order>, StorageError> {
        let account = account.as_str();
        let limit = i64::try_from(limit).map_err(|_| StorageError::Internal("the page limit exceeds i64".into()))?;
        let after = after.map(|position| (position.created_at.unix_micros(), position.order_id.to_string()));
        let rows: Vec<OrderRow> = match (self, after) {
            (Self::Sqlite(pool), None) => {
                sqlx::query_as(sqlite_sql::FIRST_PAGE).bind(account).bind(limit).fetch_all(pool).await?
            }
            (Self::Sqlite(pool), Some((created_at, order_id))) => {
                let query = sqlx::query_as(sqlite_sql::NEXT_PAGE).bind(account).bind(created_at).bind(order_id);
                query.bind(limit).fetch_all(pool).await?
            }
            #[cfg(feature = "postgres")]
            (Self::Postgres(pool), None) => {
                sqlx::query_as(postgres_sql::FIRST_PAGE).bind(account).bind(limit).fetch_all(pool).await?
            }
            #[cfg(feature = "postgres")]
            (Self::Postgres(pool), Some((created_at, order_id))) => {
                let query = sqlx::query_as(postgres_sql::NEXT_PAGE).bind(account).bind(created_at).bind(order_id);
                query.bind(limit).fetch_all(pool).await?
            }
        };
        rows.into_iter().map(Order::try_from).collect()
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        match self {
            Self::Sqlite(pool) => pool.close().await,
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => pool.close().await,
        }
    }
}

/// An orders row as both backends return it (PostgreSQL's `uuid` is read as text).
#[derive(sqlx::FromRow)]
struct OrderRow {
    order_id: String,
    account_id: String,
    sku: String,
    quantity: i64,
    amount_minor: String,
    currency: String,
    created_at: i64,
    idempotency_operation_id: String,
}

/// Reading a row back checks it as strictly as a request: a row that is not a valid order is
/// a bug (500), never a half-read answer. The errors name the column, not its value.
impl TryFrom<OrderRow> for Order {
    type Error = StorageError;

    fn try_from(row: OrderRow) -> Result<Self, StorageError> {
        let corrupt = |column: &str| StorageError::Internal(format!("a stored {column} is not valid").into());
        Ok(Self {
            order_id: Uuid::try_parse(&row.order_id).map_err(|_| corrupt("order_id"))?,
            account_id: Account::parse(&row.account_id).ok_or_else(|| corrupt("account_id"))?,
            sku: row.sku,
            quantity: u64::try_from(row.quantity).map_err(|_| corrupt("quantity"))?,
            amount_minor: AmountMinor::from_digits(row.amount_minor).map_err(|_| corrupt("amount_minor"))?,
            currency: row.currency,
            created_at: CreatedAt::from_unix_micros(row.created_at),
            idempotency_operation_id: row.idempotency_operation_id,
        })
    }
}

/// The idempotency claim's transaction, as the create handler gets it: an axum extractor that
/// finds the layer's [`TxHandle`] of the order book's database in the request.
///
/// Hold it only while writing: [`insert`](Self::insert) consumes it, so the handle is back
/// with the layer before the handler answers. (A handle still held when the answer comes
/// back makes the layer roll back and answer 500.)
#[derive(Debug)]
pub enum OrderTx {
    /// The transaction of an atomic [`SqliteStore`].
    Sqlite(TxHandle<Sqlite>),
    /// The transaction of an atomic `PostgresStore`.
    #[cfg(feature = "postgres")]
    Postgres(TxHandle<Postgres>),
}

impl OrderTx {
    /// Inserts `order` in the transaction, which the layer commits together with the answer.
    pub async fn insert(self, order: &Order) -> Result<(), StorageError> {
        let order_id = order.order_id.to_string();
        // A validated quantity is at most i64::MAX; anything else is a bug.
        let quantity =
            i64::try_from(order.quantity).map_err(|_| StorageError::Internal("the quantity exceeds i64".into()))?;
        let (created_at, operation_id) = (order.created_at.unix_micros(), order.idempotency_operation_id.as_str());
        match self {
            Self::Sqlite(handle) => {
                let mut conn = handle.acquire().await?;
                sqlx::query(sqlite_sql::INSERT)
                    .bind(order_id)
                    .bind(order.account_id.as_str())
                    .bind(order.sku.as_str())
                    .bind(quantity)
                    .bind(order.amount_minor.digits())
                    .bind(order.currency.as_str())
                    .bind(created_at)
                    .bind(operation_id)
                    .execute(&mut *conn)
                    .await?;
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(handle) => {
                let mut conn = handle.acquire().await?;
                sqlx::query(postgres_sql::INSERT)
                    .bind(order_id)
                    .bind(order.account_id.as_str())
                    .bind(order.sku.as_str())
                    .bind(quantity)
                    .bind(order.amount_minor.digits())
                    .bind(order.currency.as_str())
                    .bind(created_at)
                    .bind(operation_id)
                    .execute(&mut *conn)
                    .await?;
            }
        }
        // `conn` and the handle are dropped at the end of their arm: the layer has them back.
        Ok(())
    }
}

impl FromRequestParts<AppState> for OrderTx {
    type Rejection = ApiProblem;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        // Only a transaction on the order book's own database will do.
        let transaction = match state.orders {
            OrderBook::Sqlite(_) => parts.extensions.get::<TxHandle<Sqlite>>().cloned().map(Self::Sqlite),
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(_) => parts.extensions.get::<TxHandle<Postgres>>().cloned().map(Self::Postgres),
        };
        // A bug, not an outage: the service was assembled with the wrong store.
        transaction.ok_or_else(|| {
            eprintln!("orders: no idempotency transaction for the order book's database; is the store atomic?");
            ApiProblem::internal()
        })
    }
}

/// Why a read or write of the orders table failed, sorted by what the client should do.
#[derive(Debug)]
pub enum StorageError {
    /// The database failed: a lost or terminated connection, an aborted transaction, a
    /// statement it refused. Nothing was changed; the client may retry: 503.
    Unavailable(sqlx::Error),
    /// Something that cannot happen did: the transaction was used after its answer, the
    /// statements and the rows disagree, a stored row is not a valid order. A bug: 500.
    Internal(BoxError),
}

impl From<sqlx::Error> for StorageError {
    fn from(error: sqlx::Error) -> Self {
        match error {
            // The SQL and the Rust types disagree: retrying cannot help.
            sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::ColumnNotFound(_)
            | sqlx::Error::ColumnIndexOutOfBounds { .. }
            | sqlx::Error::Decode(_)
            | sqlx::Error::Encode(_)
            | sqlx::Error::TypeNotFound { .. } => Self::Internal(error.into()),
            error => Self::Unavailable(error),
        }
    }
}

impl From<TxFinished> for StorageError {
    fn from(error: TxFinished) -> Self {
        Self::Internal(error.into())
    }
}

impl StorageError {
    /// The answer to a failed `POST /orders`.
    pub fn on_create(self) -> ApiProblem {
        self.into_problem(
            "the order could not be stored, so nothing was created; \
             retrying with the same Idempotency-Key is safe",
        )
    }

    /// The answer to a failed `GET`.
    pub fn on_read(self) -> ApiProblem {
        self.into_problem("the orders could not be read; try again")
    }

    /// 503 or 500; the cause goes to stderr (sqlx's messages carry no bound values), never to
    /// the client.
    fn into_problem(self, unavailable: &'static str) -> ApiProblem {
        match self {
            Self::Unavailable(error) => {
                eprintln!("orders: storage unavailable: {error}");
                ApiProblem::storage_unavailable(unavailable)
            }
            Self::Internal(error) => {
                eprintln!("orders: internal error: {error}");
                ApiProblem::internal()
            }
        }
    }
}

// The orders table has no UNIQUE constraint on `idempotency_operation_id`, in either dialect,
// on purpose: this example's crash tests count the rows per operation id to prove that the idempotency layer
// alone prevents duplicate orders, and a constraint would make them unable to fail. A
// production table should add one, `UNIQUE (idempotency_operation_id)`, as a second guard
// behind the layer.

/// The SQLite dialect. `order_id` is TEXT in lowercase hyphenated form, whose bytewise order
/// (SQLite's default BINARY collation) is the UUID's, so the keyset order matches the cursor's.
pub mod sqlite_sql {
    /// The orders table and the index of the page query, if missing.
    pub const CREATE_TABLE: &str = "
        CREATE TABLE IF NOT EXISTS orders (
            order_id                 TEXT   NOT NULL PRIMARY KEY,
            account_id               TEXT   NOT NULL,
            sku                      TEXT   NOT NULL,
            quantity                 BIGINT NOT NULL CHECK (quantity > 0),
            amount_minor             TEXT   NOT NULL CHECK (amount_minor <> '' AND amount_minor NOT GLOB '*[^0-9]*'),
            currency                 TEXT   NOT NULL,
            created_at               BIGINT NOT NULL,
            idempotency_operation_id TEXT   NOT NULL
        );
        CREATE INDEX IF NOT EXISTS orders_account_page_idx ON orders (account_id, created_at DESC, order_id DESC);";
    /// Binds: order_id, account_id, sku, quantity, amount_minor, currency, created_at,
    /// idempotency_operation_id.
    pub const INSERT: &str = "
        INSERT INTO orders (order_id, account_id, sku, quantity, amount_minor, currency, created_at,
                            idempotency_operation_id)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
    /// Binds: account_id, order_id.
    pub const GET: &str = "
        SELECT order_id, account_id, sku, quantity, amount_minor, currency, created_at, idempotency_operation_id
        FROM orders WHERE account_id = $1 AND order_id = $2";
    /// Binds: account_id, limit.
    pub const FIRST_PAGE: &str = "
        SELECT order_id, account_id, sku, quantity, amount_minor, currency, created_at, idempotency_operation_id
        FROM orders WHERE account_id = $1
        ORDER BY created_at DESC, order_id DESC LIMIT $2";
    /// Binds: account_id, the cursor's created_at and order_id, limit.
    pub const NEXT_PAGE: &str = "
        SELECT order_id, account_id, sku, quantity, amount_minor, currency, created_at, idempotency_operation_id
        FROM orders WHERE account_id = $1 AND (created_at, order_id) < ($2, $3)
        ORDER BY created_at DESC, order_id DESC LIMIT $4";
}

/// The PostgreSQL dialect (feature `postgres`): the same statements, with `order_id` a native
/// `uuid` (ordered bytewise, like the UUID), bound as text and cast, and read back as text.
#[cfg(feature = "postgres")]
pub mod postgres_sql {
    /// The orders table and the index of the page query, if missing.
    pub const CREATE_TABLE: &str = "
        CREATE TABLE IF NOT EXISTS orders (
            order_id                 uuid   NOT NULL PRIMARY KEY,
            account_id               text   NOT NULL,
            sku                      text   NOT NULL,
            quantity                 bigint NOT NULL CHECK (quantity > 0),
            amount_minor             text   NOT NULL CHECK (amount_minor ~ '^[0-9]+$'),
            currency                 text   NOT NULL,
            created_at               bigint NOT NULL,
            idempotency_operation_id text   NOT NULL
        );
        CREATE INDEX IF NOT EXISTS orders_account_page_idx ON orders (account_id, created_at DESC, order_id DESC);";
    /// Binds: order_id, account_id, sku, quantity, amount_minor, currency, created_at,
    /// idempotency_operation_id.
    pub const INSERT: &str = "
        INSERT INTO orders (order_id, account_id, sku, quantity, amount_minor, currency, created_at,
                            idempotency_operation_id)
        VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8)";
    /// Binds: account_id, order_id.
    pub const GET: &str = "
        SELECT order_id::text AS order_id, account_id, sku, quantity, amount_minor, currency, created_at,
               idempotency_operation_id
        FROM orders WHERE account_id = $1 AND order_id = $2::uuid";
    /// Binds: account_id, limit.
    pub const FIRST_PAGE: &str = "
        SELECT order_id::text AS order_id, account_id, sku, quantity, amount_minor, currency, created_at,
               idempotency_operation_id
        FROM orders WHERE account_id = $1
        ORDER BY created_at DESC, order_id DESC LIMIT $2";
    /// Binds: account_id, the cursor's created_at and order_id, limit.
    pub const NEXT_PAGE: &str = "
        SELECT order_id::text AS order_id, account_id, sku, quantity, amount_minor, currency, created_at,
               idempotency_operation_id
        FROM orders WHERE account_id = $1 AND (created_at, order_id) < ($2, $3::uuid)
        ORDER BY created_at DESC, order_id DESC LIMIT $4";
}

// ---------------------------------------------------------------------------------------------
// Pagination cursors
// ---------------------------------------------------------------------------------------------

/// The only cursor version this service writes and reads.
pub const CURSOR_VERSION: u32 = 1;

/// Writes and checks opaque, tamper-evident cursors:
/// `base64url(payload) "." base64url(HMAC-SHA256(secret, payload))`.
#[derive(Clone)]
pub struct CursorCodec {
    mac: Hmac<Sha256>,
}

/// What a cursor carries (JSON, then signed).
#[derive(Debug, Serialize, Deserialize)]
pub struct CursorPayload {
    /// The format version, [`CURSOR_VERSION`].
    pub v: u32,
    /// The last row's `created_at`, in Unix microseconds (full precision).
    pub created_at: i64,
    /// The last row's `order_id`.
    pub order_id: String,
    /// A digest of the account the cursor was issued to.
    pub account: String,
}

impl CursorCodec {
    /// A codec signing with `secret`.
    pub fn new(secret: &[u8]) -> Self {
        Self { mac: <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC accepts keys of any length") }
    }

    /// A codec keyed by `ORDERS_CURSOR_SECRET`, or by a random key for this process.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("ORDERS_CURSOR_SECRET") {
            Ok(secret) if secret.len() >= MIN_CURSOR_SECRET_LEN => Ok(Self::new(secret.as_bytes())),
            Ok(_) => Err(format!("ORDERS_CURSOR_SECRET must be at least {MIN_CURSOR_SECRET_LEN} bytes")),
            Err(std::env::VarError::NotPresent) => Ok(Self::random()),
            Err(std::env::VarError::NotUnicode(_)) => Err("ORDERS_CURSOR_SECRET must be UTF-8".to_owned()),
        }
    }

    /// A codec with a random key (two UUID v4s: 244 random bits from the OS).
    pub fn random() -> Self {
        let mut secret = [0u8; 32];
        secret[..16].copy_from_slice(Uuid::new_v4().as_bytes());
        secret[16..].copy_from_slice(Uuid::new_v4().as_bytes());
        Self::new(&secret)
    }

    /// The cursor that continues after `position` for `account`.
    pub fn encode(&self, account: &Account, position: PagePosition) -> String {
        let payload = CursorPayload {
            v: CURSOR_VERSION,
            created_at: position.created_at.unix_micros(),
            order_id: position.order_id.to_string(),
            account: account_digest(account),
        };
        // Serialising a struct of numbers and strings cannot fail.
        let json = serde_json::to_vec(&payload).unwrap_or_default();
        self.sign(&json)
    }

    /// Signs raw payload bytes into a cursor.
    pub fn sign(&self, payload: &[u8]) -> String {
        let tag = self.mac.clone().chain_update(payload).finalize().into_bytes();
        format!("{}.{}", URL_SAFE_NO_PAD.encode(payload), URL_SAFE_NO_PAD.encode(tag))
    }

    /// The position a cursor continues after, if it is intact, current and `account`'s.
    pub fn decode(&self, cursor: &str, account: &Account) -> Result<PagePosition, &'static str> {
        let (payload, tag) = cursor.split_once('.').ok_or("the cursor is malformed")?;
        let payload = URL_SAFE_NO_PAD.decode(payload).map_err(|_| "the cursor is malformed")?;
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| "the cursor is malformed")?;
        self.mac.clone().chain_update(&payload).verify_slice(&tag).map_err(|_| "the cursor has been altered")?;
        let payload: CursorPayload = serde_json::from_slice(&payload).map_err(|_| "the cursor is malformed")?;
        if payload.v != CURSOR_VERSION {
            return Err("the cursor is of an unsupported version; start again from the first page");
        }
        if payload.account != account_digest(account) {
            return Err("the cursor was issued to another account");
        }
        let order_id = Uuid::try_parse(&payload.order_id).map_err(|_| "the cursor is malformed")?;
        Ok(PagePosition { created_at: CreatedAt::from_unix_micros(payload.created_at), order_id })
    }
}

/// A digest of the account for the cursor: binds it to its account without showing the id.
pub fn account_digest(account: &Account) -> String {
    let digest = Sha256::new().chain_update(b"orders/cursor-account\0").chain_update(account.as_str()).finalize();
    digest[..16].iter().map(|byte| format!("{byte:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Problems (RFC 9457)
// ---------------------------------------------------------------------------------------------

/// An error answer: `application/problem+json` with a stable `code`.
#[derive(Debug, Clone)]
pub struct ApiProblem {
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: String,
}

#[derive(Serialize)]
struct ProblemDocument<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    code: &'a str,
}

impl ApiProblem {
    fn new(status: StatusCode, code: &'static str, title: &'static str, detail: impl Into<String>) -> Self {
        Self { status, code, title, detail: detail.into() }
    }

    /// 401: no usable `Authorization: Bearer <account>`.
    pub fn unauthenticated(detail: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", "Authentication required", detail)
    }

    /// 422: the order in the body breaks a rule.
    pub fn validation_failed(detail: String) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed", "The order is not valid", detail)
    }

    /// 415: the body is not declared as JSON.
    pub fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Unsupported media type",
            "send the order as `content-type: application/json`",
        )
    }

    /// 404: no such order for this account (whether it exists elsewhere is not said).
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "order_not_found", "Order not found", "no order with this id for this account")
    }

    /// 400: `limit` is out of range or not a number.
    pub fn invalid_limit(detail: String) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_limit", "Invalid limit", detail)
    }

    /// 400: the query string could not be read at all.
    pub fn invalid_query(detail: String) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_query", "Invalid query", detail)
    }

    /// 400: the cursor is tampered, malformed, of another version or another account's.
    pub fn invalid_cursor(detail: &str) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_cursor", "Invalid cursor", detail)
    }

    /// 503: the database failed; nothing changed, and the same request may be retried. Answered
    /// with `Retry-After: 1`.
    pub fn storage_unavailable(detail: &'static str) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", "Storage unavailable", detail)
    }

    /// 500: something that cannot happen did.
    pub fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "Internal error", "an unexpected error occurred")
    }

    fn document(&self) -> ProblemDocument<'_> {
        ProblemDocument {
            kind: format!("{PROBLEM_TYPE_BASE}{}", self.code),
            title: self.title,
            status: self.status.as_u16(),
            detail: &self.detail,
            code: self.code,
        }
    }
}

impl IntoResponse for ApiProblem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.document()).unwrap_or_default();
        let mut response = (self.status, [(CONTENT_TYPE, "application/problem+json")], body).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"orders\""));
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
