//! The store suite: what every [`Store`] must do, whatever its backend.
//!
//! Each case takes a fresh store. Cases that need a lease to run out use leases of a few
//! hundred milliseconds and sleep past them; none asserts a duration.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::StatusCode;
use tokio::sync::Barrier;

use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, RecordId, Scope};
use crate::record::{RecordState, StoredResponse};
use crate::store::{Begin, BeginRequest, Claim, FinishError, Outcome, Retention, StaleLeasePolicy, Store};

/// A fresh identity, unique to this process run, so cases never see each other's records.
pub fn fresh_id(label: &str) -> RecordId {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let nonce = format!("{label}-{n}-{}-{nanos}", std::process::id());
    RecordId::new(&Scope::new("testkit"), "POST /testkit", &IdempotencyKey::new(nonce).expect("key"))
}

/// A fingerprint made from one byte.
pub fn fingerprint(byte: u8) -> Fingerprint {
    Fingerprint::from_parts(crate::fingerprint::FINGERPRINT_VERSION, [byte; 32])
}

/// A `201 Created` answer with `body` and a `Location` header: what the cases store.
pub fn answer(body: &'static str) -> StoredResponse {
    let mut response = StoredResponse::new(StatusCode::CREATED, body);
    response.headers.push((http::header::LOCATION, http::HeaderValue::from_static("/things/1")));
    response
}

/// Begins `request` on `store` and returns the claim; panics if the identity is not free.
pub async fn claim<S: Store>(store: &S, request: BeginRequest<'_>) -> S::Claim {
    match store.begin(request).await.expect("begin") {
        Begin::Claimed(claim) => claim,
        Begin::Existing(record) => panic!("expected a claim, found an existing {:?} record", record.state),
        Begin::InFlight { .. } => panic!("expected a claim, found the identity in flight"),
    }
}

/// Begins `request` on `store` and returns the record in the way; panics if the identity was
/// claimed or is in flight.
pub async fn existing<S: Store>(store: &S, request: BeginRequest<'_>) -> crate::record::Record {
    match store.begin(request).await.expect("begin") {
        Begin::Existing(record) => record,
        Begin::Claimed(_) => panic!("expected an existing record, but the identity was claimed afresh"),
        Begin::InFlight { .. } => panic!("expected an existing record, found the identity in flight"),
    }
}

/// A new identity is claimed, and the claim settles.
pub async fn claims_a_new_identity<S: Store>(store: S) {
    let id = fresh_id("new");
    let fp = fingerprint(1);
    let claim = claim(&store, BeginRequest::new(&id, &fp)).await;
    claim.finish(Outcome::Complete(answer("ok"))).await.expect("finish");
}

/// A completed record is returned with its response, status, headers and body intact.
pub async fn replays_a_completed_record<S: Store>(store: S) {
    let id = fresh_id("completed");
    let fp = fingerprint(2);
    claim(&store, BeginRequest::new(&id, &fp))
        .await
        .finish(Outcome::Complete(answer("{\"id\":1}")))
        .await
        .expect("finish");
    let record = existing(&store, BeginRequest::new(&id, &fp)).await;
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.fingerprint, fp);
    assert_eq!(record.response, Some(answer("{\"id\":1}")), "the stored response must come back byte for byte");
}

/// A stored business failure is returned as `failed` with its response.
pub async fn replays_a_stored_failure<S: Store>(store: S) {
    let id = fresh_id("failed");
    let fp = fingerprint(3);
    let declined = StoredResponse::new(StatusCode::PAYMENT_REQUIRED, "declined");
    claim(&store, BeginRequest::new(&id, &fp)).await.finish(Outcome::Reject(declined.clone())).await.expect("finish");
    let record = existing(&store, BeginRequest::new(&id, &fp)).await;
    assert_eq!(record.state, RecordState::Failed);
    assert_eq!(record.response, Some(declined));
}

/// A released claim leaves nothing: the next attempt claims afresh.
pub async fn release_lets_the_next_attempt_claim<S: Store>(store: S) {
    let id = fresh_id("release");
    let fp = fingerprint(4);
    claim(&store, BeginRequest::new(&id, &fp)).await.finish(Outcome::Release).await.expect("finish");
    claim(&store, BeginRequest::new(&id, &fp)).await.finish(Outcome::Release).await.expect("finish");
}

