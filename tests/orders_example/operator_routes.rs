//! The operator routes of the idempotency records (`/admin/idempotency/...`) and the public
//! operation status route (`GET /operations/{operation_id}`).

use axum::http::StatusCode;
use serde_json::Value;

use crate::harness::{Orders, TestDb, UNKNOWN_OPERATION, order_body};
use crate::{ALICE, BOB};

const CREATE: &str = "orders.create";

fn record_uri(path: &str, account: &str, operation: &str, key: &str) -> String {
    format!("/admin/idempotency/{path}?account={account}&operation={operation}&key={key}")
}

/// An RFC 3339 UTC time with microseconds, as the service writes them.
fn assert_time(value: &Value) {
    let text = value.as_str().unwrap_or_else(|| panic!("a time, got {value}"));
    assert_eq!(text.len(), "2025-01-02T03:04:05.000006Z".len(), "{text}");
    assert!(text.ends_with('Z') && text.as_bytes()[10] == b'T' && text.as_bytes()[19] == b'.', "{text}");
}

// ---------------------------------------------------------------------------------------------
// The token
// ---------------------------------------------------------------------------------------------

pub(crate) async fn operator_routes_answer_401_without_the_token_and_404_when_it_is_unset(db: &TestDb) {
    let service = Orders::new(db);
    service.create(ALICE, "key-1", &order_body("book", "100")).await;
    let routes = [
        ("GET", record_uri("record", ALICE, CREATE, "key-1")),
        ("DELETE", record_uri("record", ALICE, CREATE, "key-1")),
        ("POST", record_uri("record/settle", ALICE, CREATE, "key-1")),
        ("GET", "/admin/idempotency/unknown".to_owned()),
        ("GET", "/admin/idempotency/counts".to_owned()),
    ];
    for (method, uri) in &routes {
        for authorization in [None, Some("Bearer not-the-operator-token"), Some(ALICE), Some("Basic b3A6b3A=")] {
            let answer = service.operator_as(authorization, method, uri, None).await;
            answer.assert_problem(StatusCode::UNAUTHORIZED, "unauthenticated");
        }
        // Without ORDERS_ADMIN_TOKEN the routes do not exist, whatever the request carries.
        for authorization in [None, Some("Bearer operator-token-0123456789")] {
            let answer = service.operator_without_token(authorization, method, uri).await;
            answer.assert_problem(StatusCode::NOT_FOUND, "not_found");
        }
    }
    // The refused DELETE deleted nothing.
    let record = service.operator("GET", &record_uri("record", ALICE, CREATE, "key-1"), None).await;
    assert_eq!(record.status, StatusCode::OK, "{}", record.text());
}

// ---------------------------------------------------------------------------------------------
// Inspect and evict
// ---------------------------------------------------------------------------------------------

pub(crate) async fn a_record_is_inspected_by_account_operation_and_key_and_never_shows_the_key(db: &TestDb) {
    let service = Orders::new(db);
    let key = "inspect-me-7f3a9c";
    let created = service.create(ALICE, key, &order_body("book", "100")).await;
    let operation_id = created.json()["idempotency_operation_id"].as_str().expect("an operation id").to_owned();

    let answer = service.operator("GET", &record_uri("record", ALICE, CREATE, key), None).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert_eq!(answer.header("content-type"), Some("application/json"));
    let record = answer.json();
    let members: Vec<&str> = record.as_object().expect("an object").keys().map(String::as_str).collect();
    let mut expected =
        ["created_at", "expires_at", "fencing_token", "operation_id", "state", "status", "updated_at"].to_vec();
    expected.sort_unstable();
    let mut members = members;
    members.sort_unstable();
    assert_eq!(members, expected, "{record}");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["operation_id"], operation_id.as_str());
    assert_eq!(record["status"], 201);
    // A number (0 for PostgreSQL's atomic records; SQLite draws one for every claim).
    assert!(record["fencing_token"].as_u64().is_some(), "{record}");
    for time in ["created_at", "updated_at", "expires_at"] {
        assert_time(&record[time]);
    }
    assert!(record["expires_at"].as_str() > record["created_at"].as_str(), "{record}");
    assert!(!answer.text().contains(key), "the raw key is never shown: {}", answer.text());

    // Another account, operation or key names another record: none.
    for uri in [
        record_uri("record", BOB, CREATE, key),
        record_uri("record", ALICE, "orders.other", key),
        record_uri("record", ALICE, CREATE, "inspect-me-7f3a9d"),
    ] {
        service.operator("GET", &uri, None).await.assert_problem(StatusCode::NOT_FOUND, "record_not_found");
    }
}

