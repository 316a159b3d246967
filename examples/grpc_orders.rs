//! # The orders service over gRPC, safe to retry
//!
//! The gRPC twin of `examples/orders.rs`: the same order creation, on the same store, as a
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
//! Exactly as the HTTP example, and the same tables, so both can serve one database:
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
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tower_idempotency::{BoxError, IdempotencyContext, IdempotencyLayer, Scope, SqliteStore, Store, TxHandle};
use uuid::Uuid;
// PostgreSQL: only in a build with `--features postgres`.
#[cfg(feature = "postgres")]
use sqlx::Postgres;
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgPool, PgPoolOptions};
#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;

/// The code generated from `proto/orders.proto` at build time.
pub mod proto {
    tonic::include_proto!("orders.v1");
}

use proto::orders_server::{Orders, OrdersServer};
use proto::{CreateOrderRequest, GetOrderRequest, Order};

/// The guarded method: its path is also the idempotency operation.
pub const CREATE_ORDER: &str = "/orders.v1.Orders/CreateOrder";
/// The longest account id accepted in `authorization: Bearer <account>`.
pub const MAX_ACCOUNT_LEN: usize = 64;
/// The longest `sku` accepted, in characters.
pub const MAX_SKU_LEN: usize = 64;
/// The SQLite file used when `DATABASE_URL` is unset (the HTTP example's).
pub const DEFAULT_SQLITE_FILE: &str = "orders.db";

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

/// A pool on the SQLite file of `options`, created if missing, in WAL mode with a busy timeout.
async fn connect_sqlite(options: SqliteConnectOptions) -> Result<SqlitePool, sqlx::Error> {
    let options = options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5))
        .synchronous(SqliteSynchronous::Full);
    SqlitePoolOptions::new().max_connections(8).connect_with(options).await
}

#[cfg(feature = "postgres")]
async fn open_postgres(url: &str) -> Result<OrderBook, BoxError> {
    Ok(OrderBook::Postgres(PgPoolOptions::new().max_connections(16).connect(url).await?))
}

#[cfg(not(feature = "postgres"))]
async fn open_postgres(_url: &str) -> Result<OrderBook, BoxError> {
    Err("DATABASE_URL names a PostgreSQL database, but this build has no PostgreSQL support; \
         build with `--features grpc-example,postgres`"
        .into())
}

/// Resolves on Ctrl-C or, on Unix, SIGTERM.
async fn shutdown_signal() {
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
// Authentication
// ---------------------------------------------------------------------------------------------

/// The authenticated account: the idempotency scope, and the owner of orders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account(String);

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
        .map(|(_, token)| token.trim_start_matches(' '))
        .filter(|token| (1..=MAX_ACCOUNT_LEN).contains(&token.len()) && token.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| Status::unauthenticated("the bearer token must be an account id of 1 to 64 visible ASCII"))?
        .to_owned();
    request.extensions_mut().insert(Scope::new(account.as_str()));
    request.extensions_mut().insert(Account(account));
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
        let transaction = OrderTx::from_extensions(&self.book, extensions)?;
        // `into_inner` drops the request and its extensions, the layer's copy of the handle too.
        let draft = validate(request.into_inner())?;
        let order = Order {
            order_id: Uuid::new_v4().to_string(),
            account_id: account.0,
            sku: draft.sku,
            quantity: draft.quantity,
            amount_minor: draft.amount_minor,
            currency: draft.currency,
            created_at: String::new(),
            idempotency_operation_id: context.operation_id().to_owned(),
        };
        let created_at = unix_micros_now();
        // `insert` consumes the handle, so the layer has it back before the answer: it stores the
        // answer in the same transaction and commits the order and the answer together.
        transaction.insert(&order, created_at).await?;
        Ok(Response::new(Order { created_at: rfc3339(created_at), ..order }))
    }

    /// The caller's order, or NOT_FOUND for anything else. Not guarded.
    async fn get_order(&self, request: Request<GetOrderRequest>) -> Result<Response<Order>, Status> {
        let account = request.extensions().get::<Account>().cloned().ok_or_else(|| internal("no account"))?;
        let not_found = || Status::not_found("no such order");
        let order_id = Uuid::try_parse(&request.get_ref().order_id).map_err(|_| not_found())?;
        let order = self.book.get(&account, order_id).await.map_err(storage_unavailable)?;
        order.map(Response::new).ok_or_else(not_found)
    }
}