/// A request with another fingerprint learns of the mismatch at once, even while the first
/// request is in flight, without waiting.
pub async fn reports_a_different_fingerprint_even_in_flight<S: Store>(store: S) {
    let id = fresh_id("mismatch");
    let (first, other) = (fingerprint(5), fingerprint(6));
    let holder = claim(&store, BeginRequest::new(&id, &first)).await;
    let found = store.begin(BeginRequest::new(&id, &other).wait(Duration::from_millis(300))).await.expect("begin");
    match found {
        Begin::Existing(record) => assert_eq!(record.fingerprint, first),
        // An atomic store cannot read a row another transaction holds; it may only answer in
        // flight, and must not claim.
        Begin::InFlight { .. } => {}
        Begin::Claimed(_) => panic!("a second claim was granted while the first is in flight"),
    }
    holder.finish(Outcome::Complete(answer("first"))).await.expect("finish");
    let record = existing(&store, BeginRequest::new(&id, &other)).await;
    assert_eq!(record.fingerprint, first, "the record keeps the first request's fingerprint");
}

/// A duplicate waits (bounded) for the holder, then reports the identity in flight.
pub async fn in_flight_duplicate_waits_then_reports_in_flight<S: Store>(store: S) {
    let id = fresh_id("inflight");
    let fp = fingerprint(7);
    let holder = claim(&store, BeginRequest::new(&id, &fp)).await;
    match store.begin(BeginRequest::new(&id, &fp).wait(Duration::from_millis(200))).await.expect("begin") {
        Begin::InFlight { .. } => {}
        Begin::Claimed(_) => panic!("a second claim was granted while the first is in flight"),
        Begin::Existing(record) => panic!("expected in flight, found {:?}", record.state),
    }
    holder.finish(Outcome::Complete(answer("done"))).await.expect("finish");
}

