//! The harness: a fresh database per case, the example's router over it, and what a case
//! sends and reads back.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use serde_json::Value;
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::SqliteConnectOptions;
use tower::ServiceExt;
#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;
use tower_idempotency::recovery::RecoveryReport;
use tower_idempotency::store::{Admin, FinishError};
use tower_idempotency::{
    Begin, BeginRequest, Claim, CouplingMode, Fingerprint, IdempotencyKey, IdempotencyLayer, Outcome, OutcomeClass,
    RecordId, Retention, Scope, SqliteStore, Store, StoredResponse,
};

use crate::cleanup::Cleanup;
use crate::orders::admin::AdminToken;
use crate::orders::api::{AppState, Clock};
use crate::orders::auth::authenticate;
use crate::orders::book::created_at::CreatedAt;
use crate::orders::book::storage::OrderBook;
use crate::orders::cursor::CursorCodec;
use crate::orders::lifecycle::Lifecycle;
use crate::orders::limits::RequestLimits;
use crate::orders::{operator, recovery};
use crate::{ADMIN_TOKEN, CURSOR_SECRET, START_MICROS};

#[derive(Clone, Copy, Debug)]
pub(crate) enum Backend {
    Sqlite,
    #[cfg(feature = "postgres")]
    Postgres,
}

/// A fresh, empty database with the orders table and the idempotency table, as the example
/// creates them on start.
pub(crate) struct TestDb {
    orders: OrderBook,
    place: Place,
    /// Removes the file or schema when the case ends, passed or panicked.
    _cleanup: Cleanup,
}

enum Place {
    SqliteFile,
    #[cfg(feature = "postgres")]
    PostgresSchema(String),
}

