//! [`MemoryStore`]: an in-process store in leased mode.
//!
//! It keeps the whole contract that does not need durability: fenced claims with leases,
//! the stale-lease policy, retention with tombstones, and waiting on an in-flight duplicate
//! without polling (waiters sleep on a channel that the claim's holder closes when it
//! finishes). Records live as long as the process: use it for tests, single-process tools and
//! as the reference behaviour for other stores, not where a restart must keep answers.
//!
//! ```
//! use tower_idempotency::MemoryStore;
//! let store = MemoryStore::new();
//! assert_eq!(store.len(), 0);
//! ```

mod admin;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;

use super::decide::{ABANDONED, Decision, EXPIRED, Found, decide, stored_outcome};
use super::{
    Begin, BeginRequest, Claim, FinishError, NoHandle, Outcome, Renewal, Retention, StaleLeasePolicy, Store, StoreError,
};
use crate::key::RecordId;
use crate::record::{Record, RecordState};

/// An in-process [`Store`] in leased mode. Cheap to clone: clones share the records.
#[derive(Clone, Default)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    records: Mutex<Records>,
    next_token: AtomicU64,
    /// This store value's deployment secret, drawn when it is made.
    secret: Secret,
}

/// A random 32-byte secret ([`Store::deployment_secret`]).
struct Secret([u8; 32]);

impl Default for Secret {
    /// SHA-256 over 512 bits of the standard library's randomly keyed SipHash (its keys come
    /// from the operating system's random source), the time and a process-wide counter.
    fn default() -> Self {
        use sha2::{Digest, Sha256};
        use std::hash::BuildHasher;
        static DRAWN: AtomicU64 = AtomicU64::new(0);
        let drawn = DRAWN.fetch_add(1, Ordering::Relaxed);
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/memory-store/secret\0");
        hasher.update(drawn.to_be_bytes());
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        hasher.update(nanos.to_be_bytes());
        for round in 0..8u64 {
            hasher.update(std::collections::hash_map::RandomState::new().hash_one((drawn, round)).to_be_bytes());
        }
        Secret(hasher.finalize().into())
    }
}

/// The records, each entry boxed: a slot of the map is then an identity and a pointer (40
/// bytes) instead of the whole entry (392), so the map's growth, which moves every slot and
/// doubles its memory for a moment, moves a tenth as much (it was the largest part of a new
/// key's cost once the store held a few hundred thousand records).
type Records = HashMap<RecordId, Box<Entry>, DigestHashing>;

/// Hashes a [`RecordId`] by its first eight bytes, mixed with a per-process random seed.
///
/// The id is already a SHA-256 digest, so running SipHash over all 32 bytes buys nothing but
/// time; the seed keeps clients who choose keys from steering identities into one bucket.
#[derive(Clone)]
struct DigestHashing {
    seed: u64,
}

impl Default for DigestHashing {
    fn default() -> Self {
        // RandomState is seeded from the OS once per process; take 64 bits of it.
        use std::hash::BuildHasher;
        Self { seed: std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64) }
    }
}

impl std::hash::BuildHasher for DigestHashing {
    type Hasher = DigestHasher;

    fn build_hasher(&self) -> DigestHasher {
        DigestHasher { state: self.seed }
    }
}

struct DigestHasher {
    state: u64,
}

impl std::hash::Hasher for DigestHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only ever fed a RecordId's digest (see `impl Hash for RecordId`); fold anything else.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, word: u64) {
        let mixed = (self.state ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.state = mixed ^ (mixed >> 29);
    }

    fn finish(&self) -> u64 {
        self.state
    }
}

struct Entry {
    record: Record,
    token: u64,
    lease_until: Instant,
    /// When the record expires into a tombstone (a finished record's response is dropped, an
    /// unsettled record stops locking its key).
    response_until: Option<Instant>,
    /// When the tombstone is deleted.
    tombstone_until: Option<Instant>,
    retention: Retention,
    /// Closed (dropped) when the record leaves `processing` or its holder gives up:
    /// every waiter wakes and looks again.
    waiters: Option<watch::Sender<()>>,
    /// What an operator sees of it.
    labels: Labels,
}

/// What the admin operations read of an entry besides its record.
#[derive(Clone)]
struct Labels {
    created: SystemTime,
    updated: SystemTime,
    operation: Option<Arc<str>>,
    scope: Option<[u8; 32]>,
    /// The claim declared its route re-executable: a dead lease is released, not marked.
    reexecutable: bool,
    /// Reconciler looks so far, and when the next one is due.
    attempts: u32,
    recheck_at: Option<Instant>,
}