/// A waiting duplicate wakes when the holder finishes and sees the stored outcome.
pub async fn waiter_sees_the_outcome_when_the_holder_finishes<S: Store>(store: S) {
    let id = fresh_id("waiter");
    let fp = fingerprint(8);
    let holder = claim(&store, BeginRequest::new(&id, &fp)).await;
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move {
            let request = BeginRequest::new(&id, &fp).wait(Duration::from_secs(20));
            match store.begin(request).await.expect("begin") {
                Begin::Existing(record) => record,
                Begin::Claimed(_) => panic!("the waiter claimed while the holder was completing"),
                Begin::InFlight { .. } => panic!("the waiter gave up although the holder finished"),
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder.finish(Outcome::Complete(answer("awaited"))).await.expect("finish");
    let record = waiting.await.expect("waiter task");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.response, Some(answer("awaited")));
}

/// A waiting duplicate claims the identity when the holder releases it.
pub async fn waiter_claims_after_a_release<S: Store>(store: S) {
    let id = fresh_id("waiter-release");
    let fp = fingerprint(9);
    let holder = claim(&store, BeginRequest::new(&id, &fp)).await;
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move {
            let request = BeginRequest::new(&id, &fp).wait(Duration::from_secs(20));
            match store.begin(request).await.expect("begin") {
                Begin::Claimed(claim) => claim.finish(Outcome::Release).await.is_ok(),
                _ => false,
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder.finish(Outcome::Release).await.expect("finish");
    assert!(waiting.await.expect("waiter task"), "after a release the waiting duplicate must be able to claim");
}

/// Two identities never see each other's records.
pub async fn identities_are_independent<S: Store>(store: S) {
    let key = IdempotencyKey::new(format!("shared-key-{}", fresh_id("k"))).expect("key");
    let a = RecordId::new(&Scope::new("tenant-a"), "POST /x", &key);
    let b = RecordId::new(&Scope::new("tenant-b"), "POST /x", &key);
    let fp = fingerprint(10);
    claim(&store, BeginRequest::new(&a, &fp)).await.finish(Outcome::Complete(answer("a"))).await.expect("finish");
    claim(&store, BeginRequest::new(&b, &fp)).await.finish(Outcome::Complete(answer("b"))).await.expect("finish");
    assert_eq!(existing(&store, BeginRequest::new(&a, &fp)).await.response, Some(answer("a")));
    assert_eq!(existing(&store, BeginRequest::new(&b, &fp)).await.response, Some(answer("b")));
}

/// Many identical begins released together: exactly one claim; every other one replays or is
/// told the identity is in flight.
pub async fn concurrent_begins_grant_exactly_one_claim<S: Store>(store: S) {
    const CONTENDERS: usize = 32;
    let id = fresh_id("storm");
    let fp = fingerprint(11);
    let barrier = Arc::new(Barrier::new(CONTENDERS));
    let claims = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CONTENDERS {
        let (store, barrier, claims) = (store.clone(), barrier.clone(), claims.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let request = BeginRequest::new(&id, &fp).wait(Duration::from_secs(10));
            match store.begin(request).await.expect("begin") {
                Begin::Claimed(claim) => {
                    claims.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    claim.finish(Outcome::Complete(answer("once"))).await.expect("finish");
                }
                Begin::Existing(record) => {
                    assert_eq!(record.state, RecordState::Completed);
                    assert_eq!(record.response, Some(answer("once")));
                }
                Begin::InFlight { .. } => {}
            }
        }));
    }
    for task in tasks {
        task.await.expect("contender");
    }
    assert_eq!(claims.load(Ordering::SeqCst), 1, "exactly one contender may claim the identity");
}

/// After retention the response is dropped and a tombstone answers `expired`; after the
/// tombstone's time the identity is forgotten. `purge` does the same work in batches.
pub async fn retention_keeps_a_tombstone_then_forgets<S: Store>(store: S) {
    let id = fresh_id("retention");
    let fp = fingerprint(12);
    // Wide margins between the phases, so a slow machine cannot blur them.
    let retention = Retention {
        response: Duration::from_millis(1000),
        tombstone: Duration::from_millis(3000),
        ..Retention::default()
    };
    let request = || BeginRequest::new(&id, &fp).retention(retention);
    claim(&store, request()).await.finish(Outcome::Complete(answer("kept"))).await.expect("finish");
    assert_eq!(existing(&store, request()).await.state, RecordState::Completed);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    store.purge(1000).await.expect("purge");
    let tombstone = existing(&store, request()).await;
    assert_eq!(tombstone.state, RecordState::Expired);
    assert_eq!(tombstone.response, None, "an expired record keeps no response");
    tokio::time::sleep(Duration::from_millis(3000)).await;
    store.purge(1000).await.expect("purge");
    claim(&store, request()).await.finish(Outcome::Release).await.expect("finish");
}

/// A record past its tombstone time that no purge has removed yet is claimed afresh, and the
/// new outcome takes its place: once as a completion, then (forgotten again) as a stored
/// failure, which an atomic store stores under a fresh claim.
pub async fn forgotten_record_is_taken_over_before_any_purge<S: Store>(store: S) {
    let id = fresh_id("takeover");
    let fp = fingerprint(13);
    let brief = Retention {
        response: Duration::from_millis(200),
        tombstone: Duration::from_millis(300),
        ..Retention::default()
    };
    let brief_request = || BeginRequest::new(&id, &fp).retention(brief);
    claim(&store, brief_request()).await.finish(Outcome::Complete(answer("first"))).await.expect("finish");
    // Well past the tombstone time, and no purge: the forgotten record is still in the table.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    claim(&store, brief_request()).await.finish(Outcome::Complete(answer("second"))).await.expect("take over");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let declined = StoredResponse::new(StatusCode::PAYMENT_REQUIRED, "declined");
    let kept = || BeginRequest::new(&id, &fp);
    claim(&store, kept()).await.finish(Outcome::Reject(declined.clone())).await.expect("take over again");
    let record = existing(&store, kept()).await;
    assert_eq!(record.state, RecordState::Failed);
    assert_eq!(record.response, Some(declined), "the newest outcome must have replaced the forgotten one");
}

/// Shadow mode's batches ([`Store::record_shadow`]): entries are recorded (completed, or
/// failed for a stored failure) with their status and no body; recorded again, each finds the
/// record already there and keeps it; a forgotten record is taken over.
pub async fn records_shadow_batches<S: Store>(store: S) {
    use crate::store::{ShadowEntry, ShadowSeen};
    let (done, declined, brief) = (fresh_id("shadow-done"), fresh_id("shadow-declined"), fresh_id("shadow-brief"));
    let entry = |id: RecordId, byte: u8, status: StatusCode| {
        ShadowEntry::new(id, fingerprint(byte), status, Retention::default())
    };
    let first =
        vec![entry(done, 21, StatusCode::CREATED), entry(declined, 22, StatusCode::PAYMENT_REQUIRED).as_failure()];
    let seen = store.record_shadow(first).await.expect("record a batch");
    assert!(matches!(seen.as_slice(), [ShadowSeen::Recorded, ShadowSeen::Recorded]), "{seen:?}");

    // The records are the store's own: a claim finds them, with the status and no body.
    let record = existing(&store, BeginRequest::new(&done, &fingerprint(21))).await;
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.response.map(|response| (response.status, response.body.len())), Some((StatusCode::CREATED, 0)));
    let record = existing(&store, BeginRequest::new(&declined, &fingerprint(22))).await;
    assert_eq!(record.state, RecordState::Failed);

    // Again, with another fingerprint for one of them: both records are kept as they were.
    let again = vec![entry(done, 21, StatusCode::CREATED), entry(declined, 23, StatusCode::CREATED)];
    let seen = store.record_shadow(again).await.expect("record a batch again");
    match seen.as_slice() {
        [ShadowSeen::Existing(done), ShadowSeen::Existing(declined)] => {
            assert_eq!((done.state, done.fingerprint), (RecordState::Completed, fingerprint(21)));
            assert_eq!((declined.state, declined.fingerprint), (RecordState::Failed, fingerprint(22)));
        }
        other => panic!("both records were there: {other:?}"),
    }

    // A forgotten record (past its tombstone time, not purged) is taken over.
    let brief_retention = Retention {
        response: Duration::from_millis(200),
        tombstone: Duration::from_millis(300),
        ..Retention::default()
    };
    let short = ShadowEntry::new(brief, fingerprint(24), StatusCode::CREATED, brief_retention);
    assert!(matches!(store.record_shadow(vec![short]).await.expect("record").as_slice(), [ShadowSeen::Recorded]));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let seen = store.record_shadow(vec![short]).await.expect("record over the forgotten one");
    assert!(matches!(seen.as_slice(), [ShadowSeen::Recorded]), "{seen:?}");
}

