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
//! Redis is never the safety boundary (CONTRACT §7): the durable store's claim decides who
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
//! let fast = FastPath::connect(store.clone(), "redis://127.0.0.1:6379/").await?
//!     .prefix("orders")?
//!     .timeout(Duration::from_millis(100));
//! // ... or a cluster.
//! let _clustered = FastPath::connect_cluster(store, &["redis://127.0.0.1:7000/"]).await?;
//!
//! let layer = IdempotencyLayer::new(fast.clone());
//! # drop(layer);
//! println!("replays served by Redis so far: {}", fast.stats().hits);
//! # Ok(()) }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};
use tokio::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::{Record, RecordState, StoredResponse};
use crate::store::{Begin, BeginRequest, Claim, FinishError, Outcome, Store, StoreError};

/// Looks for the cached response; on a miss takes the lock, or reports who holds it.
///
/// `KEYS[1]`: the cached response; `KEYS[2]`: the lock. `ARGV[1]`: our lock value; `ARGV[2]`:
/// the lock's TTL in milliseconds. Returns `{1, response}`, `{2}` (the lock is ours), or
/// `{3, holder's lock value, the lock's remaining TTL in milliseconds}`.
const ACQUIRE_LUA: &str = r"
local cached = redis.call('GET', KEYS[1])
if cached then return {1, cached} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2} end
return {3, redis.call('GET', KEYS[2]) or '', redis.call('PTTL', KEYS[2])}
";

/// Caches a committed response (when there is one) and releases the lock (when it is still
/// ours), in one round trip: both keys share a slot.
///
/// `KEYS[1]`: the cached response; `KEYS[2]`: the lock. `ARGV[1]`: our lock value (empty: no
/// lock); `ARGV[2]`: the response to cache (empty: none); `ARGV[3]`: its TTL in milliseconds.
/// A cache write refused for lack of memory does not keep the lock from being released.
/// Returns 1 when the response was cached.
const SETTLE_LUA: &str = r"
local cached = 0
if ARGV[2] ~= '' then
  local ok = redis.pcall('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  if type(ok) == 'table' and ok.ok then cached = 1 end
end
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return cached
";

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(SETTLE_LUA));

/// The version byte of the cached value's encoding.
const CACHE_FORMAT: u8 = 1;
/// Version, state, fingerprint version and digest, status, length of the fields.
const CACHE_HEADER_LEN: usize = 1 + 1 + 1 + 32 + 2 + 4;
/// The lock token's length; the lock value is the token followed by the fingerprint.
const TOKEN_LEN: usize = 16;
/// The connection timeouts of [`FastPath::connect`] and [`FastPath::connect_cluster`].
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection to Redis: one node or a cluster. Both reconnect by themselves.
#[derive(Clone)]
#[non_exhaustive]
pub enum RedisConnection {
    /// One node, through a [`ConnectionManager`].
    Single(ConnectionManager),
    /// A Redis Cluster, through a [`ClusterConnection`].
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConnection::Single(_) => "RedisConnection::Single",
            RedisConnection::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl From<ConnectionManager> for RedisConnection {
    fn from(connection: ConnectionManager) -> Self {
        RedisConnection::Single(connection)
    }
}

impl From<ClusterConnection> for RedisConnection {
    fn from(connection: ClusterConnection) -> Self {
        RedisConnection::Cluster(connection)
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Single(connection) => connection.req_packed_command(cmd),
            RedisConnection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Single(connection) => connection.req_packed_commands(pipeline, offset, count),
            RedisConnection::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Single(connection) => connection.get_db(),
            RedisConnection::Cluster(connection) => connection.get_db(),
        }
    }
}

/// A key prefix that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The prefix is empty, longer than 64 bytes, or has characters other than visible ASCII
    /// without `{` and `}` (which would break the keys' hash tag).
    #[error("invalid Redis key prefix: {0}")]
    InvalidPrefix(String),
}

