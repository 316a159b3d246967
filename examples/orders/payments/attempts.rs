//! The `payment_attempts` table: one row per payment attempt, written **before** the provider
//! is called, and every change of it conditional on the state it expects.
//!
//! Columns: `payment_id` (a UUID v4), `order_id`, `account_id`, the fixed `amount_minor`
//! (digits) and `currency` (copied from the order when the attempt is made, never changed),
//! `provider`, `provider_key` (the idempotency context's downstream key: the same on every
//! retry and every reconciliation), `operation_id` (the idempotency record's, for the
//! reconciler), `state`, `open_call` (1 from just before a provider call is sent until its
//! answer is written: the call permit), `charge_id`, `created_at` and `settled_at` (Unix
//! microseconds).
//!
//! `payment_attempts_one_live_per_order` is a partial unique index on `order_id` over every
//! attempt that is not `declined`: while one is `pending` or `unknown` a second attempt for
//! the order cannot be inserted (409 `payment_in_progress`), and once one `succeeded` none can
//! (409 `order_already_paid`), whatever races the checks before it lose. A partial index works
//! the same on PostgreSQL and SQLite.

use sqlx::FromRow;
use tower_idempotency::BoxError;

use super::super::book::storage::OrderBook;
use super::super::events;

/// The provider name kept with each attempt.
pub(crate) const PROVIDER: &str = "psp";

const SQLITE_CREATE: &str = "
    CREATE TABLE IF NOT EXISTS payment_attempts (
        payment_id   TEXT    NOT NULL PRIMARY KEY,
        order_id     TEXT    NOT NULL,
        account_id   TEXT    NOT NULL,
        amount_minor TEXT    NOT NULL,
        currency     TEXT    NOT NULL,
        provider     TEXT    NOT NULL,
        provider_key TEXT    NOT NULL CONSTRAINT payment_attempts_provider_key_unique UNIQUE,
        operation_id TEXT    NOT NULL CONSTRAINT payment_attempts_operation_unique UNIQUE,
        state        TEXT    NOT NULL
            CONSTRAINT payment_attempts_state_check CHECK (state IN ('pending', 'unknown', 'succeeded', 'declined')),
        open_call    INTEGER NOT NULL DEFAULT 0,
        charge_id    TEXT,
        created_at   INTEGER NOT NULL,
        settled_at   INTEGER
    );
    CREATE UNIQUE INDEX IF NOT EXISTS payment_attempts_one_live_per_order
        ON payment_attempts (order_id) WHERE state <> 'declined';";
#[cfg(feature = "postgres")]
const POSTGRES_CREATE: &str = "
    CREATE TABLE IF NOT EXISTS payment_attempts (
        payment_id   text   NOT NULL PRIMARY KEY,
        order_id     text   NOT NULL,
        account_id   text   NOT NULL,
        amount_minor text   NOT NULL,
        currency     text   NOT NULL,
        provider     text   NOT NULL,
        provider_key text   NOT NULL CONSTRAINT payment_attempts_provider_key_unique UNIQUE,
        operation_id text   NOT NULL CONSTRAINT payment_attempts_operation_unique UNIQUE,
        state        text   NOT NULL
            CONSTRAINT payment_attempts_state_check CHECK (state IN ('pending', 'unknown', 'succeeded', 'declined')),
        open_call    bigint NOT NULL DEFAULT 0,
        charge_id    text,
        created_at   bigint NOT NULL,
        settled_at   bigint
    );
    CREATE UNIQUE INDEX IF NOT EXISTS payment_attempts_one_live_per_order
        ON payment_attempts (order_id) WHERE state <> 'declined';";

const COLUMNS: &str = "payment_id, order_id, account_id, amount_minor, currency, provider, provider_key, \
                       operation_id, state, open_call, charge_id, created_at, settled_at";

/// Runs the same statement on either pool.
macro_rules! on_pool {
    ($book:expr, $pool:ident => $body:expr) => {
        match $book {
            OrderBook::Sqlite($pool) => $body,
            #[cfg(feature = "postgres")]
            OrderBook::Postgres($pool) => $body,
        }
    };
}