/// Leased mode: each claim's fencing token is greater than the one before on the same identity.
pub async fn fencing_tokens_increase<S: Store>(store: S) {
    let id = fresh_id("fencing");
    let fp = fingerprint(13);
    let first = claim(&store, BeginRequest::new(&id, &fp)).await;
    let first_token = first.fencing_token().expect("a leased claim has a fencing token");
    first.finish(Outcome::Release).await.expect("finish");
    let second = claim(&store, BeginRequest::new(&id, &fp)).await;
    assert!(second.fencing_token().expect("token") > first_token, "fencing tokens must increase");
    second.finish(Outcome::Release).await.expect("finish");
}

/// Leased mode: a holder whose lease ran out is presumed dead; by default the record becomes
/// `unknown` and nothing re-runs.
pub async fn stale_lease_becomes_unknown<S: Store>(store: S) {
    let id = fresh_id("stale");
    let fp = fingerprint(14);
    let request = || BeginRequest::new(&id, &fp).lease(Duration::from_millis(200));
    let holder = claim(&store, request()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(existing(&store, request()).await.state, RecordState::Unknown);
    match holder.finish(Outcome::Complete(answer("late"))).await {
        Err(FinishError::ClaimLost) => {}
        other => panic!("a holder whose record became unknown must lose its lease, got {other:?}"),
    }
    assert_eq!(existing(&store, request()).await.state, RecordState::Unknown);
}

/// Leased mode, re-executable route: a retry takes an expired lease over with a higher token,
/// and the old holder's late completion is refused.
pub async fn stale_lease_reexecute_takes_over_and_fences_the_old_holder<S: Store>(store: S) {
    let id = fresh_id("takeover");
    let fp = fingerprint(15);
    let request =
        || BeginRequest::new(&id, &fp).lease(Duration::from_millis(200)).stale_lease(StaleLeasePolicy::Reexecute);
    let old = claim(&store, request()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let new = claim(&store, request()).await;
    assert!(new.fencing_token() > old.fencing_token());
    assert!(matches!(old.finish(Outcome::Complete(answer("old"))).await, Err(FinishError::ClaimLost)));
    new.finish(Outcome::Complete(answer("new"))).await.expect("finish");
    assert_eq!(existing(&store, request()).await.response, Some(answer("new")));
}

/// Leased mode: a claim dropped without finishing (handler error, panic, cancellation) does not
/// leave duplicates waiting for its whole lease: the next attempt finds `unknown`.
pub async fn dropped_leased_claim_is_not_left_in_flight<S: Store>(store: S) {
    let id = fresh_id("dropped-leased");
    let fp = fingerprint(16);
    drop(claim(&store, BeginRequest::new(&id, &fp)).await);
    let record = existing(&store, BeginRequest::new(&id, &fp).wait(Duration::from_secs(5))).await;
    assert_eq!(record.state, RecordState::Unknown);
}

/// Atomic mode: a claim dropped without finishing rolls back; the identity is free again.
pub async fn dropped_atomic_claim_leaves_nothing<S: Store>(store: S) {
    let id = fresh_id("dropped-atomic");
    let fp = fingerprint(17);
    drop(claim(&store, BeginRequest::new(&id, &fp)).await);
    claim(&store, BeginRequest::new(&id, &fp).wait(Duration::from_secs(5)))
        .await
        .finish(Outcome::Release)
        .await
        .expect("finish");
}
