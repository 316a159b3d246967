//! A SQL store's claim, atomic or leased, and the public surface both SQL stores share.

use std::future::Future;

use sqlx::Database;

use super::dialect::Dialect;
use super::leased::LeasedClaim;
use super::tx::{OpenTx, TxHandle};
use crate::record::{RecordState, StoredResponse};
use crate::store::decide::stored_outcome;
use crate::store::{FinishError, Outcome};

/// A SQL store's atomic claim: the transaction the handler writes in.
pub(crate) trait AtomicClaim: std::fmt::Debug + Send + 'static {
    /// The database of the transaction.
    type Db: Database;

    /// The handle on the transaction, until the claim is finished.
    fn handle(&self) -> Option<TxHandle<Self::Db>>;

    /// Stores the outcome in the transaction and commits it (or rolls it back).
    fn finish(self, outcome: Outcome) -> impl Future<Output = Result<(), FinishError>> + Send;
}

/// Takes an atomic claim's transaction out of `handle` to finish it with `outcome`, failing
/// closed if the handler still holds it. `None`: the outcome is a release, so the transaction
/// was rolled back and nothing is to be stored; else the transaction, and the state and
/// response to store in it.
pub(crate) async fn take_to_store<DB: Database>(
    handle: &mut Option<TxHandle<DB>>,
    outcome: Outcome,
) -> Result<Option<(OpenTx<DB>, RecordState, StoredResponse)>, FinishError> {
    let handle = handle.take().expect("an unfinished claim holds its transaction");
    let tx = handle.take_to_finish().await?;
    match stored_outcome(outcome) {
        Some((state, response)) => Ok(Some((tx, state, response))),
        None => {
            tx.discard().await;
            Ok(None)
        }
    }
}

/// What a SQL store's claim holds: a live transaction (atomic) or a lease (leased).
#[derive(Debug)]
pub(crate) enum Held<A, D: Dialect> {
    Atomic(A),
    Leased(LeasedClaim<D>),
}

impl<A: AtomicClaim<Db = D::Db>, D: Dialect> Held<A, D> {
    /// The transaction handle of an atomic claim.
    pub(crate) fn handle(&self) -> Option<TxHandle<D::Db>> {
        match self {
            Held::Atomic(claim) => claim.handle(),
            Held::Leased(_) => None,
        }
    }

    /// The fencing token of a leased claim (an atomic claim is fenced by its transaction).
    pub(crate) fn fencing_token(&self) -> Option<u64> {
        match self {
            Held::Atomic(_) => None,
            Held::Leased(claim) => Some(claim.token() as u64),
        }
    }

    /// Renews a leased claim's lease (an atomic claim holds none).
    pub(crate) fn renew(
        &self,
        lease: std::time::Duration,
    ) -> impl Future<Output = Result<crate::store::Renewal, crate::store::StoreError>> + Send + 'static {
        let renewal = match self {
            Held::Atomic(_) => None,
            Held::Leased(claim) => Some(claim.renewal(lease)),
        };
        async move {
            match renewal {
                Some(renewal) => renewal.await,
                None => Ok(crate::store::Renewal::NotLeased),
            }
        }
    }

    /// Finishes the claim with `outcome`.
    pub(crate) async fn finish(self, outcome: Outcome) -> Result<(), FinishError> {
        match self {
            Held::Atomic(claim) => claim.finish(outcome).await,
            Held::Leased(claim) => claim.finish(outcome).await,
        }
    }
}

