//! The Lua scripts the fast path runs, the keys they work on, and how their replies are
//! read. Each call is one round trip, bounded by a timeout.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{FromRedisValue, Script, ScriptInvocation, Value};

use super::connection::{Failure, RedisConnection};
use crate::key::RecordId;

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

/// Forgets the cached response of a record that changed underneath it (settled, evicted).
///
/// `KEYS[1]`: the cached response. Returns how many keys were deleted.
const FORGET_LUA: &str = r"
return redis.call('DEL', KEYS[1])
";

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
static FORGET: LazyLock<Script> = LazyLock::new(|| Script::new(FORGET_LUA));
static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(SETTLE_LUA));

/// The Redis keys of one identity in one deployment's namespace: the identity's digest in a hash
/// tag, so that both live on one Redis Cluster slot, and never the raw key or scope.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    cache: String,
    lock: String,
}

impl Keys {
    pub(super) fn new(prefix: &str, namespace: &str, id: &RecordId) -> Self {
        let base = format!("{prefix}:{namespace}:{{{}}}:", id.to_hex());
        Self { cache: format!("{base}c"), lock: format!("{base}l") }
    }
}

/// Visible ASCII, 1 to 64 bytes, and no braces: the first `{…}` of a key must be its hash tag.
pub(super) fn valid_prefix(prefix: &str) -> bool {
    (1..=64).contains(&prefix.len()) && prefix.bytes().all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
}

/// What the acquire script found.
pub(super) enum Probe {
    /// The cached response.
    Cached(Vec<u8>),
    /// The lock is ours.
    Locked,
    /// A duplicate holds the lock: its value, and how long it has left (`None`: the lock has
    /// no expiry, so the fast path did not set it).
    Held { holder: Vec<u8>, ttl: Option<Duration> },
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
                    Some(Value::Int(ms)) if ms > 0 => Some(Duration::from_millis(ms as u64)),
                    // No expiry: not a lock of ours.
                    Some(Value::Int(-1)) => None,
                    // Gone meanwhile: look again soon.
                    _ => Some(Duration::from_millis(1)),
                };
                Some(Probe::Held { holder, ttl })
            }
            _ => None,
        }
    }
}

/// Runs the acquire script: the cached response, or the lock (`lock_value` for `lock_ttl`), or
/// who holds it.
pub(super) async fn acquire(
    redis: &RedisConnection,
    keys: &Keys,
    lock_value: &[u8],
    lock_ttl: Duration,
    timeout: Duration,
) -> Result<Probe, Failure> {
    let mut invocation = ACQUIRE.prepare_invoke();
    invocation.key(&keys.cache).key(&keys.lock).arg(lock_value).arg(millis(lock_ttl));
    let reply: Value = invoke(redis, &invocation, timeout).await?;
    Probe::parse(reply).ok_or(Failure::Reply)
}

/// Runs the settle script: caches `cache` (a committed response and its TTL) and releases
/// `lock` (our lock value) if it is still ours. Returns whether the response was cached.
pub(super) async fn settle(
    redis: &RedisConnection,
    keys: &Keys,
    lock: Option<&[u8]>,
    cache: Option<(&[u8], Duration)>,
    timeout: Duration,
) -> Result<bool, Failure> {
    let (value, ttl) = cache.unwrap_or_default();
    let mut invocation = SETTLE.prepare_invoke();
    invocation.key(&keys.cache).key(&keys.lock).arg(lock.unwrap_or_default()).arg(value).arg(millis(ttl));
    let cached: i64 = invoke(redis, &invocation, timeout).await?;
    Ok(cached == 1)
}

/// Runs the forget script: deletes the cached response of `keys`.
pub(super) async fn forget(redis: &RedisConnection, keys: &Keys, timeout: Duration) -> Result<(), Failure> {
    let mut invocation = FORGET.prepare_invoke();
    invocation.key(&keys.cache);
    let _deleted: i64 = invoke(redis, &invocation, timeout).await?;
    Ok(())
}

/// One script call, bounded by `timeout`.
async fn invoke<T: FromRedisValue>(
    redis: &RedisConnection,
    invocation: &ScriptInvocation<'_>,
    timeout: Duration,
) -> Result<T, Failure> {
    let mut redis = redis.clone();
    Ok(tokio::time::timeout(timeout, invocation.invoke_async(&mut redis)).await.map_err(|_| Failure::Timeout)??)
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_digest_in_a_hash_tag_and_nothing_else() {
        let key = crate::IdempotencyKey::new("secret-key").expect("key");
        let id = RecordId::new(&crate::Scope::new("tenant-secret"), "POST /x", &key);
        let keys = Keys::new("p", "n", &id);
        assert_eq!(keys.cache, format!("p:n:{{{}}}:c", id.to_hex()));
        assert_eq!(keys.lock, format!("p:n:{{{}}}:l", id.to_hex()));
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
    fn script_replies_parse() {
        assert!(matches!(Probe::parse(Value::Array(vec![Value::Int(2)])), Some(Probe::Locked)));
        assert!(matches!(
            Probe::parse(Value::Array(vec![Value::Int(1), Value::BulkString(vec![1])])),
            Some(Probe::Cached(v)) if v == [1]
        ));
        assert!(matches!(
            Probe::parse(Value::Array(vec![Value::Int(3), Value::BulkString(vec![7]), Value::Int(1500)])),
            Some(Probe::Held { holder, ttl }) if holder == [7] && ttl == Some(Duration::from_millis(1500))
        ));
        assert!(matches!(
            Probe::parse(Value::Array(vec![Value::Int(3), Value::BulkString(vec![]), Value::Int(-2)])),
            Some(Probe::Held { ttl, .. }) if ttl == Some(Duration::from_millis(1))
        ));
        assert!(matches!(
            Probe::parse(Value::Array(vec![Value::Int(3), Value::BulkString(vec![7]), Value::Int(-1)])),
            Some(Probe::Held { ttl: None, .. })
        ));
        assert!(Probe::parse(Value::Nil).is_none());
        assert!(Probe::parse(Value::Array(vec![Value::Int(1)])).is_none());
        assert!(Probe::parse(Value::Array(vec![Value::Int(9)])).is_none());
    }
}
