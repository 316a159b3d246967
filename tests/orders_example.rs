//! The orders example (`examples/orders/`), driven in process through its router, on both of
//! its databases: every case runs once on SQLite (`sqlite::…`, a fresh file in the temp
//! directory) and, with the `postgres` feature, once on PostgreSQL (`postgres::…`, a fresh
//! schema on the server that `DATABASE_URL` names, default
//! `postgres://postgres@127.0.0.1:5432/test`). `cargo test --all-features` runs both.
#![cfg(all(feature = "axum", feature = "sqlite"))]

/// The orders example's modules, all but its `main.rs` and start-up (the tests build the
/// router themselves, with a clock of their own).
#[path = "../examples/orders"]
#[allow(dead_code, reason = "what only start-up or the gRPC example uses goes unused here")]
mod orders {
    pub mod api;
    mod auth;
    pub mod book;
    mod create_request;
    pub mod cursor;
    mod problem;
}

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::SqliteConnectOptions;
use tower::ServiceExt;
#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;
use tower_idempotency::SqliteStore;

use orders::api::{AppState, Clock};
use orders::book::account::Account;
use orders::book::created_at::CreatedAt;
use orders::book::storage::{OrderBook, PagePosition};
use orders::cursor::{CursorCodec, account_digest};

const CURSOR_SECRET: &[u8] = b"orders example test cursor secret";
/// 2025-01-02T03:04:05.000006Z
const START_MICROS: i64 = 1_735_787_045_000_006;
const ALICE: &str = "acct_alice";
const BOB: &str = "acct_bob";

// ---------------------------------------------------------------------------------------------
// Every case on every backend
// ---------------------------------------------------------------------------------------------

/// Stamps out, for each case, one test on SQLite and (with the `postgres` feature) one on
/// PostgreSQL. Each gets a database of its own, removed when the case passes (kept for a look
/// when it fails).
macro_rules! on_every_backend {
    ($($case:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $case() {
                    let db = crate::TestDb::create(crate::Backend::Sqlite).await;
                    crate::$case(&db).await;
                    db.remove().await;
                }
            )+
        }

        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test]
                async fn $case() {
                    let db = crate::TestDb::create(crate::Backend::Postgres).await;
                    crate::$case(&db).await;
                    db.remove().await;
                }
            )+
        }
    };
}

on_every_backend!(
    request_without_authorization_is_401_and_stores_nothing_so_the_key_still_executes_later,
    malformed_authorization_is_401_on_every_route,
    bearer_scheme_is_case_insensitive_and_64_character_accounts_are_accepted,
    create_answers_201_with_location_json_and_the_order,
    retry_with_same_key_and_body_replays_the_first_answer_and_creates_one_order,
    same_key_with_a_different_body_is_422_idempotency_key_reused,
    missing_idempotency_key_is_400_idempotency_key_missing_and_creates_nothing,
    invalid_input_is_422_validation_failed_and_a_corrected_retry_with_the_same_key_executes,
    every_kind_of_invalid_order_is_422_validation_failed_naming_the_problem,
    a_body_not_declared_as_json_is_415,
    amounts_beyond_f64_and_u64_are_preserved_exactly,
    amounts_that_differ_beyond_f64_precision_under_different_keys_are_different_orders,
    key_reused_with_an_amount_that_differs_beyond_f64_precision_is_422_idempotency_key_reused,
    two_accounts_using_the_same_key_get_separate_orders,
    another_accounts_order_an_unknown_id_and_a_malformed_id_are_the_same_404,
    get_routes_are_not_guarded_by_the_idempotency_layer,
    pages_of_ten_return_all_25_orders_once_newest_first_with_ties_broken_by_order_id,
    the_last_page_has_a_null_next_cursor_even_when_it_is_exactly_full,
    the_default_page_is_20_orders,
    an_order_created_between_page_fetches_neither_repeats_nor_skips_older_orders,
    a_tampered_cursor_is_400_invalid_cursor,
    another_accounts_cursor_is_400_invalid_cursor,
    a_cursor_of_another_version_or_signed_with_another_secret_is_400_invalid_cursor,
    limit_out_of_range_or_not_a_number_is_400_invalid_limit_and_a_repeated_limit_is_400_invalid_query,
    create_writes_the_order_and_the_stored_answer_in_one_transaction,
);

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    #[cfg(feature = "postgres")]
    Postgres,
}