/// What the fast path has done since it was made; shared by its clones.
///
/// Every Redis failure is in `degraded`: the request went down the durable path instead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FastPathStats {
    /// Begins answered from the cached response, without the durable store (duplicates that
    /// waited for it included).
    pub hits: u64,
    /// Begins whose first look found no cached response.
    pub misses: u64,
    /// Locks taken (each followed by the durable store's begin).
    pub locks: u64,
    /// Begins that found the lock held by a duplicate and waited.
    pub waits: u64,
    /// Waits that ran out: answered in flight without the durable store.
    pub in_flight: u64,
    /// Begins that went to the durable store without the lock because the lock's holder has
    /// another fingerprint or the cached value was unreadable (the store decides).
    pub handed_over: u64,
    /// Cached values that could not be read (corrupt, or of an unknown format): misses.
    pub corrupt: u64,
    /// Responses cached after their commit.
    pub cached: u64,
    /// Redis calls that failed or timed out; the request went down the durable path.
    pub degraded: u64,
    /// Begins that skipped Redis during the cool-down after a failure.
    pub bypassed: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    locks: AtomicU64,
    waits: AtomicU64,
    in_flight: AtomicU64,
    handed_over: AtomicU64,
    corrupt: AtomicU64,
    cached: AtomicU64,
    degraded: AtomicU64,
    bypassed: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

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

/// The Redis side, shared by a fast path's clones and its claims.
struct Shared {
    redis: RedisConnection,
    counters: Counters,
    /// The start of `down_until_ms`'s clock.
    epoch: Instant,
    /// Until when (milliseconds after `epoch`) Redis is left alone after a failure.
    down_until_ms: AtomicU64,
}

impl Shared {
    fn cooling_down(&self) -> bool {
        (self.epoch.elapsed().as_millis() as u64) < self.down_until_ms.load(Ordering::Relaxed)
    }

    /// Counts a failed Redis call and starts the cool-down.
    fn failed(&self, options: &Options, id: &RecordId, error: &Failure) {
        bump(&self.counters.degraded);
        let until = (self.epoch.elapsed() + options.cooldown).as_millis() as u64;
        let previous = self.down_until_ms.swap(until, Ordering::Relaxed);
        if previous <= self.epoch.elapsed().as_millis() as u64 {
            tracing::warn!(record = %id, %error, "idempotency: Redis fast path failed; using the store alone for a while");
        } else {
            tracing::debug!(record = %id, %error, "idempotency: Redis fast path failed");
        }
    }
}

/// Why a Redis call did not answer.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("Redis call timed out")]
    Timeout,
    #[error("Redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected Redis reply")]
    Reply,
}

/// The Redis keys of one identity.
#[derive(Debug, Clone)]
struct Keys {
    cache: String,
    lock: String,
}

impl Keys {
    fn new(prefix: &str, id: &RecordId) -> Self {
        let base = format!("{prefix}:{{{}}}:", id.to_hex());
        Self { cache: format!("{base}c"), lock: format!("{base}l") }
    }
}

/// A Redis lock and replay cache in front of the durable store `S`. See the [module
/// docs](self).
pub struct FastPath<S> {
    inner: S,
    shared: Arc<Shared>,
    options: Arc<Options>,
}