/// One attempt, as stored.
#[derive(Clone, Debug, FromRow)]
pub(crate) struct Attempt {
    pub(crate) payment_id: String,
    pub(crate) order_id: String,
    pub(crate) account_id: String,
    pub(crate) amount_minor: String,
    pub(crate) currency: String,
    pub(crate) provider: String,
    pub(crate) provider_key: String,
    pub(crate) operation_id: String,
    pub(crate) state: String,
    pub(crate) open_call: i64,
    pub(crate) charge_id: Option<String>,
    pub(crate) created_at: i64,
    pub(crate) settled_at: Option<i64>,
}

impl Attempt {
    /// Whether a provider call of it was sent and its answer never written.
    pub(crate) fn call_open(&self) -> bool {
        self.open_call != 0
    }
}

/// What inserting a new attempt found.
pub(crate) enum Inserted {
    /// The attempt is in the table, `pending`.
    Created,
    /// The order already has a live attempt (this one, another key's `pending` or `unknown`, or
    /// a `succeeded` one).
    Blocked,
}

/// Creates the table and its indexes if they are missing.
pub(crate) async fn create_table(book: &OrderBook) -> Result<(), BoxError> {
    match book {
        OrderBook::Sqlite(pool) => {
            sqlx::raw_sql(SQLITE_CREATE).execute(pool).await?;
        }
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pool) => {
            sqlx::raw_sql(POSTGRES_CREATE).execute(pool).await?;
        }
    }
    Ok(())
}

fn select(filter: &str) -> String {
    format!("SELECT {COLUMNS} FROM payment_attempts WHERE {filter}")
}

/// The attempt whose provider key is `key`.
pub(crate) async fn by_provider_key(book: &OrderBook, key: &str) -> Result<Option<Attempt>, sqlx::Error> {
    let sql = select("provider_key = $1");
    on_pool!(book, pool => sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(key).fetch_optional(pool).await)
}

/// The attempt of the idempotency operation `operation_id`.
pub(crate) async fn by_operation(book: &OrderBook, operation_id: &str) -> Result<Option<Attempt>, sqlx::Error> {
    let sql = select("operation_id = $1");
    on_pool!(book, pool => sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(operation_id).fetch_optional(pool).await)
}

/// The attempt `payment_id`.
pub(crate) async fn by_id(book: &OrderBook, payment_id: &str) -> Result<Option<Attempt>, sqlx::Error> {
    let sql = select("payment_id = $1");
    on_pool!(book, pool => sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(payment_id).fetch_optional(pool).await)
}

/// The attempts of `order_id`, oldest first.
pub(crate) async fn of_order(book: &OrderBook, order_id: &str) -> Result<Vec<Attempt>, sqlx::Error> {
    let sql = select("order_id = $1 ORDER BY created_at, payment_id");
    on_pool!(book, pool => sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(order_id).fetch_all(pool).await)
}

/// Inserts `attempt` as `pending`, unless the unique constraints refuse it.
pub(crate) async fn insert(book: &OrderBook, attempt: &Attempt) -> Result<Inserted, sqlx::Error> {
    let sql = format!(
        "INSERT INTO payment_attempts ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', 0, NULL, $9, NULL)"
    );
    let done = on_pool!(book, pool => sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&attempt.payment_id)
        .bind(&attempt.order_id)
        .bind(&attempt.account_id)
        .bind(&attempt.amount_minor)
        .bind(&attempt.currency)
        .bind(&attempt.provider)
        .bind(&attempt.provider_key)
        .bind(&attempt.operation_id)
        .bind(attempt.created_at)
        .execute(pool)
        .await
        .map(|_| ()));
    match done {
        Ok(()) => Ok(Inserted::Created),
        Err(sqlx::Error::Database(error)) if error.is_unique_violation() => Ok(Inserted::Blocked),
        Err(error) => Err(error),
    }
}

/// Runs a conditional update; whether it changed the row.
async fn update(book: &OrderBook, sql: &'static str, binds: &[&str]) -> Result<bool, sqlx::Error> {
    on_pool!(book, pool => {
        let mut query = sqlx::query(sql);
        for bind in binds {
            query = query.bind(*bind);
        }
        query.execute(pool).await.map(|done| done.rows_affected() == 1)
    })
}

