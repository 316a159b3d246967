//! Uniqueness at any isolation level: the storm of identical requests on PostgreSQL whose
//! sessions default to REPEATABLE READ or SERIALIZABLE. The primary key decides; a duplicate
//! that could not see the winner's commit is rolled back and told to retry (503), and its retry
//! replays. A duplicate that finds no pool connection, or keeps failing serialization, until
//! its wait runs out (384 requests share 24 connections, beside the rest of the suite) is told
//! to retry before anything runs (503 `idempotency_store_unavailable`). The same storms run on a
//! store whose answers are apart (`PostgresStore::answers_apart`).
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
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, PostgresStore, TxHandle};

const KEYS: usize = 12;
const DUPLICATES: usize = 32;

async fn create(context: IdempotencyContext, tx: TxHandle<Postgres>) -> (StatusCode, String) {
    let order_id = uuid::Uuid::new_v4().to_string();
    let mut conn = tx.acquire().await.expect("transaction");
    sqlx::query("INSERT INTO iso_orders (order_id, operation_id) VALUES ($1, $2)")
        .bind(&order_id)
        .bind(context.operation_id())
        .execute(&mut *conn)
        .await
        .expect("insert");
    (StatusCode::CREATED, order_id)
}

/// The storm with sessions at `level`, on a store with its answers apart if `apart`.
async fn storm_at(level: &str, apart: bool) {
    let schema = support::unique_name("tidem_iso");
    let options: sqlx::postgres::PgConnectOptions = support::database_url().parse().unwrap();
    let options = options.options([("search_path", schema.as_str()), ("default_transaction_isolation", level)]);
    let _schema = support::pg_schema(&schema).await;
    let admin = sqlx::PgPool::connect_with(options.clone()).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".iso_orders (order_id text PRIMARY KEY, operation_id text NOT NULL)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(24).connect_with(options).await.unwrap();
    let store = PostgresStore::new(pool).schema(&schema).unwrap();
    let store = if apart { store.answers_apart() } else { store };
    store.migrate().await.unwrap();
    let app = Router::new().route("/o", post(create).layer(IdempotencyLayer::new(store.clone()).shared_scope("iso")));

    let send = move |key: String| {
        let app = app.clone();
        async move {
            let request = Request::post("/o").header("idempotency-key", key).body(Body::empty()).unwrap();
            let response = app.oneshot(request).await.unwrap();
            let (status, replayed) = (response.status(), response.headers().contains_key("idempotent-replayed"));
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let barrier = Arc::new(Barrier::new(KEYS * DUPLICATES));
    let mut tasks = Vec::new();
    for k in 0..KEYS {
        for _ in 0..DUPLICATES {
            let (barrier, send, key) = (barrier.clone(), send.clone(), format!("{}-{k}", level.replace(" ", "_")));
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                (key.clone(), send(key).await)
            }));
        }
    }
    let mut executed: HashMap<String, String> = HashMap::new();
    let mut retryable = 0;
    for task in tasks {
        let (key, (status, replayed, body)) = task.await.unwrap();
        match status {
            StatusCode::CREATED if !replayed => {
                assert!(executed.insert(key.clone(), body).is_none(), "{level}: {key} executed twice");
            }
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => assert!(body.contains("idempotency_request_in_flight"), "{body}"),
            StatusCode::SERVICE_UNAVAILABLE => {
                let before_the_handler =
                    body.contains("idempotency_store_unavailable") && body.contains("nothing was executed");
                assert!(body.contains("idempotency_commit_uncertain") || before_the_handler, "{body}");
                retryable += 1;
            }
            other => panic!("{level}: unexpected {other}: {body}"),
        }
    }
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT operation_id, count(*) FROM \"{schema}\".iso_orders GROUP BY 1"
    )))
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(rows.len(), KEYS, "{level}: every key has its order");
    assert!(rows.iter().all(|(_, n)| *n == 1), "{level}: a key has more than one order: {rows:?}");
    for k in 0..KEYS {
        let key = format!("{}-{k}", level.replace(" ", "_"));
        let (status, replayed, body) = send(key.clone()).await;
        assert!(status == StatusCode::CREATED && replayed, "{level}: the retry of {key} replays");
        assert_eq!(Some(&body), executed.get(&key), "{level}: the replay is the executed answer");
    }
    println!(
        "{level}: {KEYS} keys x {DUPLICATES}: one order each; {retryable} duplicates were rolled back and told to retry"
    );
    admin.close().await;
}

#[test]
fn repeatable_read_sessions_still_create_one_order_per_key() {
    tower_idempotency::testkit::run(storm_at("repeatable read", false));
}

#[test]
fn repeatable_read_sessions_with_answers_apart_still_create_one_order_per_key() {
    tower_idempotency::testkit::run(storm_at("repeatable read", true));
}

#[test]
fn serializable_sessions_still_create_one_order_per_key() {
    tower_idempotency::testkit::run(storm_at("serializable", false));
}

#[test]
fn serializable_sessions_with_answers_apart_still_create_one_order_per_key() {
    tower_idempotency::testkit::run(storm_at("serializable", true));
}