/// The PostgreSQL server of the tests.
#[cfg(feature = "postgres")]
fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// `tidem_orders_<pid>_<n>_<nanos>`: no other test of this or any other run uses it.
fn unique_name() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    format!("tidem_orders_{}_{}_{nanos}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

impl TestDb {
    pub(crate) async fn create(backend: Backend) -> Self {
        let db = match backend {
            Backend::Sqlite => {
                let path = std::env::temp_dir().join(format!("{}.db", unique_name()));
                let cleanup = Cleanup::sqlite_file(&path);
                let options = SqliteConnectOptions::new().filename(&path);
                let pool = crate::orders::book::storage::connect_sqlite(options).await.expect("open the SQLite file");
                SqliteStore::new(pool.clone()).migrate().await.expect("migrate the idempotency table");
                Self { orders: OrderBook::Sqlite(pool), place: Place::SqliteFile, _cleanup: cleanup }
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres => {
                let schema = unique_name();
                let cleanup = Cleanup::pg_schema(&schema);
                let options: PgConnectOptions = database_url().parse().expect("DATABASE_URL");
                // Unqualified names (the example's `orders`) land in the test's own schema.
                let options = options.options([("search_path", schema.as_str())]);
                let pool = PgPoolOptions::new()
                    .max_connections(4)
                    .connect_with(options)
                    .await
                    .expect("PostgreSQL must be running for these tests");
                let create = sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\""));
                sqlx::raw_sql(create).execute(&pool).await.expect("create the test schema");
                pg_store(&pool, &schema).migrate().await.expect("migrate the idempotency table");
                Self { orders: OrderBook::Postgres(pool), place: Place::PostgresSchema(schema), _cleanup: cleanup }
            }
        };
        db.orders.create_table().await.expect("create the orders table");
        let _outbox_route = crate::orders::events::start(&db.orders).await.expect("create the outbox table");
        db
    }

    /// The example's public API and its operator listener (with the operator token set, and
    /// without one) over this database, with an atomic idempotency store on it.
    fn routers(&self, state: AppState) -> Routers {
        match (&self.orders, &self.place) {
            (OrderBook::Sqlite(pool), _) => services(state, SqliteStore::new(pool.clone())),
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(pool), Place::PostgresSchema(schema)) => services(state, pg_store(pool, schema)),
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(_), Place::SqliteFile) => unreachable!("a PostgreSQL pool has a schema"),
        }
    }

    /// One pass of the example's recovery worker over this database, configured by `lifecycle`.
    pub(crate) async fn recovery_pass(&self, lifecycle: &Lifecycle) -> RecoveryReport {
        let pass = match (&self.orders, &self.place) {
            (OrderBook::Sqlite(pool), _) => {
                recovery::worker(SqliteStore::new(pool.clone()), lifecycle, None).run_once().await
            }
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(pool), Place::PostgresSchema(schema)) => {
                recovery::worker(pg_store(pool, schema), lifecycle, None).run_once().await
            }
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(_), Place::SqliteFile) => unreachable!("a PostgreSQL pool has a schema"),
        };
        pass.expect("a recovery pass")
    }

    /// Claims `(account, operation, key)` in leased mode on this database's idempotency table and
    /// holds the claim, as a handler still running would; `None` if the identity is taken.
    pub(crate) async fn hold_leased_claim(&self, account: &str, operation: &str, key: &str) -> Option<HeldClaim> {
        let scope = Scope::new(account);
        let id = RecordId::new(&scope, operation, &IdempotencyKey::new(key).expect("a valid key"));
        let fingerprint = Fingerprint::from_parts(1, [7; 32]);
        let request = BeginRequest::new(&id, &fingerprint).labels(&scope, operation).lease(Duration::from_secs(60));
        let begun = match (&self.orders, &self.place) {
            (OrderBook::Sqlite(pool), _) => {
                let store = SqliteStore::new(pool.clone()).mode(CouplingMode::Leased);
                store.begin(request).await.map(|begun| match begun {
                    Begin::Claimed(claim) => Some(HeldClaim::Sqlite(claim)),
                    _ => None,
                })
            }
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(pool), Place::PostgresSchema(schema)) => {
                let store = pg_store(pool, schema).mode(CouplingMode::Leased);
                store.begin(request).await.map(|begun| match begun {
                    Begin::Claimed(claim) => Some(HeldClaim::Postgres(claim)),
                    _ => None,
                })
            }
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(_), Place::SqliteFile) => unreachable!("a PostgreSQL pool has a schema"),
        };
        begun.expect("the store answers")
    }

    /// How many idempotency records exist, in any state.
    pub(crate) async fn idempotency_records(&self) -> i64 {
        self.scalar("SELECT COUNT(*) FROM idempotency_records").await
    }

    pub(crate) async fn scalar(&self, sql: &'static str) -> i64 {
        match &self.orders {
            OrderBook::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql),
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql),
        }
    }

    pub(crate) async fn strings(&self, sql: &'static str) -> Vec<String> {
        match &self.orders {
            OrderBook::Sqlite(pool) => sqlx::query_scalar(sql).fetch_all(pool).await.expect(sql),
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(pool) => sqlx::query_scalar(sql).fetch_all(pool).await.expect(sql),
        }
    }

    /// Runs the statements written for this backend.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) async fn execute(&self, sqlite: &'static str, postgres: &'static str) {
        match &self.orders {
            OrderBook::Sqlite(pool) => {
                sqlx::raw_sql(sqlite).execute(pool).await.expect(sqlite);
            }
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(pool) => {
                sqlx::raw_sql(postgres).execute(pool).await.expect(postgres);
            }
        }
    }

    /// Closes the pool; the guard then deletes the file or schema.
    pub(crate) async fn remove(self) {
        match &self.orders {
            OrderBook::Sqlite(pool) => pool.close().await,
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(pool) => pool.close().await,
        }
    }
}

#[cfg(feature = "postgres")]
fn pg_store(pool: &PgPool, schema: &str) -> PostgresStore {
    PostgresStore::new(pool.clone()).schema(schema).expect("a valid schema name")
}

/// A leased claim held by a test, as by a handler still running.
pub(crate) enum HeldClaim {
    Sqlite(<SqliteStore as Store>::Claim),
    #[cfg(feature = "postgres")]
    Postgres(<PostgresStore as Store>::Claim),
}

impl HeldClaim {
    /// The claim's fencing token.
    pub(crate) fn fencing_token(&self) -> Option<u64> {
        match self {
            Self::Sqlite(claim) => claim.fencing_token(),
            #[cfg(feature = "postgres")]
            Self::Postgres(claim) => claim.fencing_token(),
        }
    }

    /// Finishes the claim with a 201 `done`.
    pub(crate) async fn complete(self) -> Result<(), FinishError> {
        let outcome = Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "done"));
        match self {
            Self::Sqlite(claim) => claim.finish(outcome).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(claim) => claim.finish(outcome).await,
        }
    }
}

