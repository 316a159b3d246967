//! The storm: 64 identical requests released together, for each of 200 keys, against the real
//! PostgreSQL in atomic mode. Exactly one order row per key; every other answer is the
//! identical replay or a 409.
#![cfg(all(feature = "axum", feature = "postgres"))]

mod support;

use axum::Router;
use axum::routing::post;
use tower_idempotency::{CouplingMode, IdempotencyLayer};

const KEYS: usize = 200;
const DUPLICATES: usize = 64;
/// Keys stormed at the same time (each with all its duplicates): enough to interleave keys,
/// few enough that the 2-core machine and the pool are not the bottleneck being measured.
const KEYS_AT_ONCE: usize = 4;

#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key() {
    tower_idempotency::testkit::run(async {
        let store = support::pg_store(CouplingMode::Atomic).await;
        sqlx::raw_sql(support::storm::CREATE_TABLE).execute(store.pool()).await.expect("orders table");
        let layer = IdempotencyLayer::new(store.clone()).shared_scope("storm").operation("storm.create");
        let app = Router::new().route("/orders", post(support::storm::create_order).layer(layer));

        let answers = support::storm::storm(&app, "storm", KEYS, DUPLICATES, KEYS_AT_ONCE).await;

        let rows = support::storm::orders_per_operation(store.pool()).await;
        assert_eq!(rows.len(), KEYS, "every key must have created an order");
        assert!(rows.iter().all(|(_, n)| *n == 1), "some key created more than one order: {rows:?}");

        let conflicts = support::storm::check_answers(&answers, DUPLICATES);
        println!("storm: {KEYS} keys x {DUPLICATES} requests: {} orders, {conflicts} answers were 409", rows.len());
    });
}
