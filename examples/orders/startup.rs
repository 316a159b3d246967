//! Start-up: opens the database `DATABASE_URL` names, creates what is missing, and assembles
//! the service over an atomic idempotency store on that same database: the public API, the
//! operator routes and the recovery worker (with the crash drill's leased route when it is on).

use std::str::FromStr;

use axum::Router;
#[cfg(feature = "postgres")]
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqliteConnectOptions;
#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;
use tower_idempotency::store::Admin;
use tower_idempotency::{BoxError, CouplingMode, RolloutSwitch, SqliteStore, Store};

use super::admin::AdminRoutes;
use super::api::{AppState, Clock, app_with_rollout};
use super::book::storage::{DEFAULT_SQLITE_FILE, OrderBook, connect_sqlite};
use super::cursor::CursorCodec;
use super::drill::DrillMode;
use super::lifecycle::Lifecycle;
use super::limits::RequestLimits;
use super::payments::{self, PaymentSettings};
use super::recovery::{self, Recovery};
use super::{drill, operator};

/// What start-up assembles: the public API, the operator listener's routes, the order book and
/// the recovery worker.
pub(crate) struct Opened {
    /// The public API (`ORDERS_ADDR`).
    pub(crate) api: Router,
    /// The routes of the operator listener (`ORDERS_ADMIN_ADDR`).
    pub(crate) admin: AdminRoutes,
    /// The orders, closed on shutdown.
    pub(crate) orders: OrderBook,
    /// The recovery worker, run until shutdown.
    pub(crate) recovery: Recovery,
    /// The payment records' recovery worker and its period, when payments are on.
    pub(crate) payments: Option<(Recovery, std::time::Duration)>,
}

/// What the service is made of besides its database.
pub(crate) struct Settings {
    /// Signs pagination cursors.
    pub(crate) cursors: CursorCodec,
    /// The limits on request bodies.
    pub(crate) limits: RequestLimits,
    /// Retention and the recovery worker's period.
    pub(crate) lifecycle: Lifecycle,
    /// The crash drill's leased route, if on (`ORDERS_CRASH_DRILL`).
    pub(crate) drill: Option<DrillMode>,
    /// Where `created_at` comes from.
    pub(crate) clock: Clock,
    /// The payment provider and the payment route's settings.
    pub(crate) payments: PaymentSettings,
    /// The idempotency layer's mode and cohort on `POST /orders` (`ORDERS_IDEMPOTENCY_MODE`,
    /// `ORDERS_IDEMPOTENCY_COHORT`; see `rollout.rs`), and what the operator routes change.
    pub(crate) rollout: RolloutSwitch,
}

/// Opens the database `database_url` names (see *Storage* in `main.rs`), creates what is
/// missing, and returns the service with its order book.
pub(crate) async fn open(database_url: Option<&str>, settings: Settings) -> Result<Opened, BoxError> {
    match database_url {
        None => open_sqlite(SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE), settings).await,
        Some(url) if url.starts_with("sqlite:") => open_sqlite(SqliteConnectOptions::from_str(url)?, settings).await,
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            open_postgres(url, settings).await
        }
        // Not echoed: the URL may carry a password.
        Some(_) => Err("DATABASE_URL must start with sqlite:, postgres:// or postgresql://".into()),
    }
}

/// SQLite: the file of `options`, created if missing.
async fn open_sqlite(options: SqliteConnectOptions, settings: Settings) -> Result<Opened, BoxError> {
    eprintln!("orders: storage is SQLite, {}", options.get_filename().display());
    let pool = connect_sqlite(options).await?;
    // One store per database, cloned wherever it is needed: the SQLite store keeps the
    // in-process gate that tells a duplicate in flight from a busy database.
    let store = SqliteStore::new(pool.clone());
    store.migrate().await?;
    let orders = OrderBook::Sqlite(pool);
    orders.create_table().await?;
    let leased = store.clone().mode(CouplingMode::Leased);
    let worker = recovery::worker(leased.clone(), &settings.lifecycle, reconciled_drill(&settings, &orders));
    let payments = payments::worker(leased.clone(), &orders, &settings.lifecycle, &settings.payments);
    let recovery = (Recovery::Sqlite(worker), payments.map(Recovery::Sqlite));
    assemble(orders, store, leased, settings, recovery).await
}

/// PostgreSQL: the existing database `url` names.
#[cfg(feature = "postgres")]
async fn open_postgres(url: &str, settings: Settings) -> Result<Opened, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(super::book::storage::POOL_ACQUIRE_TIMEOUT)
        .connect(url)
        .await?;
    // Atomic is the store's default mode: the claim, the order and the answer are one
    // transaction.
    let store = PostgresStore::new(pool.clone());
    let store = match answers_apart(std::env::var("ORDERS_ANSWERS_APART").ok().as_deref())? {
        true => store.answers_apart(),
        false => store,
    };
    store.migrate().await?;
    let orders = OrderBook::Postgres(pool);
    orders.create_table().await?;
    eprintln!("orders: storage is PostgreSQL");
    let leased = store.clone().mode(CouplingMode::Leased);
    let worker = recovery::worker(leased.clone(), &settings.lifecycle, reconciled_drill(&settings, &orders));
    let payments = payments::worker(leased.clone(), &orders, &settings.lifecycle, &settings.payments);
    let recovery = (Recovery::Postgres(worker), payments.map(Recovery::Postgres));
    assemble(orders, store, leased, settings, recovery).await
}

