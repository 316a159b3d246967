//! What the answers-apart test binaries share: completing a record, a short retention, and a
//! table with answers inline moved to answers apart.

use std::time::Duration;

use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
use tower_idempotency::{Begin, BeginRequest, Claim, Fingerprint, Outcome, PostgresStore, RecordId, Retention, Store};

/// Answers kept 300 ms, tombstones an hour.
pub const SHORT: Retention = Retention {
    response: Duration::from_millis(300),
    tombstone: Duration::from_secs(3600),
    unsettled: Duration::from_secs(3600),
};

/// Claims `id` and completes it with `body` (retention `retention`).
pub async fn complete(
    store: &PostgresStore,
    id: &RecordId,
    fp: &Fingerprint,
    body: &'static str,
    retention: Retention,
) {
    let Begin::Claimed(claim) = store.begin(BeginRequest::new(id, fp).retention(retention)).await.expect("begin")
    else {
        panic!("a fresh identity is claimed")
    };
    claim.finish(Outcome::Complete(answer(body))).await.expect("finish");
}

/// A store whose table held answers inline, moved to answers apart by its migration (run twice:
/// the second finds nothing to do), and the two records completed inline before the move.
pub struct Moved {
    pub apart: PostgresStore,
    pub fp: Fingerprint,
    /// Completed with "old kept", kept as long as by default.
    pub old_kept: RecordId,
    /// Completed with "old due", its answer kept for [`SHORT`].
    pub old_due: RecordId,
}

/// Completes two records on `inline` (answers inline), then moves its table to answers apart.
pub async fn move_to_answers_apart(inline: &PostgresStore) -> Moved {
    let fp = fingerprint(4);
    let (old_kept, old_due) = (fresh_id("old-kept"), fresh_id("old-due"));
    complete(inline, &old_kept, &fp, "old kept", Retention::default()).await;
    complete(inline, &old_due, &fp, "old due", SHORT).await;
    let apart = inline.clone().answers_apart();
    apart.migrate().await.expect("migrate to answers apart");
    apart.migrate().await.expect("again: nothing to do");
    Moved { apart, fp, old_kept, old_due }
}
