//! Redis is never trusted: whatever an attacker (or a neighbour) puts in it is a miss, never an
//! answer. Against a real `redis-server` and PostgreSQL stores:
//!
//! - a cached value with an altered body is not replayed;
//! - another tenant's cached value copied under a fresh identity is not replayed, and the
//!   fresh identity is claimed (its order gets created);
//! - a lock with no expiry, or one held past the bounded wait, does not answer in flight on
//!   its own: the durable store decides;
//! - two deployments (two stores, two schemas) on one Redis with the same prefix never replay
//!   each other's answers, while replicas of one deployment share their cache;
//! - a store without a deployment secret keeps the fast path out of Redis (never fails open).
#![cfg(all(feature = "testkit", feature = "postgres", feature = "redis"))]

mod support;

use std::time::Duration;

use redis::AsyncCommands;
use support::redis::{find_key, namespace_of, raw_connection, shared_server, unique_prefix};
use tower_idempotency::store::{Begin, BeginRequest, Claim, Outcome, Store, StoreError};
use tower_idempotency::testkit::store::{answer, claim, existing, fingerprint, fresh_id};
use tower_idempotency::{CouplingMode, FastPath, MemoryStore, PostgresStore, RecordState, Retention};

/// The fast path over `store` on the shared server, under `prefix`.
fn fast_over<S: Store>(store: S, prefix: &str) -> FastPath<S> {
    FastPath::connect(store, &shared_server().url())
        .expect("redis URL")
        .prefix(prefix)
        .expect("prefix")
        .timeout(support::redis::TEST_TIMEOUT)
}

async fn raw_get(key: &str) -> Vec<u8> {
    let mut redis = raw_connection(&shared_server().url()).await;
    redis.get(key).await.expect("GET")
}

async fn raw_set(key: &str, value: &[u8]) {
    let mut redis = raw_connection(&shared_server().url()).await;
    let () = redis.set(key, value).await.expect("SET");
}

#[test]
fn a_cached_value_with_an_altered_body_is_not_replayed() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let fast = fast_over(support::pg_store(CouplingMode::Atomic).await, &prefix);
        let (id, fp) = (fresh_id("altered"), fingerprint(1));
        claim(&fast, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("paid 10"))).await.unwrap();
        let cache = find_key(shared_server(), &prefix, &id, 'c').expect("the answer is cached");
        let value = raw_get(&cache).await;
        let at = value.windows(7).position(|w| w == b"paid 10").expect("the body is in the value");
        let mut altered = value.clone();
        altered[at..at + 7].copy_from_slice(b"paid 99");
        raw_set(&cache, &altered).await;

        let record = existing(&fast, BeginRequest::new(&id, &fp)).await;
        assert_eq!(record.response, Some(answer("paid 10")), "the store's answer, never the altered one");
        let stats = fast.stats();
        assert_eq!((stats.hits, stats.unverified), (0, 1), "{stats:?}");
    });
}

#[test]
fn another_tenants_value_copied_under_a_fresh_identity_is_not_replayed() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let fast = fast_over(support::pg_store(CouplingMode::Atomic).await, &prefix);
        let fp = fingerprint(2);
        let (tenant_a, tenant_b) = (fresh_id("tenant-a"), fresh_id("tenant-b"));
        claim(&fast, BeginRequest::new(&tenant_a, &fp))
            .await
            .finish(Outcome::Complete(answer("A's order")))
            .await
            .unwrap();
        let source = find_key(shared_server(), &prefix, &tenant_a, 'c').expect("A's answer is cached");
        // The same namespace, tenant B's identity.
        let target = source.replace(&tenant_a.to_hex(), &tenant_b.to_hex());
        raw_set(&target, &raw_get(&source).await).await;

        match fast.begin(BeginRequest::new(&tenant_b, &fp)).await.expect("begin") {
            Begin::Claimed(claim) => {
                // B's own order is created, and its own answer replaces the copy.
                claim.finish(Outcome::Complete(answer("B's order"))).await.unwrap();
            }
            Begin::Existing(record) => panic!("tenant B was answered with {:?}", record.response),
            Begin::InFlight { .. } => panic!("tenant B was answered in flight"),
        }
        assert_eq!(existing(&fast, BeginRequest::new(&tenant_b, &fp)).await.response, Some(answer("B's order")));
        assert_eq!(existing(&fast, BeginRequest::new(&tenant_a, &fp)).await.response, Some(answer("A's order")));
        let stats = fast.stats();
        assert_eq!(stats.unverified, 1, "{stats:?}");
        assert_eq!(stats.hits, 2, "the genuine answers are still served from Redis: {stats:?}");
    });
}