pub(crate) async fn a_record_query_missing_a_parameter_or_with_an_invalid_one_is_400_invalid_query(db: &TestDb) {
    let service = Orders::new(db);
    let too_long_account = "a".repeat(65);
    let too_long_key = "k".repeat(256);
    for uri in [
        "/admin/idempotency/record".to_owned(),
        format!("/admin/idempotency/record?account={ALICE}&operation={CREATE}"),
        format!("/admin/idempotency/record?account={ALICE}&key=k"),
        format!("/admin/idempotency/record?operation={CREATE}&key=k"),
        format!("/admin/idempotency/record?account=&operation={CREATE}&key=k"),
        record_uri("record", &too_long_account, CREATE, "k"),
        record_uri("record", ALICE, CREATE, &too_long_key),
        record_uri("record", ALICE, CREATE, "two%20words"),
        format!("/admin/idempotency/record?account={ALICE}&account={BOB}&operation={CREATE}&key=k"),
    ] {
        for method in ["GET", "DELETE"] {
            let answer = service.operator(method, &uri, None).await;
            let detail = answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_query");
            assert!(!detail.is_empty(), "{uri}");
        }
    }
    for limit in ["0", "1001", "-1", "ten"] {
        let answer = service.operator("GET", &format!("/admin/idempotency/unknown?limit={limit}"), None).await;
        answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_limit");
    }
}

pub(crate) async fn evicting_a_record_lets_its_key_execute_afresh(db: &TestDb) {
    let service = Orders::new(db);
    let body = order_body("book", "100");
    let first = service.create(ALICE, "evict-1", &body).await;
    let uri = record_uri("record", ALICE, CREATE, "evict-1");

    let evicted = service.operator("DELETE", &uri, None).await;
    assert_eq!(evicted.status, StatusCode::NO_CONTENT, "{}", evicted.text());
    assert!(evicted.body.is_empty());
    service.operator("GET", &uri, None).await.assert_problem(StatusCode::NOT_FOUND, "record_not_found");
    service.operator("DELETE", &uri, None).await.assert_problem(StatusCode::NOT_FOUND, "record_not_found");

    // The key is free: the same request executes again (a second order: what eviction means).
    let again = service.create(ALICE, "evict-1", &body).await;
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_ne!(again.json()["order_id"], first.json()["order_id"]);
    assert_eq!(db.scalar("SELECT COUNT(*) FROM orders").await, 2);
    let replay = service.create(ALICE, "evict-1", &body).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
}

