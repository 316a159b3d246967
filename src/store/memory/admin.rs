//! The [`Admin`] operations of a [`MemoryStore`]: every one under the store's lock, so each
//! transition is checked and made at once.

use std::time::SystemTime;

use tokio::time::Instant;

use super::{Entry, MemoryStore};
use crate::key::{RecordId, Scope};
use crate::record::RecordState;
use crate::store::StoreError;
use crate::store::admin::{
    Admin, Backoff, LeaseSweep, RecordInfo, SettleError, SettleRequest, Settlement, StateCounts, parse_operation_id,
};
use crate::store::decide::ABANDONED;

/// The wall-clock time of `at`, given one instant read on both clocks.
fn wall(at: Instant, now: Instant, wall_now: SystemTime) -> SystemTime {
    if at >= now { wall_now + (at - now) } else { wall_now - (now - at) }
}

fn info(id: &RecordId, entry: &Entry, now: Instant, wall_now: SystemTime) -> RecordInfo {
    let response = entry.record.response.as_ref();
    let processing = entry.record.state == RecordState::Processing;
    RecordInfo {
        id: *id,
        state: entry.record.state,
        operation: entry.labels.operation.as_deref().map(str::to_owned),
        operation_id: id.operation_id(),
        fingerprint_version: entry.record.fingerprint.version(),
        fencing_token: entry.token,
        created_at: entry.labels.created,
        updated_at: entry.labels.updated,
        expires_at: entry.response_until.map(|at| wall(at, now, wall_now)),
        forget_at: entry
            .tombstone_until
            .or(entry.response_until.map(|at| at + entry.retention.tombstone))
            .map(|at| wall(at, now, wall_now)),
        lease_until: processing.then(|| wall(entry.lease_until, now, wall_now)),
        status: response.map(|r| r.status),
        location: response
            .and_then(|r| r.headers.iter().find(|(name, _)| name == http::header::LOCATION).map(|(_, v)| v.clone())),
        attempts: entry.labels.attempts,
    }
}

