//! What the answers-apart test binaries share: completing a record, a short retention, and a
//! table with answers inline moved to answers apart.

use std::time::Duration;

use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
use tower_idempotency::{
    Begin, BeginRequest, Claim, Fingerprint, Outcome, PostgresStore, RecordId, RecordState, Retention, Store,
};

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

/// Moves `inline` to answers apart, then: a purge finds no inline answer due; one falls due (its
/// retention moved into the past); the next 63 purges leave it, though every read already finds
/// it past its retention; the 64th empties it in place.
pub async fn leftovers_are_looked_for_by_every_64th_purge_once_none_is_due(inline: &PostgresStore) {
    let Moved { apart, fp, old_kept, .. } = move_to_answers_apart(inline).await;
    let pool = apart.pool();
    sqlx::query(
        "UPDATE idempotency_records SET response_until = clock_timestamp() + interval '1 hour' \
         WHERE response_headers IS NOT NULL",
    )
    .execute(pool)
    .await
    .expect("both inline answers kept an hour");
    assert_eq!(apart.purge(100).await.expect("purge"), 0, "no inline answer is due");

    sqlx::query(
        "UPDATE idempotency_records SET response_until = clock_timestamp() - interval '1 second' WHERE record_id = $1",
    )
    .bind(old_kept.digest().to_vec())
    .execute(pool)
    .await
    .expect("one inline answer due");
    let inline_answer = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT response_headers IS NOT NULL FROM idempotency_records WHERE record_id = $1",
        )
        .bind(old_kept.digest().to_vec())
        .fetch_one(pool)
        .await
        .expect("the record")
    };
    for purge in 1..=63 {
        assert_eq!(apart.purge(100).await.expect("purge"), 0, "purge {purge} after the one that found none");
    }
    assert!(inline_answer().await, "left in place by the purges that skip the step");
    match apart.begin(BeginRequest::new(&old_kept, &fp)).await.expect("a retry") {
        Begin::Existing(record) => {
            assert_eq!((record.state, record.response), (RecordState::Expired, None), "past its retention already")
        }
        _ => panic!("a retry of a finished request finds its record"),
    }
    assert_eq!(apart.purge(100).await.expect("purge"), 1, "the 64th purge takes the step again");
    assert!(!inline_answer().await, "emptied in place");
}

/// On `apart` (answers apart, leased mode): settlements refused (another token; a record not
/// unknown) write no answer row, and a settlement replaces the unknown record's answer row with
/// its own.
pub async fn settlements_leave_no_answer_row_that_nothing_points_at(apart: &PostgresStore) {
    use tower_idempotency::store::{Admin, SettleError, SettleRequest, Settlement};
    use tower_idempotency::testkit::lifecycle::{labelled, make_unknown};

    let answers = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idempotency_records_answers")
            .fetch_one(apart.pool())
            .await
            .expect("count the answers")
    };
    let (unknown, fp) = (fresh_id("unknown"), fingerprint(8));
    make_unknown(apart, labelled(&unknown, &fp)).await;
    assert_eq!(answers().await, 1, "the unknown record's answer");
    let token = apart.inspect(&unknown).await.expect("inspect").expect("the record").fencing_token;
    let settled = || Settlement::Completed(answer("settled"));
    let wrong = apart.settle(SettleRequest::new(&unknown, settled()).fenced(token + 1)).await;
    assert!(matches!(wrong, Err(SettleError::Superseded)), "{wrong:?}");
    let (processing, other_fp) = (fresh_id("processing"), fingerprint(9));
    let lease = Duration::from_secs(60);
    let Begin::Claimed(_held) = apart.begin(labelled(&processing, &other_fp).lease(lease)).await.expect("begin") else {
        panic!("a fresh identity is claimed")
    };
    let early = apart.settle(SettleRequest::new(&processing, settled())).await;
    assert!(matches!(early, Err(SettleError::NotUnknown(RecordState::Processing))), "{early:?}");
    assert_eq!(answers().await, 1, "the refused settlements wrote no answer");
    apart.settle(SettleRequest::new(&unknown, settled()).fenced(token)).await.expect("settle");
    assert_eq!(answers().await, 1, "the settlement's answer in place of the unknown record's");
    let Ok(Begin::Existing(record)) = apart.begin(labelled(&unknown, &fp)).await else { panic!("a replay") };
    assert_eq!(record.response, Some(answer("settled")));
}
