//! The leased claim of both SQL stores: committed at once as `processing` with a lease and a
//! fencing token, finished by a fenced, state-checked write, given up on drop.
//!
//! Finishing, releasing and giving up take their connection by the end of the lease: until
//! then the record is this claim's to settle; after it, the stale-lease policy decides for the
//! next retry, and a request whose pool stays exhausted that long gets `FinishError::Store`.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::dialect::Dialect;
use super::{Records, unavailable};
use crate::key::RecordId;
use crate::store::decide::stored_outcome;
use crate::store::{BeginRequest, FinishError, Outcome, Renewal, Retention, StoreError};

/// A leased claim on a SQL store's record.
#[derive(Debug)]
pub(crate) struct LeasedClaim<D: Dialect> {
    records: Records<D>,
    id: RecordId,
    token: i64,
    retention: Retention,
    /// When the lease runs out: the bound on taking a connection to settle the claim.
    lease_ends: Instant,
    /// Whether the claim was finished (or is being finished), so dropping it gives nothing up.
    finished: bool,
}

impl<D: Dialect> LeasedClaim<D> {
    /// The claim of `request`'s identity under fencing `token`.
    pub(crate) fn new(records: &Records<D>, request: &BeginRequest<'_>, token: i64) -> Self {
        Self {
            records: records.clone(),
            id: *request.id,
            token,
            retention: request.retention,
            lease_ends: Instant::now() + request.lease,
            finished: false,
        }
    }

    /// The claim's fencing token.
    pub(crate) fn token(&self) -> i64 {
        self.token
    }

    /// Stores the outcome with a fenced write: one row means the claim still held the record;
    /// none, that it was lost; an error, that the write may or may not have reached the
    /// database, unless the dialect says it surely did not.
    pub(crate) async fn finish(mut self, outcome: Outcome) -> Result<(), FinishError> {
        self.finished = true;
        let statements = &self.records.statements;
        let statement = match stored_outcome(outcome) {
            None => statements.release(&self.id, self.token),
            Some((state, response)) => statements.finish(&self.id, self.token, state, &response, self.retention),
        };
        match self.records.execute_by(statement, self.lease_ends).await {
            Ok(1) => Ok(()),
            Ok(_) => Err(FinishError::ClaimLost),
            Err(error) if D::never_ran(&error) => Err(FinishError::Store(unavailable(error))),
            Err(error) => Err(FinishError::CommitUncertain(Box::new(error))),
        }
    }
}

impl<D: Dialect> LeasedClaim<D> {
    /// The renewal of the lease to `lease` from now: a fenced, state-checked write on a
    /// connection taken by the end of the current lease (after it, another request may take
    /// the record over: the heartbeat treats a renewal that cannot be made by then as a loss).
    pub(crate) fn renewal(
        &self,
        lease: Duration,
    ) -> impl Future<Output = Result<Renewal, StoreError>> + Send + 'static {
        let (records, statement) = (self.records.clone(), self.records.statements.renew(&self.id, self.token, lease));
        let lease_ends = self.lease_ends.max(Instant::now());
        async move {
            match records.execute_by(statement, lease_ends).await {
                Ok(1) => Ok(Renewal::Renewed),
                Ok(_) => Ok(Renewal::Lost),
                Err(error) => Err(unavailable(error)),
            }
        }
    }
}

impl<D: Dialect> Drop for LeasedClaim<D> {
    /// The lease is given up at once (in the background), so the next retry applies the
    /// stale-lease policy without waiting it out.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (records, abandon) = (self.records.clone(), self.records.statements.abandon(&self.id, self.token));
        let lease_ends = self.lease_ends;
        runtime.spawn(async move {
            let _ = records.execute_by(abandon, lease_ends).await;
        });
    }
}
