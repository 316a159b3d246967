//! The kill switch keeps the old path, on both SQL stores over HTTP: in `Off` and `Shadow` a
//! handler written for atomic mode (it takes a `TxHandle`) still gets a plain transaction from
//! the same store, committed when it is done, with no claim and no stored answer; in `Shadow`
//! the request is recorded apart, so turning enforcement on later replays nothing it saw.
#![cfg(all(feature = "axum", feature = "sqlite", feature = "postgres"))]

mod support;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{CouplingMode, IdempotencyContext, IdempotencyLayer, RolloutMode, RolloutSwitch, Store};

/// What one answer looked like.
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: String,
}

async fn send(app: &Router, key: &str, note: &str) -> Answer {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Body::from(note.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer { status, replayed, body: String::from_utf8_lossy(&body).into_owned() }
}

/// The route of each store: a handler that needs the transaction (it answers 500 without one),
/// inserts `(operation_id, note)` through it, and answers 422 for the note `reject` after
/// writing (which the outcome rule rolls back).
macro_rules! suite {
    ($name:ident, $db:ty, $store:expr, $insert:literal) => {
        mod $name {
            use super::*;
            use tower_idempotency::TxHandle;

            async fn create(
                tx: Option<TxHandle<$db>>,
                context: Option<IdempotencyContext>,
                note: String,
            ) -> (StatusCode, String) {
                let Some(tx) = tx else {
                    return (StatusCode::INTERNAL_SERVER_ERROR, "no transaction".into());
                };
                let operation_id = context.map(|c| c.operation_id().to_owned()).unwrap_or_default();
                let mut conn = tx.acquire().await.expect("open transaction");
                sqlx::query($insert).bind(&operation_id).bind(&note).execute(&mut *conn).await.expect("insert");
                if note == "reject" {
                    return (StatusCode::UNPROCESSABLE_ENTITY, "rejected".into());
                }
                (StatusCode::CREATED, format!("created {note}"))
            }

            async fn setup() -> (Router, RolloutSwitch, Count) {
                let store = $store;
                sqlx::raw_sql("CREATE TABLE orders (operation_id text NOT NULL, note text NOT NULL)")
                    .execute(store.pool())
                    .await
                    .expect("orders table");
                let switch = RolloutSwitch::new(RolloutMode::Off);
                let layer = IdempotencyLayer::new(store.clone()).shared_scope("tenant").rollout(switch.clone());
                let app = Router::new().route("/orders", post(create).layer(layer));
                let count = Count { pool: store.pool().clone() };
                (app, switch, count)
            }

            #[derive(Clone)]
            struct Count {
                pool: sqlx::Pool<$db>,
            }

            impl Count {
                async fn orders(&self) -> i64 {
                    sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(&self.pool).await.unwrap()
                }
                async fn distinct_operations(&self) -> i64 {
                    sqlx::query_scalar("SELECT count(DISTINCT operation_id) FROM orders")
                        .fetch_one(&self.pool)
                        .await
                        .unwrap()
                }
                async fn records(&self) -> i64 {
                    sqlx::query_scalar("SELECT count(*) FROM idempotency_records").fetch_one(&self.pool).await.unwrap()
                }
            }

            #[tokio::test]
            async fn off_gives_an_atomic_handler_a_plain_transaction_and_stores_nothing() {
                let (app, _switch, count) = setup().await;
                for _ in 0..2 {
                    let answer = send(&app, "k-off", "a").await;
                    assert_eq!((answer.status, answer.body.as_str()), (StatusCode::CREATED, "created a"));
                    assert!(!answer.replayed, "the old path never replays");
                }
                assert_eq!(count.orders().await, 2, "the old path creates an order on every call, committed");
                assert_eq!(count.distinct_operations().await, 1, "both carry the key's operation id");
                assert_eq!(count.records().await, 0, "no claim and no stored answer");
                // The outcome rule still applies: a 422 rolls the handler's write back.
                assert_eq!(send(&app, "k-reject", "reject").await.status, StatusCode::UNPROCESSABLE_ENTITY);
                assert_eq!(count.orders().await, 2, "a released answer rolls the plain transaction back");
            }

            #[tokio::test]
            async fn enforce_is_the_negative_control_one_order_and_a_replay() {
                let (app, switch, count) = setup().await;
                switch.set(RolloutMode::Enforce);
                let first = send(&app, "k-enforce", "a").await;
                let retry = send(&app, "k-enforce", "a").await;
                assert_eq!((first.status, first.replayed), (StatusCode::CREATED, false));
                assert_eq!((retry.status, retry.replayed), (StatusCode::CREATED, true));
                assert_eq!(count.orders().await, 1);
                assert_eq!(count.records().await, 1);
            }

            #[tokio::test]
            async fn shadow_answers_as_off_records_apart_and_enforce_replays_nothing_it_saw() {
                let (app, switch, count) = setup().await;
                switch.set(RolloutMode::Shadow);
                for _ in 0..2 {
                    let answer = send(&app, "k-shadow", "a").await;
                    assert_eq!((answer.status, answer.replayed), (StatusCode::CREATED, false));
                }
                assert_eq!(count.orders().await, 2, "shadow mode never changes the answer nor stops a duplicate");
                // The shadow record is written after the answer, off the request's path.
                let mut waited = 0;
                while count.records().await < 1 && waited < 500 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    waited += 1;
                }
                assert_eq!(count.records().await, 1, "one shadow record for the key");
                switch.set(RolloutMode::Enforce);
                let first = send(&app, "k-shadow", "a").await;
                assert_eq!((first.status, first.replayed), (StatusCode::CREATED, false), "not a shadow replay");
                assert_eq!(count.orders().await, 3);
                let retry = send(&app, "k-shadow", "a").await;
                assert!(retry.replayed, "enforced from now on");
                assert_eq!(count.orders().await, 3);
            }
        }
    };
}

suite!(
    sqlite,
    sqlx::Sqlite,
    support::sqlite_store(CouplingMode::Atomic).await,
    "INSERT INTO orders (operation_id, note) VALUES (?1, ?2)"
);
suite!(
    postgres,
    sqlx::Postgres,
    support::pg_store(CouplingMode::Atomic).await,
    "INSERT INTO orders (operation_id, note) VALUES ($1, $2)"
);

/// A leased store hands out no handle in enforce mode, and none on the old path either.
#[tokio::test]
async fn a_leased_store_has_no_plain_transaction() {
    let store = support::sqlite_store(CouplingMode::Leased).await;
    assert!(store.plain_transaction(Duration::from_secs(1)).await.expect("no error").is_none());
    let atomic = support::sqlite_store(CouplingMode::Atomic).await;
    let tx = atomic.plain_transaction(Duration::from_secs(1)).await.expect("begin").expect("atomic has one");
    tx.commit().await.expect("commit");
}