/// A lock value as the fast path writes it: a token, then the fingerprint.
fn planted_lock(fp: &tower_idempotency::Fingerprint) -> Vec<u8> {
    let mut value = b"planted-token-16".to_vec();
    value.push(fp.version());
    value.extend_from_slice(fp.digest());
    value
}

#[test]
fn a_lock_with_no_expiry_or_held_past_the_wait_hands_the_decision_to_the_store() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let fast = fast_over(support::pg_store(CouplingMode::Atomic).await, &prefix);
        // Some key of this deployment, to learn its namespace.
        let (seen, fp) = (fresh_id("seen"), fingerprint(3));
        claim(&fast, BeginRequest::new(&seen, &fp)).await.finish(Outcome::Complete(answer("seen"))).await.unwrap();
        let namespace = namespace_of(shared_server(), &prefix).expect("a key of the deployment");
        let lock_of = |id: &tower_idempotency::RecordId| format!("{prefix}:{namespace}:{{{}}}:l", id.to_hex());

        // No expiry: a lock the fast path never sets. Not waited on at all.
        let forever = fresh_id("forever");
        raw_set(&lock_of(&forever), &planted_lock(&fp)).await;
        let wait = Duration::from_millis(300);
        let claimed = claim(&fast, BeginRequest::new(&forever, &fp).wait(wait)).await;
        claimed.finish(Outcome::Complete(answer("forever"))).await.unwrap();
        assert_eq!(existing(&fast, BeginRequest::new(&forever, &fp)).await.response, Some(answer("forever")));
        assert_eq!(fast.stats().foreign_locks, 1);

        // An hour-long lock of the right shape with nothing behind it: after the bounded wait the
        // store, which knows of no claim, claims.
        let stuck = fresh_id("stuck");
        let mut redis = raw_connection(&shared_server().url()).await;
        let () = redis.pset_ex(lock_of(&stuck), planted_lock(&fp), 3_600_000).await.expect("SET PX");
        let claimed = claim(&fast, BeginRequest::new(&stuck, &fp).wait(wait)).await;
        claimed.finish(Outcome::Release).await.unwrap();
        let stats = fast.stats();
        assert_eq!((stats.waits, stats.in_flight), (1, 1), "it waited, then asked the store: {stats:?}");
    });
}

#[test]
fn a_live_holder_past_the_wait_is_reported_in_flight_by_the_store() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let fast = fast_over(support::pg_store(CouplingMode::Leased).await, &prefix);
        let (id, fp) = (fresh_id("live"), fingerprint(4));
        let holder = claim(&fast, BeginRequest::new(&id, &fp)).await;
        let duplicate = fast.begin(BeginRequest::new(&id, &fp).wait(Duration::from_millis(300))).await.expect("begin");
        assert!(matches!(duplicate, Begin::InFlight { .. }), "the store knows the live claim");
        assert_eq!(fast.stats().in_flight, 1);
        holder.finish(Outcome::Complete(answer("live"))).await.unwrap();
        assert_eq!(existing(&fast, BeginRequest::new(&id, &fp)).await.response, Some(answer("live")));
    });
}

#[test]
fn two_deployments_sharing_one_redis_and_prefix_never_replay_each_others_answers() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let one = fast_over(support::pg_store(CouplingMode::Atomic).await, &prefix);
        let two = fast_over(support::pg_store(CouplingMode::Atomic).await, &prefix);
        let (id, fp) = (fresh_id("shared"), fingerprint(5));

        claim(&one, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("order of one"))).await.unwrap();
        // The same request on the second deployment, which has no such order: it runs there.
        let claimed = claim(&two, BeginRequest::new(&id, &fp)).await;
        claimed.finish(Outcome::Complete(answer("order of two"))).await.unwrap();

        for _ in 0..2 {
            assert_eq!(existing(&one, BeginRequest::new(&id, &fp)).await.response, Some(answer("order of one")));
            assert_eq!(existing(&two, BeginRequest::new(&id, &fp)).await.response, Some(answer("order of two")));
        }
        let (stats_one, stats_two) = (one.stats(), two.stats());
        assert_eq!((stats_one.hits, stats_two.hits), (2, 2), "each is served from its own cache");
        assert_eq!(stats_one.unverified + stats_two.unverified, 0, "their keys do not even meet");
        let keys = shared_server().cli(&["--scan", "--pattern", &format!("{prefix}:*:c")]);
        assert_eq!(keys.lines().filter(|key| !key.trim().is_empty()).count(), 2, "two namespaces: {keys}");
    });
}

