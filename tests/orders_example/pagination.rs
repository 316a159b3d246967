//! Keyset pagination: every order once, newest first, behind signed cursors.

use std::collections::HashSet;

use axum::http::StatusCode;
use serde_json::Value;

use crate::harness::{Orders, TestDb, flip_char_at, ids, order_body, order_id};
use crate::orders::book::account::Account;
use crate::orders::book::created_at::CreatedAt;
use crate::orders::book::storage::PagePosition;
use crate::orders::cursor::{CursorCodec, account_digest};
use crate::{ALICE, BOB, CURSOR_SECRET, START_MICROS};

// ---------------------------------------------------------------------------------------------
// Pagination
// ---------------------------------------------------------------------------------------------

pub(crate) async fn pages_of_ten_return_all_25_orders_once_newest_first_with_ties_broken_by_order_id(db: &TestDb) {
    let service = Orders::with_ties_of_three(db);
    let mut created = Vec::new();
    for n in 0..25 {
        let answer = service.create(ALICE, &format!("key-{n}"), &order_body(&format!("sku-{n}"), "1")).await;
        let order = answer.json();
        created.push((order["created_at"].as_str().expect("a time").to_owned(), order_id(&answer)));
    }
    service.create(BOB, "key-bob", &order_body("bob", "1")).await;
    // Fixed-width RFC 3339 text and lowercase hyphenated UUIDs sort like the values they show.
    created.sort_by(|a, b| b.cmp(a));
    let distinct_times: HashSet<_> = created.iter().map(|(time, _)| time.clone()).collect();
    assert_eq!(distinct_times.len(), 9, "runs of three share a created_at");

    let page_one = service.list(ALICE, "/orders?limit=10").await;
    assert_eq!(page_one["orders"].as_array().map(Vec::len), Some(10));
    let walked = service.walk(ALICE, 10).await;
    let expected: Vec<String> = created.into_iter().map(|(_, id)| id).collect();
    assert_eq!(ids(&walked), expected);
}

pub(crate) async fn the_last_page_has_a_null_next_cursor_even_when_it_is_exactly_full(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..20 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let first = service.list(ALICE, "/orders?limit=10").await;
    let cursor = first["next_cursor"].as_str().expect("a second page follows");
    let second = service.list(ALICE, &format!("/orders?limit=10&cursor={cursor}")).await;
    assert_eq!(second["orders"].as_array().map(Vec::len), Some(10));
    assert_eq!(second["next_cursor"], Value::Null);
    let everything = service.list(ALICE, "/orders?limit=100").await;
    assert_eq!(everything["next_cursor"], Value::Null);
}

pub(crate) async fn the_default_page_is_20_orders(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..21 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let page = service.list(ALICE, "/orders").await;
    assert_eq!(page["orders"].as_array().map(Vec::len), Some(20));
    assert!(page["next_cursor"].is_string());
}

pub(crate) async fn an_order_created_between_page_fetches_neither_repeats_nor_skips_older_orders(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..25 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let before = ids(&service.walk(ALICE, 100).await);

    let first = service.list(ALICE, "/orders?limit=10").await;
    let newest = service.create(ALICE, "key-late", &order_body("late", "1")).await;
    let mut seen = ids(first["orders"].as_array().expect("orders"));
    let mut cursor = first["next_cursor"].as_str().map(str::to_owned);
    while let Some(next) = cursor {
        let page = service.list(ALICE, &format!("/orders?limit=10&cursor={next}")).await;
        seen.extend(ids(page["orders"].as_array().expect("orders")));
        cursor = page["next_cursor"].as_str().map(str::to_owned);
    }
    assert_eq!(seen, before, "every older order exactly once, in order");
    assert_eq!(ids(&service.walk(ALICE, 10).await)[0], order_id(&newest), "a fresh walk starts with it");
}

pub(crate) async fn a_tampered_cursor_is_400_invalid_cursor(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..3 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let page = service.list(ALICE, "/orders?limit=1").await;
    let cursor = page["next_cursor"].as_str().expect("a cursor").to_owned();
    let dot = cursor.find('.').expect("payload.signature");
    let tampered = [
        flip_char_at(&cursor, 3),
        flip_char_at(&cursor, dot + 3),
        flip_char_at(&cursor, cursor.len() - 1),
        cursor.replace('.', ""),
        format!("{cursor}A"),
        cursor[..dot].to_owned(),
        "garbage".to_owned(),
        "..".to_owned(),
        String::new(),
    ];
    for bad in tampered {
        let answer = service.get(ALICE, &format!("/orders?limit=1&cursor={bad}")).await;
        answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
    }
}

pub(crate) async fn another_accounts_cursor_is_400_invalid_cursor(db: &TestDb) {
    let service = Orders::new(db);
    for n in 0..3 {
        service.create(ALICE, &format!("key-{n}"), &order_body("book", "1")).await;
        service.create(BOB, &format!("key-{n}"), &order_body("book", "1")).await;
    }
    let alices = service.list(ALICE, "/orders?limit=1").await;
    let cursor = alices["next_cursor"].as_str().expect("a cursor");
    let answer = service.get(BOB, &format!("/orders?limit=1&cursor={cursor}")).await;
    let detail = answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
    assert!(detail.contains("another account"), "{detail}");
}

pub(crate) async fn a_cursor_of_another_version_or_signed_with_another_secret_is_400_invalid_cursor(db: &TestDb) {
    let service = Orders::new(db);
    let alice = Account::parse(ALICE).expect("a valid account");
    let payload = serde_json::json!({
        "v": 2,
        "created_at": START_MICROS,
        "order_id": uuid::Uuid::new_v4().to_string(),
        "account": account_digest(&alice),
    });
    let bytes = serde_json::to_vec(&payload).expect("JSON");
    let other_version = CursorCodec::new(CURSOR_SECRET).sign(&bytes);
    let answer = service.get(ALICE, &format!("/orders?cursor={other_version}")).await;
    let detail = answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
    assert!(detail.contains("version"), "{detail}");

    let position =
        PagePosition { created_at: CreatedAt::from_unix_micros(START_MICROS), order_id: uuid::Uuid::new_v4() };
    let foreign = CursorCodec::new(b"some other service's secret").encode(&alice, position);
    service
        .get(ALICE, &format!("/orders?cursor={foreign}"))
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "invalid_cursor");
}

pub(crate) async fn limit_out_of_range_or_not_a_number_is_400_invalid_limit_and_a_repeated_limit_is_400_invalid_query(
    db: &TestDb,
) {
    let service = Orders::new(db);
    for limit in ["0", "101", "1000", "abc", "-1", "1.5", ""] {
        let answer = service.get(ALICE, &format!("/orders?limit={limit}")).await;
        answer.assert_problem(StatusCode::BAD_REQUEST, "invalid_limit");
    }
    let repeated = service.get(ALICE, "/orders?limit=1&limit=2").await;
    repeated.assert_problem(StatusCode::BAD_REQUEST, "invalid_query");
    for limit in ["1", "100"] {
        assert_eq!(service.get(ALICE, &format!("/orders?limit={limit}")).await.status, StatusCode::OK);
    }
}
