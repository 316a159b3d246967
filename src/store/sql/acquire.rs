//! Taking a connection from the pool on a request's behalf, bounded by the request's deadline.
//!
//! A pool that every connection of is held (by handlers inside the layer, or by the
//! application) makes `Pool::acquire` wait for the pool's own acquire timeout (sqlx's default:
//! 30 s), far past the request's bounded wait. Every connection a store takes for a request goes
//! through [`acquire_by`] instead: when the deadline passes first, the store answers
//! [`StoreError::Unavailable`](crate::store::StoreError::Unavailable) (the contract's 503 with
//! `Retry-After`), and nothing was claimed.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, SqlStr, Transaction};
use tokio::time::Instant;

/// The least time a connection is waited for, however near the deadline: taking even an idle
/// connection costs a round trip (the pool's liveness check), so a zero in-flight wait, or a
/// deadline spent waiting on a duplicate, must not fail a store that has connections to give.
pub(crate) const ACQUIRE_GRACE: Duration = Duration::from_secs(1);

/// A connection from `pool`, waited for until `deadline` (or [`ACQUIRE_GRACE`] from now, if that
/// is later), and never past the pool's own acquire timeout. Running out is
/// [`sqlx::Error::PoolTimedOut`], as the pool's own timeout would be.
pub(crate) async fn acquire_by<DB: Database>(
    pool: &Pool<DB>,
    deadline: Instant,
) -> Result<PoolConnection<DB>, sqlx::Error> {
    let deadline = deadline.max(Instant::now() + ACQUIRE_GRACE);
    match tokio::time::timeout_at(deadline, pool.acquire()).await {
        Ok(acquired) => acquired,
        Err(_elapsed) => Err(sqlx::Error::PoolTimedOut),
    }
}

/// A transaction begun with `statement` on a connection taken by `deadline` (see
/// [`acquire_by`]); the statement itself runs as long as the database makes it.
pub(crate) async fn begin_by<DB: Database>(
    pool: &Pool<DB>,
    statement: SqlStr,
    deadline: Instant,
) -> Result<Transaction<'static, DB>, sqlx::Error> {
    let conn = acquire_by(pool, deadline).await?;
    Transaction::begin(conn, Some(statement)).await
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    /// A pool whose only connection is held answers `PoolTimedOut` once the deadline (with its
    /// grace) is past, not after the pool's own acquire timeout; a free connection is taken
    /// even when the deadline is already past.
    #[tokio::test]
    async fn an_exhausted_pool_is_given_up_on_at_the_deadline() {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(3600))
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let held = acquire_by(&pool, Instant::now()).await.expect("a free connection, deadline or not");
        let waited = tokio::time::timeout(Duration::from_secs(30), acquire_by(&pool, Instant::now())).await;
        assert!(matches!(waited, Ok(Err(sqlx::Error::PoolTimedOut))), "{waited:?}");
        drop(held);
        acquire_by(&pool, Instant::now()).await.expect("the connection is back");
    }
}
