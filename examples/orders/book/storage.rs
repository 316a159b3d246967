//! The orders table: created on start, read through the pool, written only through the
//! idempotency claim's transaction.

use std::time::Duration;

#[cfg(feature = "postgres")]
use sqlx::Postgres;
use sqlx::Sqlite;
#[cfg(feature = "postgres")]
use sqlx::postgres::PgPool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use tower_idempotency::tx::TxFinished;
use tower_idempotency::{BoxError, TxHandle};
use uuid::Uuid;

use super::account::Account;
use super::created_at::CreatedAt;
use super::order::{AmountMinor, Order};
use super::sql;

/// The SQLite file used when `DATABASE_URL` is unset.
pub(crate) const DEFAULT_SQLITE_FILE: &str = "orders.db";
/// How long a SQLite writer waits for another before giving up.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long any request waits for a connection from the pool (both databases) before it is
/// answered 503 with `Retry-After`: a pool filled by slow requests must not make the others,
/// plain `GET`s included, wait for sqlx's default of 30 s. The idempotency layer takes its
/// own connections by the request's in-flight wait (2 s), or this, whichever comes first.
pub(crate) const POOL_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// A pool on the SQLite file of `options`, created if missing, in WAL mode with a busy timeout.
pub(crate) async fn connect_sqlite(options: SqliteConnectOptions) -> Result<SqlitePool, sqlx::Error> {
    let options = options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(SQLITE_BUSY_TIMEOUT)
        // sqlx's default, said out loud: a COMMIT is on disk before the answer leaves.
        .synchronous(SqliteSynchronous::Full);
    SqlitePoolOptions::new().max_connections(8).acquire_timeout(POOL_ACQUIRE_TIMEOUT).connect_with(options).await
}

/// An order's place in the listing: newest first by `created_at`, then by `order_id`
/// (compared bytewise), both descending. `order_id` is unique, so the order is total.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct PagePosition {
    /// The order's creation time.
    pub(crate) created_at: CreatedAt,
    /// The order's id, the tie-breaker.
    pub(crate) order_id: Uuid,
}

/// The orders table, on the database that also holds the idempotency records.
///
/// Reads go through the pool. Writes do not: an order is inserted only by the create
/// handler, on the idempotency claim's transaction ([`OrderTx`]).
#[derive(Clone, Debug)]
pub(crate) enum OrderBook {
    /// SQLite: `order_id` is TEXT (see `sqlite_sql`).
    Sqlite(SqlitePool),
    /// PostgreSQL: `order_id` is `uuid` (see `postgres_sql`).
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
}

impl OrderBook {
    /// Creates the orders table and its page index if they are missing.
    pub(crate) async fn create_table(&self) -> Result<(), BoxError> {
        match self {
            Self::Sqlite(pool) => {
                sqlx::raw_sql(sql::sqlite_sql::CREATE_TABLE).execute(pool).await?;
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => {
                sqlx::raw_sql(sql::postgres_sql::CREATE_TABLE).execute(pool).await?;
            }
        }
        Ok(())
    }

    /// The order `order_id` if `account` owns it.
    pub(crate) async fn get(&self, account: &Account, order_id: Uuid) -> Result<Option<Order>, StorageError> {
        let (account, order_id) = (account.as_str(), order_id.to_string());
        let row: Option<OrderRow> = match self {
            Self::Sqlite(pool) => {
                sqlx::query_as(sql::sqlite_sql::GET).bind(account).bind(order_id).fetch_optional(pool).await?
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => {
                sqlx::query_as(sql::postgres_sql::GET).bind(account).bind(order_id).fetch_optional(pool).await?
            }
        };
        row.map(Order::try_from).transpose()
    }

    /// Up to `limit` of `account`'s orders, newest first, strictly after `after` in that order.
    pub(crate) async fn page(
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
                sqlx::query_as(sql::sqlite_sql::FIRST_PAGE).bind(account).bind(limit).fetch_all(pool).await?
            }
            (Self::Sqlite(pool), Some((created_at, order_id))) => {
                let query = sqlx::query_as(sql::sqlite_sql::NEXT_PAGE).bind(account).bind(created_at).bind(order_id);
                query.bind(limit).fetch_all(pool).await?
            }
            #[cfg(feature = "postgres")]
            (Self::Postgres(pool), None) => {
                sqlx::query_as(sql::postgres_sql::FIRST_PAGE).bind(account).bind(limit).fetch_all(pool).await?
            }
            #[cfg(feature = "postgres")]
            (Self::Postgres(pool), Some((created_at, order_id))) => {
                let query = sqlx::query_as(sql::postgres_sql::NEXT_PAGE).bind(account).bind(created_at).bind(order_id);
                query.bind(limit).fetch_all(pool).await?
            }
        };
        rows.into_iter().map(Order::try_from).collect()
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub(crate) async fn close(&self) {
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

/// The idempotency claim's transaction, as the create handler gets it: the layer's
/// [`TxHandle`] of the order book's database, found in the request (the HTTP service's
/// extractor, the gRPC service's extensions).
///
/// Hold it only while writing: [`insert`](Self::insert) consumes it, so the handle is back
/// with the layer before the handler answers. (A handle still held when the answer comes
/// back makes the layer roll back and answer 500.)
#[derive(Debug)]
pub(crate) enum OrderTx {
    /// The transaction of an atomic `SqliteStore`.
    Sqlite(TxHandle<Sqlite>),
    /// The transaction of an atomic `PostgresStore`.
    #[cfg(feature = "postgres")]
    Postgres(TxHandle<Postgres>),
}

impl OrderTx {
    /// Inserts `order` in the transaction, which the layer commits together with the answer.
    pub(crate) async fn insert(self, order: &Order) -> Result<(), StorageError> {
        let order_id = order.order_id.to_string();
        // A validated quantity is at most i64::MAX; anything else is a bug.
        let quantity =
            i64::try_from(order.quantity).map_err(|_| StorageError::Internal("the quantity exceeds i64".into()))?;
        let (created_at, operation_id) = (order.created_at.unix_micros(), order.idempotency_operation_id.as_str());
        match self {
            Self::Sqlite(handle) => {
                let mut conn = handle.acquire().await?;
                sqlx::query(sql::sqlite_sql::INSERT)
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
                sqlx::query(sql::postgres_sql::INSERT)
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

/// Why a read or write of the orders table failed, sorted by what the client should do.
#[derive(Debug)]
pub(crate) enum StorageError {
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
