//! Atomic mode on the real PostgreSQL: the business write and the stored answer commit together
//! or not at all, and the layer fails closed when it cannot be sure.
#![cfg(all(feature = "axum", feature = "postgres"))]

mod support;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlx::Postgres;
use tower::ServiceExt;
use tower_idempotency::{CouplingMode, IdempotencyContext, IdempotencyLayer, OutcomeClass, PostgresStore, TxHandle};

async fn store_with_orders() -> PostgresStore {
    let store = support::pg_store(CouplingMode::Atomic).await;
    sqlx::raw_sql("CREATE TABLE orders (operation_id text NOT NULL, note text NOT NULL)")
        .execute(store.pool())
        .await
        .expect("orders table");
    store
}

async fn send(app: &Router, key: &str, note: &str) -> (StatusCode, String) {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Body::from(note.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Claims a new identity for `key` and writes one order (`key`, `note`) through the claim's
/// transaction, giving the handle back: a claim ready to finish.
async fn claim_with_an_order(
    store: &PostgresStore,
    key: &str,
    note: &str,
) -> tower_idempotency::store::postgres::PgClaim {
    use tower_idempotency::{Begin, BeginRequest, Claim, Fingerprint, IdempotencyKey, RecordId, Scope, Store};

    let id = RecordId::new(&Scope::new("atomic"), "POST /orders", &IdempotencyKey::new(key).unwrap());
    let fingerprint = Fingerprint::from_parts(tower_idempotency::fingerprint::FINGERPRINT_VERSION, [7; 32]);
    let Begin::Claimed(claim) = store.begin(BeginRequest::new(&id, &fingerprint)).await.expect("begin") else {
        panic!("a new identity must be claimed");
    };
    let handle = claim.handle().expect("an atomic claim hands out its transaction");
    let mut conn = handle.acquire().await.expect("open transaction");
    sqlx::query("INSERT INTO orders (operation_id, note) VALUES ($1, $2)")
        .bind(key)
        .bind(note)
        .execute(&mut *conn)
        .await
        .unwrap();
    claim
}

async fn orders(store: &PostgresStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(store.pool()).await.unwrap()
}

async fn records(store: &PostgresStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_records").fetch_one(store.pool()).await.unwrap()
}

async fn insert(tx: &TxHandle<Postgres>, context: &IdempotencyContext, note: &str) {
    let mut conn = tx.acquire().await.expect("open transaction");
    sqlx::query("INSERT INTO orders (operation_id, note) VALUES ($1, $2)")
        .bind(context.operation_id())
        .bind(note)
        .execute(&mut *conn)
        .await
        .expect("insert");
}

fn app(store: &PostgresStore, handler: axum::routing::MethodRouter) -> Router {
    Router::new().route("/orders", handler.layer(IdempotencyLayer::new(store.clone()).shared_scope("atomic")))
}

#[tokio::test]
async fn handle_kept_past_the_response_rolls_back_and_answers_500() {
    let store = store_with_orders().await;
    let app = app(
        &store,
        post(|context: IdempotencyContext, tx: TxHandle<Postgres>, note: String| async move {
            insert(&tx, &context, &note).await;
            // The handle escapes into a task that outlives the response.
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                drop(tx);
            });
            StatusCode::CREATED
        }),
    );
    let (status, body) = send(&app, "held", "a").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(body.contains("idempotency_handle_still_held"), "{body}");
    assert_eq!((orders(&store).await, records(&store).await), (0, 0), "nothing may commit");
}

#[tokio::test]
async fn commit_that_fails_answers_503_commit_uncertain_and_leaves_nothing() {
    let store = store_with_orders().await;
    // A deferred constraint trigger fails at COMMIT, after everything else succeeded.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN IF NEW.note = 'refuse' THEN RAISE EXCEPTION 'refused at commit'; END IF; RETURN NEW; END $$; \
         CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON orders \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_at_commit();",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let app = app(
        &store,
        post(|context: IdempotencyContext, tx: TxHandle<Postgres>, note: String| async move {
            insert(&tx, &context, &note).await;
            StatusCode::CREATED
        }),
    );
    let (status, body) = send(&app, "commit", "refuse").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("idempotency_commit_uncertain"), "{body}");
    assert!(!body.contains("refused at commit"), "no database error text in the answer: {body}");
    assert_eq!((orders(&store).await, records(&store).await), (0, 0));
    // A retry with the same key is safe: nothing was committed, so it executes.
    sqlx::raw_sql("DROP TRIGGER refuse_at_commit ON orders").execute(store.pool()).await.unwrap();
    assert_eq!(send(&app, "commit", "refuse").await.0, StatusCode::CREATED);
    assert_eq!((orders(&store).await, records(&store).await), (1, 1));
}

