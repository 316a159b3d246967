//! [`FastPath`] (feature `redis`): a Redis lock and replay cache in front of any [`Store`].
//!
//! `FastPath<S>` is itself a [`Store`] that wraps a durable store `S`, so the layer never learns
//! that Redis is there. It makes the two common cases cheap:
//!
//! - **Replays.** After a claim finishes and its outcome is committed, the stored response
//!   (status, headers, trailers, body, fingerprint, state) is cached in Redis, with a TTL no
//!   longer than the record's [`Retention::response`](crate::Retention::response). A retry is
//!   answered from the cache without touching the database; a retry with another fingerprint
//!   gets the cached record too, and the layer refuses it as a mismatch.
//! - **Concurrent duplicates.** Before the durable claim, `SET NX PX` with a random token takes
//!   a short lock on the identity. A duplicate that finds the lock taken waits, bounded by the
//!   request's in-flight wait, for the cached answer to appear or the lock to go, **without
//!   holding a database connection**; then it replays, asks the durable store (which decides),
//!   or reports the identity in flight. The lock is released with a compare-and-delete script
//!   when the claim finishes (or is dropped); its TTL bounds a crash.
//!
//! Redis is never the safety boundary ([contract §7](crate::contract#7-fast-path)): the durable store's claim decides who
//! runs. Any Redis error or timeout (every call has one, 200 ms by default) sends the request
//! down the durable path without the lock, is counted in [`FastPath::stats`], and makes the fast
//! path leave Redis alone for a short cool-down (1 s by default), so an outage costs neither
//! wrong answers nor a timeout per request. A flushed, evicted or restarted Redis just misses.
//!
//! ## What is in Redis, and what is verified
//!
//! Whoever can write to Redis must not be able to make the service lie. So:
//!
//! - **Each deployment has a secret**, the durable store's [`Store::deployment_secret`] (the
//!   SQL stores draw it once, at migration, and keep it with the records; a
//!   [`MemoryStore`](crate::MemoryStore) draws one per store value), read once on the first
//!   request, or one the application gives ([`FastPath::secret`]). Both the keys' namespace and
//!   the MAC key come from it: deployments sharing one Redis, even with one prefix, never see
//!   each other's keys, and replicas of one deployment share theirs.
//! - **A cached value is sealed** with an HMAC-SHA256 over the identity, the fingerprint, the
//!   state and the whole stored response, under the deployment's MAC key, and verified before it
//!   is replayed. A value that does not verify (altered, another identity's copied over,
//!   another deployment's, or of the old unsealed format) or does not decode is a miss, counted
//!   (`unverified`, `corrupt`), and the durable store answers; its outcome is cached afresh.
//! - **A lock only delays, never answers.** A lock the fast path did not set (no expiry, or not
//!   of its shape) is not waited on; a lock still held when the bounded wait runs out hands the
//!   decision to the durable store, which answers in flight only if it knows of a live claim.
//! - **Cancel-safe.** The lock is owned by a guard from before the acquire script is sent until
//!   its release has answered; a request dropped at any await point (its client gone) releases
//!   its lock by its token in the background.
//! - **A store without a secret** (a store of your own that does not implement
//!   [`Store::deployment_secret`]) and no [`FastPath::secret`]: the fast path stays out of Redis
//!   and every request goes to the store (counted in `unkeyed`, with one warning). It never
//!   falls back to a shared, guessable namespace.
//!
//! Keys hold the identity's digest, never the raw key or scope, with a hash tag so that one
//! identity's keys live on one Redis Cluster slot:
//!
//! ```text
//! <prefix>:<namespace>:{<record digest, hex>}:c    the cached response, sealed (format 2)
//! <prefix>:<namespace>:{<record digest, hex>}:l    the lock (token and fingerprint)
//! ```
//!
//! The namespace is 16 hex digits derived from the deployment's secret; the prefix (default
//! `tidem`) is only for telling the fast path's keys from others in a shared Redis.
//!
//! ## What it does not do
//!
//! - A record read from the database (after a cache miss) is not written back to the cache: the
//!   fast path does not know when that record's response expires, and must never replay past it.
//! - The lock lives at most [`lock_ttl`](FastPath::lock_ttl) (10 s by default) and never longer
//!   than the claim's lease; it is not extended while a handler runs. A handler that runs longer
//!   only lets its duplicates reach the durable store, which keeps them out as it would without
//!   Redis. A process that dies holding a lock makes retries of that key wait out the bounded
//!   in-flight wait, then the durable store decides.
//! - A response cached before the route's retention was shortened is replayed until its own TTL.
//! - Cached responses are kept in Redis as they are in the database, in clear (sealed, not
//!   encrypted): protect Redis as you protect the database. A value copied back under its own
//!   key after it was replaced (a replay of an old answer for the same identity and request) is
//!   not detected; it is that identity's own committed answer.
//!
//! ## Example
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tower_idempotency::{FastPath, IdempotencyLayer, PostgresStore};
//!
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! let store = PostgresStore::new(pool);
//! store.migrate().await?;
//!
//! // One node (a lazy `ConnectionManager`: the service starts even while Redis is down) ...
//! // The deployment's secret is the store's own (drawn by `migrate`): nothing to configure.
//! let fast = FastPath::connect(store.clone(), "redis://127.0.0.1:6379/")?
//!     .prefix("orders")?
//!     .timeout(Duration::from_millis(100));
//! // ... or a cluster.
//! let _clustered = FastPath::connect_cluster(store, &["redis://127.0.0.1:7000/"])?;
//!
//! let layer = IdempotencyLayer::new(fast.clone());
//! # drop(layer);
//! println!("replays served by Redis so far: {}", fast.stats().hits);
//! # Ok(()) }
//! ```

