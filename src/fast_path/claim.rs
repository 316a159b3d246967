//! A claim taken through the fast path, the Redis lock it holds, and what it caches when it
//! finishes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use tokio::time::Instant;

use super::connection::RedisLink;
use super::keying::{self, Keying};
use super::scripts::{self, Keys};
use super::{FastPath, Options, codec};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::RecordState;
use crate::store::{BeginRequest, Claim, FinishError, Outcome};

/// The lock token's length; the lock value is the token followed by the fingerprint.
pub(super) const TOKEN_LEN: usize = 16;

/// A claim taken through the fast path: the durable store's claim, and the Redis lock (when
/// one was taken) that keeps duplicates off the database until it finishes.
///
/// Its [`handle`](Claim::handle) is the durable claim's own (a `TxHandle` in atomic mode).
pub struct FastPathClaim<C> {
    // Dropped first: an unfinished durable claim rolls back (or gives up its lease) before the
    // lock is released.
    inner: C,
    guard: LockGuard,
}

impl<C> FastPathClaim<C> {
    /// The durable claim `inner`, holding the lock (if any) of `guard` until it finishes.
    pub(super) fn new(inner: C, guard: LockGuard) -> Self {
        Self { inner, guard }
    }
}

impl<C: std::fmt::Debug> std::fmt::Debug for FastPathClaim<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPathClaim")
            .field("inner", &self.inner)
            .field("locked", &self.guard.lock.is_some())
            .finish_non_exhaustive()
    }
}

impl<C: Claim> Claim for FastPathClaim<C> {
    type Handle = C::Handle;

    fn handle(&self) -> Option<C::Handle> {
        self.inner.handle()
    }

    fn fencing_token(&self) -> Option<u64> {
        self.inner.fencing_token()
    }

    fn renew(
        &self,
        lease: std::time::Duration,
    ) -> impl std::future::Future<Output = Result<crate::store::Renewal, crate::store::StoreError>> + Send + 'static
    {
        // The Redis lock is not extended: it only keeps duplicates off the database for a while
        // (module docs), and the durable lease is what fences.
        self.inner.renew(lease)
    }

    async fn finish(self, outcome: Outcome) -> Result<(), FinishError> {
        let FastPathClaim { inner, guard } = self;
        let retention = guard.retention;
        let state = match &outcome {
            Outcome::Complete(response) => Some((RecordState::Completed, response)),
            Outcome::Reject(response) => Some((RecordState::Failed, response)),
            // An unknown outcome is never cached: retries must reach the store, which answers
            // `unknown` until the record is settled.
            Outcome::Release | Outcome::Unknown(_) => None,
        };
        let payload = match (&guard.keying, state) {
            (Some(_), Some((state, response))) => Some(codec::encode_payload(state, &guard.fingerprint, response)),
            _ => None,
        };
        // The record's retention starts no earlier than this. The cached copy's TTL is counted
        // from here, less the longest the write may take to reach Redis (the call's timeout),
        // so it ends no later than the record's response does. The value is sealed with that
        // end, so a copy kept in Redis past its TTL is not replayed either.
        let started = Instant::now();
        let sealed_at = keying::unix_millis();
        let finished = inner.finish(outcome).await;
        // Only a committed outcome is cached.
        let spent = started.elapsed() + guard.options.timeout;
        let ttl = retention.saturating_sub(spent).min(guard.options.cache_ttl_cap);
        let cache = match (&finished, payload, &guard.keying) {
            (Ok(()), Some(payload), Some(keying)) if ttl >= Duration::from_millis(1) => {
                let until = sealed_at.saturating_add(u64::try_from((spent + ttl).as_millis()).unwrap_or(u64::MAX));
                Some((keying.seal(&guard.id, until, payload), ttl))
            }
            _ => None,
        };
        guard.settle(cache).await;
        finished
    }
}

/// The Redis lock of a claim (if one was taken), and what the claim needs to cache its
/// response. Released in the background if dropped unsettled.
///
/// It owns the lock from before the acquire script is sent until the release script has
/// answered, so that a request cancelled at any await point in between (the script in flight,
/// the durable store's begin, the handler, the release itself) leaves no lock behind: the drop
/// releases it by its token.
pub(super) struct LockGuard {
    link: Arc<RedisLink>,
    options: Arc<Options>,
    /// The deployment's keying; `None`: the fast path has no secret and stays out of Redis.
    keying: Option<Arc<Keying>>,
    id: RecordId,
    keys: Keys,
    /// Our lock value, while we hold the lock.
    lock: Option<Vec<u8>>,
    fingerprint: Fingerprint,
    /// The record's response retention: the cached response's TTL is within it.
    retention: Duration,
}