#[test]
fn replicas_of_one_deployment_share_the_cache_and_an_explicit_secret_shares_it_on_purpose() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let store = support::pg_store(CouplingMode::Atomic).await;
        // A second replica: its own pool, the same schema and table, so the same secret.
        let schema = store_schema(&store);
        let replica_store = PostgresStore::new(support::pg_pool(&schema, 4).await).schema(&schema).expect("schema");
        replica_store.migrate().await.expect("migrate again: a no-op");
        let (replica_one, replica_two) = (fast_over(store, &prefix), fast_over(replica_store, &prefix));
        let (id, fp) = (fresh_id("replica"), fingerprint(6));
        claim(&replica_one, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("one"))).await.unwrap();
        assert_eq!(existing(&replica_two, BeginRequest::new(&id, &fp)).await.response, Some(answer("one")));
        assert_eq!(replica_two.stats().hits, 1, "the replica replays from Redis");

        // Two memory stores are two deployments, unless the application says otherwise.
        let secret = b"an application secret of 32 byte";
        let (a, b) = (fast_over(MemoryStore::new(), &prefix), fast_over(MemoryStore::new(), &prefix));
        let (id, fp) = (fresh_id("apart"), fingerprint(7));
        claim(&a, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("a"))).await.unwrap();
        claim(&b, BeginRequest::new(&id, &fp)).await.finish(Outcome::Release).await.unwrap();
        let (a, b) = (a.secret(secret), b.secret(secret));
        let id = fresh_id("together");
        claim(&a, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("a"))).await.unwrap();
        assert_eq!(existing(&b, BeginRequest::new(&id, &fp)).await.response, Some(answer("a")), "shared on purpose");
    });
}

/// The schema `support::pg_store` made for `store`.
fn store_schema(store: &PostgresStore) -> String {
    let debug = format!("{store:?}");
    let start = debug.find("schema: \"").expect("the schema in Debug") + "schema: \"".len();
    debug[start..].split('"').next().expect("schema").to_owned()
}

/// A user's store that implements only what it must: no deployment secret.
#[derive(Clone)]
struct PlainStore(MemoryStore);

impl Store for PlainStore {
    type Claim = <MemoryStore as Store>::Claim;

    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin<Self::Claim>, StoreError> {
        self.0.begin(request).await
    }

    async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        self.0.purge(limit).await
    }
}

#[test]
fn a_store_without_a_secret_keeps_the_fast_path_out_of_redis() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let fast = fast_over(PlainStore(MemoryStore::new()), &prefix);
        let (id, fp) = (fresh_id("plain"), fingerprint(8));
        claim(&fast, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("plain"))).await.unwrap();
        let record = existing(&fast, BeginRequest::new(&id, &fp)).await;
        assert_eq!((record.state, record.response), (RecordState::Completed, Some(answer("plain"))));
        let stats = fast.stats();
        assert_eq!((stats.unkeyed, stats.hits, stats.locks, stats.cached), (2, 0, 0, 0), "{stats:?}");
        let keys = shared_server().cli(&["--scan", "--pattern", &format!("{prefix}:*")]);
        assert!(keys.trim().is_empty(), "nothing was written to Redis: {keys}");

        // With a secret given by the application, it uses Redis.
        let fast = fast.secret(b"an application secret of 32 byte");
        let (id, fp) = (fresh_id("plain-keyed"), fingerprint(9));
        claim(&fast, BeginRequest::new(&id, &fp)).await.finish(Outcome::Complete(answer("keyed"))).await.unwrap();
        assert_eq!(existing(&fast, BeginRequest::new(&id, &fp)).await.response, Some(answer("keyed")));
        assert_eq!(fast.stats().hits, 1);
    });
}

#[test]
fn a_cached_value_kept_past_its_time_is_not_replayed() {
    tower_idempotency::testkit::run(async {
        let prefix = unique_prefix();
        let fast = fast_over(support::pg_store(CouplingMode::Atomic).await, &prefix);
        let (id, fp) = (fresh_id("persisted"), fingerprint(10));
        let retention =
            Retention { response: Duration::from_secs(5), tombstone: Duration::from_secs(600), ..Retention::default() };
        let request = || BeginRequest::new(&id, &fp).retention(retention);
        claim(&fast, request()).await.finish(Outcome::Complete(answer("old"))).await.unwrap();
        // Someone with access to Redis keeps the value beyond the TTL it was written with.
        let cache = find_key(shared_server(), &prefix, &id, 'c').expect("the answer is cached");
        assert_eq!(shared_server().cli(&["persist", &cache]).trim(), "1", "the value was still there to keep");
        tokio::time::sleep(retention.response + Duration::from_millis(500)).await;
        let record = existing(&fast, request()).await;
        assert_eq!(record.state, RecordState::Expired, "past its retention the store answers with the tombstone");
        assert_eq!((fast.stats().hits, fast.stats().unverified), (0, 1));
    });
}
