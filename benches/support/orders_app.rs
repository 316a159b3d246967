//! The `POST /orders` service the HTTP benchmarks load: one handler that writes an order to
//! `bench_orders`, behind an optional idempotency layer, on a loopback port; and, for the
//! PostgreSQL benchmark's floor, the same handler writing a record of its answer by hand.

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Postgres};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, PostgresStore, Scope, Store, StoredResponse, TxHandle};

/// The order every request posts.
pub const BODY: &str = "{\"sku\":\"book-42\",\"quantity\":1,\"amount_minor\":129900,\"currency\":\"EUR\"}";

/// Creates the table the handler writes to.
pub async fn create_orders_table(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE bench_orders (order_id text PRIMARY KEY, operation_id text NOT NULL, body text NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await
    .expect("create bench_orders");
}

/// The one handler: writes the order through the claim's transaction when the layer hands one
/// out, else in a transaction of its own.
async fn create_order(
    State(pool): State<PgPool>,
    context: Option<IdempotencyContext>,
    tx: Option<TxHandle<Postgres>>,
    body: String,
) -> Created {
    let order_id = uuid::Uuid::new_v4();
    let operation_id = context.as_ref().map_or("", |c| c.operation_id()).to_owned();
    let insert = insert_order(order_id, operation_id, &body);
    match tx {
        Some(tx) => {
            let mut conn = tx.acquire().await.expect("claim transaction");
            insert.execute(&mut *conn).await.expect("insert");
        }
        None => {
            let mut own = pool.begin().await.expect("begin");
            insert.execute(&mut *own).await.expect("insert");
            own.commit().await.expect("commit");
        }
    }
    created(order_id, &body)
}

/// The order's INSERT.
fn insert_order(
    order_id: uuid::Uuid,
    operation_id: String,
    body: &str,
) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query("INSERT INTO bench_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
        .bind(order_id.to_string())
        .bind(operation_id)
        .bind(body.to_owned())
}

/// The handlers' answer: status, content type and location, JSON body.
type Created = (StatusCode, [(&'static str, String); 2], String);

/// The handlers' answer: 201 with the order's location and a JSON body.
fn created(order_id: uuid::Uuid, body: &str) -> Created {
    let json = format!("{{\"order_id\":\"{order_id}\",\"body\":{body}}}");
    (
        StatusCode::CREATED,
        [("content-type", "application/json".to_owned()), ("location", format!("/orders/{order_id}"))],
        json,
    )
}

/// The table the floor's handler keeps its records in: the layer's own table shape, made by
/// the store's migration under another name.
const FLOOR_RECORDS: &str = "floor_records";

/// The records table of the floor with a read, the same shape, apart from [`FLOOR_RECORDS`] so
/// that neither scenario's rows weigh on the other's.
const FLOOR_READ_RECORDS: &str = "floor_read_records";

/// The records table of the floor with a prepared read, the same shape, apart from the others.
const FLOOR_PREPARED_READ_RECORDS: &str = "floor_prepared_read_records";

/// The handlers' answer for `order_id`, and its headers as the floors keep them beside it: in
/// the stores' own form ([`StoredResponse::encode_fields`]), so that floor rows weigh what the
/// layer's do.
fn answer_and_kept_headers(order_id: uuid::Uuid, body: &str) -> (Created, Vec<u8>) {
    let answer = created(order_id, body);
    let mut stored = StoredResponse::new(answer.0, Vec::new());
    for (name, value) in &answer.1 {
        stored.headers.push((HeaderName::from_static(name), HeaderValue::from_str(value).expect("a header value")));
    }
    (answer, stored.encode_fields())
}

/// The floor: the same order, and in the same transaction a row of the answer in a table of
/// the layer's shape ([`FLOOR_RECORDS`]), written with prepared statements. No read first, no
/// lock, no fingerprint check: only the row that keeps the answer with the order.
async fn create_order_and_record(State(pool): State<PgPool>, headers: HeaderMap, body: String) -> Created {
    let key = headers.get("idempotency-key").map_or(&[][..], |key| key.as_bytes());
    let order_id = uuid::Uuid::new_v4();
    let (answer, kept_headers) = answer_and_kept_headers(order_id, &body);
    let mut tx = pool.begin().await.expect("begin");
    insert_order(order_id, String::new(), &body).execute(&mut *tx).await.expect("insert the order");
    sqlx::query(
        "INSERT INTO floor_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
             response_status, response_headers, response_body, response_until, forget_at, updated_at, attempts) \
         VALUES ($1, 'completed', 1, $2, NULL, 201, $3, $4, clock_timestamp() + interval '1 day', \
             clock_timestamp() + interval '2 days', NULL, NULL)",
    )
    .bind(Sha256::digest(key).to_vec())
    .bind(Sha256::digest(body.as_bytes()).to_vec())
    .bind(kept_headers)
    .bind(answer.2.clone().into_bytes())
    .execute(&mut *tx)
    .await
    .expect("insert the record");
    tx.commit().await.expect("commit");
    answer
}

/// The floor with what no claim can skip: the same order and record as [`create_order_and_record`],
/// but BEGIN travels with a read of the record by its primary key (one round trip, as the
/// store's claim goes), and the record carries the labels the store writes with every record
/// (see [`insert_labelled_record`]). No lock, no function, no fingerprint, no layer.
async fn create_order_read_and_record(State(pool): State<PgPool>, headers: HeaderMap, body: String) -> Created {
    let key = headers.get("idempotency-key").map_or(&[][..], |key| key.as_bytes());
    let record_id = Sha256::digest(key);
    let order_id = uuid::Uuid::new_v4();
    let (answer, kept_headers) = answer_and_kept_headers(order_id, &body);
    let mut conn = pool.acquire().await.expect("a connection");
    let hex: String = record_id.iter().map(|byte| format!("{byte:02x}")).collect();
    let begin_and_read = format!("BEGIN; SELECT 1 FROM {FLOOR_READ_RECORDS} WHERE record_id = E'\\\\x{hex}'::bytea");
    let found = sqlx::raw_sql(sqlx::AssertSqlSafe(begin_and_read)).fetch_all(&mut *conn).await.expect("begin and read");
    assert!(found.is_empty(), "every request of the floor is a new key");
    insert_order(order_id, String::new(), &body).execute(&mut *conn).await.expect("insert the order");
    insert_labelled_record(&mut conn, FLOOR_READ_RECORDS, record_id.into(), &body, &answer, kept_headers).await;
    sqlx::raw_sql("COMMIT").execute(&mut *conn).await.expect("commit");
    answer
}

/// The floor with the cheapest read sqlx can send: the same order and labelled record as
/// [`create_order_read_and_record`], but the record is read by a prepared statement (parsed and
/// planned once per connection) in a round trip of its own after `BEGIN`.
async fn create_order_prepared_read_and_record(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    body: String,
) -> Created {
    let key = headers.get("idempotency-key").map_or(&[][..], |key| key.as_bytes());
    let record_id: [u8; 32] = Sha256::digest(key).into();
    let order_id = uuid::Uuid::new_v4();
    let (answer, kept_headers) = answer_and_kept_headers(order_id, &body);
    let mut tx = pool.begin().await.expect("begin");
    let found = sqlx::query("SELECT 1 FROM floor_prepared_read_records WHERE record_id = $1")
        .bind(record_id.to_vec())
        .fetch_optional(&mut *tx)
        .await
        .expect("read");
    assert!(found.is_none(), "every request of the floor is a new key");
    insert_order(order_id, String::new(), &body).execute(&mut *tx).await.expect("insert the order");
    insert_labelled_record(&mut tx, FLOOR_PREPARED_READ_RECORDS, record_id, &body, &answer, kept_headers).await;
    tx.commit().await.expect("commit");
    answer
}

/// The record of `answer` in `table`, with the labels the store writes with every record (the
/// operation, and the operation id's key, which joins its hash index), in the compact form the
/// store writes (migration 9: no fencing token, `updated_at`, attempts or scope digest).
async fn insert_labelled_record(
    conn: &mut sqlx::PgConnection,
    table: &str,
    record_id: [u8; 32],
    body: &str,
    answer: &Created,
    kept_headers: Vec<u8>,
) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (record_id, state, fingerprint_version, fingerprint, fencing_token, \
             response_status, response_headers, response_body, response_until, forget_at, updated_at, \
             attempts, operation, operation_id) \
         VALUES ($1, 'completed', 1, $2, NULL, 201, $3, $4, clock_timestamp() + interval '1 day', \
             clock_timestamp() + interval '2 days', NULL, NULL, $5, $6)"
    )))
    .bind(record_id.to_vec())
    .bind(Sha256::digest(body.as_bytes()).to_vec())
    .bind(kept_headers)
    .bind(answer.2.clone().into_bytes())
    .bind("POST /orders")
    .bind(record_id[..16].to_vec())
    .execute(conn)
    .await
    .expect("insert the record");
}

