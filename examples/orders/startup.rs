//! Start-up: opens the database `DATABASE_URL` names, creates what is missing, and assembles
//! the service over an atomic idempotency store on that same database.

use std::str::FromStr;

use axum::Router;
#[cfg(feature = "postgres")]
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqliteConnectOptions;
#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;
use tower_idempotency::{BoxError, RolloutSwitch, SqliteStore, Store};

use super::admin::AdminRoutes;
use super::api::{AppState, Clock, app_with_rollout};
use super::book::storage::{DEFAULT_SQLITE_FILE, OrderBook, connect_sqlite};
use super::cursor::CursorCodec;
use super::limits::RequestLimits;

/// What start-up assembles: the public API, the operator listener's routes, and the order book.
pub(crate) struct Opened {
    /// The public API (`ORDERS_ADDR`).
    pub(crate) api: Router,
    /// The routes of the operator listener (`ORDERS_ADMIN_ADDR`).
    pub(crate) admin: AdminRoutes,
    /// The orders, closed on shutdown.
    pub(crate) orders: OrderBook,
}

/// Opens the database `database_url` names (see *Storage* in `main.rs`), creates what is
/// missing, and returns the service with its order book.
pub(crate) async fn open(
    database_url: Option<&str>,
    cursors: CursorCodec,
    limits: RequestLimits,
    clock: Clock,
) -> Result<Opened, BoxError> {
    let rollout = super::rollout::switch_from_env()?;
    let admin = super::rollout::routes(rollout.clone());
    let state = |orders: &OrderBook| AppState { orders: orders.clone(), cursors, limits, clock };
    let assembled = |opened: Opened| Opened { admin: opened.admin.merge(admin), ..opened };
    match database_url {
        None => {
            open_sqlite(SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE), state, rollout).await.map(assembled)
        }
        Some(url) if url.starts_with("sqlite:") => {
            open_sqlite(SqliteConnectOptions::from_str(url)?, state, rollout).await.map(assembled)
        }
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            open_postgres(url, state, rollout).await.map(assembled)
        }
        // Not echoed: the URL may carry a password.
        Some(_) => Err("DATABASE_URL must start with sqlite:, postgres:// or postgresql://".into()),
    }
}

/// SQLite: the file of `options`, created if missing.
async fn open_sqlite(
    options: SqliteConnectOptions,
    state: impl FnOnce(&OrderBook) -> AppState,
    rollout: RolloutSwitch,
) -> Result<Opened, BoxError> {
    eprintln!("orders: storage is SQLite, {}", options.get_filename().display());
    let pool = connect_sqlite(options).await?;
    // One store per database, cloned wherever it is needed: the SQLite store keeps the
    // in-process gate that tells a duplicate in flight from a busy database.
    let store = SqliteStore::new(pool.clone());
    store.migrate().await?;
    let orders = OrderBook::Sqlite(pool);
    orders.create_table().await?;
    Ok(Opened { api: with_fast_path(state(&orders), store, rollout)?, admin: AdminRoutes::default(), orders })
}

/// PostgreSQL: the existing database `url` names.
#[cfg(feature = "postgres")]
async fn open_postgres(
    url: &str,
    state: impl FnOnce(&OrderBook) -> AppState,
    rollout: RolloutSwitch,
) -> Result<Opened, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(super::book::storage::POOL_ACQUIRE_TIMEOUT)
        .connect(url)
        .await?;
    // Atomic is the store's default mode: the claim, the order and the answer are one
    // transaction.
    let store = PostgresStore::new(pool.clone());
    store.migrate().await?;
    let orders = OrderBook::Postgres(pool);
    orders.create_table().await?;
    eprintln!("orders: storage is PostgreSQL");
    Ok(Opened { api: with_fast_path(state(&orders), store, rollout)?, admin: AdminRoutes::default(), orders })
}

/// PostgreSQL in a build without the `postgres` feature: refuse to start, and say how to fix it.
#[cfg(not(feature = "postgres"))]
async fn open_postgres(
    _url: &str,
    _state: impl FnOnce(&OrderBook) -> AppState,
    _rollout: RolloutSwitch,
) -> Result<Opened, BoxError> {
    Err("DATABASE_URL names a PostgreSQL database, but this build has no PostgreSQL support; \
         build with `--features postgres`: cargo run --features postgres --example orders"
        .into())
}

/// The service over `store`, behind the Redis fast path (a lock and replay cache in front of
/// the store) when `REDIS_URL` is set and the build has the `redis` feature.
fn with_fast_path<St: Store>(state: AppState, store: St, rollout: RolloutSwitch) -> Result<Router, BoxError> {
    #[cfg(feature = "redis")]
    if let Some(url) = std::env::var("REDIS_URL").ok().filter(|url| !url.is_empty()) {
        // Lazy: the service starts, on its database alone, even while Redis is down.
        let fast = tower_idempotency::FastPath::connect(store, &url)?;
        eprintln!("orders: Redis fast path on");
        return Ok(app_with_rollout(state, fast, rollout));
    }
    Ok(app_with_rollout(state, store, rollout))
}
