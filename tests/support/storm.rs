//! The storm the storm tests run: for each key, many identical requests released together
//! behind a barrier, a few keys at a time; then the checks every storm must pass.

use std::collections::HashMap;

use axum::Router;
use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// The orders table of the storms.
#[cfg(feature = "postgres")]
pub const CREATE_TABLE: &str =
    "CREATE TABLE storm_orders (order_id text PRIMARY KEY, operation_id text NOT NULL, body text NOT NULL)";

/// Inserts an order through the claim's transaction; its id.
#[cfg(feature = "postgres")]
pub async fn insert_order(
    context: &tower_idempotency::IdempotencyContext,
    tx: &tower_idempotency::TxHandle<sqlx::Postgres>,
    body: &str,
) -> uuid::Uuid {
    let order_id = uuid::Uuid::new_v4();
    let mut conn = tx.acquire().await.expect("the claim's transaction");
    sqlx::query("INSERT INTO storm_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
        .bind(order_id.to_string())
        .bind(context.operation_id())
        .bind(body)
        .execute(&mut *conn)
        .await
        .expect("insert the order");
    order_id
}

/// The storms' handler: writes an order through the claim's transaction and answers with its id.
#[cfg(feature = "postgres")]
pub async fn create_order(
    context: tower_idempotency::IdempotencyContext,
    tx: tower_idempotency::TxHandle<sqlx::Postgres>,
    body: String,
) -> (StatusCode, String) {
    let order_id = insert_order(&context, &tx, &body).await;
    (StatusCode::CREATED, format!("{{\"order_id\":\"{order_id}\"}}"))
}

/// How many orders each operation created.
#[cfg(feature = "postgres")]
pub async fn orders_per_operation(pool: &sqlx::PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT operation_id, count(*) FROM storm_orders GROUP BY operation_id")
        .fetch_all(pool)
        .await
        .expect("count the orders")
}

/// The storm on PostgreSQL: `store`'s layer on `POST /orders` writing to the orders table, which
/// this creates in `store`'s schema, `keys` keys of `duplicates` identical requests
/// ([`storm`]); then the checks every storm must pass: one order per key, each key executed
/// once, every other answer the identical replay or a 409 ([`check_answers`]). Returns how many
/// answers were 409.
#[cfg(feature = "postgres")]
pub async fn pg_storm(
    store: &tower_idempotency::PostgresStore,
    label: &str,
    keys: usize,
    duplicates: usize,
    keys_at_once: usize,
) -> usize {
    use axum::routing::post;
    use tower_idempotency::IdempotencyLayer;

    sqlx::raw_sql(CREATE_TABLE).execute(store.pool()).await.expect("orders table");
    let layer = IdempotencyLayer::new(store.clone()).shared_scope("storm").operation("storm.create");
    let app = Router::new().route("/orders", post(create_order).layer(layer));

    let answers = storm(&app, label, keys, duplicates, keys_at_once).await;

    let rows = orders_per_operation(store.pool()).await;
    assert_eq!(rows.len(), keys, "every key must have created an order");
    assert!(rows.iter().all(|(_, n)| *n == 1), "some key created more than one order: {rows:?}");
    check_answers(&answers, duplicates)
}

/// One answer: status, whether it was a replay, body.
pub type Answer = (StatusCode, bool, String);

/// Sends `duplicates` identical `POST /orders` for each of `keys` keys (named
/// `{label}-key-{k}`), `keys_at_once` keys at a time, all requests of a batch released together.
pub async fn storm(
    app: &Router,
    label: &str,
    keys: usize,
    duplicates: usize,
    keys_at_once: usize,
) -> HashMap<String, Vec<Answer>> {
    super::released_together(keys, duplicates, keys_at_once, |k, _, barrier| {
        let (app, key) = (app.clone(), format!("{label}-key-{k}"));
        async move {
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
            (key, (status, replayed, String::from_utf8_lossy(&body).into_owned()))
        }
    })
    .await
}

/// Checks a storm's answers: for each key, exactly one execution, every replay identical to it,
/// and nothing else but 409 in flight. Returns how many answers were 409.
pub fn check_answers(answers: &HashMap<String, Vec<Answer>>, duplicates: usize) -> usize {
    let mut conflicts = 0;
    for (key, answers) in answers {
        assert_eq!(answers.len(), duplicates);
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
    conflicts
}