/// A fresh, empty database with the orders table and the idempotency table, as the example
/// creates them on start.
struct TestDb {
    orders: OrderBook,
    place: Place,
}

enum Place {
    SqliteFile(PathBuf),
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
    async fn create(backend: Backend) -> Self {
        let db = match backend {
            Backend::Sqlite => {
                let path = std::env::temp_dir().join(format!("{}.db", unique_name()));
                let options = SqliteConnectOptions::new().filename(&path);
                let pool = orders::book::storage::connect_sqlite(options).await.expect("open the SQLite file");
                SqliteStore::new(pool.clone()).migrate().await.expect("migrate the idempotency table");
                Self { orders: OrderBook::Sqlite(pool), place: Place::SqliteFile(path) }
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres => {
                let schema = unique_name();
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
                Self { orders: OrderBook::Postgres(pool), place: Place::PostgresSchema(schema) }
            }
        };
        db.orders.create_table().await.expect("create the orders table");
        db
    }

    /// The example's router over this database, with an atomic idempotency store on it.
    fn router(&self, state: AppState) -> Router {
        match (&self.orders, &self.place) {
            (OrderBook::Sqlite(pool), _) => orders::api::app(state, SqliteStore::new(pool.clone())),
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(pool), Place::PostgresSchema(schema)) => {
                orders::api::app(state, pg_store(pool, schema))
            }
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(_), Place::SqliteFile(_)) => unreachable!("a PostgreSQL pool has a schema"),
        }
    }

    /// How many idempotency records exist, in any state.
    async fn idempotency_records(&self) -> i64 {
        self.scalar("SELECT COUNT(*) FROM idempotency_records").await
    }

    async fn scalar(&self, sql: &'static str) -> i64 {
        match &self.orders {
            OrderBook::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql),
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql),
        }
    }

    async fn strings(&self, sql: &'static str) -> Vec<String> {
        match &self.orders {
            OrderBook::Sqlite(pool) => sqlx::query_scalar(sql).fetch_all(pool).await.expect(sql),
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(pool) => sqlx::query_scalar(sql).fetch_all(pool).await.expect(sql),
        }
    }

    /// Runs the statements written for this backend.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    async fn execute(&self, sqlite: &'static str, postgres: &'static str) {
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

    /// Closes the pool and deletes the file or schema.
    async fn remove(self) {
        match (&self.orders, &self.place) {
            (OrderBook::Sqlite(pool), Place::SqliteFile(path)) => {
                pool.close().await;
                remove_sqlite_files(path);
            }
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(pool), Place::PostgresSchema(schema)) => {
                let drop = sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE"));
                sqlx::raw_sql(drop).execute(pool).await.expect("drop the test schema");
                pool.close().await;
            }
            #[cfg(feature = "postgres")]
            _ => unreachable!("a pool and its place match"),
        }
    }
}

#[cfg(feature = "postgres")]
fn pg_store(pool: &PgPool, schema: &str) -> PostgresStore {
    PostgresStore::new(pool.clone()).schema(schema).expect("a valid schema name")
}

