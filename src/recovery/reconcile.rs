//! The reconciliation step of a pass: the due `unknown` records of an operation handed to its
//! reconciler, a few at a time, and what it found settled, fenced.

use std::sync::Arc;

use super::{Reconciler, Reconciliation, RecoveryReport, RecoveryWorker, emit_actions};
use crate::join;
use crate::store::{Admin, RecordInfo, SettleError, SettleRequest, Settlement, Store, StoreError};

impl<St: Store + Admin> RecoveryWorker<St> {
    /// Asks `reconciler` about `due`, a few at a time, and settles what it finds.
    pub(super) async fn reconcile(
        &self,
        reconciler: &Arc<dyn Reconciler>,
        due: Vec<RecordInfo>,
        report: &mut RecoveryReport,
    ) -> Result<(), StoreError> {
        let mut due = due.into_iter().peekable();
        while due.peek().is_some() {
            let calls: Vec<_> =
                due.by_ref().take(self.concurrency).map(|record| self.settle_one(reconciler, record)).collect();
            for settled in join::all(calls).await {
                match settled? {
                    Settled::Reconciled => report.reconciled += 1,
                    Settled::Released => report.released += 1,
                    Settled::StillUnknown => report.still_unknown += 1,
                    Settled::Superseded => report.superseded += 1,
                }
            }
        }
        Ok(())
    }

    /// Asks about one record and settles it, fenced by the token it was asked about with.
    async fn settle_one(&self, reconciler: &Arc<dyn Reconciler>, record: RecordInfo) -> Result<Settled, StoreError> {
        let (id, token) = (record.id, record.fencing_token);
        let answer = tokio::time::timeout(self.reconcile_timeout, reconciler.reconcile(record))
            .await
            .unwrap_or(Reconciliation::StillUnknown);
        let (settlement, done) = match answer {
            Reconciliation::StillUnknown => return Ok(Settled::StillUnknown),
            Reconciliation::Completed(response) => (Settlement::Completed(response), Settled::Reconciled),
            Reconciliation::Failed(response) => (Settlement::Failed(response), Settled::Reconciled),
            Reconciliation::NotExecuted => (Settlement::NotExecuted, Settled::Released),
        };
        let request = SettleRequest::new(&id, settlement).fenced(token).retention(self.retention);
        match self.store.settle(request).await {
            Ok(()) => {
                emit_actions(&[(if done == Settled::Released { "released" } else { "reconciled" }, 1)]);
                Ok(done)
            }
            Err(SettleError::Store(error)) => Err(error),
            Err(_) => Ok(Settled::Superseded),
        }
    }
}

/// What became of one record a reconciler was asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    Reconciled,
    Released,
    StillUnknown,
    Superseded,
}
