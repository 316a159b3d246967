//! How a begin goes through the fast path: the cached response (if it verifies), else the lock
//! and the durable store, else a bounded wait on the lock's holder, then the durable store; the
//! durable store alone whenever Redis fails or is cooling down, or the deployment has no secret.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::FastPath;
use super::claim::{self, FastPathClaim, LockGuard, TOKEN_LEN};
use super::codec::{self, Decoded};
use super::keying::{self, Keying};
use super::scripts::{self, Keys, Probe};
use crate::store::{Begin, BeginRequest, Claim, PlainTransaction, ShadowEntry, ShadowSeen, Store, StoreError};

impl<S: Store> Store for FastPath<S> {
    type Claim = FastPathClaim<S::Claim>;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<Self::Claim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        let counters = &self.link.counters;
        // Reading the deployment's secret (once, lazily) is a store call made on this request's
        // behalf: bounded like the store's own, by the wait (at least a second); a read that
        // runs out leaves this request to the store alone.
        let read_until = deadline.max(Instant::now() + Duration::from_secs(1));
        let keying = tokio::time::timeout_at(read_until, self.keying()).await.ok().flatten();
        let Some(keying) = keying else {
            counters.unkeyed.bump();
            return self.unlocked(request, None, deadline).await;
        };
        if self.link.cooling_down() {
            counters.bypassed.bump();
            return self.unlocked(request, Some(keying), deadline).await;
        }
        let keys = Keys::new(&self.options.prefix, keying.namespace(), request.id);
        let lock_value = claim::lock_value(request.fingerprint);
        // The lock never outlives the claim's lease, so a dead holder's stale lease is found
        // by the store as soon as it would be without Redis.
        let lock_ttl = self.options.lock_ttl.min(request.lease).max(Duration::from_millis(1));
        let mut backoff = self.options.poll_min;
        let mut waited = false;
        loop {
            // The guard owns the lock before the script that may take it is sent: cancelled
            // while the script is in flight, or at any later await, it releases the lock.
            let mut guard =
                LockGuard::new(self, &request, Some(keying.clone()), keys.clone(), Some(lock_value.clone()));
            let acquired =
                scripts::acquire(&self.link.connection, &keys, &lock_value, lock_ttl, self.options.timeout).await;
            let probe = match acquired {
                Ok(probe) => probe,
                Err(failure) => {
                    self.link.failed(self.options.cooldown, request.id, &failure);
                    // The script may still run after the timeout: the guard takes back a lock
                    // it would leave behind, once Redis answers again (the token is ours alone).
                    drop(guard);
                    return self.unlocked(request, Some(keying), deadline).await;
                }
            };
            match probe {
                Probe::Cached(value) => {
                    guard.disarm();
                    match codec::decode(&keying, request.id, &value, keying::unix_millis()) {
                        Decoded::Record(record) => {
                            counters.hits.bump();
                            return Ok(Begin::Existing(record));
                        }
                        // Not written by this deployment for this identity, or altered: never
                        // replayed. The store decides (and its outcome overwrites the value).
                        Decoded::Unverified => counters.unverified.bump(),
                        Decoded::Unreadable => counters.corrupt.bump(),
                    }
                    counters.handed_over.bump();
                    return self.unlocked(request, Some(keying), deadline).await;
                }
                Probe::Locked => {
                    if !waited {
                        counters.misses.bump();
                    }
                    counters.locks.bump();
                    let wait = deadline.saturating_duration_since(Instant::now());
                    return hand_lock_to_claim(self.inner.begin(request.wait(wait)).await, guard).await;
                }
                Probe::Held { holder, ttl } => {
                    guard.disarm();
                    if !waited {
                        counters.misses.bump();
                    }
                    let Some(ttl) = ttl.filter(|_| holder.len() == lock_value.len()) else {
                        // A lock the fast path did not set (no expiry, or not of its shape):
                        // never waited on. The store decides.
                        counters.foreign_locks.bump();
                        counters.handed_over.bump();
                        return self.unlocked(request, Some(keying), deadline).await;
                    };
                    if holder.get(TOKEN_LEN..) != lock_value.get(TOKEN_LEN..) {
                        // Another request with this key (a client bug, or a request of another
                        // shape): the store knows the record and answers the mismatch.
                        counters.handed_over.bump();
                        return self.unlocked(request, Some(keying), deadline).await;
                    }
                    if !waited {
                        counters.waits.bump();
                        waited = true;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        // Redis's word alone never answers in flight: the store does, if it
                        // knows of a live claim, and otherwise claims.
                        counters.in_flight.bump();
                        return self.unlocked(request, Some(keying), deadline).await;
                    }
                    // Look again soon: never past the deadline, nor much past the lock's end.
                    let pause = backoff.min(deadline - now).min(ttl.max(Duration::from_millis(1)));
                    tokio::time::sleep(pause).await;
                    backoff = (backoff * 2).min(self.options.poll_max);
                }
            }
        }
    }

    async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        // Cached responses expire by their TTL, which is within the record's retention.
        self.inner.purge(limit).await
    }

    async fn deployment_secret(&self) -> Result<Option<[u8; 32]>, StoreError> {
        self.inner.deployment_secret().await
    }

    /// The durable store's own: the old path never touches Redis.
    async fn plain_transaction(
        &self,
        wait: Duration,
    ) -> Result<Option<PlainTransaction<<S::Claim as Claim>::Handle>>, StoreError> {
        self.inner.plain_transaction(wait).await
    }

    /// The durable store's own: shadow records never touch Redis.
    async fn record_shadow(&self, entries: Vec<ShadowEntry>) -> Result<Vec<ShadowSeen>, StoreError> {
        self.inner.record_shadow(entries).await
    }
}

impl<S: Store> FastPath<S> {
    /// The durable path without the lock: the store decides, within what is left of the wait.
    /// A claim still caches its response when it finishes (unless `keying` is `None`).
    async fn unlocked(
        &self,
        request: BeginRequest<'_>,
        keying: Option<Arc<Keying>>,
        deadline: Instant,
    ) -> Result<Begin<FastPathClaim<S::Claim>>, StoreError> {
        let namespace = keying.as_ref().map_or("", |keying| keying.namespace());
        let keys = Keys::new(&self.options.prefix, namespace, request.id);
        let guard = LockGuard::new(self, &request, keying, keys, None);
        let wait = deadline.saturating_duration_since(Instant::now());
        hand_lock_to_claim(self.inner.begin(request.wait(wait)).await, guard).await
    }
}

/// The durable store's answer to a begin made under `guard`: a claim takes the lock along until
/// it finishes; any other answer releases it at once.
async fn hand_lock_to_claim<C>(
    begun: Result<Begin<C>, StoreError>,
    guard: LockGuard,
) -> Result<Begin<FastPathClaim<C>>, StoreError> {
    let answer = match begun {
        Ok(Begin::Claimed(claim)) => return Ok(Begin::Claimed(FastPathClaim::new(claim, guard))),
        Ok(Begin::Existing(record)) => Ok(Begin::Existing(record)),
        Ok(Begin::InFlight { retry_after }) => Ok(Begin::InFlight { retry_after }),
        Err(error) => Err(error),
    };
    guard.settle(None).await;
    answer
}
