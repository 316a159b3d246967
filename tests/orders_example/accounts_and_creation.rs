//! Authentication, creation and its replays, exact amounts, and accounts kept apart.

use axum::body::Body;
use axum::http::{Request, StatusCode};

use crate::harness::{Orders, TestDb, ids, order_body, order_id};
use crate::{ALICE, BOB};

// ---------------------------------------------------------------------------------------------
// Authentication
// ---------------------------------------------------------------------------------------------

pub(crate) async fn request_without_authorization_is_401_and_stores_nothing_so_the_key_still_executes_later(
    db: &TestDb,
) {
    let service = Orders::new(db);
    let body = order_body("book", "100");

    let refused = service.post(None, Some("key-1"), &body).await;
    refused.assert_problem(StatusCode::UNAUTHORIZED, "unauthenticated");
    assert_eq!(refused.header("www-authenticate"), Some("Bearer realm=\"orders\""));
    assert_eq!(db.idempotency_records().await, 0, "a refused request must leave no idempotency record");

    let created = service.create(ALICE, "key-1", &body).await;
    assert_eq!(created.header("idempotent-replayed"), None, "the key must execute, not replay");
}

pub(crate) async fn malformed_authorization_is_401_on_every_route(db: &TestDb) {
    let service = Orders::new(db);
    let too_long = format!("Bearer {}", "a".repeat(65));
    for authorization in ["Basic YWxpY2U6cHc=", "Bearer", "Bearer ", "Bearer two words", "acct_alice", &too_long] {
        for (method, uri) in [("POST", "/orders"), ("GET", "/orders"), ("GET", "/orders/whatever")] {
            let request = Request::builder()
                .method(method)
                .uri(uri)
                .header("authorization", authorization)
                .header("idempotency-key", "key-1")
                .header("content-type", "application/json")
                .body(Body::from(order_body("book", "1")))
                .expect("a valid request");
            service.send(request).await.assert_problem(StatusCode::UNAUTHORIZED, "unauthenticated");
        }
    }
    assert_eq!(db.idempotency_records().await, 0);
}

pub(crate) async fn bearer_scheme_is_case_insensitive_and_64_character_accounts_are_accepted(db: &TestDb) {
    let service = Orders::new(db);
    let account = "a".repeat(64);
    let request = Request::get("/orders")
        .header("authorization", format!("bearer {account}"))
        .body(Body::empty())
        .expect("a valid request");
    assert_eq!(service.send(request).await.status, StatusCode::OK);
}

// ---------------------------------------------------------------------------------------------
// Create and replay
// ---------------------------------------------------------------------------------------------

pub(crate) async fn create_answers_201_with_location_json_and_the_order(db: &TestDb) {
    let service = Orders::new(db);
    let created = service.create(ALICE, "key-1", &order_body("book-42", "1500")).await;

    assert_eq!(created.header("content-type"), Some("application/json"));
    let order = created.json();
    let id = order["order_id"].as_str().expect("an order id");
    assert!(uuid::Uuid::try_parse(id).is_ok_and(|uuid| uuid.get_version_num() == 4), "{id}");
    assert_eq!(created.header("location"), Some(format!("/orders/{id}").as_str()));
    assert_eq!(order["account_id"], ALICE);
    assert_eq!(order["sku"], "book-42");
    assert_eq!(order["quantity"], 2);
    assert_eq!(order["amount_minor"], 1500);
    assert_eq!(order["currency"], "JPY");
    assert_eq!(order["created_at"], "2025-01-02T03:04:05.000006Z");
    assert!(order["idempotency_operation_id"].as_str().is_some_and(|op| op.len() == 36), "{order}");

    let read = service.get(ALICE, &format!("/orders/{id}")).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.header("content-type"), Some("application/json"));
    assert_eq!(read.body, created.body, "GET answers the same order document");
}

pub(crate) async fn retry_with_same_key_and_body_replays_the_first_answer_and_creates_one_order(db: &TestDb) {
    let service = Orders::new(db);
    let body = order_body("book", "100");
    let first = service.create(ALICE, "key-1", &body).await;
    let retry = service.post(Some(ALICE), Some("key-1"), &body).await;

    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body, "the replay is byte for byte");
    assert_eq!(retry.header("location"), first.header("location"));
    assert_eq!(retry.header("content-type"), first.header("content-type"));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.header("idempotent-replayed"), None);

    let listed = service.list(ALICE, "/orders").await;
    assert_eq!(ids(listed["orders"].as_array().expect("orders")), vec![order_id(&first)]);
}

