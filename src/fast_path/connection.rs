//! The way to Redis: the connection (one node or a cluster), and the link the fast path shares
//! over it, which counts what happens and leaves Redis alone for a while after a failure.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use tokio::time::Instant;

use super::stats::Counters;
use crate::key::RecordId;

/// The connection timeouts of [`FastPath::connect`](super::FastPath::connect) and
/// [`FastPath::connect_cluster`](super::FastPath::connect_cluster).
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

impl RedisConnection {
    /// A lazy [`ConnectionManager`] to the node at `url`: nothing is sent until the first call.
    pub(super) fn lazy_single(url: &str) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(CONNECTION_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        Ok(ConnectionManager::new_lazy_with_config(client, config)?.into())
    }

    /// A [`ClusterConnection`] to the cluster of `nodes`, made in the background.
    pub(super) fn pending_cluster(nodes: &[&str]) -> Result<Self, redis::RedisError> {
        let client = redis::cluster::ClusterClient::builder(nodes.iter().copied()).retries(2).build()?;
        let config = redis::cluster::ClusterConfig::new()
            .set_connection_timeout(CONNECTION_TIMEOUT)
            .set_response_timeout(CONNECTION_TIMEOUT);
        Ok(client.get_pending_async_connection_with_config(config).into())
    }
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

/// Why a Redis call did not answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum Failure {
    #[error("Redis call timed out")]
    Timeout,
    #[error("Redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected Redis reply")]
    Reply,
}

/// The link to Redis, shared by a fast path's clones and its claims: the connection, the
/// counters, and the cool-down after a failure.
pub(super) struct RedisLink {
    pub(super) connection: RedisConnection,
    pub(super) counters: Counters,
    /// The start of `down_until_ms`'s clock.
    epoch: Instant,
    /// Until when (milliseconds after `epoch`) Redis is left alone after a failure.
    down_until_ms: AtomicU64,
}

impl RedisLink {
    pub(super) fn new(connection: RedisConnection) -> Self {
        Self { connection, counters: Counters::default(), epoch: Instant::now(), down_until_ms: AtomicU64::new(0) }
    }

    /// Whether Redis failed a moment ago and is left alone for now.
    pub(super) fn cooling_down(&self) -> bool {
        (self.epoch.elapsed().as_millis() as u64) < self.down_until_ms.load(Ordering::Relaxed)
    }

    /// Counts a failed Redis call and starts a cool-down of `cooldown`.
    pub(super) fn failed(&self, cooldown: Duration, id: &RecordId, error: &Failure) {
        self.counters.degraded.bump();
        let until = (self.epoch.elapsed() + cooldown).as_millis() as u64;
        let previous = self.down_until_ms.swap(until, Ordering::Relaxed);
        if previous <= self.epoch.elapsed().as_millis() as u64 {
            tracing::warn!(record = %id, %error, "idempotency: Redis fast path failed; using the store alone for a while");
        } else {
            tracing::debug!(record = %id, %error, "idempotency: Redis fast path failed");
        }
    }
}