mod admin;
mod begin;
mod claim;
pub(crate) mod codec;
mod connection;
mod keying;
mod scripts;
mod stats;

use std::sync::Arc;
use std::time::Duration;

pub use claim::FastPathClaim;
pub use connection::RedisConnection;
use connection::RedisLink;
use keying::Keying;
pub use stats::FastPathStats;
use tokio::sync::OnceCell;

use crate::name::InvalidName;
use crate::store::Store;

/// A Redis lock and replay cache in front of the durable store `S`. See the [module
/// docs](self).
pub struct FastPath<S> {
    inner: S,
    link: Arc<RedisLink>,
    options: Arc<Options>,
    /// The deployment's keying, from the application's secret or read once from the store;
    /// `None` inside: the store has no secret and none was given, so Redis is left alone.
    keying: Arc<OnceCell<Option<Arc<Keying>>>>,
}

/// A fast path's settings, shared by its clones and its claims.
#[derive(Debug, Clone)]
struct Options {
    prefix: Arc<str>,
    lock_ttl: Duration,
    cache_ttl_cap: Duration,
    timeout: Duration,
    cooldown: Duration,
    poll_min: Duration,
    poll_max: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            prefix: Arc::from("tidem"),
            lock_ttl: Duration::from_secs(10),
            cache_ttl_cap: Duration::from_secs(600),
            timeout: Duration::from_millis(200),
            cooldown: Duration::from_secs(1),
            poll_min: Duration::from_millis(2),
            poll_max: Duration::from_millis(50),
        }
    }
}

impl<S: Clone> Clone for FastPath<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            link: self.link.clone(),
            options: self.options.clone(),
            keying: self.keying.clone(),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for FastPath<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("inner", &self.inner)
            .field("redis", &self.link.connection)
            .field("prefix", &self.options.prefix)
            .field("lock_ttl", &self.options.lock_ttl)
            .field("cache_ttl_cap", &self.options.cache_ttl_cap)
            .field("timeout", &self.options.timeout)
            .finish_non_exhaustive()
    }
}

impl<S: Store> FastPath<S> {
    /// A fast path over `inner`, on a Redis connection: a [`ConnectionManager`] (one node) or a
    /// [`ClusterConnection`]. Give the connection its own response timeout too; the fast path
    /// bounds every call by [`timeout`](Self::timeout) whatever the connection does.
    ///
    /// [`ConnectionManager`]: redis::aio::ConnectionManager
    /// [`ClusterConnection`]: redis::cluster_async::ClusterConnection
    pub fn new(inner: S, redis: impl Into<RedisConnection>) -> Self {
        Self {
            inner,
            link: Arc::new(RedisLink::new(redis.into())),
            options: Arc::new(Options::default()),
            keying: Arc::new(OnceCell::new()),
        }
    }

    /// A fast path over `inner` on the Redis node at `url` (`redis://host:port/db`), through a
    /// lazy [`ConnectionManager`](redis::aio::ConnectionManager). It is not `async`: nothing is
    /// sent until the first request, so this fails only on a malformed URL, and the service
    /// starts (on its store alone) while Redis is down.
    ///
    /// The connection's own timeouts (to connect, and for a response) are 1 s, a safety net
    /// behind the fast path's [`timeout`](Self::timeout); for other settings make the
    /// connection yourself and use [`new`](Self::new). Call it on a Tokio runtime (in async
    /// code, or inside `Runtime::enter`): the connection's task is spawned there at once.
    pub fn connect(inner: S, url: &str) -> Result<Self, redis::RedisError> {
        Ok(Self::new(inner, RedisConnection::lazy_single(url)?))
    }

