//! The transaction handle handed to handlers in atomic mode (features `postgres`, `sqlite`).
//!
//! In atomic mode the claim, the handler's business writes and the stored response are one
//! database transaction. The layer puts a [`TxHandle`] into the request's extensions; the
//! handler locks it and runs its queries on the connection it gives out. After the handler
//! answers, the layer stores the response in the same transaction and commits; the response
//! leaves only after COMMIT.
//!
//! Give the handle back by dropping it (and every clone) before answering: a handle still held
//! when the response comes back makes the layer roll back and answer 500 (fail closed), because
//! whoever holds it may still mean to write.
//!
//! Handlers can be unit-tested with a handle built from a plain transaction, [`TxHandle::new`]:
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn demo() -> Result<(), sqlx::Error> {
//! use tower_idempotency::tx::TxHandle;
//!
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! let handle = TxHandle::new(pool.begin().await?);
//! {
//!     let mut conn = handle.acquire().await.expect("the transaction is open");
//!     sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY)").execute(&mut *conn).await?;
//! }
//! handle.take().await.expect("still open").commit().await?;
//! # Ok(()) }
//! ```

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Transaction};
use sqlx_core::transaction::TransactionManager;
use tokio::sync::{Mutex, MutexGuard};

/// A shared handle on the request's database transaction.
pub struct TxHandle<DB: Database> {
    slot: Arc<Mutex<Option<OpenTx<DB>>>>,
}

impl<DB: Database> Clone for TxHandle<DB> {
    fn clone(&self) -> Self {
        Self { slot: self.slot.clone() }
    }
}

impl<DB: Database> std::fmt::Debug for TxHandle<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxHandle").field("database", &DB::NAME).finish()
    }
}

/// The handle was used after the layer finished the transaction.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the idempotency transaction is already finished; the handle was kept past the response")]
pub struct TxFinished;

impl<DB: Database> TxHandle<DB> {
    /// A handle on `transaction`: how unit tests of handlers build one (and the SQLite store).
    pub fn new(transaction: Transaction<'static, DB>) -> Self {
        Self::from_open(OpenTx::Transaction(transaction))
    }

    pub(crate) fn from_open(open: OpenTx<DB>) -> Self {
        Self { slot: Arc::new(Mutex::new(Some(open))) }
    }

    /// Locks the transaction and gives out its connection for the handler's queries:
    /// `sqlx::query(..).execute(&mut *conn)`. Nested `begin()` on it makes a savepoint.
    pub async fn acquire(&self) -> Result<TxConnection<'_, DB>, TxFinished> {
        let guard = self.slot.lock().await;
        if guard.is_none() {
            return Err(TxFinished);
        }
        Ok(TxConnection { guard })
    }

    /// Takes the transaction out of a handle built with [`TxHandle::new`], to commit or inspect
    /// it in a test. `None` once it is taken, and for handles a store made.
    pub async fn take(&self) -> Option<Transaction<'static, DB>> {
        let mut slot = self.slot.lock().await;
        match slot.take() {
            Some(OpenTx::Transaction(transaction)) => Some(transaction),
            other => {
                *slot = other;
                None
            }
        }
    }

    /// Takes the transaction to finish it, failing closed: if anyone but the store still holds
    /// the handle (a clone kept past the response, or a lock guard), whoever holds it may still
    /// mean to write, so the transaction is rolled back and nothing is stored.
    pub(crate) async fn take_to_finish(&self) -> Result<OpenTx<DB>, HandleStillHeld> {
        let shared = Arc::strong_count(&self.slot) > 1;
        let taken = self.slot.try_lock().ok().and_then(|mut slot| slot.take());
        match taken {
            Some(tx) if shared => {
                tx.discard().await;
                Err(HandleStillHeld)
            }
            Some(tx) => Ok(tx),
            None => Err(HandleStillHeld),
        }
    }

    /// Takes the transaction without waiting; `None` if it is locked or gone.
    pub(crate) fn try_take(&self) -> Option<OpenTx<DB>> {
        self.slot.try_lock().ok()?.take()
    }
}

/// The handler still held the handle when the store came to finish the transaction: the
/// transaction was rolled back, and nothing was stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HandleStillHeld;

/// An open transaction: sqlx's own, or one a store began on a pooled connection with a
/// statement of its own (so BEGIN and the claim travel in one round trip).
pub(crate) enum OpenTx<DB: Database> {
    Transaction(Transaction<'static, DB>),
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Managed(ManagedTx<DB>),
}

impl<DB: Database> OpenTx<DB> {
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            OpenTx::Transaction(transaction) => transaction.commit().await,
            OpenTx::Managed(managed) => managed.commit().await,
        }
    }

    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            OpenTx::Transaction(transaction) => transaction.rollback().await,
            OpenTx::Managed(managed) => managed.rollback().await,
        }
    }

    /// Rolls back, ignoring failure: a rollback that fails leaves the transaction to die with
    /// its connection, so nothing of it is committed either way.
    pub(crate) async fn discard(self) {
        let _ = self.rollback().await;
    }
}