pub(crate) async fn a_record_in_flight_is_shown_processing_and_evicting_it_takes_the_claim_from_its_holder(
    db: &TestDb,
) {
    let service = Orders::new(db);
    let held = db.hold_leased_claim(ALICE, "payments.charge", "in-flight-1").await.expect("a fresh claim");
    let token = held.fencing_token().expect("a leased claim has a token");
    let uri = record_uri("record", ALICE, "payments.charge", "in-flight-1");

    let record = service.operator("GET", &uri, None).await.json();
    assert_eq!(record["state"], "processing", "{record}");
    assert_eq!(record["status"], Value::Null, "nothing stored yet: {record}");
    assert_eq!(record["fencing_token"], token, "{record}");
    assert_time(&record["expires_at"]);
    let counts = service.operator("GET", "/admin/idempotency/counts", None).await.json();
    assert_eq!(counts["processing"], 1, "{counts}");
    let operation_id = record["operation_id"].as_str().expect("an operation id");
    let status = service.get(ALICE, &format!("/operations/{operation_id}")).await.json();
    assert_eq!(
        status,
        serde_json::json!({"operation_id": operation_id, "state": "processing", "status": null, "location": null})
    );
    let settle = r#"{"state": "completed", "status": 201}"#;
    let refused = service
        .operator("POST", &record_uri("record/settle", ALICE, "payments.charge", "in-flight-1"), Some(settle))
        .await;
    let detail = refused.assert_problem(StatusCode::CONFLICT, "record_not_unknown");
    assert!(detail.contains("processing"), "{detail}");

    // Evicted while its holder runs: the holder's outcome is refused, and nothing comes back.
    let evicted = service.operator("DELETE", &uri, None).await;
    assert_eq!(evicted.status, StatusCode::NO_CONTENT, "{}", evicted.text());
    assert!(held.complete().await.is_err(), "a holder whose record was evicted must not store its outcome");
    service.operator("GET", &uri, None).await.assert_problem(StatusCode::NOT_FOUND, "record_not_found");
    assert_eq!(db.idempotency_records().await, 0);
}

// ---------------------------------------------------------------------------------------------
// Unknown outcomes and settling by hand
// ---------------------------------------------------------------------------------------------

pub(crate) async fn an_unknown_outcome_is_409_until_an_operator_settles_it_and_then_replays_the_settlement(
    db: &TestDb,
) {
    let service = Orders::new(db);
    let first = service.post_unknown(ALICE, "unknown-1").await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT, "the marked answer still reaches the client");

    let uri = record_uri("record", ALICE, UNKNOWN_OPERATION, "unknown-1");
    let record = service.operator("GET", &uri, None).await;
    assert_eq!(record.status, StatusCode::OK, "{}", record.text());
    assert_eq!(record.json()["state"], "unknown");
    let retry = service.post_unknown(ALICE, "unknown-1").await;
    retry.assert_problem(StatusCode::CONFLICT, "idempotency_outcome_unknown");
    assert!(retry.header("retry-after").is_some());

    // The operator found the effect happened, and settles it with the answer it should have had.
    let settlement = r#"{"state": "completed", "status": 201,
        "headers": {"Location": "/things/42", "content-type": "application/json"},
        "body": "{\"thing\":42}"}"#;
    let settled = service
        .operator("POST", &record_uri("record/settle", ALICE, UNKNOWN_OPERATION, "unknown-1"), Some(settlement))
        .await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.text());
    let settled = settled.json();
    assert_eq!(settled["state"], "completed");
    assert_eq!(settled["status"], 201);
    assert_eq!(settled["operation_id"], record.json()["operation_id"]);

    let replay = service.post_unknown(ALICE, "unknown-1").await;
    assert_eq!(replay.status, StatusCode::CREATED, "{}", replay.text());
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("location"), Some("/things/42"));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(replay.text(), r#"{"thing":42}"#);

    // Settled once: a second settlement is refused, and changes nothing.
    let again = r#"{"state": "failed", "status": 402, "body": "declined"}"#;
    let refused = service
        .operator("POST", &record_uri("record/settle", ALICE, UNKNOWN_OPERATION, "unknown-1"), Some(again))
        .await;
    let detail = refused.assert_problem(StatusCode::CONFLICT, "record_not_unknown");
    assert!(detail.contains("completed"), "{detail}");
    assert_eq!(service.post_unknown(ALICE, "unknown-1").await.text(), r#"{"thing":42}"#);

    // Settled as failed: retries replay the failure.
    service.post_unknown(ALICE, "unknown-2").await;
    let failed = r#"{"state": "failed", "status": 402, "headers": {"content-type": "text/plain"}, "body": "declined"}"#;
    let settled = service
        .operator("POST", &record_uri("record/settle", ALICE, UNKNOWN_OPERATION, "unknown-2"), Some(failed))
        .await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.text());
    assert_eq!(settled.json()["state"], "failed");
    let replay = service.post_unknown(ALICE, "unknown-2").await;
    assert_eq!((replay.status, replay.text().as_str()), (StatusCode::PAYMENT_REQUIRED, "declined"));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
}