/// The operation of the tests' own route whose handler marks its outcome unknown.
pub(crate) const UNKNOWN_OPERATION: &str = "test.unknown";

struct Routers {
    api: Router,
    admin: Router,
    admin_off: Router,
}

/// The example's API (plus `POST /test/unknown`) and operator routes over `store`, as the
/// example's start-up assembles them.
fn services<St: Store + Admin>(state: AppState, store: St) -> Routers {
    let retention = state.lifecycle.retention();
    let unknown = unknown_route(store.clone(), retention);
    let api = crate::orders::api::app(state, store.clone()).merge(unknown);
    let operator = || operator::routes(store.clone(), retention);
    Routers {
        api,
        admin: operator().into_router(AdminToken::new(Some(ADMIN_TOKEN))),
        admin_off: operator().into_router(AdminToken::new(None)),
    }
}

/// `POST /test/unknown` (authenticated like the example's routes, operation
/// [`UNKNOWN_OPERATION`]): its handler answers 504, marked as an unknown outcome, as one whose
/// downstream call timed out after it was sent would.
fn unknown_route<St: Store>(store: St, retention: Retention) -> Router {
    let layer = IdempotencyLayer::new(store).operation(UNKNOWN_OPERATION).retention(retention);
    let handler = || async {
        let mut response = (StatusCode::GATEWAY_TIMEOUT, "the downstream did not answer in time").into_response();
        response.extensions_mut().insert(OutcomeClass::Unknown);
        response
    };
    Router::new().route("/test/unknown", post(handler).layer(layer)).layer(middleware::from_fn(authenticate))
}

/// The example's routers over a fresh order book and idempotency store.
pub(crate) struct Orders {
    router: Router,
    admin: Router,
    admin_off: Router,
}

