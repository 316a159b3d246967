//! Retention as the service configures it (`ORDERS_RETENTION_SECS`, `ORDERS_TOMBSTONE_SECS`),
//! and the recovery worker's purge.

use std::time::Duration;

use axum::http::StatusCode;

use crate::ALICE;
use crate::harness::{Orders, TestDb, order_body};
use crate::orders::lifecycle::Lifecycle;

pub(crate) async fn a_key_past_its_retention_is_422_expired_until_its_tombstone_ends_then_executes_afresh(db: &TestDb) {
    let lifecycle = Lifecycle {
        retention: Duration::from_millis(400),
        tombstone: Duration::from_millis(400),
        janitor_every: Duration::from_secs(60),
        ..Lifecycle::default()
    };
    let service = Orders::with_lifecycle(db, lifecycle);
    let body = order_body("book", "100");
    let uri = "/admin/idempotency/record?account=acct_alice&operation=orders.create&key=retained";
    service.create(ALICE, "retained", &body).await;

    // Past the retention: the answer is gone, the tombstone refuses the retry.
    tokio::time::sleep(lifecycle.retention + Duration::from_millis(50)).await;
    let late = service.post(Some(ALICE), Some("retained"), &body).await;
    late.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_expired");
    let record = service.operator("GET", uri, None).await;
    assert_eq!(record.status, StatusCode::OK, "{}", record.text());
    assert_eq!(record.json()["state"], "expired");
    assert_eq!(record.json()["expires_at"], serde_json::Value::Null, "{}", record.text());
    let counts = service.operator("GET", "/admin/idempotency/counts", None).await.json();
    assert_eq!(counts["expired"], 1, "{counts}");
    assert_eq!(counts["completed"], 0, "{counts}");
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders").await, 1);

    // Past the tombstone: the recovery worker deletes the record, and the key is free again.
    tokio::time::sleep(lifecycle.tombstone + Duration::from_millis(50)).await;
    let report = db.recovery_pass(&lifecycle).await;
    assert!(report.purged >= 1, "{report:?}");
    service.operator("GET", uri, None).await.assert_problem(StatusCode::NOT_FOUND, "record_not_found");
    let again = service.create(ALICE, "retained", &body).await;
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders").await, 2);
}