#[tokio::test]
async fn stored_failure_rolls_back_the_business_write_and_replays_the_failure() {
    let store = store_with_orders().await;
    let app = app(
        &store,
        post(|context: IdempotencyContext, tx: TxHandle<Postgres>, note: String| async move {
            insert(&tx, &context, &note).await;
            drop(tx);
            let mut response = axum::response::IntoResponse::into_response((StatusCode::PAYMENT_REQUIRED, "declined"));
            response.extensions_mut().insert(OutcomeClass::Reject);
            response
        }),
    );
    assert_eq!(send(&app, "declined", "x").await, (StatusCode::PAYMENT_REQUIRED, "declined".to_owned()));
    assert_eq!(send(&app, "declined", "x").await, (StatusCode::PAYMENT_REQUIRED, "declined".to_owned()));
    assert_eq!(orders(&store).await, 0, "a stored failure keeps no business write");
    let state: String =
        sqlx::query_scalar("SELECT state FROM idempotency_records").fetch_one(store.pool()).await.unwrap();
    assert_eq!(state, "failed");
}

#[tokio::test]
async fn handlers_nested_transactions_are_savepoints_inside_the_claim() {
    let store = store_with_orders().await;
    let app = app(
        &store,
        post(|context: IdempotencyContext, tx: TxHandle<Postgres>, note: String| async move {
            let mut conn = tx.acquire().await.unwrap();
            {
                // A repository that opens "its own" transaction gets a savepoint, not a COMMIT.
                let mut nested = sqlx::Connection::begin(&mut *conn).await.unwrap();
                sqlx::query("INSERT INTO orders (operation_id, note) VALUES ($1, $2)")
                    .bind(context.operation_id())
                    .bind(&note)
                    .execute(&mut *nested)
                    .await
                    .unwrap();
                nested.commit().await.unwrap();
            }
            drop(conn);
            drop(tx);
            StatusCode::INTERNAL_SERVER_ERROR // released: everything rolls back
        }),
    );
    assert_eq!(send(&app, "nested", "n").await.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(orders(&store).await, 0, "the nested commit must not have committed the claim's transaction");
}

#[tokio::test]
async fn handle_built_from_a_plain_transaction_for_unit_tests() {
    let store = store_with_orders().await;
    let handle = TxHandle::new(store.pool().begin().await.unwrap());
    {
        let mut conn = handle.acquire().await.unwrap();
        sqlx::query("INSERT INTO orders (operation_id, note) VALUES ('unit', 'test')")
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    handle.take().await.expect("the transaction").rollback().await.unwrap();
    assert!(handle.acquire().await.is_err(), "a taken handle is finished");
    assert_eq!(orders(&store).await, 0);
}

/// A claim whose record is beaten to the table (here by a writer that skips the claim's lock)
/// stores nothing: the primary key turns its record away, the COMMIT never runs, the business
/// write rolls back, and the claim reports the lease lost rather than an uncertain commit.
#[tokio::test]
async fn a_record_committed_first_by_another_writer_wins_and_the_business_write_rolls_back() {
    use tower_idempotency::store::FinishError;
    use tower_idempotency::{Claim, IdempotencyKey, Outcome, RecordId, Scope};

    let store = store_with_orders().await;
    let claim = claim_with_an_order(&store, "raced", "mine").await;
    let id = RecordId::new(&Scope::new("atomic"), "POST /orders", &IdempotencyKey::new("raced").unwrap());
    sqlx::query(
        "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token, \
             response_status) VALUES (decode($1, 'hex'), 'completed', 1, $2, 0, 201)",
    )
    .bind(id.to_hex())
    .bind(vec![7_u8; 32])
    .execute(store.pool())
    .await
    .expect("the other writer's record");
    let finished =
        claim.finish(Outcome::Complete(tower_idempotency::StoredResponse::new(StatusCode::CREATED, "mine"))).await;
    assert!(matches!(finished, Err(FinishError::ClaimLost)), "{finished:?}");
    assert_eq!((orders(&store).await, records(&store).await), (0, 1), "only the other writer's record may remain");
}

/// A unique violation of the application's own (here a deferred constraint, checked at COMMIT)
/// is not mistaken for another record winning the identity: the claim reports an uncertain
/// commit, and nothing of the claim is stored.
#[tokio::test]
async fn an_applications_own_unique_violation_at_commit_is_an_uncertain_commit_not_a_lost_identity() {
    use tower_idempotency::store::FinishError;
    use tower_idempotency::{Claim, Outcome};

    let store = store_with_orders().await;
    sqlx::raw_sql(
        "ALTER TABLE orders ADD CONSTRAINT orders_note_key UNIQUE (note) DEFERRABLE INITIALLY DEFERRED; \
         INSERT INTO orders (operation_id, note) VALUES ('earlier', 'taken')",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let claim = claim_with_an_order(&store, "deferred", "taken").await;
    let finished =
        claim.finish(Outcome::Complete(tower_idempotency::StoredResponse::new(StatusCode::CREATED, "x"))).await;
    assert!(matches!(finished, Err(FinishError::CommitUncertain(_))), "{finished:?}");
    assert_eq!((orders(&store).await, records(&store).await), (1, 0), "only the earlier order may remain");
}