/// `ORDERS_ANSWERS_APART` (default `false`; `true` or `false`), given as `value`: whether the
/// PostgreSQL store keeps its answers in a table of their own (`PostgresStore::answers_apart`).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
fn answers_apart(value: Option<&str>) -> Result<bool, BoxError> {
    match value.map(str::trim) {
        None | Some("") | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(text) => Err(format!("ORDERS_ANSWERS_APART must be true or false, got {text:?}").into()),
    }
}

/// The order book whose drill effects the recovery worker reconciles, if the drill is on and
/// reconciled.
fn reconciled_drill<'a>(settings: &Settings, orders: &'a OrderBook) -> Option<&'a OrderBook> {
    (settings.drill == Some(DrillMode::Reconciled)).then_some(orders)
}

/// The service over the atomic `store` of `orders`' database, and the leased routes (the
/// payments; the drill's, when it is on) over the `leased` store of the same database.
async fn assemble<St: Store + Admin, L: Store + Admin>(
    orders: OrderBook,
    store: St,
    leased: L,
    settings: Settings,
    (recovery, payments_recovery): (Recovery, Option<Recovery>),
) -> Result<Opened, BoxError> {
    let Settings { cursors, limits, lifecycle, drill, clock, payments, rollout } = settings;
    let state = AppState { orders: orders.clone(), cursors, limits, lifecycle, clock };
    let (mut api, mut admin) = with_fast_path(state, store, rollout.clone())?;
    admin = admin.merge(super::rollout::routes(rollout));
    admin.operator = admin.operator.merge(super::events::start(&orders).await?);
    payments::create_table(&orders).await?;
    api = api.merge(payments::routes(orders.clone(), leased.clone(), &lifecycle, &payments));
    admin.operator = admin.operator.merge(payments::operator_routes(orders.clone(), leased.clone(), &lifecycle));
    if payments.provider.is_some() {
        eprintln!("orders: payments on (idempotent provider: {})", payments.idempotent);
    }
    let payments_recovery = payments_recovery.map(|worker| (worker, payments.reconcile_every));
    if let Some(mode) = drill {
        drill::create_table(&orders).await?;
        api = api.merge(drill::routes(orders.clone(), leased, &lifecycle, mode));
        eprintln!("orders: crash drill on (POST /drill/effects, {mode:?})");
    }
    Ok(Opened { api, admin, orders, recovery, payments: payments_recovery })
}

/// PostgreSQL in a build without the `postgres` feature: refuse to start, and say how to fix it.
#[cfg(not(feature = "postgres"))]
async fn open_postgres(_url: &str, _settings: Settings) -> Result<Opened, BoxError> {
    Err("DATABASE_URL names a PostgreSQL database, but this build has no PostgreSQL support; \
         build with `--features postgres`: cargo run --features postgres --example orders"
        .into())
}

/// The public API and the operator routes over `store`, behind the Redis fast path (a lock and
/// replay cache in front of the store) when `REDIS_URL` is set and the build has the `redis`
/// feature. The operator routes go through the fast path too, so that a record they change is
/// never replayed from a stale cached copy.
fn with_fast_path<St: Store + Admin>(
    state: AppState,
    store: St,
    rollout: RolloutSwitch,
) -> Result<(Router, AdminRoutes), BoxError> {
    #[cfg(feature = "redis")]
    if let Some(url) = std::env::var("REDIS_URL").ok().filter(|url| !url.is_empty()) {
        // Lazy: the service starts, on its database alone, even while Redis is down.
        let fast = tower_idempotency::FastPath::connect(store, &url)?;
        eprintln!("orders: Redis fast path on");
        return Ok(services(state, fast, rollout));
    }
    Ok(services(state, store, rollout))
}

/// The public API (`POST /orders` in the mode and cohort of `rollout`) and the operator routes
/// over one store.
fn services<St: Store + Admin>(state: AppState, store: St, rollout: RolloutSwitch) -> (Router, AdminRoutes) {
    let retention = state.lifecycle.retention();
    let admin = operator::routes(store.clone(), retention);
    (app_with_rollout(state, store, rollout), admin)
}

#[cfg(test)]
mod tests {
    use super::answers_apart;

    #[test]
    fn answers_apart_is_true_or_false() {
        assert!(!answers_apart(None).unwrap());
        assert!(!answers_apart(Some("")).unwrap());
        assert!(!answers_apart(Some("false")).unwrap());
        assert!(answers_apart(Some(" true ")).unwrap());
        let error = answers_apart(Some("yes")).unwrap_err().to_string();
        assert!(error.starts_with("ORDERS_ANSWERS_APART"), "{error}");
    }
}
