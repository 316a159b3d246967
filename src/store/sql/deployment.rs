//! The deployment secret ([`Store::deployment_secret`](crate::store::Store::deployment_secret))
//! of a SQL store: one row, drawn by the store's second migration, read back here.

use crate::store::StoreError;

use super::unavailable;

/// The secret read from a row, or why it is not one: the migration draws exactly one row of 32
/// bytes, so anything else is a damaged table.
fn secret_of(row: Option<Vec<u8>>, table: &str) -> Result<Option<[u8; 32]>, StoreError> {
    let row = row.ok_or_else(|| StoreError::Corrupt(format!("{table} has no deployment secret: run migrate()")))?;
    let secret = <[u8; 32]>::try_from(row.as_slice())
        .map_err(|_| StoreError::Corrupt(format!("{table}'s deployment secret is not 32 bytes")))?;
    Ok(Some(secret))
}

/// The secret of the PostgreSQL records table `schema`.`table`.
#[cfg(feature = "postgres")]
pub(crate) async fn postgres(pool: &sqlx::PgPool, schema: &str, table: &str) -> Result<Option<[u8; 32]>, StoreError> {
    let name = format!("\"{schema}\".\"{table}_deployment\"");
    let sql = format!("SELECT secret FROM {name} WHERE id = 1");
    let row: Option<Vec<u8>> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_optional(pool).await.map_err(unavailable)?;
    secret_of(row, &name)
}

/// The secret of the SQLite records table `table`.
#[cfg(feature = "sqlite")]
pub(crate) async fn sqlite(pool: &sqlx::SqlitePool, table: &str) -> Result<Option<[u8; 32]>, StoreError> {
    let name = format!("\"{table}_deployment\"");
    let sql = format!("SELECT secret FROM {name} WHERE id = 1");
    let row: Option<Vec<u8>> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_optional(pool).await.map_err(unavailable)?;
    secret_of(row, &name)
}