pub(crate) async fn same_key_with_a_different_body_is_422_idempotency_key_reused(db: &TestDb) {
    let service = Orders::new(db);
    service.create(ALICE, "key-1", &order_body("book", "100")).await;
    let reused = service.post(Some(ALICE), Some("key-1"), &order_body("pen", "100")).await;
    reused.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused");
    assert_eq!(service.list(ALICE, "/orders").await["orders"].as_array().map(Vec::len), Some(1));
}

pub(crate) async fn missing_idempotency_key_is_400_idempotency_key_missing_and_creates_nothing(db: &TestDb) {
    let service = Orders::new(db);
    let refused = service.post(Some(ALICE), None, &order_body("book", "100")).await;
    refused.assert_problem(StatusCode::BAD_REQUEST, "idempotency_key_missing");
    assert_eq!(service.list(ALICE, "/orders").await["orders"], serde_json::json!([]));
}

pub(crate) async fn invalid_input_is_422_validation_failed_and_a_corrected_retry_with_the_same_key_executes(
    db: &TestDb,
) {
    let service = Orders::new(db);
    let invalid = service.post(Some(ALICE), Some("key-1"), &order_body("book", "-100")).await;
    let detail = invalid.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed");
    assert!(detail.contains("amount_minor"), "{detail}");
    assert_eq!(invalid.header("idempotent-replayed"), None);

    let corrected = service.create(ALICE, "key-1", &order_body("book", "100")).await;
    assert_eq!(corrected.header("idempotent-replayed"), None, "the 422 was released, not stored");
    assert_eq!(corrected.json()["amount_minor"], 100);
}