async fn authenticate(mut request: Request<Body>, next: axum::middleware::Next) -> axum::response::Response {
    request.extensions_mut().insert(Scope::new("bench-account"));
    next.run(request).await
}

/// Serves `POST /orders` on a loopback port, behind `layer` if there is one; its address.
pub async fn serve<S: Store>(pool: PgPool, layer: Option<IdempotencyLayer<S>>) -> std::net::SocketAddr {
    serve_wrapped(pool, layer, |router| router).await
}

/// [`serve`], with `wrap` laid around the whole app (outside the layer), for a benchmark's own
/// middleware.
pub async fn serve_wrapped<S: Store>(
    pool: PgPool,
    layer: Option<IdempotencyLayer<S>>,
    wrap: impl FnOnce(Router) -> Router,
) -> std::net::SocketAddr {
    let route = match layer {
        Some(layer) => post(create_order).layer(layer),
        None => post(create_order),
    };
    let app = Router::new().route("/orders", route).layer(axum::middleware::from_fn(authenticate)).with_state(pool);
    listen(wrap(app)).await
}

/// Creates the floor's records table and serves the floor's `POST /orders` (no layer; the
/// handler writes its own record) on a loopback port; its address.
#[allow(dead_code)] // Only the PostgreSQL benchmark measures the floor.
pub async fn serve_floor(pool: PgPool) -> std::net::SocketAddr {
    let records = PostgresStore::new(pool.clone()).table(FLOOR_RECORDS).expect("a valid table name");
    records.migrate().await.expect("create the floor's records table");
    listen(Router::new().route("/orders", post(create_order_and_record)).with_state(pool)).await
}

