//! The storm: 64 identical requests released together, for each of 200 keys, against the real
//! PostgreSQL in atomic mode. Exactly one order row per key; every other answer is the
//! identical replay or a 409.
#![cfg(all(feature = "axum", feature = "postgres"))]

mod support;

use axum::Router;
use axum::routing::post;
use http::StatusCode;
use sqlx::Postgres;
use tower_idempotency::{CouplingMode, IdempotencyContext, IdempotencyLayer, TxHandle};

const KEYS: usize = 200;
const DUPLICATES: usize = 64;
/// Keys stormed at the same time (each with all its duplicates): enough to interleave keys,
/// few enough that the 2-core machine and the pool are not the bottleneck being measured.
const KEYS_AT_ONCE: usize = 4;

async fn create_order(context: IdempotencyContext, tx: TxHandle<Postgres>, body: String) -> (StatusCode, String) {
    let order_id = uuid::Uuid::new_v4();
    let mut conn = tx.acquire().await.expect("the claim's transaction");
    sqlx::query("INSERT INTO storm_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
        .bind(order_id.to_string())
        .bind(context.operation_id())
        .bind(&body)
        .execute(&mut *conn)
        .await
        .expect("insert the order");
    (StatusCode::CREATED, format!("{{\"order_id\":\"{order_id}\"}}"))
}

#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key() {
    tower_idempotency::testkit::run(async {
        let store = support::pg_store(CouplingMode::Atomic).await;
        sqlx::raw_sql(
            "CREATE TABLE storm_orders (order_id text PRIMARY KEY, operation_id text NOT NULL, body text NOT NULL)",
        )
        .execute(store.pool())
        .await
        .expect("orders table");
        let layer = IdempotencyLayer::new(store.clone()).shared_scope("storm").operation("storm.create");
        let app = Router::new().route("/orders", post(create_order).layer(layer));

        let answers = support::storm::storm(&app, "storm", KEYS, DUPLICATES, KEYS_AT_ONCE).await;

        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT operation_id, count(*) FROM storm_orders GROUP BY operation_id")
                .fetch_all(store.pool())
                .await
                .unwrap();
        assert_eq!(rows.len(), KEYS, "every key must have created an order");
        assert!(rows.iter().all(|(_, n)| *n == 1), "some key created more than one order: {rows:?}");

        let conflicts = support::storm::check_answers(&answers, DUPLICATES);
        println!("storm: {KEYS} keys x {DUPLICATES} requests: {} orders, {conflicts} answers were 409", rows.len());
    });
}