pub(crate) async fn unknown_records_are_listed_oldest_first_and_counted_by_state(db: &TestDb) {
    let service = Orders::new(db);
    let empty = service.operator("GET", "/admin/idempotency/counts", None).await;
    assert_eq!(empty.status, StatusCode::OK, "{}", empty.text());
    assert_eq!(
        empty.json(),
        serde_json::json!({"processing": 0, "completed": 0, "failed": 0, "unknown": 0, "expired": 0})
    );

    let mut operation_ids = Vec::new();
    for n in 0..3 {
        service.post_unknown(ALICE, &format!("list-{n}")).await;
        let record =
            service.operator("GET", &record_uri("record", ALICE, UNKNOWN_OPERATION, &format!("list-{n}")), None).await;
        operation_ids.push(record.json()["operation_id"].as_str().expect("an operation id").to_owned());
        // Distinct claim times, whatever the clock's resolution.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    service.create(ALICE, "listed-not", &order_body("book", "1")).await;

    let page = service.operator("GET", "/admin/idempotency/unknown", None).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.text());
    let records = page.json()["records"].as_array().expect("records").clone();
    let listed: Vec<&str> = records.iter().map(|r| r["operation_id"].as_str().expect("an operation id")).collect();
    assert_eq!(listed, operation_ids.iter().map(String::as_str).collect::<Vec<_>>(), "oldest first");
    for record in &records {
        assert_eq!(record["operation"], UNKNOWN_OPERATION);
        assert!(record["age_seconds"].as_u64().is_some(), "{record}");
        assert_time(&record["created_at"]);
    }
    let first_two = service.operator("GET", "/admin/idempotency/unknown?limit=2", None).await.json();
    let first_two: Vec<&str> =
        first_two["records"].as_array().expect("records").iter().map(|r| r["operation_id"].as_str().unwrap()).collect();
    assert_eq!(first_two, listed[..2]);

    let counts = service.operator("GET", "/admin/idempotency/counts", None).await.json();
    assert_eq!(counts, serde_json::json!({"processing": 0, "completed": 1, "failed": 0, "unknown": 3, "expired": 0}));
}