/// What came back: status, headers and the body's exact bytes.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Orders {
    /// A clock that moves one microsecond per order.
    pub(crate) fn new(db: &TestDb) -> Self {
        let now = Arc::new(AtomicI64::new(START_MICROS));
        Self::with_clock(db, Arc::new(move || CreatedAt::from_unix_micros(now.fetch_add(1, Ordering::SeqCst))))
    }

    /// A clock that gives the same `created_at` to each run of three orders.
    pub(crate) fn with_ties_of_three(db: &TestDb) -> Self {
        let calls = Arc::new(AtomicI64::new(0));
        Self::with_clock(
            db,
            Arc::new(move || CreatedAt::from_unix_micros(START_MICROS + calls.fetch_add(1, Ordering::SeqCst) / 3)),
        )
    }

    /// A clock that moves one microsecond per order, and records kept as `lifecycle` says.
    pub(crate) fn with_lifecycle(db: &TestDb, lifecycle: Lifecycle) -> Self {
        let now = Arc::new(AtomicI64::new(START_MICROS));
        let clock: Clock = Arc::new(move || CreatedAt::from_unix_micros(now.fetch_add(1, Ordering::SeqCst)));
        Self::with(db, clock, lifecycle)
    }

    fn with_clock(db: &TestDb, clock: Clock) -> Self {
        Self::with(db, clock, Lifecycle::default())
    }

    fn with(db: &TestDb, clock: Clock, lifecycle: Lifecycle) -> Self {
        let state = AppState {
            orders: db.orders.clone(),
            cursors: CursorCodec::new(CURSOR_SECRET),
            clock,
            limits: RequestLimits::default(),
            lifecycle,
        };
        let Routers { api, admin, admin_off } = db.routers(state);
        Self { router: api, admin, admin_off }
    }

    /// A request to the operator listener, with the operator token.
    pub(crate) async fn operator(&self, method: &str, uri: &str, body: Option<&str>) -> Answer {
        self.operator_as(Some(&format!("Bearer {ADMIN_TOKEN}")), method, uri, body).await
    }

    /// A request to the operator listener with `authorization` (or none).
    pub(crate) async fn operator_as(
        &self,
        authorization: Option<&str>,
        method: &str,
        uri: &str,
        body: Option<&str>,
    ) -> Answer {
        send(&self.admin, admin_request(authorization, method, uri, body)).await
    }

    /// A request to an operator listener started without `ORDERS_ADMIN_TOKEN`.
    pub(crate) async fn operator_without_token(&self, authorization: Option<&str>, method: &str, uri: &str) -> Answer {
        send(&self.admin_off, admin_request(authorization, method, uri, None)).await
    }

    /// `POST /test/unknown` as `account` with `key`: 504, its outcome marked unknown.
    pub(crate) async fn post_unknown(&self, account: &str, key: &str) -> Answer {
        let request = Request::post("/test/unknown")
            .header("authorization", format!("Bearer {account}"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .expect("a valid request");
        self.send(request).await
    }

    pub(crate) async fn send(&self, request: Request<Body>) -> Answer {
        send(&self.router, request).await
    }

    pub(crate) async fn post(&self, account: Option<&str>, key: Option<&str>, body: &str) -> Answer {
        let mut request = Request::post("/orders").header("content-type", "application/json");
        if let Some(account) = account {
            request = request.header("authorization", format!("Bearer {account}"));
        }
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        self.send(request.body(Body::from(body.to_owned())).expect("a valid request")).await
    }

    pub(crate) async fn create(&self, account: &str, key: &str, body: &str) -> Answer {
        let answer = self.post(Some(account), Some(key), body).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
        answer
    }

    pub(crate) async fn get(&self, account: &str, uri: &str) -> Answer {
        let request = Request::get(uri).header("authorization", format!("Bearer {account}"));
        self.send(request.body(Body::empty()).expect("a valid request")).await
    }

    pub(crate) async fn list(&self, account: &str, uri: &str) -> Value {
        let answer = self.get(account, uri).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        answer.json()
    }

    /// Follows `next_cursor` from the first page to the last; every order, in page order.
    pub(crate) async fn walk(&self, account: &str, limit: usize) -> Vec<Value> {
        let mut all = Vec::new();
        let mut uri = format!("/orders?limit={limit}");
        loop {
            let page = self.list(account, &uri).await;
            let orders = page["orders"].as_array().expect("orders is an array").clone();
            assert!(orders.len() <= limit);
            all.extend(orders);
            match page["next_cursor"].as_str() {
                Some(cursor) => uri = format!("/orders?limit={limit}&cursor={cursor}"),
                None => return all,
            }
        }
    }
}

async fn send(router: &Router, request: Request<Body>) -> Answer {
    let response = router.clone().oneshot(request).await.expect("the router is infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("the body is readable").to_bytes();
    Answer { status: parts.status, headers: parts.headers, body }
}

fn admin_request(authorization: Option<&str>, method: &str, uri: &str, body: Option<&str>) -> Request<Body> {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(authorization) = authorization {
        request = request.header("authorization", authorization);
    }
    if body.is_some() {
        request = request.header("content-type", "application/json");
    }
    request.body(body.map(|body| Body::from(body.to_owned())).unwrap_or_default()).expect("a valid request")
}

impl Answer {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|value| value.to_str().expect("an ASCII header"))
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    /// Asserts an RFC 9457 problem with `status` and `code`, and returns its `detail`.
    pub(crate) fn assert_problem(&self, status: StatusCode, code: &str) -> String {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(self.header("content-type"), Some("application/problem+json"));
        let problem = self.json();
        assert_eq!(problem["code"], code, "{problem}");
        assert_eq!(problem["status"], status.as_u16());
        assert!(problem["type"].as_str().is_some_and(|t| t.ends_with(code)), "{problem}");
        assert!(problem["title"].as_str().is_some_and(|t| !t.is_empty()), "{problem}");
        let detail = problem["detail"].as_str().expect("a detail").to_owned();
        assert!(!detail.is_empty());
        detail
    }
}

pub(crate) fn order_body(sku: &str, amount_minor: &str) -> String {
    format!(r#"{{"sku":"{sku}","quantity":2,"amount_minor":{amount_minor},"currency":"JPY"}}"#)
}

pub(crate) fn ids(orders: &[Value]) -> Vec<String> {
    orders.iter().map(|order| order["order_id"].as_str().expect("an order id").to_owned()).collect()
}

pub(crate) fn order_id(answer: &Answer) -> String {
    answer.json()["order_id"].as_str().expect("an order id").to_owned()
}

pub(crate) fn flip_char_at(text: &str, index: usize) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    chars[index] = if chars[index] == 'A' { 'B' } else { 'A' };
    chars.into_iter().collect()
}
