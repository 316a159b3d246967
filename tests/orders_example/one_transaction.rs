//! The order and the stored answer commit together or not at all.

use axum::http::StatusCode;

use crate::ALICE;
use crate::harness::{Orders, TestDb, order_body};

// ---------------------------------------------------------------------------------------------
// One transaction
// ---------------------------------------------------------------------------------------------

pub(crate) async fn create_writes_the_order_and_the_stored_answer_in_one_transaction(db: &TestDb) {
    let service = Orders::new(db);

    // A 201: the order row and a completed record, committed together.
    let created = service.create(ALICE, "key-ok", &order_body("committed", "100")).await;
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'committed'").await, 1);
    assert_eq!(db.strings("SELECT state FROM idempotency_records").await, ["completed"]);
    let operation_id = created.json()["idempotency_operation_id"].as_str().expect("an operation id").to_owned();
    assert_eq!(db.strings("SELECT idempotency_operation_id FROM orders").await, [operation_id]);

    // The database refuses the INSERT: the handler answers a retryable 503, and the claim is
    // rolled back with it.
    db.execute(
        "CREATE TRIGGER refuse_sku BEFORE INSERT ON orders WHEN NEW.sku = 'refused'
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        "ALTER TABLE orders ADD CONSTRAINT refuse_sku CHECK (sku <> 'refused')",
    )
    .await;
    let failed = service.post(Some(ALICE), Some("key-refused"), &order_body("refused", "100")).await;
    let detail = failed.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable");
    assert!(detail.contains("nothing was created") && detail.contains("Idempotency-Key"), "{detail}");
    assert_eq!(failed.header("retry-after"), Some("1"));
    assert!(!failed.text().contains("refused by the test"), "the cause stays in the log: {}", failed.text());
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'refused'").await, 0);
    assert_eq!(db.idempotency_records().await, 1, "a 5xx leaves no record");
    db.execute("DROP TRIGGER refuse_sku", "ALTER TABLE orders DROP CONSTRAINT refuse_sku").await;
    let retried = service.create(ALICE, "key-refused", &order_body("refused", "100")).await;
    assert_eq!(retried.header("idempotent-replayed"), None, "nothing was stored, so the retry executes");

    // The INSERT succeeds but the answer cannot be stored: the order is rolled back with it.
    db.execute(
        "CREATE TRIGGER refuse_completion BEFORE UPDATE ON idempotency_records WHEN NEW.state = 'completed'
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        "ALTER TABLE idempotency_records ADD CONSTRAINT refuse_completion CHECK (state <> 'completed') NOT VALID",
    )
    .await;
    let unanswered = service.post(Some(ALICE), Some("key-unanswered"), &order_body("unanswered", "100")).await;
    assert!(unanswered.status.is_server_error(), "{} {}", unanswered.status, unanswered.text());
    assert_eq!(unanswered.header("content-type"), Some("application/problem+json"));
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'unanswered'").await, 0, "the INSERT rolled back");
    assert_eq!(db.idempotency_records().await, 2);
    db.execute("DROP TRIGGER refuse_completion", "ALTER TABLE idempotency_records DROP CONSTRAINT refuse_completion")
        .await;
    let answered = service.create(ALICE, "key-unanswered", &order_body("unanswered", "100")).await;
    assert_eq!(answered.header("idempotent-replayed"), None);
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders WHERE sku = 'unanswered'").await, 1);
    assert_eq!(db.strings("SELECT state FROM idempotency_records").await, ["completed"; 3]);
}