impl<S: Clone> Clone for FastPath<S> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), shared: self.shared.clone(), options: self.options.clone() }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for FastPath<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("inner", &self.inner)
            .field("redis", &self.shared.redis)
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
    pub fn new(inner: S, redis: impl Into<RedisConnection>) -> Self {
        let shared = Shared {
            redis: redis.into(),
            counters: Counters::default(),
            epoch: Instant::now(),
            down_until_ms: AtomicU64::new(0),
        };
        Self { inner, shared: Arc::new(shared), options: Arc::new(Options::default()) }
    }

    /// A fast path over `inner` on the Redis node at `url` (`redis://host:port/db`), through a
    /// lazy [`ConnectionManager`]: nothing is sent until the first request, so this fails only
    /// on a malformed URL, and the service starts (on its store alone) while Redis is down.
    ///
    /// The connection's own timeouts (to connect, and for a response) are 1 s, a safety net
    /// behind the fast path's [`timeout`](Self::timeout); for other settings make the
    /// connection yourself and use [`new`](Self::new). Call it on a Tokio runtime: the
    /// connection's tasks are spawned there.
    pub async fn connect(inner: S, url: &str) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(CONNECTION_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(Self::new(inner, manager))
    }

    /// A fast path over `inner` on the Redis Cluster that `nodes` (`redis://host:port/` of one
    /// or more of its nodes) belong to. The connections are made in the background: this fails
    /// only on malformed URLs. Timeouts as for [`connect`](Self::connect).
    pub async fn connect_cluster(inner: S, nodes: &[&str]) -> Result<Self, redis::RedisError> {
        let client = redis::cluster::ClusterClient::builder(nodes.iter().copied()).retries(2).build()?;
        let config = redis::cluster::ClusterConfig::new()
            .set_connection_timeout(CONNECTION_TIMEOUT)
            .set_response_timeout(CONNECTION_TIMEOUT);
        Ok(Self::new(inner, client.get_pending_async_connection_with_config(config)))
    }

    /// The prefix of every key (default `tidem`): give each durable store its own when several
    /// share one Redis. Visible ASCII, 1 to 64 bytes, without `{` or `}`.
    pub fn prefix(mut self, prefix: &str) -> Result<Self, ConfigError> {
        if !valid_prefix(prefix) {
            return Err(ConfigError::InvalidPrefix(prefix.escape_debug().to_string()));
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
        let c = &self.shared.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        FastPathStats {
            hits: get(&c.hits),
            misses: get(&c.misses),
            locks: get(&c.locks),
            waits: get(&c.waits),
            in_flight: get(&c.in_flight),
            handed_over: get(&c.handed_over),
            corrupt: get(&c.corrupt),
            cached: get(&c.cached),
            degraded: get(&c.degraded),
            bypassed: get(&c.bypassed),
        }
    }

    /// The durable path without the lock: the store decides, within what is left of the wait.
    async fn unlocked(
        &self,
        request: BeginRequest<'_>,
        deadline: Instant,
    ) -> Result<Begin<FastPathClaim<S::Claim>>, StoreError> {
        let guard = LockGuard::new(self, &request, Keys::new(&self.options.prefix, request.id), None);
        let wait = deadline.saturating_duration_since(Instant::now());
        self.settle_begin(self.inner.begin(request.wait(wait)).await, guard).await
    }

    /// The durable begin with the lock held: a claim keeps the lock until it finishes; any
    /// other answer releases it at once.
    async fn settle_begin(
        &self,
        begun: Result<Begin<S::Claim>, StoreError>,
        guard: LockGuard,
    ) -> Result<Begin<FastPathClaim<S::Claim>>, StoreError> {
        match begun {
            Ok(Begin::Claimed(claim)) => Ok(Begin::Claimed(FastPathClaim { inner: claim, guard })),
            Ok(Begin::Existing(record)) => {
                guard.settle(None).await;
                Ok(Begin::Existing(record))
            }
            Ok(Begin::InFlight { retry_after }) => {
                guard.settle(None).await;
                Ok(Begin::InFlight { retry_after })
            }
            Err(error) => {
                guard.settle(None).await;
                Err(error)
            }
        }
    }

    async fn acquire(&self, keys: &Keys, lock_value: &[u8], lock_ttl: Duration) -> Result<Probe, Failure> {
        let mut invocation = ACQUIRE.prepare_invoke();
        invocation.key(&keys.cache).key(&keys.lock).arg(lock_value).arg(millis(lock_ttl));
        let mut redis = self.shared.redis.clone();
        let reply: Value = tokio::time::timeout(self.options.timeout, invocation.invoke_async(&mut redis))
            .await
            .map_err(|_| Failure::Timeout)??;
        Probe::parse(reply).ok_or(Failure::Reply)
    }
}

