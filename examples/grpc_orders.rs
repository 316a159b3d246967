//! # The orders service over gRPC, safe to retry
//!
//! The gRPC twin of `examples/orders/`: the same order creation, on the same store, as a
//! tonic service (`proto/orders.proto`, package `orders.v1`). A client whose call times out can
//! call `CreateOrder` again with the same `idempotency-key` metadata; the service creates the
//! order at most once and answers every retry with the first answer (message, metadata and
//! trailers), marked with `idempotent-replayed: true` metadata.
//!
//! What it shows:
//!
//! - **Opt-in per method.** The idempotency layer guards `/orders.v1.Orders/CreateOrder` only
//!   ([`IdempotencyLayer::grpc_methods`]); `GetOrder` passes through untouched.
//! - **Authentication before idempotency.** A tonic interceptor turns `authorization: Bearer
//!   <account>` into the request's [`Scope`] (and an [`Account`]) *before* the idempotency layer
//!   runs; without it the call is `UNAUTHENTICATED` and nothing is stored. A key of one account
//!   never replays another account's answer.
//! - **One transaction for the order and its answer.** The store runs in atomic mode: the layer
//!   claims the key in a database transaction and hands it to the handler through the request's
//!   extensions as a [`TxHandle`]. The handler inserts the order on it and lets go of it; the
//!   layer stores the answer in the same transaction and commits, and the answer leaves only
//!   after `COMMIT`.
//! - **The handler's context.** [`IdempotencyContext`], also from the request's extensions,
//!   gives the stable `idempotency_operation_id` stored with the order.
//! - **Release on bad input.** An invalid order is `INVALID_ARGUMENT`, which the layer releases
//!   (any status but `OK` is released by default): the transaction rolls back, nothing is
//!   stored, and the corrected call may reuse the key.
//! - **Exact money.** `amount_minor` is a string of decimal digits of any length, stored as
//!   its digits, never a floating-point number.
//!
//! ## Storage
//!
//! The HTTP example's own orders module (this file mounts `examples/orders/book/`): the same
//! tables and statements, the same validation rules, so both can serve one database:
//!
//! - `DATABASE_URL` unset: SQLite, the file `orders.db` in the working directory;
//! - `sqlite:PATH`: SQLite in that file, created if missing;
//! - `postgres://…` or `postgresql://…`: PostgreSQL, in a build with the `postgres` feature.
//!
//! ## Run it
//!
//! ```text
//! cargo run --features grpc-example --example grpc_orders
//! DATABASE_URL=postgres://postgres@127.0.0.1/orders cargo run --features grpc-example,postgres --example grpc_orders
//! ```
//!
//! The `grpc-example` feature compiles `proto/orders.proto` at build time with protox, a
//! protobuf compiler written in Rust: no `protoc` to install. It prints `listening on
//! 127.0.0.1:50051` once bound (`GRPC_ORDERS_ADDR` changes the address; port `0` picks a free
//! one), and stops cleanly on Ctrl-C or SIGTERM.
//!
//! A call, with the client generated from the same `.proto`:
//!
//! ```ignore
//! let mut client = OrdersClient::connect("http://127.0.0.1:50051").await?;
//! let mut request = tonic::Request::new(CreateOrderRequest {
//!     sku: "book-42".into(), quantity: 1, amount_minor: "9007199254740993".into(), currency: "JPY".into(),
//! });
//! request.metadata_mut().insert("authorization", "Bearer acct_1".parse()?);
//! request.metadata_mut().insert("idempotency-key", "8e0c3c3a-4b7f-4a53-9d0e-1f6c2b8a7d11".parse()?);
//! let order = client.create_order(request).await?; // the same call again: the same order, replayed
//! ```
//!
//! ## The interface
//!
//! - **Authentication**: `authorization: Bearer <account>` metadata, where the token *is* the
//!   account id (a stand-in for real authentication): 1 to 64 visible ASCII characters.
//!   Missing or malformed: `UNAUTHENTICATED`, on every method.
//! - **`CreateOrder`**, `idempotency-key` metadata required (`INVALID_ARGUMENT` without it).
//!   `sku`: 1 to 64 characters, no control characters; `quantity`: at least 1; `amount_minor`:
//!   decimal digits, no sign, no leading zero (`"0"` itself is fine); `currency`: three
//!   uppercase ASCII letters. Anything else: `INVALID_ARGUMENT`, naming the field. The answer is
//!   the [`Order`](proto::Order). The layer's own refusals (same key with another order:
//!   `FAILED_PRECONDITION`; the first call still running: `ABORTED`; …) carry the stable code
//!   in `idempotency-code` metadata.
//! - **`GetOrder`**: the caller's order; another account's order, an unknown id and a
//!   malformed id are all `NOT_FOUND`.
//! - A storage failure is `UNAVAILABLE` (released: a retry with the same key executes afresh);
//!   its cause goes to stderr, never to the client.