impl LockGuard {
    /// The guard of `request`'s lock `lock` (`None`: no lock is or will be ours) on `keys`,
    /// in the deployment of `keying`.
    pub(super) fn new<S>(
        fast: &FastPath<S>,
        request: &BeginRequest<'_>,
        keying: Option<Arc<Keying>>,
        keys: Keys,
        lock: Option<Vec<u8>>,
    ) -> Self {
        LockGuard {
            link: fast.link.clone(),
            options: fast.options.clone(),
            keying,
            id: *request.id,
            keys,
            lock,
            fingerprint: *request.fingerprint,
            retention: request.retention.response,
        }
    }

    /// The lock was not taken after all (the script found a cached value or another holder):
    /// nothing to release.
    pub(super) fn disarm(&mut self) {
        self.lock = None;
    }

    /// Caches `cache` (a committed response and its TTL) and releases the lock, in one round
    /// trip. A failure is counted; the lock is then released once more in the background (its
    /// TTL bounds it anyway). Cancelled, it releases the lock in the background too.
    pub(super) async fn settle(mut self, cache: Option<(Vec<u8>, Duration)>) {
        if (self.lock.is_none() && cache.is_none()) || self.link.cooling_down() {
            // Nothing to do, or Redis failed a moment ago and the answer is not held up for it
            // (a held lock is then released in the background, on drop).
            return;
        }
        let cache = cache.as_ref().map(|(value, ttl)| (value.as_slice(), *ttl));
        let settled =
            scripts::settle(&self.link.connection, &self.keys, self.lock.as_deref(), cache, self.options.timeout).await;
        match settled {
            Ok(cached) => {
                // Released: nothing left for the drop to do.
                self.lock = None;
                if cached {
                    self.link.counters.cached.bump();
                }
            }
            Err(failure) => self.link.failed(self.options.cooldown, &self.id, &failure),
        }
    }
}

impl Drop for LockGuard {
    /// Releases a lock still held (a request cancelled while its acquire script was in flight,
    /// a claim dropped unfinished, a lock a timed-out call may have taken, a release that
    /// failed or was skipped during the cool-down) from a task of its own, best effort. The
    /// release goes down the same connection after the acquire, so it finds the lock if the
    /// acquire took it.
    fn drop(&mut self) {
        let Some(lock) = self.lock.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (link, keys, timeout) = (self.link.clone(), self.keys.clone(), self.options.timeout);
        runtime.spawn(async move {
            let _ = scripts::settle(&link.connection, &keys, Some(&lock), None, timeout).await;
        });
    }
}

/// A lock value: a fresh random token, then the request's fingerprint (so a duplicate can tell
/// a holder of the same request from one of another).
pub(super) fn lock_value(fingerprint: &Fingerprint) -> Vec<u8> {
    let mut value = Vec::with_capacity(TOKEN_LEN + 33);
    value.extend_from_slice(&token());
    value.push(fingerprint.version());
    value.extend_from_slice(fingerprint.digest());
    value
}

/// A 128-bit token unique to this lock: a process-wide counter, hashed with the standard
/// library's randomly keyed SipHash (so other processes' tokens differ), next to the counter
/// itself (so this process's never repeat). It needs to be unique, not secret.
fn token() -> [u8; TOKEN_LEN] {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static KEYS: LazyLock<std::hash::RandomState> = LazyLock::new(std::hash::RandomState::new);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut hasher = KEYS.build_hasher();
    hasher.write_u64(n);
    hasher.write_u32(std::process::id());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    hasher.write_u128(nanos);
    let mut token = [0; TOKEN_LEN];
    token[..8].copy_from_slice(&hasher.finish().to_be_bytes());
    token[8..].copy_from_slice(&n.to_be_bytes());
    token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_unique_and_lock_values_carry_the_fingerprint() {
        let fingerprint = Fingerprint::from_parts(1, [3; 32]);
        let (a, b) = (lock_value(&fingerprint), lock_value(&fingerprint));
        assert_ne!(a[..TOKEN_LEN], b[..TOKEN_LEN]);
        assert_eq!(a[TOKEN_LEN..], b[TOKEN_LEN..]);
        assert_eq!(a[TOKEN_LEN], 1);
        assert_eq!(a[TOKEN_LEN + 1..], [3; 32]);
    }
}
