//! The plans SQLite makes of the store's statements, read with `EXPLAIN QUERY PLAN`.

use sqlx::sqlite::SqlitePoolOptions;

use super::{SqliteStore, now_ms};

/// The recovery pass's count of open records (`Admin::open_counts`, every pass) reads the index
/// of open records, whose condition is its own, and not the table, which holds every record kept.
#[tokio::test]
async fn open_counts_read_the_index_of_open_records() {
    let pool = SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await.expect("memory database");
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    let explain = format!("EXPLAIN QUERY PLAN {}", store.records.open_counts_sql());
    let rows: Vec<(i64, i64, i64, String)> =
        sqlx::query_as(sqlx::AssertSqlSafe(explain)).bind(now_ms()).fetch_all(&pool).await.expect("explain");
    let plan: Vec<&str> = rows.iter().map(|(_, _, _, detail)| detail.as_str()).collect();
    assert!(
        plan.iter().any(|detail| detail.contains("USING INDEX idempotency_records_open_idx")),
        "the index of open records: {plan:?}"
    );
    assert!(
        !plan.iter().any(|detail| detail.starts_with("SCAN idempotency_records") && !detail.contains("INDEX")),
        "{plan:?}"
    );
}
