//! The conformance suites with the fast path on a local Redis Cluster: three masters on free
//! loopback ports, started by this test binary (`redis-server --cluster-enabled yes`, joined by
//! `redis-cli --cluster create`), in front of PostgreSQL in both modes.
#![cfg(all(feature = "testkit", feature = "postgres", feature = "redis"))]

mod support;

use http::StatusCode;
use support::redis::{cluster_fast_path, shared_cluster};
use tower_idempotency::testkit::store::{fingerprint, fresh_id};
use tower_idempotency::{
    Begin, BeginRequest, Claim, CouplingMode, FastPath, Outcome, PostgresStore, Store, StoredResponse,
};

async fn fast(mode: CouplingMode) -> FastPath<PostgresStore> {
    cluster_fast_path(support::pg_store(mode).await)
}

support::suites_in_both_modes!(crate::fast);

/// The suites would pass on the store alone if every Redis call failed (each failure falls back
/// to the store): this proves the cluster really answers, on every master.
#[test]
fn the_cluster_serves_locks_and_replays_on_every_master() {
    tower_idempotency::testkit::run(async {
        const IDENTITIES: usize = 60;
        let prefix = support::redis::unique_prefix();
        let urls = shared_cluster().urls();
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        let store = support::pg_store(CouplingMode::Atomic).await;
        let fast = FastPath::connect_cluster(store, &urls)
            .unwrap()
            .prefix(&prefix)
            .unwrap()
            .timeout(support::redis::TEST_TIMEOUT);
        let fp = fingerprint(1);
        let ids: Vec<_> = (0..IDENTITIES).map(|_| fresh_id("cluster")).collect();
        for id in &ids {
            let Begin::Claimed(claim) = fast.begin(BeginRequest::new(id, &fp)).await.unwrap() else {
                panic!("a fresh identity must be claimed")
            };
            claim.finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, id.to_hex()))).await.unwrap();
        }
        // Nothing may fall back to the store from here: close it.
        fast.inner().pool().close().await;
        for id in &ids {
            match fast.begin(BeginRequest::new(id, &fp)).await.unwrap() {
                Begin::Existing(record) => assert_eq!(record.response.unwrap().body, id.to_hex()),
                _ => panic!("a completed identity must be replayed"),
            }
        }
        let stats = fast.stats();
        assert_eq!(stats.degraded, 0, "no Redis call may fail on a healthy cluster: {stats:?}");
        assert_eq!((stats.locks, stats.cached, stats.hits), (IDENTITIES as u64, IDENTITIES as u64, IDENTITIES as u64));
        for node in &shared_cluster().nodes {
            let keys = node.cli(&["--scan", "--pattern", &format!("{prefix}:*")]);
            assert!(keys.lines().count() > 0, "master {} holds none of the {IDENTITIES} identities", node.port);
        }
    });
}