impl<DB: Database> Deref for OpenTx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match self {
            OpenTx::Transaction(transaction) => transaction,
            OpenTx::Managed(managed) => &managed.conn,
        }
    }
}

impl<DB: Database> DerefMut for OpenTx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match self {
            OpenTx::Transaction(transaction) => transaction,
            OpenTx::Managed(managed) => &mut managed.conn,
        }
    }
}

/// A transaction begun on a pooled connection through sqlx's transaction manager, so sqlx
/// tracks its depth (a handler's nested `begin()` makes a savepoint) exactly as it does for its
/// own `Transaction`; dropped open, it rolls back the same way.
pub(crate) struct ManagedTx<DB: Database> {
    conn: PoolConnection<DB>,
    open: bool,
}

impl<DB: Database> ManagedTx<DB> {
    /// Begins with `statement` (which must start the transaction). On failure the connection
    /// comes back, possibly in a failed transaction block: the caller rolls it back.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) async fn begin(
        mut conn: PoolConnection<DB>,
        statement: sqlx::SqlStr,
    ) -> Result<Self, (sqlx::Error, PoolConnection<DB>)> {
        match DB::TransactionManager::begin(&mut conn, Some(statement)).await {
            Ok(()) => Ok(Self { conn, open: true }),
            Err(error) => Err((error, conn)),
        }
    }

    async fn commit(mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::commit(&mut self.conn).await?;
        self.open = false;
        Ok(())
    }

    async fn rollback(mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::rollback(&mut self.conn).await?;
        self.open = false;
        Ok(())
    }
}

impl<DB: Database> Drop for ManagedTx<DB> {
    fn drop(&mut self) {
        if self.open {
            DB::TransactionManager::start_rollback(&mut self.conn);
        }
    }
}

/// The transaction's connection, locked for the handler. Dereferences to the driver's
/// connection (`PgConnection`, `SqliteConnection`), which is an `sqlx::Executor` as
/// `&mut *conn`.
pub struct TxConnection<'a, DB: Database> {
    guard: MutexGuard<'a, Option<OpenTx<DB>>>,
}

impl<DB: Database> Deref for TxConnection<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.guard.as_ref().expect("checked open when acquired")
    }
}

impl<DB: Database> DerefMut for TxConnection<'_, DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.guard.as_mut().expect("checked open when acquired")
    }
}

#[cfg(feature = "axum")]
mod axum_extract {
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::request::Parts;
    use sqlx::Database;

    use super::TxHandle;
    use crate::problem::{Problem, ProblemCode};

    /// The rejection when a handler asks for a [`TxHandle`] on a route without an atomic
    /// idempotency layer.
    #[derive(Debug, Clone, Copy)]
    pub struct MissingTx;

    impl IntoResponse for MissingTx {
        /// 500 problem+json, code `idempotency_transaction_missing`.
        fn into_response(self) -> Response {
            Problem::new(
                ProblemCode::TransactionMissing,
                "this handler needs a TxHandle, but the route is not wrapped by an IdempotencyLayer over an atomic \
                 PostgresStore or SqliteStore",
            )
            .into_response()
        }
    }

    impl<DB: Database, S: Send + Sync> FromRequestParts<S> for TxHandle<DB> {
        type Rejection = MissingTx;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
            parts.extensions.get::<TxHandle<DB>>().cloned().ok_or(MissingTx)
        }
    }

    /// `Option<TxHandle<DB>>`: `None` on routes without an atomic layer (a leased store, the
    /// kill switch, an optional key that was not sent), for handlers that then open their own
    /// transaction.
    impl<DB: Database, S: Send + Sync> OptionalFromRequestParts<S> for TxHandle<DB> {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<TxHandle<DB>>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use axum_extract::MissingTx;

#[cfg(all(test, feature = "axum", feature = "sqlite"))]
mod tests {
    use axum::response::IntoResponse;

    use super::MissingTx;

    #[tokio::test]
    async fn a_missing_transaction_is_refused_with_a_problem_that_has_a_code() {
        let response = MissingTx.into_response();
        assert_eq!(response.status(), 500);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("the body");
        let problem: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(problem["code"], "idempotency_transaction_missing");
        assert_eq!(problem["status"], 500);
    }
}