impl<S: Store> Store for FastPath<S> {
    type Claim = FastPathClaim<S::Claim>;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<Self::Claim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        let counters = &self.shared.counters;
        if self.shared.cooling_down() {
            bump(&counters.bypassed);
            return self.unlocked(request, deadline).await;
        }
        let keys = Keys::new(&self.options.prefix, request.id);
        let lock_value = lock_value(request.fingerprint);
        // The lock never outlives the claim's lease, so a dead holder's stale lease is found
        // by the store as soon as it would be without Redis.
        let lock_ttl = self.options.lock_ttl.min(request.lease).max(Duration::from_millis(1));
        let mut backoff = self.options.poll_min;
        let mut waited = false;
        loop {
            let probe = match self.acquire(&keys, &lock_value, lock_ttl).await {
                Ok(probe) => probe,
                Err(failure) => {
                    self.shared.failed(&self.options, request.id, &failure);
                    // The script may still run after the timeout: take back a lock it would
                    // leave behind, once Redis answers again (the token is ours alone).
                    drop(LockGuard::new(self, &request, keys, Some(lock_value)));
                    return self.unlocked(request, deadline).await;
                }
            };
            match probe {
                Probe::Cached(value) => match decode(&value) {
                    Some(record) => {
                        bump(&counters.hits);
                        return Ok(Begin::Existing(record));
                    }
                    None => {
                        bump(&counters.corrupt);
                        bump(&counters.handed_over);
                        return self.unlocked(request, deadline).await;
                    }
                },
                Probe::Locked => {
                    if !waited {
                        bump(&counters.misses);
                    }
                    bump(&counters.locks);
                    let guard = LockGuard::new(self, &request, keys, Some(lock_value));
                    let wait = deadline.saturating_duration_since(Instant::now());
                    return self.settle_begin(self.inner.begin(request.wait(wait)).await, guard).await;
                }
                Probe::Held { holder, ttl } => {
                    if !waited {
                        bump(&counters.misses);
                    }
                    if holder.get(TOKEN_LEN..) != lock_value.get(TOKEN_LEN..) {
                        // Another request with this key (a client bug, or a request of another
                        // shape): the store knows the record and answers the mismatch.
                        bump(&counters.handed_over);
                        return self.unlocked(request, deadline).await;
                    }
                    if !waited {
                        bump(&counters.waits);
                        waited = true;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        bump(&counters.in_flight);
                        let retry_after = ttl.clamp(Duration::from_millis(1), Duration::from_secs(1));
                        return Ok(Begin::InFlight { retry_after });
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
}

/// What the acquire script found.
enum Probe {
    /// The cached response.
    Cached(Vec<u8>),
    /// The lock is ours.
    Locked,
    /// A duplicate holds the lock: its value, and how long it has left.
    Held { holder: Vec<u8>, ttl: Duration },
}

impl Probe {
    fn parse(reply: Value) -> Option<Probe> {
        let Value::Array(items) = reply else { return None };
        let mut items = items.into_iter();
        let bytes = |value: Option<Value>| match value {
            Some(Value::BulkString(bytes)) => Some(bytes),
            _ => None,
        };
        match items.next()? {
            Value::Int(1) => Some(Probe::Cached(bytes(items.next())?)),
            Value::Int(2) => Some(Probe::Locked),
            Value::Int(3) => {
                let holder = bytes(items.next()).unwrap_or_default();
                let ttl = match items.next() {
                    Some(Value::Int(ms)) if ms > 0 => Duration::from_millis(ms as u64),
                    // No TTL (set by someone else) or gone meanwhile: look again soon.
                    _ => Duration::from_millis(1),
                };
                Some(Probe::Held { holder, ttl })
            }
            _ => None,
        }
    }
}

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

    async fn finish(self, outcome: Outcome) -> Result<(), FinishError> {
        let FastPathClaim { inner, guard } = self;
        let retention = guard.retention;
        let value = match &outcome {
            Outcome::Complete(response) => Some(encode(RecordState::Completed, &guard.fingerprint, response)),
            Outcome::Reject(response) => Some(encode(RecordState::Failed, &guard.fingerprint, response)),
            Outcome::Release => None,
        };
        // The record's retention starts no earlier than this. The cached copy's TTL is counted
        // from here, less the longest the write may take to reach Redis (the call's timeout),
        // so it ends no later than the record's response does.
        let started = Instant::now();
        let finished = inner.finish(outcome).await;
        // Only a committed outcome is cached.
        let spent = started.elapsed() + guard.options.timeout;
        let ttl = retention.saturating_sub(spent).min(guard.options.cache_ttl_cap);
        let cache = match (&finished, value) {
            (Ok(()), Some(value)) if ttl >= Duration::from_millis(1) => Some((value, ttl)),
            _ => None,
        };
        guard.settle(cache).await;
        finished
    }
}

/// The Redis lock of a claim (if one was taken), and what the claim needs to cache its
/// response. Released in the background if dropped unsettled.
struct LockGuard {
    shared: Arc<Shared>,
    options: Arc<Options>,
    id: RecordId,
    keys: Keys,
    /// Our lock value, while we hold the lock.
    lock: Option<Vec<u8>>,
    fingerprint: Fingerprint,
    /// The record's response retention: the cached response's TTL is within it.
    retention: Duration,
}

impl LockGuard {
    fn new<S>(fast: &FastPath<S>, request: &BeginRequest<'_>, keys: Keys, lock: Option<Vec<u8>>) -> Self {
        LockGuard {
            shared: fast.shared.clone(),
            options: fast.options.clone(),
            id: *request.id,
            keys,
            lock,
            fingerprint: *request.fingerprint,
            retention: request.retention.response,
        }
    }

    /// Caches `cache` (a committed response and its TTL) and releases the lock, in one round
    /// trip. A failure is counted and otherwise ignored: the lock's TTL bounds it.
    async fn settle(mut self, cache: Option<(Vec<u8>, Duration)>) {
        if (self.lock.is_none() && cache.is_none()) || self.shared.cooling_down() {
            // Nothing to do, or Redis failed a moment ago and the answer is not held up for it
            // (a held lock is then released in the background, on drop).
            return;
        }
        let (value, ttl) = cache.unwrap_or_default();
        let mut invocation = SETTLE.prepare_invoke();
        invocation
            .key(&self.keys.cache)
            .key(&self.keys.lock)
            .arg(self.lock.take().unwrap_or_default())
            .arg(value)
            .arg(millis(ttl));
        let mut redis = self.shared.redis.clone();
        let settled = tokio::time::timeout(self.options.timeout, invocation.invoke_async::<i64>(&mut redis)).await;
        match settled {
            Ok(Ok(cached)) => {
                if cached == 1 {
                    bump(&self.shared.counters.cached);
                }
            }
            Ok(Err(error)) => self.shared.failed(&self.options, &self.id, &Failure::Redis(error)),
            Err(_) => self.shared.failed(&self.options, &self.id, &Failure::Timeout),
        }
    }
}

impl Drop for LockGuard {
    /// Releases a lock still held (a claim dropped unfinished, a lock a timed-out call may have
    /// taken, a release skipped during the cool-down) from a task of its own, best effort.
    fn drop(&mut self) {
        let Some(lock) = self.lock.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (mut redis, keys, timeout) = (self.shared.redis.clone(), self.keys.clone(), self.options.timeout);
        runtime.spawn(async move {
            let mut invocation = SETTLE.prepare_invoke();
            invocation.key(&keys.cache).key(&keys.lock).arg(lock).arg(&b""[..]).arg(0);
            let _ = tokio::time::timeout(timeout, invocation.invoke_async::<i64>(&mut redis)).await;
        });
    }
}

/// Visible ASCII, 1 to 64 bytes, and no braces: the first `{…}` of a key must be its hash tag.
fn valid_prefix(prefix: &str) -> bool {
    (1..=64).contains(&prefix.len()) && prefix.bytes().all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
}

/// A lock value: a fresh random token, then the request's fingerprint (so a duplicate can tell
/// a holder of the same request from one of another).
fn lock_value(fingerprint: &Fingerprint) -> Vec<u8> {
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

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The cached value of a finished record, format 1: the format, the state (1 completed, 2
/// failed), the fingerprint's version and digest, the status (u16, big-endian), the length of
/// the encoded headers and trailers (u32, big-endian), those fields
/// ([`StoredResponse::encode_fields`]), then the body to the end.
fn encode(state: RecordState, fingerprint: &Fingerprint, response: &StoredResponse) -> Vec<u8> {
    let fields = response.encode_fields();
    let mut value = Vec::with_capacity(CACHE_HEADER_LEN + fields.len() + response.body.len());
    value.push(CACHE_FORMAT);
    value.push(if state == RecordState::Failed { 2 } else { 1 });
    value.push(fingerprint.version());
    value.extend_from_slice(fingerprint.digest());
    value.extend_from_slice(&response.status.as_u16().to_be_bytes());
    value.extend_from_slice(&u32::try_from(fields.len()).unwrap_or(u32::MAX).to_be_bytes());
    value.extend_from_slice(&fields);
    value.extend_from_slice(&response.body);
    value
}

/// Reads a value written by [`encode`]; `None` for anything else (a miss).
fn decode(value: &[u8]) -> Option<Record> {
    let (&[format, state, version], rest) = value.split_first_chunk::<3>()?;
    if format != CACHE_FORMAT {
        return None;
    }
    let state = match state {
        1 => RecordState::Completed,
        2 => RecordState::Failed,
        _ => return None,
    };
    let (digest, rest) = rest.split_first_chunk::<32>()?;
    let (status, rest) = rest.split_first_chunk::<2>()?;
    let (length, rest) = rest.split_first_chunk::<4>()?;
    let status = StatusCode::from_u16(u16::from_be_bytes(*status)).ok()?;
    let length = usize::try_from(u32::from_be_bytes(*length)).ok()?;
    if rest.len() < length {
        return None;
    }
    let (fields, body) = rest.split_at(length);
    let (headers, trailers) = StoredResponse::decode_fields(fields)?;
    let mut response = StoredResponse::new(status, Bytes::copy_from_slice(body));
    response.headers = headers;
    response.trailers = trailers;
    Some(Record::with_response(state, Fingerprint::from_parts(version, *digest), response))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    fn response() -> StoredResponse {
        let mut response = StoredResponse::new(StatusCode::CREATED, &b"{\"id\":1}\xff"[..]);
        response.headers.push((http::header::LOCATION, HeaderValue::from_static("/things/1")));
        response.headers.push((http::header::CONTENT_TYPE, HeaderValue::from_static("application/json")));
        response.trailers.push((HeaderName::from_static("grpc-status"), HeaderValue::from_static("0")));
        response
    }

    #[test]
    fn cached_records_round_trip() {
        let fingerprint = Fingerprint::from_parts(1, [9; 32]);
        for state in [RecordState::Completed, RecordState::Failed] {
            let value = encode(state, &fingerprint, &response());
            assert_eq!(decode(&value), Some(Record::with_response(state, fingerprint, response())));
        }
    }

    #[test]
    fn unreadable_values_are_misses() {
        let value = encode(RecordState::Completed, &Fingerprint::from_parts(1, [9; 32]), &response());
        for cut in 0..CACHE_HEADER_LEN {
            assert_eq!(decode(&value[..cut]), None, "a value cut to {cut} bytes must not decode");
        }
        let mut other_format = value.clone();
        other_format[0] = 2;
        assert_eq!(decode(&other_format), None, "an unknown format is a miss");
        let mut other_state = value.clone();
        other_state[1] = 7;
        assert_eq!(decode(&other_state), None);
        let mut bad_status = value.clone();
        bad_status[35..37].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(decode(&bad_status), None);
        let mut long_fields = value;
        long_fields[37..41].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(decode(&long_fields), None);
        assert_eq!(decode(b""), None);
    }

    #[test]
    fn keys_carry_the_digest_in_a_hash_tag_and_nothing_else() {
        let key = crate::IdempotencyKey::new("secret-key").expect("key");
        let id = RecordId::new(&crate::Scope::new("tenant-secret"), "POST /x", &key);
        let keys = Keys::new("p", &id);
        assert_eq!(keys.cache, format!("p:{{{}}}:c", id.to_hex()));
        assert_eq!(keys.lock, format!("p:{{{}}}:l", id.to_hex()));
        assert!(!keys.cache.contains("secret") && !keys.lock.contains("secret"));
    }

    #[test]
    fn prefixes_cannot_break_the_hash_tag() {
        for good in ["tidem", "orders:v2", "a", &"p".repeat(64)] {
            assert!(valid_prefix(good), "{good:?} is a fine prefix");
        }
        for bad in ["", "a{b", "a}b", "{x}", "has space", "tab\t", "é", &"p".repeat(65)] {
            assert!(!valid_prefix(bad), "{bad:?} must be refused");
        }
    }

    #[test]
    fn tokens_are_unique_and_lock_values_carry_the_fingerprint() {
        let fingerprint = Fingerprint::from_parts(1, [3; 32]);
        let (a, b) = (lock_value(&fingerprint), lock_value(&fingerprint));
        assert_ne!(a[..TOKEN_LEN], b[..TOKEN_LEN]);
        assert_eq!(a[TOKEN_LEN..], b[TOKEN_LEN..]);
        assert_eq!(a[TOKEN_LEN], 1);
        assert_eq!(a[TOKEN_LEN + 1..], [3; 32]);
    }

    #[test]
    fn script_replies_parse() {
        assert!(matches!(Probe::parse(Value::Array(vec![Value::Int(2)])), Some(Probe::Locked)));
        assert!(matches!(
            Probe::parse(Value::Array(vec![Value::Int(1), Value::BulkString(vec![1])])),
            Some(Probe::Cached(v)) if v == [1]
        ));
        assert!(matches!(
            Probe::parse(Value::Array(vec![Value::Int(3), Value::BulkString(vec![7]), Value::Int(1500)])),
            Some(Probe::Held { holder, ttl }) if holder == [7] && ttl == Duration::from_millis(1500)
        ));
        assert!(matches!(
            Probe::parse(Value::Array(vec![Value::Int(3), Value::BulkString(vec![]), Value::Int(-1)])),
            Some(Probe::Held { ttl, .. }) if ttl == Duration::from_millis(1)
        ));
        assert!(Probe::parse(Value::Nil).is_none());
        assert!(Probe::parse(Value::Array(vec![Value::Int(1)])).is_none());
        assert!(Probe::parse(Value::Array(vec![Value::Int(9)])).is_none());
    }
}