/// A `CreateOrderRequest` that follows the rules.
struct Draft {
    sku: String,
    quantity: i64,
    amount_minor: String,
    currency: String,
}

/// The rules of the HTTP example, field by field; the error names the field.
fn validate(request: CreateOrderRequest) -> Result<Draft, Status> {
    let invalid = |detail: String| Err(Status::invalid_argument(detail));
    let sku_len = request.sku.chars().count();
    if !(1..=MAX_SKU_LEN).contains(&sku_len) || request.sku.chars().any(char::is_control) {
        return invalid(format!("sku must be 1 to {MAX_SKU_LEN} characters without control characters"));
    }
    if request.quantity < 1 {
        return invalid(format!("quantity must be at least 1, got {}", request.quantity));
    }
    let amount = &request.amount_minor;
    let digits_only = !amount.is_empty() && amount.bytes().all(|b| b.is_ascii_digit());
    if !digits_only || (amount.len() > 1 && amount.starts_with('0')) {
        return invalid(
            "amount_minor must be a whole number of minor units, as decimal digits without a sign, \
                        fraction, exponent or leading zero"
                .to_owned(),
        );
    }
    if request.currency.len() != 3 || !request.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return invalid("currency must be three uppercase ASCII letters, such as \"JPY\"".to_owned());
    }
    Ok(Draft {
        sku: request.sku,
        quantity: request.quantity,
        amount_minor: request.amount_minor,
        currency: request.currency,
    })
}

/// A bug, not an outage: the service was assembled wrongly. The cause goes to stderr.
fn internal(cause: &str) -> Status {
    eprintln!("grpc_orders: internal error: {cause}");
    Status::internal("internal error")
}

/// The database failed: nothing was created, and a retry with the same key is safe.
fn storage_unavailable(error: sqlx::Error) -> Status {
    eprintln!("grpc_orders: storage unavailable: {error}");
    Status::unavailable("the order could not be stored or read; retrying with the same idempotency-key is safe")
}

// ---------------------------------------------------------------------------------------------
// Storage: the HTTP example's tables, read through the pool, written through the claim's
// transaction
// ---------------------------------------------------------------------------------------------

/// The orders table, on the database that also holds the idempotency records.
#[derive(Clone, Debug)]
pub enum OrderBook {
    /// SQLite.
    Sqlite(SqlitePool),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
}

/// The claim's transaction, on the order book's database.
enum OrderTx {
    Sqlite(TxHandle<Sqlite>),
    #[cfg(feature = "postgres")]
    Postgres(TxHandle<Postgres>),
}

impl OrderTx {
    /// The layer's transaction handle for `book`'s database, from the request's extensions.
    fn from_extensions(book: &OrderBook, extensions: &tonic::Extensions) -> Result<Self, Status> {
        let transaction = match book {
            OrderBook::Sqlite(_) => extensions.get::<TxHandle<Sqlite>>().cloned().map(Self::Sqlite),
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(_) => extensions.get::<TxHandle<Postgres>>().cloned().map(Self::Postgres),
        };
        transaction.ok_or_else(|| internal("no idempotency transaction for the order book; is the store atomic?"))
    }

