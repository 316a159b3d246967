//! The storm: 64 identical requests released together, for each of 200 keys, against the real
//! PostgreSQL in atomic mode. Exactly one order row per key; every other answer is the
//! identical replay or a 409.
#![cfg(all(feature = "axum", feature = "postgres"))]

mod support;

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlx::Postgres;
use tokio::sync::Barrier;
use tower::ServiceExt;
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

        let mut answers: HashMap<String, Vec<(StatusCode, bool, String)>> = HashMap::new();
        for batch in (0..KEYS).collect::<Vec<_>>().chunks(KEYS_AT_ONCE) {
            let barrier = Arc::new(Barrier::new(batch.len() * DUPLICATES));
            let mut tasks = Vec::new();
            for &k in batch {
                for _ in 0..DUPLICATES {
                    let (app, barrier, key) = (app.clone(), barrier.clone(), format!("storm-key-{k}"));
                    tasks.push(tokio::spawn(async move {
                        let request = Request::post("/orders")
                            .header("idempotency-key", &key)
                            .header("content-type", "application/json")
                            .body(Body::from(format!("{{\"sku\":\"{key}\",\"quantity\":1}}")))
                            .unwrap();
                        barrier.wait().await;
                        let response = app.oneshot(request).await.unwrap();
                        let status = response.status();
                        let replayed = response.headers().contains_key("idempotent-replayed");
                        let body = response.into_body().collect().await.unwrap().to_bytes();
                        (key, status, replayed, String::from_utf8_lossy(&body).into_owned())
                    }));
                }
            }
            for task in tasks {
                let (key, status, replayed, body) = task.await.expect("request task");
                answers.entry(key).or_default().push((status, replayed, body));
            }
        }

        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT operation_id, count(*) FROM storm_orders GROUP BY operation_id")
                .fetch_all(store.pool())
                .await
                .unwrap();
        assert_eq!(rows.len(), KEYS, "every key must have created an order");
        assert!(rows.iter().all(|(_, n)| *n == 1), "some key created more than one order: {rows:?}");

        let mut conflicts = 0;
        for (key, answers) in &answers {
            assert_eq!(answers.len(), DUPLICATES);
            let executed: Vec<_> =
                answers.iter().filter(|(s, replayed, _)| *s == StatusCode::CREATED && !replayed).collect();
            assert_eq!(executed.len(), 1, "{key}: exactly one answer is the execution");
            for (status, replayed, body) in answers {
                if *replayed {
                    assert_eq!((status, body), (&StatusCode::CREATED, &executed[0].2), "{key}: replays are identical");
                } else if *status != StatusCode::CREATED {
                    assert_eq!(*status, StatusCode::CONFLICT, "{key}: the only other answer is 409, got {body}");
                    assert!(body.contains("idempotency_request_in_flight"), "{body}");
                    conflicts += 1;
                }
            }
        }
        println!("storm: {KEYS} keys x {DUPLICATES} requests: {} orders, {conflicts} answers were 409", rows.len());
    });
}