/// What both SQL stores offer the same way, written once: the builder methods that set the
/// mode or give out the pool, the [`Store`](crate::store::Store) implementation (which sends a
/// claim to the store's `begin_atomic` or `begin_leased`), and the [`Claim`](crate::store::Claim)
/// implementation of its claim type (a newtype over [`Held`]).
macro_rules! sql_store_surface {
    ($store:ident, $pool:ty, $claim:ident, $db:ty, $plain_begin:literal) => {
        impl $store {
            /// The coupling mode: [`CouplingMode::Atomic`](crate::store::CouplingMode::Atomic)
            /// (default) or [`CouplingMode::Leased`](crate::store::CouplingMode::Leased).
            pub fn mode(mut self, mode: $crate::store::CouplingMode) -> Self {
                self.records.mode = mode;
                self
            }

            /// The same store in leased mode.
            pub fn leased(self) -> Self {
                self.mode($crate::store::CouplingMode::Leased)
            }

            /// The pool this store uses.
            pub fn pool(&self) -> &$pool {
                &self.records.pool
            }
        }

        impl $crate::store::Store for $store {
            type Claim = $claim;

            async fn begin(
                &self,
                request: $crate::store::BeginRequest<'_>,
            ) -> Result<$crate::store::Begin<$claim>, $crate::store::StoreError> {
                match self.records.mode {
                    $crate::store::CouplingMode::Atomic => self.begin_atomic(&request).await,
                    $crate::store::CouplingMode::Leased => self.begin_leased(&request).await,
                }
            }

            async fn purge(&self, limit: usize) -> Result<usize, $crate::store::StoreError> {
                self.records.purge(limit).await
            }

            /// Drawn once, by [`migrate`](Self::migrate), and kept in the database with the
            /// records: every replica of the store reads the same one.
            async fn deployment_secret(&self) -> Result<Option<[u8; 32]>, $crate::store::StoreError> {
                self.read_deployment_secret().await
            }

            /// In atomic mode, a transaction begun on the pool (SQLite: `BEGIN IMMEDIATE`, so it
            /// never deadlocks upgrading a read lock), taking the connection within `wait` (at
            /// least a second); `None` in leased mode, whose handlers get no handle in enforce
            /// mode either.
            async fn plain_transaction(
                &self,
                wait: std::time::Duration,
            ) -> Result<
                Option<$crate::store::PlainTransaction<$crate::store::sql::tx::TxHandle<$db>>>,
                $crate::store::StoreError,
            > {
                $crate::store::sql::plain_transaction(&self.records, $plain_begin, wait).await
            }

            /// The whole batch by one statement on a connection of its own, in either mode;
            /// only the records already there are read back.
            async fn record_shadow(
                &self,
                entries: Vec<$crate::store::ShadowEntry>,
            ) -> Result<Vec<$crate::store::ShadowSeen>, $crate::store::StoreError> {
                $crate::store::sql::shadow::record_shadow(&self.records, entries).await
            }
        }

        impl $crate::store::Admin for $store {
            async fn inspect(
                &self,
                id: &$crate::RecordId,
            ) -> Result<Option<$crate::store::RecordInfo>, $crate::store::StoreError> {
                self.records.inspect(id).await
            }

            async fn inspect_operation(
                &self,
                scope: &$crate::Scope,
                operation_id: &str,
            ) -> Result<Option<$crate::store::RecordInfo>, $crate::store::StoreError> {
                self.records.inspect_operation(scope, operation_id).await
            }

            async fn list_unknown(
                &self,
                limit: usize,
            ) -> Result<Vec<$crate::store::RecordInfo>, $crate::store::StoreError> {
                self.records.list_unknown(limit).await
            }

            async fn counts(&self) -> Result<$crate::store::StateCounts, $crate::store::StoreError> {
                self.records.counts().await
            }

            async fn open_counts(&self) -> Result<$crate::store::StateCounts, $crate::store::StoreError> {
                self.records.open_counts().await
            }

            async fn settle(
                &self,
                request: $crate::store::SettleRequest<'_>,
            ) -> Result<(), $crate::store::SettleError> {
                self.records.settle(request).await
            }

            async fn evict(&self, id: &$crate::RecordId) -> Result<bool, $crate::store::StoreError> {
                self.records.evict(id).await
            }

            async fn sweep_leases(
                &self,
                limit: usize,
            ) -> Result<$crate::store::LeaseSweep, $crate::store::StoreError> {
                self.records.sweep_leases(limit).await
            }

            async fn checkout_unknown(
                &self,
                operation: &str,
                limit: usize,
                backoff: $crate::store::Backoff,
            ) -> Result<Vec<$crate::store::RecordInfo>, $crate::store::StoreError> {
                self.records.checkout_unknown(operation, limit, backoff).await
            }
        }

        impl $crate::store::Claim for $claim {
            type Handle = $crate::store::sql::tx::TxHandle<$db>;

            fn handle(&self) -> Option<Self::Handle> {
                self.0.handle()
            }

            /// Leased claims only: an atomic claim is fenced by its transaction.
            fn fencing_token(&self) -> Option<u64> {
                self.0.fencing_token()
            }

            async fn finish(self, outcome: $crate::store::Outcome) -> Result<(), $crate::store::FinishError> {
                self.0.finish(outcome).await
            }

            fn renew(
                &self,
                lease: std::time::Duration,
            ) -> impl std::future::Future<Output = Result<$crate::store::Renewal, $crate::store::StoreError>>
            + Send
            + 'static {
                self.0.renew(lease)
            }
        }
    };
}

pub(crate) use sql_store_surface;