use std::process::ExitCode;
use std::str::FromStr;

use sqlx::Sqlite;
use sqlx::sqlite::SqliteConnectOptions;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tower_idempotency::{BoxError, IdempotencyContext, IdempotencyLayer, Scope, SqliteStore, Store, TxHandle};
use uuid::Uuid;
// PostgreSQL: only in a build with `--features postgres`.
#[cfg(feature = "postgres")]
use sqlx::Postgres;
#[cfg(feature = "postgres")]
use sqlx::postgres::PgPoolOptions;
#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;

/// The orders, their rules and their table: the HTTP example's own, so both services serve one
/// database by the same rules.
#[path = "orders/book/mod.rs"]
#[allow(dead_code, reason = "listing orders is the HTTP example's; this service has no list method")]
mod book;
/// Ctrl-C or SIGTERM, as the HTTP example stops.
#[path = "orders/shutdown.rs"]
mod shutdown;

use book::account::Account;
use book::created_at::CreatedAt;
use book::order::{AmountMinor, OrderDraft};
use book::storage::{DEFAULT_SQLITE_FILE, OrderBook, OrderTx, StorageError, connect_sqlite};
use shutdown::shutdown_signal;

/// The code generated from `proto/orders.proto` at build time.
pub mod proto {
    tonic::include_proto!("orders.v1");
}

use proto::orders_server::{Orders, OrdersServer};
use proto::{CreateOrderRequest, GetOrderRequest, Order};

/// The guarded method: its path is also the idempotency operation.
pub const CREATE_ORDER: &str = "/orders.v1.Orders/CreateOrder";

// ---------------------------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> ExitCode {
    match serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Display, not Debug; no startup error repeats DATABASE_URL (it may hold a password).
            eprintln!("grpc_orders: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Opens the database, binds, announces `listening on <addr>` as the first line of stdout,
/// and serves until Ctrl-C or SIGTERM.
async fn serve() -> Result<(), BoxError> {
    let address = std::env::var("GRPC_ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".to_owned());
    let database_url = std::env::var("DATABASE_URL").ok().filter(|url| !url.is_empty());
    let book = open(database_url.as_deref()).await?;
    let listener = tokio::net::TcpListener::bind(&address).await?;
    let service = OrdersService { book: book.clone() };
    // One idempotency store per database, on the order book's pool: the claim, the order and
    // the answer are one transaction (atomic, the stores' default mode).
    match &book {
        OrderBook::Sqlite(pool) => {
            let store = SqliteStore::new(pool.clone());
            store.migrate().await?;
            run(store, service, listener).await?;
        }
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pool) => {
            let store = PostgresStore::new(pool.clone());
            store.migrate().await?;
            run(store, service, listener).await?;
        }
    }
    // Calls in flight have finished (their transactions are committed or rolled back).
    book.close().await;
    Ok(())
}

/// Serves `service` on `listener` until Ctrl-C or SIGTERM, with its layers, outermost first:
/// authentication, then idempotency on `CreateOrder`.
async fn run<St: Store>(store: St, service: OrdersService, listener: tokio::net::TcpListener) -> Result<(), BoxError> {
    let idempotency = IdempotencyLayer::new(store).grpc_methods([CREATE_ORDER]);
    println!("listening on {}", listener.local_addr()?);
    Server::builder()
        // Before the idempotency layer: an unauthenticated call never reaches it, so nothing is
        // stored for it, and every guarded call has its account as the scope.
        .layer(tonic::service::InterceptorLayer::new(authenticate))
        .layer(idempotency.into_tonic())
        .add_service(OrdersServer::new(service))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown_signal())
        .await?;
    Ok(())
}

/// Opens the database `database_url` names, and creates the orders table if it is missing.
async fn open(database_url: Option<&str>) -> Result<OrderBook, BoxError> {
    let book = match database_url {
        None => OrderBook::Sqlite(connect_sqlite(SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE)).await?),
        Some(url) if url.starts_with("sqlite:") => {
            OrderBook::Sqlite(connect_sqlite(SqliteConnectOptions::from_str(url)?).await?)
        }
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => open_postgres(url).await?,
        // Not echoed: the URL may carry a password.
        Some(_) => return Err("DATABASE_URL must start with sqlite:, postgres:// or postgresql://".into()),
    };
    book.create_table().await?;
    Ok(book)
}

#[cfg(feature = "postgres")]
async fn open_postgres(url: &str) -> Result<OrderBook, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(book::storage::POOL_ACQUIRE_TIMEOUT)
        .connect(url)
        .await?;
    Ok(OrderBook::Postgres(pool))
}

#[cfg(not(feature = "postgres"))]
async fn open_postgres(_url: &str) -> Result<OrderBook, BoxError> {
    Err("DATABASE_URL names a PostgreSQL database, but this build has no PostgreSQL support; \
         build with `--features grpc-example,postgres`"
        .into())
}

