//! The purge's batches on both SQL stores (one table, and PostgreSQL's hash partitions), which
//! pick their rows by physical address (`ctid`, `rowid`): several purges at once, over a table
//! that mixes live records, records past their response retention and records past their
//! tombstone time, leave every live record replayable, turn the second kind into tombstones and
//! forget the third, and never fail.
#![cfg(all(feature = "testkit", feature = "sqlite", feature = "postgres"))]

mod support;

use std::time::Duration;

use tower_idempotency::testkit::store::{answer, claim, existing, fingerprint, fresh_id};
use tower_idempotency::{Begin, BeginRequest, Claim, CouplingMode, Outcome, RecordId, RecordState, Retention, Store};

/// Records of each kind.
const EACH: usize = 60;
/// Purges running at once, and each one's batch.
const PURGES: usize = 4;
const BATCH: usize = 25;

async fn mixed_records_under_concurrent_purges<S: Store + Clone + 'static>(store: S) {
    let fp = fingerprint(41);
    let live =
        Retention { response: Duration::from_secs(3600), tombstone: Duration::from_secs(3600), ..Retention::default() };
    let expiring = Retention {
        response: Duration::from_millis(100),
        tombstone: Duration::from_secs(3600),
        ..Retention::default()
    };
    let forgotten = Retention {
        response: Duration::from_millis(100),
        tombstone: Duration::from_millis(100),
        ..Retention::default()
    };
    let mut kinds: [Vec<RecordId>; 3] = Default::default();
    for index in 0..EACH * 3 {
        let (kind, retention) = match index % 3 {
            0 => (0, live),
            1 => (1, expiring),
            _ => (2, forgotten),
        };
        let id = fresh_id("purge-batch");
        claim(&store, BeginRequest::new(&id, &fp).retention(retention))
            .await
            .finish(Outcome::Complete(answer("kept")))
            .await
            .expect("finish");
        kinds[kind].push(id);
    }
    tokio::time::sleep(Duration::from_millis(600)).await;

    // Several purges at once, each back to back until it finds nothing left to do.
    let purges: Vec<_> = (0..PURGES)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut total = 0;
                loop {
                    match store.purge(BATCH).await.expect("a purge never fails") {
                        0 => return total,
                        n => total += n,
                    }
                }
            })
        })
        .collect();
    let mut purged = 0;
    for purge in purges {
        purged += purge.await.expect("purge task");
    }
    assert!(purged >= EACH * 2, "the purges did the work: {purged} records for {} due", EACH * 2);

    let [live, expiring, forgotten] = kinds;
    for id in &live {
        let record = existing(&store, BeginRequest::new(id, &fp)).await;
        assert_eq!(record.state, RecordState::Completed, "a live record is left alone");
        assert!(record.response.is_some(), "a live record keeps its answer");
    }
    for id in &expiring {
        let record = existing(&store, BeginRequest::new(id, &fp)).await;
        assert_eq!(record.state, RecordState::Expired, "a record past its response retention is a tombstone");
        assert_eq!(record.response, None);
    }
    for id in &forgotten {
        match store.begin(BeginRequest::new(id, &fp)).await.expect("begin") {
            Begin::Claimed(claim) => claim.finish(Outcome::Release).await.expect("release"),
            Begin::Existing(record) => {
                panic!("a record past its tombstone time is forgotten, found {:?}", record.state)
            }
            Begin::InFlight { .. } => panic!("a record past its tombstone time is forgotten, found it in flight"),
        }
    }
}

#[tokio::test]
async fn sqlite_purges_by_rowid() {
    mixed_records_under_concurrent_purges(support::sqlite_store(CouplingMode::Atomic).await).await;
}

#[tokio::test]
async fn postgres_purges_by_ctid() {
    mixed_records_under_concurrent_purges(support::pg_store(CouplingMode::Atomic).await).await;
}

#[tokio::test]
async fn partitioned_postgres_purges_by_ctid_in_each_partition() {
    mixed_records_under_concurrent_purges(support::pg_partitioned_store(CouplingMode::Atomic).await).await;
}