fn remove_sqlite_files(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

/// The example's router over a fresh order book and idempotency store.
struct Orders {
    router: Router,
}

/// What came back: status, headers and the body's exact bytes.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Orders {
    /// A clock that moves one microsecond per order.
    fn new(db: &TestDb) -> Self {
        let now = Arc::new(AtomicI64::new(START_MICROS));
        Self::with_clock(db, Arc::new(move || CreatedAt::from_unix_micros(now.fetch_add(1, Ordering::SeqCst))))
    }

    /// A clock that gives the same `created_at` to each run of three orders.
    fn with_ties_of_three(db: &TestDb) -> Self {
        let calls = Arc::new(AtomicI64::new(0));
        Self::with_clock(
            db,
            Arc::new(move || CreatedAt::from_unix_micros(START_MICROS + calls.fetch_add(1, Ordering::SeqCst) / 3)),
        )
    }

    fn with_clock(db: &TestDb, clock: Clock) -> Self {
        let state = AppState { orders: db.orders.clone(), cursors: CursorCodec::new(CURSOR_SECRET), clock };
        Self { router: db.router(state) }
    }

    async fn send(&self, request: Request<Body>) -> Answer {
        let response = self.router.clone().oneshot(request).await.expect("the router is infallible");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("the body is readable").to_bytes();
        Answer { status: parts.status, headers: parts.headers, body }
    }

    async fn post(&self, account: Option<&str>, key: Option<&str>, body: &str) -> Answer {
        let mut request = Request::post("/orders").header("content-type", "application/json");
        if let Some(account) = account {
            request = request.header("authorization", format!("Bearer {account}"));
        }
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        self.send(request.body(Body::from(body.to_owned())).expect("a valid request")).await
    }

    async fn create(&self, account: &str, key: &str, body: &str) -> Answer {
        let answer = self.post(Some(account), Some(key), body).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
        answer
    }

    async fn get(&self, account: &str, uri: &str) -> Answer {
        let request = Request::get(uri).header("authorization", format!("Bearer {account}"));
        self.send(request.body(Body::empty()).expect("a valid request")).await
    }

    async fn list(&self, account: &str, uri: &str) -> Value {
        let answer = self.get(account, uri).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        answer.json()
    }

    /// Follows `next_cursor` from the first page to the last; every order, in page order.
    async fn walk(&self, account: &str, limit: usize) -> Vec<Value> {
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

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|value| value.to_str().expect("an ASCII header"))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    /// Asserts an RFC 9457 problem with `status` and `code`, and returns its `detail`.
    fn assert_problem(&self, status: StatusCode, code: &str) -> String {
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

fn order_body(sku: &str, amount_minor: &str) -> String {
    format!(r#"{{"sku":"{sku}","quantity":2,"amount_minor":{amount_minor},"currency":"JPY"}}"#)
}

fn ids(orders: &[Value]) -> Vec<String> {
    orders.iter().map(|order| order["order_id"].as_str().expect("an order id").to_owned()).collect()
}

fn order_id(answer: &Answer) -> String {
    answer.json()["order_id"].as_str().expect("an order id").to_owned()
}

fn flip_char_at(text: &str, index: usize) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    chars[index] = if chars[index] == 'A' { 'B' } else { 'A' };
    chars.into_iter().collect()
}

// ---------------------------------------------------------------------------------------------
// Authentication
// ---------------------------------------------------------------------------------------------

async fn request_without_authorization_is_401_and_stores_nothing_so_the_key_still_executes_later(db: &TestDb) {
    let service = Orders::new(db);
    let body = order_body("book", "100");

    let refused = service.post(None, Some("key-1"), &body).await;
    refused.assert_problem(StatusCode::UNAUTHORIZED, "unauthenticated");
    assert_eq!(refused.header("www-authenticate"), Some("Bearer realm=\"orders\""));
    assert_eq!(db.idempotency_records().await, 0, "a refused request must leave no idempotency record");

    let created = service.create(ALICE, "key-1", &body).await;
    assert_eq!(created.header("idempotent-replayed"), None, "the key must execute, not replay");
}

async fn malformed_authorization_is_401_on_every_route(db: &TestDb) {
    let service = Orders::new(db);
    let too_long = format!("Bearer {}", "a".repeat(65));
    for authorization in ["Basic YWxpY2U6cHc=", "Bearer", "Bearer ", "Bearer two words", "acct_alice", &too_long] {
        for (method, uri) in [("POST", "/orders"), ("GET", "/orders"), ("GET", "/orders/whatever")] {
            let request = Request::builder()
                .method(method)
                .uri(uri)
                .header("authorization", authorization)
                .header("idempotency-key", "key-1")
                .header("content-type", "application/json")
                .body(Body::from(order_body("book", "1")))
                .expect("a valid request");
            service.send(request).await.assert_problem(StatusCode::UNAUTHORIZED, "unauthenticated");
        }
    }
    assert_eq!(db.idempotency_records().await, 0);
}

async fn bearer_scheme_is_case_insensitive_and_64_character_accounts_are_accepted(db: &TestDb) {
    let service = Orders::new(db);
    let account = "a".repeat(64);
    let request = Request::get("/orders")
        .header("authorization", format!("bearer {account}"))
        .body(Body::empty())
        .expect("a valid request");
    assert_eq!(service.send(request).await.status, StatusCode::OK);
}

// ---------------------------------------------------------------------------------------------
// Create and replay
// ---------------------------------------------------------------------------------------------

async fn create_answers_201_with_location_json_and_the_order(db: &TestDb) {
    let service = Orders::new(db);
    let created = service.create(ALICE, "key-1", &order_body("book-42", "1500")).await;

    assert_eq!(created.header("content-type"), Some("application/json"));
    let order = created.json();
    let id = order["order_id"].as_str().expect("an order id");
    assert!(uuid::Uuid::try_parse(id).is_ok_and(|uuid| uuid.get_version_num() == 4), "{id}");
    assert_eq!(created.header("location"), Some(format!("/orders/{id}").as_str()));
    assert_eq!(order["account_id"], ALICE);
    assert_eq!(order["sku"], "book-42");
    assert_eq!(order["quantity"], 2);
    assert_eq!(order["amount_minor"], 1500);
    assert_eq!(order["currency"], "JPY");
    assert_eq!(order["created_at"], "2025-01-02T03:04:05.000006Z");
    assert!(order["idempotency_operation_id"].as_str().is_some_and(|op| op.len() == 36), "{order}");

    let read = service.get(ALICE, &format!("/orders/{id}")).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.header("content-type"), Some("application/json"));
    assert_eq!(read.body, created.body, "GET answers the same order document");
}

async fn retry_with_same_key_and_body_replays_the_first_answer_and_creates_one_order(db: &TestDb) {
    let service = Orders::new(db);
    let body = order_body("book", "100");
    let first = service.create(ALICE, "key-1", &body).await;
    let retry = service.post(Some(ALICE), Some("key-1"), &body).await;

    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body, "the replay is byte for byte");
    assert_eq!(retry.header("location"), first.header("location"));
    assert_eq!(retry.header("content-type"), first.header("content-type"));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.header("idempotent-replayed"), None);

    let listed = service.list(ALICE, "/orders").await;
    assert_eq!(ids(listed["orders"].as_array().expect("orders")), vec![order_id(&first)]);
}

