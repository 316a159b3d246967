//! The `POST /orders` service the HTTP benchmarks load: one handler that writes an order to
//! `bench_orders`, behind an optional idempotency layer, on a loopback port.

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use http::{Request, StatusCode};
use sqlx::{PgPool, Postgres};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Scope, Store, TxHandle};

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
) -> (StatusCode, [(&'static str, String); 2], String) {
    let order_id = uuid::Uuid::new_v4();
    let operation_id = context.as_ref().map_or("", |c| c.operation_id()).to_owned();
    let insert = sqlx::query("INSERT INTO bench_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
        .bind(order_id.to_string())
        .bind(operation_id)
        .bind(&body);
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
    let json = format!("{{\"order_id\":\"{order_id}\",\"body\":{body}}}");
    (
        StatusCode::CREATED,
        [("content-type", "application/json".to_owned()), ("location", format!("/orders/{order_id}"))],
        json,
    )
}

async fn authenticate(mut request: Request<Body>, next: axum::middleware::Next) -> axum::response::Response {
    request.extensions_mut().insert(Scope::new("bench-account"));
    next.run(request).await
}

/// Serves `POST /orders` on a loopback port, behind `layer` if there is one; its address.
pub async fn serve<S: Store>(pool: PgPool, layer: Option<IdempotencyLayer<S>>) -> std::net::SocketAddr {
    let route = match layer {
        Some(layer) => post(create_order).layer(layer),
        None => post(create_order),
    };
    let app = Router::new().route("/orders", route).layer(axum::middleware::from_fn(authenticate)).with_state(pool);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let addr = listener.local_addr().expect("bound address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    addr
}