    /// Inserts `order` in the transaction, which the layer commits together with the answer.
    async fn insert(self, order: &Order, created_at: i64) -> Result<(), Status> {
        let finished = |_| internal("the idempotency transaction is already finished");
        match self {
            Self::Sqlite(handle) => {
                let mut conn = handle.acquire().await.map_err(finished)?;
                sqlx::query(sql::SQLITE_INSERT)
                    .bind(&order.order_id)
                    .bind(&order.account_id)
                    .bind(&order.sku)
                    .bind(order.quantity)
                    .bind(&order.amount_minor)
                    .bind(&order.currency)
                    .bind(created_at)
                    .bind(&order.idempotency_operation_id)
                    .execute(&mut *conn)
                    .await
                    .map_err(storage_unavailable)?;
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(handle) => {
                let mut conn = handle.acquire().await.map_err(finished)?;
                sqlx::query(sql::POSTGRES_INSERT)
                    .bind(&order.order_id)
                    .bind(&order.account_id)
                    .bind(&order.sku)
                    .bind(order.quantity)
                    .bind(&order.amount_minor)
                    .bind(&order.currency)
                    .bind(created_at)
                    .bind(&order.idempotency_operation_id)
                    .execute(&mut *conn)
                    .await
                    .map_err(storage_unavailable)?;
            }
        }
        // `conn` and the handle were dropped at the end of their arm: the layer has them back.
        Ok(())
    }
}

/// An orders row as both backends return it.
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

impl From<OrderRow> for Order {
    fn from(row: OrderRow) -> Self {
        Order {
            order_id: row.order_id,
            account_id: row.account_id,
            sku: row.sku,
            quantity: row.quantity,
            amount_minor: row.amount_minor,
            currency: row.currency,
            created_at: rfc3339(row.created_at),
            idempotency_operation_id: row.idempotency_operation_id,
        }
    }
}

impl OrderBook {
    /// The orders table and its page index, if missing.
    async fn create_table(&self) -> Result<(), BoxError> {
        match self {
            Self::Sqlite(pool) => {
                sqlx::raw_sql(sql::SQLITE_CREATE_TABLE).execute(pool).await?;
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => {
                sqlx::raw_sql(sql::POSTGRES_CREATE_TABLE).execute(pool).await?;
            }
        }
        Ok(())
    }

    /// The order `order_id` if `account` owns it.
    async fn get(&self, account: &Account, order_id: Uuid) -> Result<Option<Order>, sqlx::Error> {
        let (account, order_id) = (account.0.as_str(), order_id.to_string());
        let row: Option<OrderRow> = match self {
            Self::Sqlite(pool) => {
                sqlx::query_as(sql::SQLITE_GET).bind(account).bind(order_id).fetch_optional(pool).await?
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => {
                sqlx::query_as(sql::POSTGRES_GET).bind(account).bind(order_id).fetch_optional(pool).await?
            }
        };
        Ok(row.map(Order::from))
    }

    /// Closes the pool, waiting for connections in use to come back.
    async fn close(&self) {
        match self {
            Self::Sqlite(pool) => pool.close().await,
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => pool.close().await,
        }
    }
}

/// The HTTP example's tables and statements (see `sqlite_sql` and `postgres_sql` there).
mod sql {
    pub const SQLITE_CREATE_TABLE: &str = "
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
    pub const SQLITE_INSERT: &str = "
        INSERT INTO orders (order_id, account_id, sku, quantity, amount_minor, currency, created_at,
                            idempotency_operation_id)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
    pub const SQLITE_GET: &str = "
        SELECT order_id, account_id, sku, quantity, amount_minor, currency, created_at, idempotency_operation_id
        FROM orders WHERE account_id = $1 AND order_id = $2";

    #[cfg(feature = "postgres")]
    pub const POSTGRES_CREATE_TABLE: &str = "
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
    #[cfg(feature = "postgres")]
    pub const POSTGRES_INSERT: &str = "
        INSERT INTO orders (order_id, account_id, sku, quantity, amount_minor, currency, created_at,
                            idempotency_operation_id)
        VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8)";
    #[cfg(feature = "postgres")]
    pub const POSTGRES_GET: &str = "
        SELECT order_id::text AS order_id, account_id, sku, quantity, amount_minor, currency, created_at,
               idempotency_operation_id
        FROM orders WHERE account_id = $1 AND order_id = $2::uuid";
}

// ---------------------------------------------------------------------------------------------
// Time: microseconds since the Unix epoch, shown as RFC 3339 UTC
// ---------------------------------------------------------------------------------------------

fn unix_micros_now() -> i64 {
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX)
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ` (the proleptic Gregorian calendar, Howard Hinnant's algorithm).
fn rfc3339(micros: i64) -> String {
    const MICROS_PER_DAY: i64 = 86_400_000_000;
    let (days, micros_of_day) = (micros.div_euclid(MICROS_PER_DAY), micros.rem_euclid(MICROS_PER_DAY));
    let shifted = days + 719_468;
    let (era, day_of_era) = (shifted.div_euclid(146_097), shifted.rem_euclid(146_097));
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let seconds = micros_of_day / 1_000_000;
    let (hour, minute, second, fraction) = (seconds / 3600, seconds / 60 % 60, seconds % 60, micros_of_day % 1_000_000);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{fraction:06}Z")
}