async fn same_key_with_a_different_body_is_422_idempotency_key_reused(db: &TestDb) {
    let service = Orders::new(db);
    service.create(ALICE, "key-1", &order_body("book", "100")).await;
    let reused = service.post(Some(ALICE), Some("key-1"), &order_body("pen", "100")).await;
    reused.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused");
    assert_eq!(service.list(ALICE, "/orders").await["orders"].as_array().map(Vec::len), Some(1));
}

async fn missing_idempotency_key_is_400_idempotency_key_missing_and_creates_nothing(db: &TestDb) {
    let service = Orders::new(db);
    let refused = service.post(Some(ALICE), None, &order_body("book", "100")).await;
    refused.assert_problem(StatusCode::BAD_REQUEST, "idempotency_key_missing");
    assert_eq!(service.list(ALICE, "/orders").await["orders"], serde_json::json!([]));
}

async fn invalid_input_is_422_validation_failed_and_a_corrected_retry_with_the_same_key_executes(db: &TestDb) {
    let service = Orders::new(db);
    let invalid = service.post(Some(ALICE), Some("key-1"), &order_body("book", "-100")).await;
    let detail = invalid.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed");
    assert!(detail.contains("amount_minor"), "{detail}");
    assert_eq!(invalid.header("idempotent-replayed"), None);

    let corrected = service.create(ALICE, "key-1", &order_body("book", "100")).await;
    assert_eq!(corrected.header("idempotent-replayed"), None, "the 422 was released, not stored");
    assert_eq!(corrected.json()["amount_minor"], 100);
}