    /// A fast path over `inner` on the Redis Cluster that `nodes` (`redis://host:port/` of one
    /// or more of its nodes) belong to. It is not `async`: the connections are made in the
    /// background, so this fails only on malformed URLs. Timeouts, and the Tokio runtime it
    /// needs, as for [`connect`](Self::connect).
    pub fn connect_cluster(inner: S, nodes: &[&str]) -> Result<Self, redis::RedisError> {
        Ok(Self::new(inner, RedisConnection::pending_cluster(nodes)?))
    }

    /// The prefix of every key (default `tidem`). Deployments sharing one Redis need not set
    /// one each: their keys are namespaced by their secret already (see
    /// [`secret`](Self::secret)). Visible ASCII, 1 to 64 bytes, without `{` or `}`.
    pub fn prefix(mut self, prefix: &str) -> Result<Self, InvalidName> {
        if !scripts::valid_prefix(prefix) {
            return Err(InvalidName::new(
                prefix,
                "a Redis key prefix",
                "visible ASCII, 1 to 64 bytes, without `{` or `}`",
            ));
        }
        Arc::make_mut(&mut self.options).prefix = Arc::from(prefix);
        Ok(self)
    }

    /// The deployment's secret, given by the application instead of read from the store: the
    /// namespace of the fast path's Redis keys and the key of the MAC of its cached values are
    /// derived from it. Use at least 32 random bytes, kept as a credential.
    ///
    /// By default the fast path reads the durable store's own
    /// ([`Store::deployment_secret`]), once, on the first request: every deployment (store)
    /// then has its own namespace without configuration, and replicas of one deployment share
    /// it. Give one for a store that has none (without a secret the fast path stays out of
    /// Redis and every request goes to the store), or to share a cache across stores on
    /// purpose (only stores that hold the same records may share one).
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        let keying = Arc::new(Keying::derive(secret.as_ref()));
        self.keying = Arc::new(OnceCell::new_with(Some(Some(keying))));
        self
    }

    /// The longest a lock lives (default 10 s); a lock never outlives the claim's lease either.
    /// It bounds how long a crashed holder keeps its duplicates waiting. At least 1 ms.
    pub fn lock_ttl(mut self, ttl: Duration) -> Self {
        Arc::make_mut(&mut self.options).lock_ttl = ttl.max(Duration::from_millis(1));
        self
    }

    /// The longest a response stays cached (default 10 min); never longer than the record's
    /// response retention either.
    pub fn cache_ttl_cap(mut self, cap: Duration) -> Self {
        Arc::make_mut(&mut self.options).cache_ttl_cap = cap;
        self
    }

    /// The bound on every Redis call (default 200 ms); a call that takes longer counts as a
    /// failure, and the request goes down the durable path. A cached response's TTL is its
    /// record's retention less this bound (the longest the write may take to arrive).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        Arc::make_mut(&mut self.options).timeout = timeout;
        self
    }

    /// How long the fast path leaves Redis alone after a failed call (default 1 s): requests go
    /// straight to the durable store meanwhile. Zero: try Redis on every request.
    pub fn cooldown(mut self, cooldown: Duration) -> Self {
        Arc::make_mut(&mut self.options).cooldown = cooldown;
        self
    }

    /// The durable store behind the fast path.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// What the fast path has done so far (shared by its clones).
    pub fn stats(&self) -> FastPathStats {
        self.link.counters.snapshot()
    }

    /// The deployment's keying: the application's secret, else the store's, read on first use
    /// (a failed read is tried again on the next request). `None`: no secret, stay out of Redis.
    async fn keying(&self) -> Option<Arc<Keying>> {
        let read = self
            .keying
            .get_or_try_init(|| async {
                let secret = self.inner.deployment_secret().await?;
                if secret.is_none() {
                    tracing::warn!(
                        "idempotency: the store has no deployment secret and none was given \
                         (FastPath::secret); the Redis fast path is off, every request goes to the store"
                    );
                }
                Ok::<_, crate::store::StoreError>(secret.map(|secret| Arc::new(Keying::derive(&secret))))
            })
            .await;
        match read {
            Ok(keying) => keying.clone(),
            Err(error) => {
                tracing::warn!(%error, "idempotency: reading the store's deployment secret failed; this request skips Redis");
                None
            }
        }
    }
}
