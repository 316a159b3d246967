//! Shadow mode on both SQL stores, where the shadow records are written in batches after the
//! answers have left, by one statement on a connection of their own: what it counts (executed,
//! replayed, key reused, a stored failure, a storm of duplicates), what it writes (a completed
//! record with the status only, no body, no operation id), and that a failing shadow write
//! never changes the answer nor loses the handler's committed write; and that a shadow store of
//! its own ([`IdempotencyLayer::shadow_store`]) takes the records while the orders stay on the
//! layer's store.
#![cfg(all(feature = "axum", feature = "metrics", feature = "sqlite", feature = "postgres"))]

mod support;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::telemetry::SHADOW;
use tower_idempotency::{CouplingMode, IdempotencyLayer, OutcomeClass, RolloutMode, RolloutSwitch, TxHandle};

use support::recorder::{Recorded, eventually};

/// The status of the answer to `note` under `key`, and whether it was a replay.
async fn send(app: &Router, key: &str, note: &str) -> (StatusCode, bool) {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Body::from(note.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let _ = response.into_body().collect().await.unwrap();
    (status, replayed)
}

fn shadow(result: &str) -> String {
    format!("{SHADOW}{{operation=orders.create,result={result}}}")
}

macro_rules! suite {
    ($name:ident, $db:ty, $store:expr, $insert:literal, $refuse:literal, $allow:literal) => {
        mod $name {
            use super::*;

            /// Inserts the note through the transaction; a stored failure (402, marked to be
            /// stored) for `reject`, and a 422 (released by the default rule) for `release`.
            async fn create(tx: TxHandle<$db>, note: String) -> Response {
                let mut conn = tx.acquire().await.expect("open transaction");
                sqlx::query($insert).bind(&note).execute(&mut *conn).await.expect("insert");
                match note.as_str() {
                    "reject" => (StatusCode::PAYMENT_REQUIRED, Extension(OutcomeClass::Reject)).into_response(),
                    "release" => StatusCode::UNPROCESSABLE_ENTITY.into_response(),
                    _ => StatusCode::CREATED.into_response(),
                }
            }

            async fn setup() -> (Router, sqlx::Pool<$db>) {
                let store = $store;
                let pool = store.pool().clone();
                sqlx::raw_sql("CREATE TABLE orders (note text NOT NULL)").execute(&pool).await.expect("orders");
                let layer = IdempotencyLayer::new(store)
                    .operation("orders.create")
                    .shared_scope("tenant")
                    .rollout(RolloutSwitch::new(RolloutMode::Shadow));
                (Router::new().route("/orders", post(create).layer(layer)), pool)
            }

            async fn count(pool: &sqlx::Pool<$db>, sql: &'static str) -> i64 {
                sqlx::query_scalar(sql).fetch_one(pool).await.expect("count")
            }

            #[tokio::test]
            async fn shadow_records_after_the_answer_and_counts_what_enforce_would_have_done() {
                let recorded = std::sync::Arc::new(Recorded::default());
                let _guard = metrics::set_default_local_recorder(&*recorded);
                let (app, pool) = setup().await;

                assert_eq!(send(&app, "k", "a").await, (StatusCode::CREATED, false));
                assert_eq!(eventually(&recorded, &shadow("executed"), 1).await, 1, "{:?}", recorded.names());
                assert_eq!(send(&app, "k", "a").await, (StatusCode::CREATED, false), "never replayed");
                assert_eq!(eventually(&recorded, &shadow("replayed"), 1).await, 1);
                assert_eq!(send(&app, "k", "b").await, (StatusCode::CREATED, false), "never refused");
                assert_eq!(eventually(&recorded, &shadow("key_reused"), 1).await, 1);
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 3, "every call wrote its order");

                // One record: completed, the status only, no body, no labels, never leased.
                let sql = "SELECT count(*) FROM idempotency_records WHERE state = 'completed' \
                           AND response_status = 201 AND length(response_body) = 0 AND operation_id IS NULL \
                           AND fencing_token = 0";
                assert_eq!(count(&pool, sql).await, 1);
                assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_records").await, 1);
            }

            #[tokio::test]
            async fn a_stored_failure_is_recorded_apart_and_a_released_answer_not_at_all() {
                let recorded = std::sync::Arc::new(Recorded::default());
                let _guard = metrics::set_default_local_recorder(&*recorded);
                let (app, pool) = setup().await;

                assert_eq!(send(&app, "r", "reject").await, (StatusCode::PAYMENT_REQUIRED, false));
                assert_eq!(eventually(&recorded, &shadow("executed"), 1).await, 1);
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0, "a stored failure rolls back");
                let failed =
                    "SELECT count(*) FROM idempotency_records WHERE state = 'failed' AND response_status = 402";
                assert_eq!(count(&pool, failed).await, 1);
                assert_eq!(send(&app, "r", "reject").await, (StatusCode::PAYMENT_REQUIRED, false));
                assert_eq!(eventually(&recorded, &shadow("replayed"), 1).await, 1, "enforce would replay the 402");

                // A released answer rolls back and records nothing: a retry would run again.
                assert_eq!(send(&app, "l", "release").await, (StatusCode::UNPROCESSABLE_ENTITY, false));
                assert_eq!(eventually(&recorded, &shadow("released"), 1).await, 1);
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
                assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_records").await, 1);
            }

            #[tokio::test]
            async fn a_storm_of_duplicates_runs_every_time_and_is_counted_as_one_execution() {
                const DUPLICATES: usize = 16;
                let recorded = std::sync::Arc::new(Recorded::default());
                let _guard = metrics::set_default_local_recorder(&*recorded);
                let (app, pool) = setup().await;

                // All at once, behind a barrier: the old path stops none of them.
                let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(DUPLICATES));
                let mut calls = tokio::task::JoinSet::new();
                for _ in 0..DUPLICATES {
                    let (app, barrier) = (app.clone(), barrier.clone());
                    calls.spawn(async move {
                        barrier.wait().await;
                        send(&app, "storm", "a").await
                    });
                }
                for answer in calls.join_all().await {
                    assert_eq!(answer, (StatusCode::CREATED, false));
                }
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, DUPLICATES as i64);
                let replayed = eventually(&recorded, &shadow("replayed"), DUPLICATES as u64 - 1).await;
                assert_eq!(replayed, DUPLICATES as u64 - 1, "enforce mode would have replayed every duplicate");
                assert_eq!(recorded.get(&shadow("executed")), 1, "and executed the key once");
                assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_records").await, 1);
            }

            #[tokio::test]
            async fn a_shadow_store_of_its_own_takes_the_records_and_the_business_store_the_orders() {
                let recorded = std::sync::Arc::new(Recorded::default());
                let _guard = metrics::set_default_local_recorder(&*recorded);
                let (store, records) = ($store, $store);
                let (pool, records_pool) = (store.pool().clone(), records.pool().clone());
                sqlx::raw_sql("CREATE TABLE orders (note text NOT NULL)").execute(&pool).await.expect("orders");
                let switch = RolloutSwitch::new(RolloutMode::Shadow);
                let layer = IdempotencyLayer::new(store)
                    .operation("orders.create")
                    .shared_scope("tenant")
                    .rollout(switch.clone())
                    .shadow_store(records);
                let app = Router::new().route("/orders", post(create).layer(layer));

                assert_eq!(send(&app, "k", "a").await, (StatusCode::CREATED, false));
                assert_eq!(eventually(&recorded, &shadow("executed"), 1).await, 1, "{:?}", recorded.names());
                assert_eq!(send(&app, "k", "a").await, (StatusCode::CREATED, false), "never replayed");
                assert_eq!(eventually(&recorded, &shadow("replayed"), 1).await, 1, "the shadow store saw it");
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 2, "the old path wrote both");
                assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_records").await, 0);
                assert_eq!(count(&records_pool, "SELECT count(*) FROM idempotency_records").await, 1);

                // Enforced, the key is new to the business store: it executes, then replays.
                switch.set(RolloutMode::Enforce);
                assert_eq!(send(&app, "k", "a").await, (StatusCode::CREATED, false));
                assert_eq!(send(&app, "k", "a").await, (StatusCode::CREATED, true));
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 3);
                assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_records").await, 1);
                assert_eq!(count(&records_pool, "SELECT count(*) FROM idempotency_records").await, 1);
            }

            #[tokio::test]
            async fn a_failing_shadow_write_keeps_the_answer_and_the_committed_write() {
                let recorded = std::sync::Arc::new(Recorded::default());
                let _guard = metrics::set_default_local_recorder(&*recorded);
                let (app, pool) = setup().await;
                // Every write of a record is refused, in the same transaction as the order.
                sqlx::raw_sql($refuse).execute(&pool).await.expect("refusing trigger");

                assert_eq!(send(&app, "f", "a").await, (StatusCode::CREATED, false));
                assert_eq!(eventually(&recorded, &shadow("store_unavailable"), 1).await, 1);
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1, "the order committed");
                assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_records").await, 0);

                // The store heals: the next request is recorded.
                sqlx::raw_sql($allow).execute(&pool).await.expect("drop the trigger");
                assert_eq!(send(&app, "f", "a").await, (StatusCode::CREATED, false));
                assert_eq!(eventually(&recorded, &shadow("executed"), 1).await, 1);
                assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 2);
                assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_records").await, 1);
            }
        }
    };
}

suite!(
    sqlite,
    sqlx::Sqlite,
    support::sqlite_store(CouplingMode::Atomic).await,
    "INSERT INTO orders (note) VALUES (?1)",
    "CREATE TRIGGER refuse BEFORE INSERT ON idempotency_records BEGIN SELECT RAISE(ABORT, 'refused'); END",
    "DROP TRIGGER refuse"
);
suite!(
    postgres,
    sqlx::Postgres,
    support::pg_store(CouplingMode::Atomic).await,
    "INSERT INTO orders (note) VALUES ($1)",
    "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$; \
     CREATE TRIGGER refuse BEFORE INSERT ON idempotency_records FOR EACH ROW EXECUTE FUNCTION refuse()",
    "DROP TRIGGER refuse ON idempotency_records"
);