pub(crate) async fn every_kind_of_invalid_order_is_422_validation_failed_naming_the_problem(db: &TestDb) {
    let service = Orders::new(db);
    let cases = [
        ("not json", "JSON object"),
        (r#"["a",1,1,"JPY"]"#, "JSON object"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"JPY""#, "not a valid order"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1}"#, "currency"),
        (r#"{"quantity":1,"amount_minor":1,"currency":"JPY"}"#, "sku"),
        (r#"{"sku":"","quantity":1,"amount_minor":1,"currency":"JPY"}"#, "sku"),
        (r#"{"sku":"a\u0007","quantity":1,"amount_minor":1,"currency":"JPY"}"#, "sku"),
        (r#"{"sku":1,"quantity":1,"amount_minor":1,"currency":"JPY"}"#, "invalid type"),
        (r#"{"sku":"a","quantity":0,"amount_minor":1,"currency":"JPY"}"#, "quantity"),
        (r#"{"sku":"a","quantity":-3,"amount_minor":1,"currency":"JPY"}"#, "quantity"),
        (r#"{"sku":"a","quantity":1.5,"amount_minor":1,"currency":"JPY"}"#, "invalid type"),
        (r#"{"sku":"a","quantity":"1","amount_minor":1,"currency":"JPY"}"#, "invalid type"),
        (r#"{"sku":"a","quantity":1,"amount_minor":-1,"currency":"JPY"}"#, "negative"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1.5,"currency":"JPY"}"#, "fraction"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1.0,"currency":"JPY"}"#, "fraction"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1e3,"currency":"JPY"}"#, "exponent"),
        (r#"{"sku":"a","quantity":1,"amount_minor":"100","currency":"JPY"}"#, "not a string"),
        (r#"{"sku":"a","quantity":1,"amount_minor":null,"currency":"JPY"}"#, "amount_minor"),
        (r#"{"sku":"a","quantity":1,"amount_minor":007,"currency":"JPY"}"#, "not a valid order"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"jpy"}"#, "currency"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"JPYY"}"#, "currency"),
        (r#"{"sku":"a","quantity":1,"amount_minor":1,"currency":"JPY","note":"x"}"#, "unknown field"),
        (r#"{"sku":"a","sku":"b","quantity":1,"amount_minor":1,"currency":"JPY"}"#, "duplicate field"),
    ];
    for (index, (body, expected)) in cases.iter().enumerate() {
        let answer = service.post(Some(ALICE), Some(&format!("key-{index}")), body).await;
        let detail = answer.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed");
        assert!(detail.contains(expected), "{body}: {detail:?} should mention {expected:?}");
    }
    assert_eq!(service.list(ALICE, "/orders").await["orders"], serde_json::json!([]));
    assert_eq!(db.idempotency_records().await, 0, "every 422 was released");
}

pub(crate) async fn a_body_not_declared_as_json_is_415(db: &TestDb) {
    let service = Orders::new(db);
    let request = Request::post("/orders")
        .header("authorization", format!("Bearer {ALICE}"))
        .header("idempotency-key", "key-1")
        .header("content-type", "text/plain")
        .body(Body::from(order_body("book", "1")))
        .expect("a valid request");
    service.send(request).await.assert_problem(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");
}

// ---------------------------------------------------------------------------------------------
// Exact amounts
// ---------------------------------------------------------------------------------------------

pub(crate) async fn amounts_beyond_f64_and_u64_are_preserved_exactly(db: &TestDb) {
    let service = Orders::new(db);
    for (key, amount) in [("key-1", "9007199254740993"), ("key-2", "123456789012345678901234567890"), ("key-3", "0")] {
        let created = service.create(ALICE, key, &order_body("book", amount)).await;
        let expected = format!(r#""amount_minor":{amount},"#);
        assert!(created.text().contains(&expected), "{}", created.text());
        let read = service.get(ALICE, created.header("location").expect("a location")).await;
        assert!(read.text().contains(&expected), "{}", read.text());
    }
}

pub(crate) async fn amounts_that_differ_beyond_f64_precision_under_different_keys_are_different_orders(db: &TestDb) {
    let service = Orders::new(db);
    let odd = service.create(ALICE, "key-1", &order_body("book", "9007199254740993")).await;
    let even = service.create(ALICE, "key-2", &order_body("book", "9007199254740992")).await;
    assert_eq!(even.header("idempotent-replayed"), None);
    assert_ne!(order_id(&odd), order_id(&even));
    assert!(odd.text().contains(r#""amount_minor":9007199254740993,"#));
    assert!(even.text().contains(r#""amount_minor":9007199254740992,"#));
    assert_eq!(service.list(ALICE, "/orders").await["orders"].as_array().map(Vec::len), Some(2));
}

pub(crate) async fn key_reused_with_an_amount_that_differs_beyond_f64_precision_is_422_idempotency_key_reused(
    db: &TestDb,
) {
    let service = Orders::new(db);
    service.create(ALICE, "key-1", &order_body("book", "9007199254740993")).await;
    let reused = service.post(Some(ALICE), Some("key-1"), &order_body("book", "9007199254740992")).await;
    reused.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused");
}

// ---------------------------------------------------------------------------------------------
// Accounts
// ---------------------------------------------------------------------------------------------

pub(crate) async fn two_accounts_using_the_same_key_get_separate_orders(db: &TestDb) {
    let service = Orders::new(db);
    let body = order_body("book", "100");
    let alices = service.create(ALICE, "shared-key", &body).await;
    let bobs = service.create(BOB, "shared-key", &body).await;

    assert_eq!(bobs.header("idempotent-replayed"), None, "Bob must not get Alice's answer");
    assert_ne!(order_id(&alices), order_id(&bobs));
    assert_eq!(bobs.json()["account_id"], BOB);
    assert_ne!(alices.json()["idempotency_operation_id"], bobs.json()["idempotency_operation_id"]);
    assert_eq!(ids(service.list(ALICE, "/orders").await["orders"].as_array().expect("orders")), [order_id(&alices)]);
    assert_eq!(ids(service.list(BOB, "/orders").await["orders"].as_array().expect("orders")), [order_id(&bobs)]);
}

pub(crate) async fn another_accounts_order_an_unknown_id_and_a_malformed_id_are_the_same_404(db: &TestDb) {
    let service = Orders::new(db);
    let alices = service.create(ALICE, "key-1", &order_body("book", "100")).await;
    let location = alices.header("location").expect("a location");

    let for_bob = service.get(BOB, location).await;
    for_bob.assert_problem(StatusCode::NOT_FOUND, "order_not_found");
    let unknown = service.get(ALICE, &format!("/orders/{}", uuid::Uuid::new_v4())).await;
    unknown.assert_problem(StatusCode::NOT_FOUND, "order_not_found");
    let malformed = service.get(ALICE, "/orders/not-a-uuid").await;
    malformed.assert_problem(StatusCode::NOT_FOUND, "order_not_found");
    assert_eq!(for_bob.body, unknown.body, "nothing tells Bob that the order exists");
    assert_eq!(for_bob.body, malformed.body);
}

pub(crate) async fn get_routes_are_not_guarded_by_the_idempotency_layer(db: &TestDb) {
    let service = Orders::new(db);
    service.create(ALICE, "key-1", &order_body("book", "100")).await;
    let records = db.idempotency_records().await;
    let request = Request::get("/orders")
        .header("authorization", format!("Bearer {ALICE}"))
        .header("idempotency-key", "key-1")
        .body(Body::empty())
        .expect("a valid request");
    let listed = service.send(request).await;
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(listed.header("idempotent-replayed"), None);
    assert_eq!(db.idempotency_records().await, records);
}
