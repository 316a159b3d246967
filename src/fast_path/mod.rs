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
//! ## Keys
//!
//! Keys hold the identity's digest, never the raw key or scope, with a hash tag so that one
//! identity's keys live on one Redis Cluster slot:
//!
//! ```text
//! <prefix>:{<record digest, hex>}:c    the cached response (a small versioned binary value)
//! <prefix>:{<record digest, hex>}:l    the lock (token and fingerprint)
//! ```
//!
//! Give each durable store its own prefix (default `tidem`) when several share one Redis.
//!
//! ## What it does not do
//!
//! - A record read from the database (after a cache miss) is not written back to the cache: the
//!   fast path does not know when that record's response expires, and must never replay past it.
//! - The lock lives at most [`lock_ttl`](FastPath::lock_ttl) (10 s by default) and never longer
//!   than the claim's lease; it is not extended while a handler runs. A handler that runs longer
//!   only lets its duplicates reach the durable store, which keeps them out as it would without
//!   Redis. A process that dies holding a lock makes retries of that key wait (and get 409
//!   `idempotency_request_in_flight`) until the lock's TTL runs out.
//! - A response cached before the route's retention was shortened is replayed until its own TTL.
//! - Cached responses are kept in Redis as they are in the database, in clear: protect Redis as
//!   you protect the database.
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

mod begin;
mod claim;
pub(crate) mod codec;
mod connection;
mod scripts;
mod stats;

use std::sync::Arc;
use std::time::Duration;

pub use claim::FastPathClaim;
pub use connection::RedisConnection;
use connection::RedisLink;
pub use stats::FastPathStats;

use crate::name::InvalidName;
use crate::store::Store;

/// A Redis lock and replay cache in front of the durable store `S`. See the [module
/// docs](self).
pub struct FastPath<S> {
    inner: S,
    link: Arc<RedisLink>,
    options: Arc<Options>,
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
        Self { inner: self.inner.clone(), link: self.link.clone(), options: self.options.clone() }
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
        Self { inner, link: Arc::new(RedisLink::new(redis.into())), options: Arc::new(Options::default()) }
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

    /// The prefix of every key (default `tidem`): give each durable store its own when several
    /// share one Redis. Visible ASCII, 1 to 64 bytes, without `{` or `}`.
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
}