/// Creates a records table of its own ([`FLOOR_READ_RECORDS`]) and serves the floor with the
/// read no claim can skip ([`create_order_read_and_record`]) on a loopback port; its address.
#[allow(dead_code)] // Only the PostgreSQL benchmark measures the floor.
pub async fn serve_floor_with_read(pool: PgPool) -> std::net::SocketAddr {
    let records = PostgresStore::new(pool.clone()).table(FLOOR_READ_RECORDS).expect("a valid table name");
    records.migrate().await.expect("create the records table of the floor with a read");
    listen(Router::new().route("/orders", post(create_order_read_and_record)).with_state(pool)).await
}

/// Creates a records table of its own and serves the floor with a prepared read
/// ([`create_order_prepared_read_and_record`]) on a loopback port; its address.
#[allow(dead_code)] // Only the PostgreSQL benchmark measures the floor.
pub async fn serve_floor_with_prepared_read(pool: PgPool) -> std::net::SocketAddr {
    let records = PostgresStore::new(pool.clone()).table(FLOOR_PREPARED_READ_RECORDS).expect("a valid table name");
    records.migrate().await.expect("create the records table of the floor with a prepared read");
    listen(Router::new().route("/orders", post(create_order_prepared_read_and_record)).with_state(pool)).await
}

async fn listen(app: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let addr = listener.local_addr().expect("bound address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    addr
}
