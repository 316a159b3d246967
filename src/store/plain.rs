//! The old path's transaction: what a store hands a handler in `Off` and `Shadow` mode (see
//! [`rollout`](crate::rollout)), so that a handler written for atomic mode keeps working.

use std::future::Future;
use std::pin::Pin;

use super::FinishError;

/// How a [`PlainTransaction`] ends: `true` commits, `false` rolls back.
type Finisher<H> = Box<dyn FnOnce(H, bool) -> Pin<Box<dyn Future<Output = Result<(), FinishError>> + Send>> + Send>;

/// A plain database transaction from the store, handed to the handler as the store's claim
/// handle (a `TxHandle` for the SQL stores), with no claim in it and no answer stored: the
/// old path of a route while the layer is off or in shadow mode
/// ([`Store::plain_transaction`](super::Store::plain_transaction)).
pub struct PlainTransaction<H> {
    handle: H,
    finish: Finisher<H>,
}

impl<H: Clone> PlainTransaction<H> {
    /// A transaction on `handle`, ended by `finish(handle, commit)`. `finish` must fail closed
    /// the way a claim does: a handle still held by anyone but the layer rolls back with
    /// [`FinishError::HandleStillHeld`].
    pub fn new<F, Fut>(handle: H, finish: F) -> Self
    where
        F: FnOnce(H, bool) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), FinishError>> + Send + 'static,
    {
        Self { handle, finish: Box::new(move |handle, commit| Box::pin(finish(handle, commit))) }
    }

    /// The handle for the handler (a clone; give it back before the layer finishes).
    pub fn handle(&self) -> H {
        self.handle.clone()
    }

    /// Commits the handler's writes.
    pub async fn commit(self) -> Result<(), FinishError> {
        (self.finish)(self.handle, true).await
    }

    /// Rolls the handler's writes back.
    pub async fn rollback(self) -> Result<(), FinishError> {
        (self.finish)(self.handle, false).await
    }
}

impl<H> std::fmt::Debug for PlainTransaction<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainTransaction").finish_non_exhaustive()
    }
}