async fn every_kind_of_invalid_order_is_422_validation_failed_naming_the_problem(db: &TestDb) {
    let service = Orders::new(db);
    let cases = [
        ("not json", "JSON object"),
        (r#"["a",1,1,"JPY"]"#, "JSON object"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"JPY""#, "not a valid order"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1}"#, "currency"),
        (r#"{"quantity":1,"amount_minor":1,"currency":"JPY"}"#, "sku"),
        (r#"{"sku":"","quantity":1,"amount_minor":1,"currency":"JPY"}"#, "sku"),
        (r#"{"sku":"a\u0007","quantity":1,"amount_minor":1,"currency":"JPY"}"#, "sku"),
        (r#"{"sku":1,"quantity":1,"amount_minor":1,"currency":"JPY"}"#, "invalid type"),
        (r#"{"sku":"a","quantity":0,"amount_minor":1,"currency":"JPY"}"#, "quantity"),
        (r#"{"sku":"a","quantity":-3,"amount_minor":1,"currency":"JPY"}"#, "quantity"),
        (r#"{"sku":"a","quantity":1.5,"amount_minor":1,"currency":"JPY"}"#, "invalid type"),
        (r#"{"sku":"a","quantity":"1","amount_minor":1,"currency":"JPY"}"#, "invalid type"),
        (r#"{"sku":"a","quantity":1,"amount_minor":-1,"currency":"JPY"}"#, "negative"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1.5,"currency":"JPY"}"#, "fraction"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1.0,"currency":"JPY"}"#, "fraction"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1e3,"currency":"JPY"}"#, "exponent"),
        (r#"{"sku":"a","quantity":1,"amount_minor":"100","currency":"JPY"}"#, "not a string"),
        (r#"{"sku":"a","quantity":1,"amount_minor":null,"currency":"JPY"}"#, "amount_minor"),
        (r#"{"sku":"a","quantity":1,"amount_minor":007,"currency":"JPY"}"#, "not a valid order"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"jpy"}"#, "currency"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"JPYY"}"#, "currency"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"JPY","note":"x"}"#, "unknown field"),
        (r#"{"sku":"a","sku":"b","quantity":1,"amount_minor":1,"currency":"JPY"}"#, "duplicate field"),
    ];
    for (index, (body, expected)) in cases.iter().enumerate() {
        let answer = service.post(Some(ALICE), Some(&format!("key-{index}")), body).await;
        let detail = answer.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed");
        assert!(detail.contains(expected), "{body}: {detail:?} should mention {expected:?}");
    }
    assert_eq!(service.list(ALICE, "/orders").await["orders"], serde_json::json!([]));
    assert_eq!(db.idempotency_records().await, 0, "every 422 was released");
}

async fn a_body_not_declared_as_json_is_415(db: &TestDb) {
    let service = Orders::new(db);
    let request = Request::post("/orders")
        .header("authorization", format!("Bearer {ALICE}"))
        .header("idempotency-key", "key-1")
        .header("content-type", "text/plain")
        .body(Body::from(order_body("book", "1")))
        .expect("a valid request");
    service.send(request).await.assert_problem(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");
}

// ---------------------------------------------------------------------------------------------
// Exact amounts
// ---------------------------------------------------------------------------------------------

async fn amounts_beyond_f64_and_u64_are_preserved_exactly(db: &TestDb) {
    let service = Orders::new(db);
    for (key, amount) in [("key-1", "9007199254740993"), ("key-2", "123456789012345678901234567890"), ("key-3", "0")] {
        let created = service.create(ALICE, key, &order_body("book", amount)).await;
        let expected = format!(r#""amount_minor":{amount},"#);
        assert!(created.text().contains(&expected), "{}", created.text());
        let read = service.get(ALICE, created.header("location").expect("a location")).await;
        assert!(read.text().contains(&expected), "{}", read.text());
    }
}

async fn amounts_that_differ_beyond_f64_precision_under_different_keys_are_different_orders(db: &TestDb) {
    let service = Orders::new(db);
    let odd = service.create(ALICE, "key-1", &order_body("book", "9007199254740993")).await;
    let even = service.create(ALICE, "key-2", &order_body("book", "9007199254740992")).await;
    assert_eq!(even.header("idempotent-replayed"), None);
    assert_ne!(order_id(&odd), order_id(&even));
    assert!(odd.text().contains(r#""amount_minor":9007199254740993,"#));
    assert!(even.text().contains(r#""amount_minor":9007199254740992,"#));
    assert_eq!(service.list(ALICE, "/orders").await["orders"].as_array().map(Vec::len), Some(2));
}

async fn key_reused_with_an_amount_that_differs_beyond_f64_precision_is_422_idempotency_key_reused(db: &TestDb) {
    let service = Orders::new(db);
    service.create(ALICE, "key-1", &order_body("book", "9007199254740993")).await;
    let reused = service.post(Some(ALICE), Some("key-1"), &order_body("book", "9007199254740992")).await;
    reused.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused");
}

// ---------------------------------------------------------------------------------------------
// Accounts
// ---------------------------------------------------------------------------------------------

async fn two_accounts_using_the_same_key_get_separate_orders(db: &TestDb) {
    let service = Orders::new(db);
    let body = order_body("book", "100");
    let alices = service.create(ALICE, "shared-key", &body).await;
    let bobs = service.create(BOB, "shared-key", &body).await;

    assert_eq!(bobs.header("idempotent-replayed"), None, "Bob must not get Alice's answer");
    assert_ne!(order_id(&alices), order_id(&bobs));
    assert_eq!(bobs.json()["account_id"], BOB);
    assert_ne!(alices.json()["idempotency_operation_id"], bobs.json()["idempotency_operation_id"]);
    assert_eq!(ids(service.list(ALICE, "/orders").await["orders"].as_array().expect("orders")), [order_id(&alices)]);
    assert_eq!(ids(service.list(BOB, "/orders").await["orders"].as_array().expect("orders")), [order_id(&bobs)]);
}

async fn another_accounts_order_an_unknown_id_and_a_malformed_id_are_the_same_404(db: &TestDb) {
    let service = Orders::new(db);
    let alices = service.create(ALICE, "key-1", &order_body("book", "100")).await;
    let location = alices.header("location").expect("a location");

    let for_bob = service.get(BOB, location).await;
    for_bob.assert_problem(StatusCode::NOT_FOUND, "order_not_found");
    let unknown = service.get(ALICE, &format!("/orders/{}", uuid::Uuid::new_v4())).await;
    unknown.assert_problem(StatusCode::NOT_FOUND, "order_not_found");
    let malformed = service.get(ALICE, "/orders/not-a-uuid").await;
    malformed.assert_problem(StatusCode::NOT_FOUND, "order_not_found");
    assert_eq!(for_bob.body, unknown.body, "nothing tells Bob that the order exists");
    assert_eq!(for_bob.body, malformed.body);
}

async fn get_routes_are_not_guarded_by_the_idempotency_layer(db: &TestDb) {
    let service = Orders::new(db);
    service.create(ALICE, "key-1", &order_body("book", "100")).await;
    let records = db.idempotency_records().await;
    let request = Request::get("/orders")
        .header("authorization", format!("Bearer {ALICE}"))
        .header("idempotency-key", "key-1")
        .body(Body::empty())
        .expect("a valid request");
    let listed = service.send(request).await;
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(listed.header("idempotent-replayed"), None);
    assert_eq!(db.idempotency_records().await, records);
}

// ---------------------------------------------------------------------------------------------
// Pagination
// ---------------------------------------------------------------------------------------------

async fn pages_of_ten_return_all_25_orders_once_newest_first_with_ties_broken_by_order_id(db: &TestDb) {
    let service = Orders::with_ties_of_three(db);
    let mut created = Vec::new();
    for n in 0..25 {
        let answer = service.create(ALICE, &format!("key-{n}"), &order_body(&format!("sku-{n}"), "1")).await;
        let order = answer.json();
        created.push((order["created_at"].as_str().expect("a time").to_owned(), order_id(&answer)));
    }
    service.create(BOB, "key-bob", &order_body("bob", "1")).await;
    // Fixed-width RFC 3339 text and lowercase hyphenated UUIDs sort like the values they show.
    created.sort_by(|a, b| b.cmp(a));
    let distinct_times: HashSet<_> = created.iter().map(|(time, _)| time.clone()).collect();
    assert_eq!(distinct_times.len(), 9, "runs of three share a created_at");

    let page_one = service.list(ALICE, "/orders?limit=10").await;
    assert_eq!(page_one["orders"].as_array().map(Vec::len), Some(10));
    let walked = service.walk(ALICE, 10).await;
    let expected: Vec<String> = created.into_iter().map(|(_, id)| id).collect();
    assert_eq!(ids(&walked), expected);
}

async fn the_last_page_has_a_null_next_cursor_even_when_it_is_exactly_full(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..20 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let first = service.list(ALICE, "/orders?limit=10").await;
    let cursor = first["next_cursor"].as_str().expect("a second page follows");
    let second = service.list(ALICE, &format!("/orders?limit=10&cursor={cursor}")).await;
    assert_eq!(second["orders"].as_array().map(Vec::len), Some(10));
    assert_eq!(second["next_cursor"], Value::Null);
    let everything = service.list(ALICE, "/orders?limit=100").await;
    assert_eq!(everything["next_cursor"], Value::Null);
}

async fn the_default_page_is_20_orders(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..21 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let page = service.list(ALICE, "/orders").await;
    assert_eq!(page["orders"].as_array().map(Vec::len), Some(20));
    assert!(page["next_cursor"].is_string());
}

async fn an_order_created_between_page_fetches_neither_repeats_nor_skips_older_orders(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..25 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let before = ids(&service.walk(ALICE, 100).await);

    let first = service.list(ALICE, "/orders?limit=10").await;
    let newest = service.create(ALICE, "key-late", &order_body("late", "1")).await;
    let mut seen = ids(first["orders"].as_array().expect("orders"));
    let mut cursor = first["next_cursor"].as_str().map(str::to_owned);
    while let Some(next) = cursor {
        let page = service.list(ALICE, &format!("/orders?limit=10&cursor={next}")).await;
        seen.extend(ids(page["orders"].as_array().expect("orders")));
        cursor = page["next_cursor"].as_str().map(str::to_owned);
    }
    assert_eq!(seen, before, "every older order exactly once, in order");
    assert_eq!(ids(&service.walk(ALICE, 10).await)[0], order_id(&newest), "a fresh walk starts with it");
}

async fn a_tampered_cursor_is_400_invalid_cursor(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..3 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let page = service.list(ALICE, "/orders?limit=1").await;
    let cursor = page["next_cursor"].as_str().expect("a cursor").to_owned();
    let dot = cursor.find('.').expect("payload.signature");
    let tampered = [
        flip_char_at(&cursor, 3),
        flip_char_at(&cursor, dot + 3),
        flip_char_at(&cursor, cursor.len() - 1),
        cursor.replace('.', ""),
        format!("{cursor}A"),
        cursor[..dot].to_owned(),
        "garbage".to_owned(),
        "..".to_owned(),
        String::new(),
    ];
    for bad in tampered {
        let answer = service.get(ALICE, &format!("/orders?limit=1&cursor={bad}")).await;
        answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
    }
}

async fn another_accounts_cursor_is_400_invalid_cursor(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..3 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
        service.create(BOB, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let alices = service.list(ALICE, "/orders?limit=1").await;
    let cursor = alices["next_cursor"].as_str().expect("a cursor");
    let answer = service.get(BOB, &format!("/orders?limit=1&cursor={cursor}")).await;
    let detail = answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
    assert!(detail.contains("another account"), "{detail}");
}

async fn a_cursor_of_another_version_or_signed_with_another_secret_is_400_invalid_cursor(db: &TestDb) {
    let service = Orders::new(db);
    let alice = Account::parse(ALICE).expect("a valid account");
    let payload = serde_json::json!({
        "v": 2,
        "created_at": START_MICROS,
        "order_id": uuid::Uuid::new_v4().to_string(),
        "account": account_digest(&alice),
    });
    let bytes = serde_json::to_vec(&payload).expect("JSON");
    let other_version = CursorCodec::new(CURSOR_SECRET).sign(&bytes);
    let answer = service.get(ALICE, &format!("/orders?cursor={other_version}")).await;
    let detail = answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
    assert!(detail.contains("version"), "{detail}");

    let position =
        PagePosition { created_at: CreatedAt::from_unix_micros(START_MICROS), order_id: uuid::Uuid::new_v4() };
    let foreign = CursorCodec::new(b"some other service's secret").encode(&alice, position);
    service
        .get(ALICE, &format!("/orders?cursor={foreign}"))
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
}

async fn limit_out_of_range_or_not_a_number_is_400_invalid_limit_and_a_repeated_limit_is_400_invalid_query(
    db: &TestDb,
) {
    let service = Orders::new(db);
    for limit in ["0", "101", "1000", "abc", "-1", "1.5", ""] {
        let answer = service.get(ALICE, &format!("/orders?limit={limit}")).await;
        answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_limit");
    }
    let repeated = service.get(ALICE, "/orders?limit=1&limit=2").await;
    repeated.assert_problem(StatusCode::BAD_REQUEST, "invalid_query");
    for limit in ["1", "100"] {
        assert_eq!(service.get(ALICE, &format!("/orders?limit={limit}")).await.status, StatusCode::OK);
    }
}

// ---------------------------------------------------------------------------------------------
// One transaction
// ---------------------------------------------------------------------------------------------

async fn create_writes_the_order_and_the_stored_answer_in_one_transaction(db: &TestDb) {
    let service = Orders::new(db);

    // A 201: the order row and a completed record, committed together.
    let created = service.create(ALICE, "key-ok", &order_body("committed", "100")).await;
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'committed'").await, 1);
    assert_eq!(db.strings("SELECT state FROM idempotency_records").await, ["completed"]);
    let operation_id = created.json()["idempotency_operation_id"].as_str().expect("an operation id").to_owned();
    assert_eq!(db.strings("SELECT idempotency_operation_id FROM orders").await, [operation_id]);

    // The database refuses the INSERT: the handler answers a retryable 503, and the claim is
    // rolled back with it.
    db.execute(
        "CREATE TRIGGER refuse_sku BEFORE INSERT ON orders WHEN NEW.sku = 'refused'
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        "ALTER TABLE orders ADD CONSTRAINT refuse_sku CHECK (sku <> 'refused')",
    )
    .await;
    let failed = service.post(Some(ALICE), Some("key-refused"), &order_body("refused", "100")).await;
    let detail = failed.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable");
    assert!(detail.contains("nothing was created") && detail.contains("Idempotency-Key"), "{detail}");
    assert_eq!(failed.header("retry-after"), Some("1"));
    assert!(!failed.text().contains("refused by the test"), "the cause stays in the log: {}", failed.text());
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'refused'").await, 0);
    assert_eq!(db.idempotency_records().await, 1, "a 5xx leaves no record");
    db.execute("DROP TRIGGER refuse_sku", "ALTER TABLE orders DROP CONSTRAINT refuse_sku").await;
    let retried = service.create(ALICE, "key-refused", &order_body("refused", "100")).await;
    assert_eq!(retried.header("idempotent-replayed"), None, "nothing was stored, so the retry executes");

    // The INSERT succeeds but the answer cannot be stored: the order is rolled back with it.
    db.execute(
        "CREATE TRIGGER refuse_completion BEFORE UPDATE ON idempotency_records WHEN NEW.state = 'completed'
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        "ALTER TABLE idempotency_records ADD CONSTRAINT refuse_completion CHECK (state <> 'completed') NOT VALID",
    )
    .await;
    let unanswered = service.post(Some(ALICE), Some("key-unanswered"), &order_body("unanswered", "100")).await;
    assert!(unanswered.status.is_server_error(), "{} {}", unanswered.status, unanswered.text());
    assert_eq!(unanswered.header("content-type"), Some("application/problem+json"));
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'unanswered'").await, 0, "the INSERT rolled back");
    assert_eq!(db.idempotency_records().await, 2);
    db.execute("DROP TRIGGER refuse_completion", "ALTER TABLE idempotency_records DROP CONSTRAINT refuse_completion")
        .await;
    let answered = service.create(ALICE, "key-unanswered", &order_body("unanswered", "100")).await;
    assert_eq!(answered.header("idempotent-replayed"), None);
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'unanswered'").await, 1);
    assert_eq!(db.strings("SELECT state FROM idempotency_records").await, ["completed"; 3]);
}

// ---------------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------------

#[test]
fn created_at_is_rfc3339_utc_with_microseconds() {
    let cases = [
        (0, "1970-01-01T00:00:00.000000Z"),
        (-1, "1969-12-31T23:59:59.999999Z"),
        (951_782_400_000_000, "2000-02-29T00:00:00.000000Z"),
        (START_MICROS, "2025-01-02T03:04:05.000006Z"),
        (253_402_300_799_999_999, "9999-12-31T23:59:59.999999Z"),
    ];
    for (micros, expected) in cases {
        assert_eq!(CreatedAt::from_unix_micros(micros).to_string(), expected);
    }
}
