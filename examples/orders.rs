//! # An orders service whose `POST /orders` is safe to retry
//!
//! The reference example of `tower-idempotency`: a small axum service that creates orders.
//! A client that times out can send the same `POST /orders` again with the same
//! `Idempotency-Key`; the service creates the order at most once and answers every retry
//! with the first answer, byte for byte, marked `Idempotent-Replayed: true`.
//!
//! What it shows:
//!
//! - **Per-route opt-in.** Only `POST /orders` is wrapped by [`IdempotencyLayer`] (with the
//!   explicit operation name `orders.create`); the `GET` routes are not.
//! - **Authentication before idempotency.** An axum middleware turns `Authorization: Bearer
//!   <account>` into the request's [`Scope`] (and an [`Account`]) *before* the idempotency
//!   layer runs, so a refused request stores nothing, and a key of one account never replays
//!   another account's answer.
//! - **The handler's context.** The create handler takes [`IdempotencyContext`] as an
//!   extractor and records `ctx.operation_id()` with the order.
//! - **Release on bad input.** A 422 `validation_failed` is released by the layer's default
//!   rule (4xx → release): the client fixes the body and retries with the same key.
//! - **Exact money.** `amount_minor` is kept as the client's integer literal (any size), never
//!   through `f64` or `u64`.
//! - **Keyset pagination** with an opaque, HMAC-signed cursor.
//!
//! Orders live in memory, behind [`OrderBook`], the one type a database-backed version
//! replaces.
//!
//! ## Run it
//!
//! ```text
//! cargo run --example orders
//! ```
//!
//! It prints `listening on 127.0.0.1:3000` once bound. Environment:
//!
//! - `ORDERS_ADDR`: the address to bind (default `127.0.0.1:3000`; port `0` picks a free one).
//! - `ORDERS_CURSOR_SECRET`: the key that signs pagination cursors, at least 16 bytes. Unset:
//!   a random key per process (cursors then stop working after a restart).
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

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION, WWW_AUTHENTICATE};
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
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, MemoryStore, Scope, Store};
use uuid::Uuid;

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
const PROBLEM_TYPE_BASE: &str = "urn:orders:problem:";

// ---------------------------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let state = AppState { orders: OrderBook::new(), cursors: CursorCodec::from_env()? };
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app(state, MemoryStore::new())).with_graceful_shutdown(shutdown_signal()).await?;
    Ok(())
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
// The router
// ---------------------------------------------------------------------------------------------

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// Where orders live.
    pub orders: OrderBook,
    /// Signs and checks pagination cursors.
    pub cursors: CursorCodec,
}

/// The service: authentication on every route, idempotency on `POST /orders` only.
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

/// `POST /orders`: validates the body and records the order with its operation id.
async fn create_order(
    State(state): State<AppState>,
    account: Account,
    context: IdempotencyContext,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiProblem> {
    require_json(&headers)?;
    let draft = OrderDraft::from_json(&body).map_err(ApiProblem::validation_failed)?;
    let order = state.orders.insert(account, draft, context.operation_id()).await;
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
    state.orders.get(&account, order_id).await.map(Json).ok_or_else(ApiProblem::not_found)
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
    let mut orders = state.orders.page(&account, after, limit + 1).await;
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
// The order book: the storage a database replaces
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

/// The orders of every account, in memory.
///
/// The three methods are what a SQL version keeps: `insert` is an `INSERT` made through the
/// idempotency claim's transaction; `get` is `WHERE account_id = ? AND order_id = ?`; `page`
/// is `WHERE account_id = ? AND (created_at, order_id) < (?, ?) ORDER BY created_at DESC,
/// order_id DESC LIMIT ?` over an index on `(account_id, created_at, order_id)`.
#[derive(Clone)]
pub struct OrderBook {
    orders: Arc<Mutex<Orders>>,
    clock: Clock,
}

#[derive(Default)]
struct Orders {
    by_id: HashMap<Uuid, Order>,
    by_account: HashMap<Account, BTreeSet<PagePosition>>,
}

impl OrderBook {
    /// An empty book on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(CreatedAt::now))
    }

    /// An empty book whose `created_at` comes from `clock`.
    pub fn with_clock(clock: Clock) -> Self {
        Self { orders: Arc::default(), clock }
    }

    /// Records a new order for `account`, stamped with a fresh id and the clock's time.
    pub async fn insert(&self, account: Account, draft: OrderDraft, operation_id: &str) -> Order {
        let order = Order {
            order_id: Uuid::new_v4(),
            account_id: account,
            sku: draft.sku,
            quantity: draft.quantity,
            amount_minor: draft.amount_minor,
            currency: draft.currency,
            created_at: (self.clock)(),
            idempotency_operation_id: operation_id.to_owned(),
        };
        let mut orders = self.lock();
        orders.by_account.entry(order.account_id.clone()).or_default().insert(order.position());
        orders.by_id.insert(order.order_id, order.clone());
        order
    }

    /// The order `order_id` if `account` owns it.
    pub async fn get(&self, account: &Account, order_id: Uuid) -> Option<Order> {
        self.lock().by_id.get(&order_id).filter(|order| order.account_id == *account).cloned()
    }

    /// Up to `limit` of `account`'s orders, newest first, strictly after `after` in that order.
    pub async fn page(&self, account: &Account, after: Option<PagePosition>, limit: usize) -> Vec<Order> {
        let orders = self.lock();
        let Some(positions) = orders.by_account.get(account) else {
            return Vec::new();
        };
        let older = match after {
            Some(after) => positions.range(..after),
            None => positions.range(..),
        };
        older.rev().take(limit).filter_map(|position| orders.by_id.get(&position.order_id).cloned()).collect()
    }

    fn lock(&self) -> MutexGuard<'_, Orders> {
        // The map is never left half-updated, so a panic elsewhere does not poison its data.
        self.orders.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for OrderBook {
    fn default() -> Self {
        Self::new()
    }
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
        response
    }
}