/// `pending` with no open call → `pending` with one: the permit to send one provider call,
/// consumed durably before it is sent. `false`: someone else holds it, or the attempt moved on.
pub(crate) async fn open_call(book: &OrderBook, payment_id: &str) -> Result<bool, sqlx::Error> {
    const SQL: &str =
        "UPDATE payment_attempts SET open_call = 1 WHERE payment_id = $1 AND state = 'pending' AND open_call = 0";
    update(book, SQL, &[payment_id]).await
}

/// The provider said the call was not executed (its 503, or no connection at all): the permit
/// is given back, the attempt stays `pending`.
pub(crate) async fn close_call_not_executed(book: &OrderBook, payment_id: &str) -> Result<bool, sqlx::Error> {
    const SQL: &str =
        "UPDATE payment_attempts SET open_call = 0 WHERE payment_id = $1 AND state = 'pending' AND open_call = 1";
    update(book, SQL, &[payment_id]).await
}

/// `pending` → `unknown`: a call's answer is missing.
pub(crate) async fn mark_unknown(book: &OrderBook, payment_id: &str) -> Result<bool, sqlx::Error> {
    const SQL: &str = "UPDATE payment_attempts SET state = 'unknown' WHERE payment_id = $1 AND state = 'pending'";
    update(book, SQL, &[payment_id]).await
}

/// `pending` or `unknown` → `succeeded` with the provider's charge, on evidence (the provider's
/// answer or its lookup), and `payment.succeeded` enqueued in the same transaction.
pub(crate) async fn settle_succeeded(
    book: &OrderBook,
    payment_id: &str,
    charge_id: &str,
    now: i64,
) -> Result<bool, sqlx::Error> {
    settle(book, "succeeded", payment_id, Some(charge_id), now).await
}

/// `pending` or `unknown` → `declined`, on evidence, and `payment.declined` enqueued in the
/// same transaction.
pub(crate) async fn settle_declined(
    book: &OrderBook,
    payment_id: &str,
    charge_id: Option<&str>,
    now: i64,
) -> Result<bool, sqlx::Error> {
    settle(book, "declined", payment_id, charge_id, now).await
}

/// `pending` or `unknown` → `state` (`succeeded` or `declined`), conditional, and the
/// payment's event (`events.rs`) enqueued in the same transaction: a settlement that loses
/// its race changes nothing and enqueues nothing. Whether it changed the row.
async fn settle(
    book: &OrderBook,
    state: &'static str,
    payment_id: &str,
    charge_id: Option<&str>,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "UPDATE payment_attempts SET state = $4, charge_id = $2, open_call = 0, settled_at = $3 \
         WHERE payment_id = $1 AND state IN ('pending', 'unknown') RETURNING {COLUMNS}"
    );
    // The same statement on either backend's transaction.
    macro_rules! query {
        () => {
            sqlx::query_as::<_, Attempt>(sqlx::AssertSqlSafe(sql.as_str()))
                .bind(payment_id)
                .bind(charge_id)
                .bind(now)
                .bind(state)
        };
    }
    match book {
        OrderBook::Sqlite(pool) => {
            let mut tx = pool.begin().await?;
            let Some(settled) = query!().fetch_optional(&mut *tx).await? else { return Ok(false) };
            events::payment_settled_sqlite(pool, &mut tx, &settled).await?;
            tx.commit().await?;
        }
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pool) => {
            let mut tx = pool.begin().await?;
            let Some(settled) = query!().fetch_optional(&mut *tx).await? else { return Ok(false) };
            events::payment_settled_postgres(pool, &mut tx, &settled).await?;
            tx.commit().await?;
        }
    }
    Ok(true)
}

/// `unknown` → `pending` with no open call: an operator found that the provider never
/// executed the call (its audit shows no charge), and re-issues the permit. Only by hand.
pub(crate) async fn reopen_not_executed(book: &OrderBook, payment_id: &str) -> Result<bool, sqlx::Error> {
    const SQL: &str =
        "UPDATE payment_attempts SET state = 'pending', open_call = 0 WHERE payment_id = $1 AND state = 'unknown'";
    update(book, SQL, &[payment_id]).await
}