impl Admin for MemoryStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        let mut records = self.lock();
        let (now, wall_now) = (Instant::now(), SystemTime::now());
        let Some(entry) = records.get_mut(id) else { return Ok(None) };
        Ok(entry.age(now).then(|| info(id, entry, now, wall_now)))
    }

    async fn inspect_operation(&self, scope: &Scope, operation_id: &str) -> Result<Option<RecordInfo>, StoreError> {
        let Some(wanted) = parse_operation_id(operation_id) else { return Ok(None) };
        let scope = scope.digest();
        let mut records = self.lock();
        let (now, wall_now) = (Instant::now(), SystemTime::now());
        // The operation id is derived from the identity here, for the scope's records only,
        // rather than kept with every record: a lookup is an operator's rare act, and a new key
        // would otherwise pay two SHA-256 blocks for it.
        let found = records
            .iter_mut()
            .find(|(id, entry)| entry.labels.scope == Some(scope) && id.operation_id_bytes() == wanted);
        Ok(found.and_then(|(id, entry)| entry.age(now).then(|| info(id, entry, now, wall_now))))
    }

    async fn list_unknown(&self, limit: usize) -> Result<Vec<RecordInfo>, StoreError> {
        let mut records = self.lock();
        let (now, wall_now) = (Instant::now(), SystemTime::now());
        let mut unknown: Vec<RecordInfo> = records
            .iter_mut()
            .filter_map(|(id, entry)| {
                (entry.age(now) && entry.record.state == RecordState::Unknown).then(|| info(id, entry, now, wall_now))
            })
            .collect();
        unknown.sort_by_key(|info| info.created_at);
        unknown.truncate(limit);
        Ok(unknown)
    }

    async fn counts(&self) -> Result<StateCounts, StoreError> {
        let mut records = self.lock();
        let now = Instant::now();
        let mut counts = StateCounts::default();
        let mut oldest: Option<SystemTime> = None;
        for entry in records.values_mut() {
            if !entry.age(now) {
                continue;
            }
            match entry.record.state {
                RecordState::Processing => counts.processing += 1,
                RecordState::Completed => counts.completed += 1,
                RecordState::Failed => counts.failed += 1,
                RecordState::Unknown => {
                    counts.unknown += 1;
                    oldest = Some(oldest.map_or(entry.labels.created, |o| o.min(entry.labels.created)));
                }
                RecordState::Expired => counts.expired += 1,
            }
        }
        counts.oldest_unknown = oldest.map(|at| SystemTime::now().duration_since(at).unwrap_or_default());
        Ok(counts)
    }

    async fn settle(&self, request: SettleRequest<'_>) -> Result<(), SettleError> {
        let mut records = self.lock();
        let now = Instant::now();
        let Some(entry) = records.get_mut(request.id) else { return Err(SettleError::NotFound) };
        if !entry.age(now) {
            return Err(SettleError::NotFound);
        }
        if entry.record.state != ABANDONED {
            return Err(SettleError::NotUnknown(entry.record.state));
        }
        if request.fencing_token.is_some_and(|token| token != entry.token) {
            return Err(SettleError::Superseded);
        }
        let (state, response) = match request.settlement {
            Settlement::NotExecuted => {
                records.remove(request.id);
                return Ok(());
            }
            Settlement::Completed(response) => (settled(RecordState::Completed), response),
            Settlement::Failed(response) => (settled(RecordState::Failed), response),
        };
        entry.record.state = state;
        entry.record.response = Some(response);
        entry.retention = request.retention;
        entry.response_until = Some(now + request.retention.response);
        entry.tombstone_until = None;
        entry.labels.updated = SystemTime::now();
        Ok(())
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, StoreError> {
        Ok(self.lock().remove(id).is_some())
    }

    async fn sweep_leases(&self, limit: usize) -> Result<LeaseSweep, StoreError> {
        let mut records = self.lock();
        let now = Instant::now();
        let mut sweep = LeaseSweep::default();
        let mut released = Vec::new();
        for (id, entry) in records.iter_mut() {
            if sweep.marked_unknown + released.len() >= limit {
                break;
            }
            if !entry.age(now) || entry.record.state != RecordState::Processing || entry.lease_until > now {
                continue;
            }
            if entry.labels.reexecutable {
                released.push(*id);
            } else {
                entry.record.state = ABANDONED;
                entry.labels.updated = SystemTime::now();
                entry.waiters = None;
                sweep.marked_unknown += 1;
            }
        }
        sweep.released = released.len();
        for id in released {
            records.remove(&id);
        }
        Ok(sweep)
    }

    async fn checkout_unknown(
        &self,
        operation: &str,
        limit: usize,
        backoff: Backoff,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        let mut records = self.lock();
        let (now, wall_now) = (Instant::now(), SystemTime::now());
        let mut due: Vec<(SystemTime, RecordId)> = records
            .iter_mut()
            .filter_map(|(id, entry)| {
                let due = entry.age(now)
                    && entry.record.state == RecordState::Unknown
                    && entry.labels.operation.as_deref() == Some(operation)
                    && entry.labels.recheck_at.is_none_or(|at| at <= now);
                due.then_some((entry.labels.created, *id))
            })
            .collect();
        due.sort();
        due.truncate(limit);
        let mut out = Vec::with_capacity(due.len());
        for (_, id) in due {
            let entry = records.get_mut(&id).expect("selected under the same lock");
            entry.labels.attempts = entry.labels.attempts.saturating_add(1);
            entry.labels.recheck_at = Some(now + backoff.after(entry.labels.attempts));
            out.push(info(&id, entry, now, wall_now));
        }
        Ok(out)
    }
}

/// The state a settled `unknown` record moves to, checked against the state machine.
fn settled(state: RecordState) -> RecordState {
    debug_assert!(RecordState::Unknown.can_become(state));
    state
}