pub(crate) async fn settling_a_record_that_is_not_unknown_is_409_and_a_bad_settlement_is_422_or_415(db: &TestDb) {
    let service = Orders::new(db);
    let created = service.create(ALICE, "settle-completed", &order_body("book", "1")).await;
    let good = r#"{"state": "completed", "status": 201, "headers": {}, "body": ""}"#;
    let uri = record_uri("record/settle", ALICE, CREATE, "settle-completed");
    service.operator("POST", &uri, Some(good)).await.assert_problem(StatusCode::CONFLICT, "record_not_unknown");
    let missing = record_uri("record/settle", ALICE, CREATE, "never-used");
    service.operator("POST", &missing, Some(good)).await.assert_problem(StatusCode::NOT_FOUND, "record_not_found");

    service.post_unknown(ALICE, "settle-bad").await;
    let uri = record_uri("record/settle", ALICE, UNKNOWN_OPERATION, "settle-bad");
    for (bad, names) in [
        (r#"{"state": "expired", "status": 201}"#, "state"),
        (r#"{"state": "completed", "status": 404}"#, "status"),
        (r#"{"state": "failed", "status": 201}"#, "status"),
        (r#"{"state": "completed", "status": 1000}"#, "status"),
        (r#"{"state": "completed", "status": 201, "headers": {"set-cookie": "a=b"}}"#, "set-cookie"),
        (r#"{"state": "completed", "status": 201, "headers": {"x-custom": "1"}}"#, "x-custom"),
        (r#"{"state": "completed", "status": 201, "headers": {"location": "/a", "Location": "/b"}}"#, "twice"),
        (r#"{"state": "completed", "status": 201, "headers": {"location": "a\u0001b"}}"#, "location"),
        (r#"{"state": "completed", "status": 201, "extra": true}"#, "extra"),
        (r#"{"state": "completed"}"#, "status"),
        (r#"{"state": "completed", "status": 201, "body": 5}"#, "string"),
        (r#"[{"state": "completed", "status": 201}]"#, "object"),
        ("not json", "object"),
    ] {
        let answer = service.operator("POST", &uri, Some(bad)).await;
        let detail = answer.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid_settlement");
        assert!(detail.contains(names), "{bad}: {detail}");
    }
    // A body not declared as JSON.
    let undeclared = service.operator("POST", &uri, None).await;
    undeclared.assert_problem(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");

    // Every refusal left the record unknown, and the created order's record completed.
    let record = service.operator("GET", &record_uri("record", ALICE, UNKNOWN_OPERATION, "settle-bad"), None).await;
    assert_eq!(record.json()["state"], "unknown");
    let record = service.operator("GET", &record_uri("record", ALICE, CREATE, "settle-completed"), None).await;
    assert_eq!(record.json()["state"], "completed");
    assert_eq!(record.json()["operation_id"], created.json()["idempotency_operation_id"]);
}

// ---------------------------------------------------------------------------------------------
// GET /operations/{operation_id}
// ---------------------------------------------------------------------------------------------

pub(crate) async fn operation_status_is_the_callers_own_and_the_same_404_for_anything_else(db: &TestDb) {
    let service = Orders::new(db);
    let created = service.create(ALICE, "op-1", &order_body("book", "100")).await;
    let order = created.json();
    let operation_id = order["idempotency_operation_id"].as_str().expect("an operation id");

    let answer = service.get(ALICE, &format!("/operations/{operation_id}")).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert_eq!(answer.header("content-type"), Some("application/json"));
    assert_eq!(
        answer.json(),
        serde_json::json!({
            "operation_id": operation_id,
            "state": "succeeded",
            "status": 201,
            "location": format!("/orders/{}", order["order_id"].as_str().unwrap()),
        })
    );

    // An unknown outcome, then settled as failed.
    service.post_unknown(ALICE, "op-2").await;
    let record = service.operator("GET", &record_uri("record", ALICE, UNKNOWN_OPERATION, "op-2"), None).await;
    let unknown_id = record.json()["operation_id"].as_str().expect("an operation id").to_owned();
    let status = service.get(ALICE, &format!("/operations/{unknown_id}")).await.json();
    assert_eq!(status["state"], "unknown");
    let failed = r#"{"state": "failed", "status": 409, "body": "refused"}"#;
    service.operator("POST", &record_uri("record/settle", ALICE, UNKNOWN_OPERATION, "op-2"), Some(failed)).await;
    let status = service.get(ALICE, &format!("/operations/{unknown_id}")).await.json();
    assert_eq!(
        status,
        serde_json::json!({"operation_id": unknown_id, "state": "failed", "status": 409, "location": null})
    );

    // Bob's view of Alice's operation, an id nobody has, and malformed ids: the same 404.
    let nobodys = "00000000-0000-4000-8000-000000000000";
    let upper = operation_id.to_uppercase();
    let mut answers = Vec::new();
    for (account, id) in [(BOB, operation_id), (ALICE, nobodys), (ALICE, "not-an-id"), (ALICE, &upper), (ALICE, "%FF")]
    {
        let answer = service.get(account, &format!("/operations/{id}")).await;
        answer.assert_problem(StatusCode::NOT_FOUND, "operation_not_found");
        answers.push(answer.body);
    }
    assert!(answers.windows(2).all(|pair| pair[0] == pair[1]), "every 404 is the same answer");

    // Authenticated like every route.
    let request =
        axum::http::Request::get(format!("/operations/{operation_id}")).body(axum::body::Body::empty()).unwrap();
    service.send(request).await.assert_problem(StatusCode::UNAUTHORIZED, "unauthenticated");
}