// ---------------------------------------------------------------------------------------------
// Authentication
// ---------------------------------------------------------------------------------------------

/// The interceptor that runs before everything else: finds the account, or refuses the call.
fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let mut fields = request.metadata().get_all("authorization").iter();
    let (Some(field), None) = (fields.next(), fields.next()) else {
        return Err(Status::unauthenticated("send exactly one `authorization: Bearer <account>`"));
    };
    let account = field
        .to_str()
        .ok()
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .and_then(|(_, token)| Account::parse(token.trim_start_matches(' ')))
        .ok_or_else(|| Status::unauthenticated("the bearer token must be an account id of 1 to 64 visible ASCII"))?;
    request.extensions_mut().insert(Scope::new(account.as_str()));
    request.extensions_mut().insert(account);
    Ok(request)
}

// ---------------------------------------------------------------------------------------------
// The service
// ---------------------------------------------------------------------------------------------

/// The `orders.v1.Orders` service.
pub struct OrdersService {
    book: OrderBook,
}

#[tonic::async_trait]
impl Orders for OrdersService {
    /// Validates the order and inserts it, with its operation id, in the idempotency claim's
    /// transaction. Any early return drops the transaction handle unused; the layer then rolls
    /// back and, the status not being OK, stores nothing.
    async fn create_order(&self, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        let extensions = request.extensions();
        let account = extensions.get::<Account>().cloned().ok_or_else(|| internal("no authenticated account"))?;
        let context =
            extensions.get::<IdempotencyContext>().cloned().ok_or_else(|| internal("no idempotency layer"))?;
        let transaction = order_tx(&self.book, extensions)?;
        // `into_inner` drops the request and its extensions, the layer's copy of the handle too.
        let CreateOrderRequest { sku, quantity, amount_minor, currency } = request.into_inner();
        let draft = OrderDraft::new(sku, quantity, AmountMinor::from_digits(amount_minor), currency)
            .map_err(Status::invalid_argument)?;
        let order = book::order::Order::new(account, draft, context.operation_id(), CreatedAt::now());
        // `insert` consumes the handle, so the layer has it back before the answer: it stores the
        // answer in the same transaction and commits the order and the answer together.
        transaction.insert(&order).await.map_err(storage_failed)?;
        Ok(Response::new(to_message(&order)))
    }

    /// The caller's order, or NOT_FOUND for anything else. Not guarded.
    async fn get_order(&self, request: Request<GetOrderRequest>) -> Result<Response<Order>, Status> {
        let account = request.extensions().get::<Account>().cloned().ok_or_else(|| internal("no account"))?;
        let not_found = || Status::not_found("no such order");
        let order_id = Uuid::try_parse(&request.get_ref().order_id).map_err(|_| not_found())?;
        let order = self.book.get(&account, order_id).await.map_err(storage_failed)?;
        order.map(|order| Response::new(to_message(&order))).ok_or_else(not_found)
    }
}

/// The layer's transaction handle for `book`'s database, from the call's extensions.
fn order_tx(book: &OrderBook, extensions: &tonic::Extensions) -> Result<OrderTx, Status> {
    let transaction = match book {
        OrderBook::Sqlite(_) => extensions.get::<TxHandle<Sqlite>>().cloned().map(OrderTx::Sqlite),
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(_) => extensions.get::<TxHandle<Postgres>>().cloned().map(OrderTx::Postgres),
    };
    transaction.ok_or_else(|| internal("no idempotency transaction for the order book; is the store atomic?"))
}

/// An order as the `Order` message.
fn to_message(order: &book::order::Order) -> Order {
    Order {
        order_id: order.order_id.to_string(),
        account_id: order.account_id.as_str().to_owned(),
        sku: order.sku.clone(),
        // A validated quantity is at most i64::MAX.
        quantity: i64::try_from(order.quantity).unwrap_or(i64::MAX),
        amount_minor: order.amount_minor.digits().to_owned(),
        currency: order.currency.clone(),
        created_at: order.created_at.to_string(),
        idempotency_operation_id: order.idempotency_operation_id.clone(),
    }
}

/// A bug, not an outage: the service was assembled wrongly. The cause goes to stderr.
fn internal(cause: &str) -> Status {
    eprintln!("grpc_orders: internal error: {cause}");
    Status::internal("internal error")
}

/// The database failed (nothing was created, and a retry with the same key is safe), or a
/// stored row is not a valid order (a bug). The cause goes to stderr, never to the client.
fn storage_failed(error: StorageError) -> Status {
    match error {
        StorageError::Unavailable(error) => {
            eprintln!("grpc_orders: storage unavailable: {error}");
            Status::unavailable("the order could not be stored or read; retrying with the same idempotency-key is safe")
        }
        StorageError::Internal(error) => internal(&error.to_string()),
    }
}