impl Entry {
    /// Applies retention as of `now`. Returns false when the entry should be deleted.
    fn age(&mut self, now: Instant) -> bool {
        if let Some(until) = self.response_until
            && now >= until
            && self.record.state != RecordState::Expired
        {
            self.record.state = EXPIRED;
            self.record.response = None;
            self.response_until = None;
            self.tombstone_until = Some(until + self.retention.tombstone);
            self.labels.updated = SystemTime::now();
        }
        !matches!(self.tombstone_until, Some(until) if now >= until)
    }

    /// The entry as the shared decision sees it, retention applied as of `now`.
    fn found(&mut self, now: Instant) -> Found {
        let forgotten = !self.age(now);
        Found {
            state: self.record.state,
            fingerprint: self.record.fingerprint,
            lease_left: self.lease_until.saturating_duration_since(now),
            response_expired: false,
            forgotten,
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records (of any state, tombstones included) the store holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The state of a record, if there is one (retention applied as of now).
    pub fn state(&self, id: &RecordId) -> Option<RecordState> {
        let mut records = self.lock();
        let entry = records.get_mut(id)?;
        entry.age(Instant::now()).then_some(entry.record.state)
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // A panic while holding the lock cannot leave an entry half-written (every update is
        // a few field stores), so a poisoned lock is still safe to use.
        self.shared.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn token(&self) -> u64 {
        self.shared.next_token.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn claim(&self, request: &BeginRequest<'_>, token: u64) -> MemoryClaim {
        MemoryClaim { store: self.clone(), id: *request.id, token, finished: false }
    }

    fn new_entry(&self, request: &BeginRequest<'_>, now: Instant, token: u64) -> Entry {
        let created = SystemTime::now();
        Entry {
            record: Record::new(RecordState::Processing, *request.fingerprint),
            token,
            lease_until: now + request.lease,
            response_until: Some(now + request.retention.unsettled),
            tombstone_until: None,
            retention: request.retention,
            // Made when the first duplicate waits: most claims are never waited on.
            waiters: None,
            labels: Labels {
                created,
                updated: created,
                operation: super::admin::kept_operation(request.operation).map(Arc::from),
                scope: request.scope.map(|scope| scope.digest()),
                reexecutable: request.stale_lease == StaleLeasePolicy::Reexecute,
                attempts: 0,
                recheck_at: None,
            },
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").field("records", &self.len()).finish()
    }
}

impl Store for MemoryStore {
    type Claim = MemoryClaim;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<MemoryClaim>, StoreError> {
        let mut now = Instant::now();
        let deadline = now + request.wait;
        loop {
            let (mut waiter, lease_until) = {
                let mut records = self.lock();
                // One probe of the map for a new key: the vacant slot is filled where it was found.
                let entry = match records.entry(*request.id) {
                    std::collections::hash_map::Entry::Occupied(occupied) => occupied.into_mut(),
                    std::collections::hash_map::Entry::Vacant(vacant) => {
                        let token = self.token();
                        vacant.insert(Box::new(self.new_entry(&request, now, token)));
                        return Ok(Begin::Claimed(self.claim(&request, token)));
                    }
                };
                match decide(&entry.found(now), request.fingerprint, request.stale_lease) {
                    // Past its tombstone time: the record is as good as absent.
                    Decision::Claim => {
                        let token = self.token();
                        **entry = self.new_entry(&request, now, token);
                        return Ok(Begin::Claimed(self.claim(&request, token)));
                    }
                    Decision::Answer(_) => return Ok(Begin::Existing(entry.record.clone())),
                    Decision::MarkUnknown => {
                        entry.record.state = ABANDONED;
                        entry.labels.updated = SystemTime::now();
                        entry.waiters = None;
                        return Ok(Begin::Existing(entry.record.clone()));
                    }
                    Decision::TakeOver => {
                        let token = self.token();
                        entry.token = token;
                        entry.lease_until = now + request.lease;
                        entry.retention = request.retention;
                        entry.labels.updated = SystemTime::now();
                        entry.waiters = None;
                        return Ok(Begin::Claimed(self.claim(&request, token)));
                    }
                    Decision::Wait { lease_left } if now >= deadline => {
                        return Ok(Begin::InFlight { retry_after: lease_left.min(request.lease) });
                    }
                    Decision::Wait { .. } => {}
                }
                let sender = entry.waiters.get_or_insert_with(|| watch::channel(()).0);
                (sender.subscribe(), entry.lease_until)
            };
            // Woken when the holder finishes or gives up; else at the deadline or lease end.
            let _ = tokio::time::timeout_at(deadline.min(lease_until), waiter.changed()).await;
            now = Instant::now();
        }
    }

    /// Drawn when the store was made, shared by its clones: each store value is a deployment
    /// of its own (its records live in it alone).
    async fn deployment_secret(&self) -> Result<Option<[u8; 32]>, StoreError> {
        Ok(Some(self.shared.secret.0))
    }

    async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        let mut records = self.lock();
        let now = Instant::now();
        let mut changed = 0;
        let mut doomed = Vec::new();
        for (id, entry) in records.iter_mut() {
            if changed >= limit {
                break;
            }
            let before = entry.record.state;
            if !entry.age(now) {
                doomed.push(*id);
                changed += 1;
            } else if entry.record.state != before {
                changed += 1;
            }
        }
        for id in doomed {
            records.remove(&id);
        }
        Ok(changed)
    }
}

/// A claim held on a [`MemoryStore`] record.
#[derive(Debug)]
pub struct MemoryClaim {
    store: MemoryStore,
    id: RecordId,
    token: u64,
    finished: bool,
}

impl Claim for MemoryClaim {
    type Handle = NoHandle;

    fn handle(&self) -> Option<NoHandle> {
        None
    }

    fn fencing_token(&self) -> Option<u64> {
        Some(self.token)
    }

    async fn finish(mut self, outcome: Outcome) -> Result<(), FinishError> {
        self.finished = true;
        // The body is kept in a buffer of its own (copied before the lock is taken): it can be a
        // slice of a much larger one (tonic encodes each answer into an 8 KiB buffer), which
        // would otherwise stay alive as long as the record.
        let stored = stored_outcome(outcome).map(|(state, mut response)| {
            response.body = Bytes::copy_from_slice(&response.body);
            (state, response)
        });
        let mut records = self.store.lock();
        let Some(entry) = records.get_mut(&self.id) else {
            return Err(FinishError::ClaimLost);
        };
        if entry.token != self.token || entry.record.state != RecordState::Processing {
            return Err(FinishError::ClaimLost);
        }
        let now = Instant::now();
        let Some((state, response)) = stored else {
            records.remove(&self.id);
            return Ok(());
        };
        entry.record.state = state;
        entry.record.response = Some(response);
        entry.response_until = Some(now + entry.retention.live_for(state));
        entry.labels.updated = SystemTime::now();
        entry.waiters = None;
        Ok(())
    }

    fn renew(
        &self,
        lease: Duration,
    ) -> impl std::future::Future<Output = Result<Renewal, StoreError>> + Send + 'static {
        let mut records = self.store.lock();
        let renewal = match records.get_mut(&self.id) {
            Some(entry) if entry.token == self.token && entry.record.state == RecordState::Processing => {
                entry.lease_until = Instant::now() + lease;
                Renewal::Renewed
            }
            _ => Renewal::Lost,
        };
        std::future::ready(Ok(renewal))
    }
}

impl Drop for MemoryClaim {
    /// An unfinished claim gives up its lease at once, so the next retry applies the
    /// stale-lease policy instead of waiting for the lease to run out.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut records = self.store.lock();
        if let Some(entry) = records.get_mut(&self.id)
            && entry.token == self.token
            && entry.record.state == RecordState::Processing
        {
            entry.lease_until = Instant::now();
            entry.waiters = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::key::{IdempotencyKey, Scope};
    use crate::record::StoredResponse;

    #[tokio::test]
    async fn a_stored_body_does_not_keep_the_buffer_it_was_cut_from() {
        let store = MemoryStore::new();
        let id = RecordId::new(&Scope::new("t"), "/pkg.Svc/Create", &IdempotencyKey::new("k").unwrap());
        let fingerprint = Fingerprint::from_parts(2, [7; 32]);
        let request = BeginRequest::new(&id, &fingerprint);
        let Ok(Begin::Claimed(claim)) = store.begin(request.clone()).await else { panic!("a new key is claimed") };
        // As tonic answers: five bytes cut from an 8 KiB buffer.
        let mut buffer = bytes::BytesMut::with_capacity(8 * 1024);
        buffer.extend_from_slice(b"\0\0\0\0\0");
        let body = buffer.split_to(5).freeze();
        drop(buffer);
        claim.finish(Outcome::Complete(StoredResponse::new(http::StatusCode::OK, body.clone()))).await.unwrap();
        assert!(body.is_unique(), "the record holds a copy, not the 8 KiB buffer");
        let Ok(Begin::Existing(record)) = store.begin(request).await else { panic!("the record is there") };
        assert_eq!(record.response.unwrap().body, body);
    }
}
