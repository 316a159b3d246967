//! Atomic mode on SQLite: the handler writes its row through the idempotency claim's own
//! transaction (`TxHandle`), so the row and the stored answer commit together or not at all,
//! and a retry never writes a second row. A background task purges old records.
//!
//! ```text
//! cargo run --example axum_sqlite_tx
//! curl -i http://127.0.0.1:3002/notes -H 'idempotency-key: key-1' -H 'content-type: text/plain' -d 'buy milk'
//! ```
//!
//! The database is `axum_sqlite_tx.db` in the temp directory. Send the request twice: one
//! row, one answer (the second marked `idempotent-replayed: true`). Answers are replayed for
//! a minute here, then the purge task turns them into tombstones and later deletes them.

use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tower_idempotency::{BoxError, IdempotencyContext, IdempotencyLayer, Retention, SqliteStore, Store, TxHandle};

/// The application's own table, in the same database as the idempotency records.
const CREATE_NOTES: &str = "CREATE TABLE IF NOT EXISTS notes (
    id           INTEGER PRIMARY KEY,
    operation_id TEXT NOT NULL,
    text         TEXT NOT NULL
)";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let file = std::env::temp_dir().join("axum_sqlite_tx.db");
    let options = SqliteConnectOptions::new()
        .filename(&file)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5));
    let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await?;
    sqlx::raw_sql(CREATE_NOTES).execute(&pool).await?;
    // Atomic is the store's default mode: it hands the handler the claim's transaction.
    let store = SqliteStore::new(pool);
    store.migrate().await?;

    tokio::spawn(purge_forever(store.clone()));
    // Short for the demonstration; the defaults are 24 h of replays and 7 days of tombstones.
    let retention =
        Retention { response: Duration::from_secs(60), tombstone: Duration::from_secs(300), ..Retention::default() };
    let idempotency = IdempotencyLayer::new(store).shared_scope("example").retention(retention);
    let app = Router::new().route("/notes", post(create_note).layer(idempotency));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3002").await?;
    let addr = listener.local_addr()?;
    println!("listening on {addr}, database {}; try, twice:", file.display());
    println!("curl -i http://{addr}/notes -H 'idempotency-key: key-1' -H 'content-type: text/plain' -d 'buy milk'");
    axum::serve(listener, app).await?;
    Ok(())
}

/// Writes the note through the claim's transaction. The layer stores this answer in the same
/// transaction and commits both; an error answer (here a 503) is released: the transaction
/// rolls back, the row with it, and a retry with the same key runs afresh.
async fn create_note(
    transaction: TxHandle<Sqlite>,
    context: IdempotencyContext,
    text: String,
) -> Result<(StatusCode, String), StatusCode> {
    let mut connection = transaction.acquire().await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let id: i64 = sqlx::query_scalar("INSERT INTO notes (operation_id, text) VALUES ($1, $2) RETURNING id")
        .bind(context.operation_id())
        .bind(text)
        .fetch_one(&mut *connection)
        .await
        .map_err(|error| {
            eprintln!("insert failed: {error}");
            StatusCode::SERVICE_UNAVAILABLE
        })?;
    // The handle goes back to the layer when it is dropped, here on return, before it commits.
    Ok((StatusCode::CREATED, format!("note {id}\n")))
}

/// Every ten seconds: records past their retention become tombstones, old tombstones go.
async fn purge_forever(store: SqliteStore) {
    let mut every = tokio::time::interval(Duration::from_secs(10));
    loop {
        every.tick().await;
        match store.purge(1_000).await {
            Ok(0) => {}
            Ok(changed) => println!("purge: {changed} records aged"),
            Err(error) => eprintln!("purge failed: {error}"),
        }
    }
}
