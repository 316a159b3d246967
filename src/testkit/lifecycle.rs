//! The lifecycle suite: what every store that implements [`Admin`] must do after a request is
//! answered: unknown outcomes, inspection, settlement, eviction, counts, expiry of every state,
//! lease renewal and recovery. Stamp it out with [`lifecycle_suite!`](crate::lifecycle_suite).
//!
//! Cases that need a lease or a retention to run out use a few hundred milliseconds and sleep
//! past them; none asserts a duration. "Crashed" holders are claims leaked with
//! `std::mem::forget`: nothing of theirs runs again, as after a kill.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use http::StatusCode;

use super::store::{answer, claim, existing, fingerprint, fresh_id};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, RecordId, Scope};
use crate::record::{RecordState, StoredResponse};
use crate::recovery::{Reconciliation, RecoveryWorker};
use crate::store::{
    Admin, Backoff, Begin, BeginRequest, Claim, FinishError, Outcome, Renewal, Retention, SettleError, SettleRequest,
    Settlement, StaleLeasePolicy, Store,
};

/// The scope the suite's records are made in (as [`fresh_id`] makes them).
pub static SCOPE: LazyLock<Scope> = LazyLock::new(|| Scope::new("testkit"));

/// The operation the suite's records are made under (as [`fresh_id`] makes them).
pub const OPERATION: &str = "POST /testkit";

/// A begin request for `id` labelled with the suite's scope and operation.
pub fn labelled<'a>(id: &'a RecordId, fp: &'a Fingerprint) -> BeginRequest<'a> {
    BeginRequest::new(id, fp).labels(&SCOPE, OPERATION)
}

/// The answer of an outcome its handler does not know.
pub fn timed_out() -> StoredResponse {
    StoredResponse::new(StatusCode::GATEWAY_TIMEOUT, "the provider did not answer")
}

/// Claims `id` and leaves it `unknown` through its handler's marker.
pub async fn make_unknown<S: Store>(store: &S, request: BeginRequest<'_>) {
    claim(store, request).await.finish(Outcome::Unknown(timed_out())).await.expect("finish unknown");
}

async fn info<S: Admin>(store: &S, id: &RecordId) -> crate::store::RecordInfo {
    store.inspect(id).await.expect("inspect").expect("the record is there")
}

/// A finished record is shown with its state, labels, times, status and `Location`; the raw
/// key is nowhere in it.
pub async fn inspect_shows_the_record_but_never_its_key<S: Store + Admin>(store: S) {
    let raw = format!("raw-key-{}", fresh_id("k").to_hex());
    let id = RecordId::new(&SCOPE, OPERATION, &IdempotencyKey::new(raw.clone()).expect("key"));
    let fp = fingerprint(21);
    claim(&store, labelled(&id, &fp)).await.finish(Outcome::Complete(answer("shown"))).await.expect("finish");
    let shown = info(&store, &id).await;
    assert_eq!(shown.state, RecordState::Completed);
    assert_eq!(shown.id, id);
    assert_eq!(shown.operation.as_deref(), Some(OPERATION));
    assert_eq!(shown.operation_id, id.operation_id(), "the operation id handlers see");
    assert_eq!(shown.fingerprint_version, fp.version());
    assert_eq!(shown.status, Some(StatusCode::CREATED));
    assert_eq!(shown.location.as_ref().map(|v| v.as_bytes()), Some(&b"/things/1"[..]));
    assert!(shown.expires_at.is_some_and(|at| at > shown.created_at), "{shown:?}");
    assert!(shown.forget_at >= shown.expires_at, "{shown:?}");
    assert!(shown.updated_at >= shown.created_at);
    assert!(!format!("{shown:?}").contains(&raw), "the raw key must never be shown");
    assert!(store.inspect(&fresh_id("absent")).await.expect("inspect").is_none());
}

/// A record is found by its operation id within its own scope only; another scope's lookup, a
/// malformed id or an unknown one find nothing alike.
pub async fn operation_lookup_is_scoped<S: Store + Admin>(store: S) {
    let (id, fp) = (fresh_id("operation"), fingerprint(22));
    claim(&store, labelled(&id, &fp)).await.finish(Outcome::Complete(answer("polled"))).await.expect("finish");
    let found = store.inspect_operation(&SCOPE, &id.operation_id()).await.expect("lookup");
    assert_eq!(found.map(|info| info.id), Some(id));
    let other = Scope::new("another-tenant");
    assert!(store.inspect_operation(&other, &id.operation_id()).await.expect("lookup").is_none(), "another scope's");
    for wrong in ["", "not-an-operation-id", &id.operation_id().to_uppercase(), &fresh_id("x").operation_id()] {
        assert!(store.inspect_operation(&SCOPE, wrong).await.expect("lookup").is_none(), "{wrong:?}");
    }
}

/// A handler's unknown outcome is kept as `unknown` (with its answer's status), never
/// `completed`, and a retry is told so.
pub async fn unknown_outcome_is_kept_and_reported<S: Store + Admin>(store: S) {
    let (id, fp) = (fresh_id("unknown"), fingerprint(23));
    make_unknown(&store, labelled(&id, &fp)).await;
    let record = existing(&store, labelled(&id, &fp)).await;
    assert_eq!(record.state, RecordState::Unknown, "an unknown outcome is never completed");
    let shown = info(&store, &id).await;
    assert_eq!(shown.state, RecordState::Unknown);
    assert_eq!(shown.status, Some(StatusCode::GATEWAY_TIMEOUT), "the handler's answer is kept for operators");
}

/// Settling is fenced and state-checked: a wrong token is refused, the right one settles once,
/// a settled record is no longer `unknown`, and of concurrent settlements exactly one wins.
pub async fn settlement_is_fenced_state_checked_and_once<S: Store + Admin>(store: S) {
    let (id, fp) = (fresh_id("settle"), fingerprint(24));
    make_unknown(&store, labelled(&id, &fp)).await;
    let token = info(&store, &id).await.fencing_token;
    let settled = Settlement::Completed(answer("settled"));
    let wrong = store.settle(SettleRequest::new(&id, settled.clone()).fenced(token + 1)).await;
    assert!(matches!(wrong, Err(SettleError::Superseded)), "another token: {wrong:?}");
    store.settle(SettleRequest::new(&id, settled.clone()).fenced(token)).await.expect("settle");
    let record = existing(&store, labelled(&id, &fp)).await;
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.response, Some(answer("settled")), "retries replay the settled answer");
    let again = store.settle(SettleRequest::new(&id, Settlement::NotExecuted)).await;
    assert!(matches!(again, Err(SettleError::NotUnknown(RecordState::Completed))), "{again:?}");
    let absent = store.settle(SettleRequest::new(&fresh_id("absent"), settled)).await;
    assert!(matches!(absent, Err(SettleError::NotFound)), "{absent:?}");

    let (raced, fp) = (fresh_id("raced"), fingerprint(25));
    make_unknown(&store, labelled(&raced, &fp)).await;
    let wins = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for n in 0..8 {
        let (store, wins) = (store.clone(), wins.clone());
        tasks.push(tokio::spawn(async move {
            let settlement = if n % 2 == 0 {
                Settlement::Failed(StoredResponse::new(StatusCode::PAYMENT_REQUIRED, "declined"))
            } else {
                Settlement::Completed(answer("paid"))
            };
            match store.settle(SettleRequest::new(&raced, settlement)).await {
                Ok(()) => {
                    wins.fetch_add(1, Ordering::SeqCst);
                }
                Err(SettleError::NotUnknown(_) | SettleError::Superseded) => {}
                Err(other) => panic!("a losing settlement is refused, not {other:?}"),
            }
        }));
    }
    for task in tasks {
        task.await.expect("settler");
    }
    assert_eq!(wins.load(Ordering::SeqCst), 1, "exactly one settlement wins");
}

/// Settling an `unknown` record as not executed frees its key: the next attempt executes.
pub async fn not_executed_releases_the_key<S: Store + Admin>(store: S) {
    let (id, fp) = (fresh_id("not-executed"), fingerprint(26));
    make_unknown(&store, labelled(&id, &fp)).await;
    store.settle(SettleRequest::new(&id, Settlement::NotExecuted)).await.expect("release");
    assert!(store.inspect(&id).await.expect("inspect").is_none());
    claim(&store, labelled(&id, &fp)).await.finish(Outcome::Complete(answer("second"))).await.expect("finish");
}

/// An evicted record is gone, cached copies included: the next attempt executes afresh.
pub async fn eviction_frees_the_key<S: Store + Admin>(store: S) {
    let (id, fp) = (fresh_id("evict"), fingerprint(27));
    claim(&store, labelled(&id, &fp)).await.finish(Outcome::Complete(answer("first"))).await.expect("finish");
    assert_eq!(existing(&store, labelled(&id, &fp)).await.response, Some(answer("first")));
    assert!(store.evict(&id).await.expect("evict"));
    claim(&store, labelled(&id, &fp)).await.finish(Outcome::Complete(answer("second"))).await.expect("finish");
    assert_eq!(existing(&store, labelled(&id, &fp)).await.response, Some(answer("second")));
    assert!(!store.evict(&fresh_id("absent")).await.expect("evict"), "nothing to evict");
}

/// Counts follow the records' states, and the unknown list is oldest first and bounded.
pub async fn counts_and_unknown_list_follow_the_records<S: Store + Admin>(store: S) {
    let fp = fingerprint(28);
    let done = fresh_id("count-done");
    claim(&store, labelled(&done, &fp)).await.finish(Outcome::Complete(answer("a"))).await.expect("finish");
    let declined = StoredResponse::new(StatusCode::PAYMENT_REQUIRED, "declined");
    let failed = fresh_id("count-failed");
    claim(&store, labelled(&failed, &fp)).await.finish(Outcome::Reject(declined)).await.expect("finish");
    let mut unknown = Vec::new();
    for _ in 0..3 {
        let id = fresh_id("count-unknown");
        make_unknown(&store, labelled(&id, &fp)).await;
        unknown.push(id);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let counts = store.counts().await.expect("counts");
    assert_eq!((counts.completed, counts.failed, counts.unknown, counts.expired), (1, 1, 3, 0), "{counts:?}");
    assert!(counts.oldest_unknown.is_some(), "{counts:?}");
    let open = store.open_counts().await.expect("open counts");
    assert_eq!((open.processing, open.unknown), (counts.processing, 3), "the open states as counted: {open:?}");
    assert_eq!((open.completed, open.failed, open.expired), (0, 0, 0), "only the open states: {open:?}");
    let oldest = open.oldest_unknown.expect("the oldest unknown");
    assert!(oldest >= counts.oldest_unknown.unwrap(), "the same oldest: {open:?} {counts:?}");
    let listed: Vec<RecordId> = store.list_unknown(2).await.expect("list").into_iter().map(|info| info.id).collect();
    assert_eq!(listed, unknown[..2], "oldest first, at most the limit");
}

/// An unsettled record expires too: past its retention it is a tombstone
/// (`idempotency_key_expired`), and past the tombstone's the key is free.
pub async fn unknown_record_expires_after_its_retention<S: Store + Admin>(store: S) {
    let retention = Retention {
        unsettled: Duration::from_millis(300),
        tombstone: Duration::from_millis(400),
        ..Retention::default()
    };
    let (id, fp) = (fresh_id("unknown-expires"), fingerprint(29));
    make_unknown(&store, labelled(&id, &fp).retention(retention)).await;
    assert_eq!(existing(&store, labelled(&id, &fp)).await.state, RecordState::Unknown);
    assert_eq!(store.open_counts().await.expect("open counts").unknown, 1);
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(existing(&store, labelled(&id, &fp)).await.state, RecordState::Expired, "no key is locked forever");
    let open = store.open_counts().await.expect("open counts");
    assert_eq!((open.unknown, open.oldest_unknown), (0, None), "past its retention it is not open");
    assert_eq!(info(&store, &id).await.state, RecordState::Expired);
    let late = store.settle(SettleRequest::new(&id, Settlement::Completed(answer("late")))).await;
    assert!(matches!(late, Err(SettleError::NotUnknown(RecordState::Expired))), "{late:?}");
    // The purge turns it into a tombstone in the durable stores (the memory store already did).
    store.purge(100).await.expect("purge");
    assert_eq!(info(&store, &id).await.state, RecordState::Expired);
    tokio::time::sleep(Duration::from_millis(400)).await;
    claim(&store, labelled(&id, &fp)).await.finish(Outcome::Release).await.expect("the key is free again");
}

/// Due `unknown` records are handed out per operation, oldest first, each once until its
/// backoff has passed, and then again with its looks counted.
pub async fn checkout_hands_each_due_record_once_per_backoff<S: Store + Admin>(store: S) {
    let fp = fingerprint(30);
    let mut ours = Vec::new();
    for _ in 0..3 {
        let id = fresh_id("due");
        make_unknown(&store, labelled(&id, &fp)).await;
        ours.push(id);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let theirs = fresh_id("other-operation");
    make_unknown(&store, BeginRequest::new(&theirs, &fp).labels(&SCOPE, "POST /other")).await;
    let backoff = Backoff { first: Duration::from_millis(300), max: Duration::from_secs(3600) };
    let due = store.checkout_unknown(OPERATION, 10, backoff).await.expect("checkout");
    assert_eq!(due.iter().map(|info| info.id).collect::<Vec<_>>(), ours, "this operation's, oldest first");
    assert!(due.iter().all(|info| info.attempts == 1), "{due:?}");
    assert!(store.checkout_unknown(OPERATION, 10, backoff).await.expect("checkout").is_empty(), "within the backoff");
    let other = store.checkout_unknown("POST /other", 10, backoff).await.expect("checkout");
    assert_eq!(other.iter().map(|info| info.id).collect::<Vec<_>>(), [theirs]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let again = store.checkout_unknown(OPERATION, 2, backoff).await.expect("checkout");
    assert_eq!(again.iter().map(|info| info.id).collect::<Vec<_>>(), ours[..2], "bounded by the limit");
    assert!(again.iter().all(|info| info.attempts == 2), "{again:?}");
}

/// The recovery worker asks the operation's reconciler about each due `unknown` record and
/// carries its answers out: completed (replayed after), not executed (the key is free), still
/// unknown (left, looked at again later).
pub async fn recovery_worker_reconciles_unknown_records<S: Store + Admin>(store: S) {
    let fp = fingerprint(31);
    let (paid, never, unsure) = (fresh_id("paid"), fresh_id("never"), fresh_id("unsure"));
    for id in [&paid, &never, &unsure] {
        make_unknown(&store, labelled(id, &fp)).await;
    }
    let evidence: HashMap<String, Reconciliation> = HashMap::from([
        (paid.operation_id(), Reconciliation::Completed(answer("found the payment"))),
        (never.operation_id(), Reconciliation::NotExecuted),
        (unsure.operation_id(), Reconciliation::StillUnknown),
    ]);
    let evidence = Arc::new(evidence);
    let worker = RecoveryWorker::new(store.clone()).reconciler(OPERATION, move |record: crate::store::RecordInfo| {
        let answer = evidence.get(&record.operation_id).cloned().unwrap_or(Reconciliation::StillUnknown);
        async move { answer }
    });
    let report = worker.run_once().await.expect("a pass");
    assert_eq!((report.reconciled, report.released, report.still_unknown), (1, 1, 1), "{report:?}");
    assert_eq!(report.counts.map(|c| c.unknown), Some(1), "{report:?}");
    assert_eq!(existing(&store, labelled(&paid, &fp)).await.response, Some(answer("found the payment")));
    claim(&store, labelled(&never, &fp)).await.finish(Outcome::Release).await.expect("the key is free");
    assert_eq!(info(&store, &unsure).await.state, RecordState::Unknown);
    let second = worker.run_once().await.expect("a pass");
    assert_eq!(second.still_unknown, 0, "within its backoff the record is not asked about again: {second:?}");
}

/// A worker takes a census (every record counted by state) at its first pass and then once per
/// interval; the passes between count the open records alone and keep the census's other
/// states. By default every pass takes one; without a census none does.
pub async fn recovery_census_comes_at_its_interval<S: Store + Admin>(store: S) {
    let fp = fingerprint(36);
    let complete = |name: &'static str| {
        let store = store.clone();
        async move {
            let id = fresh_id(name);
            claim(&store, labelled(&id, &fp)).await.finish(Outcome::Complete(answer(name))).await.expect("finish");
        }
    };
    complete("census-first").await;
    let hourly = RecoveryWorker::new(store.clone()).census_every(Duration::from_secs(3600));
    let first = hourly.run_once().await.expect("a pass");
    assert!(first.census, "the first pass takes a census: {first:?}");
    assert_eq!(first.counts.map(|c| (c.completed, c.unknown)), Some((1, 0)), "{first:?}");

    complete("census-second").await;
    make_unknown(&store, labelled(&fresh_id("census-unknown"), &fp)).await;
    let second = hourly.run_once().await.expect("a pass");
    assert!(!second.census, "within the interval, no census: {second:?}");
    let counts = second.counts.expect("counts");
    assert_eq!((counts.completed, counts.unknown), (1, 1), "open states now, the others as counted: {counts:?}");
    assert!(counts.oldest_unknown.is_some(), "{counts:?}");

    let every_pass = RecoveryWorker::new(store.clone()).run_once().await.expect("a pass");
    assert!(every_pass.census, "{every_pass:?}");
    assert_eq!(every_pass.counts.map(|c| (c.completed, c.unknown)), Some((2, 1)), "{every_pass:?}");
    let never = RecoveryWorker::new(store.clone()).without_census().run_once().await.expect("a pass");
    assert!(!never.census, "{never:?}");
    assert_eq!(never.counts.map(|c| (c.completed, c.unknown)), Some((0, 1)), "{never:?}");
}

/// A renewal extends a leased claim's lease past its first end (a duplicate still finds it in
/// flight), and a renewal of a claim that lost its record says so, as does its finish.
pub async fn renewal_extends_the_lease_and_reports_a_lost_claim<S: Store + Admin>(store: S) {
    let (id, fp) = (fresh_id("renew"), fingerprint(32));
    // Margins of 450 ms either way: the renewal comes well before the first lease ends, the
    // look well after it and well before the renewed one ends, on a busy machine too.
    let lease = Duration::from_millis(1200);
    let holder = claim(&store, labelled(&id, &fp).lease(lease)).await;
    tokio::time::sleep(Duration::from_millis(750)).await;
    assert_eq!(holder.renew(lease).await.expect("renew"), Renewal::Renewed);
    tokio::time::sleep(Duration::from_millis(750)).await;
    match store.begin(labelled(&id, &fp)).await.expect("begin") {
        Begin::InFlight { .. } => {}
        Begin::Existing(record) => panic!("a renewed lease is not stale, found {:?}", record.state),
        Begin::Claimed(_) => panic!("a renewed lease is not taken over"),
    }
    assert!(store.evict(&id).await.expect("evict"));
    assert_eq!(holder.renew(lease).await.expect("renew"), Renewal::Lost);
    assert!(matches!(holder.finish(Outcome::Complete(answer("late"))).await, Err(FinishError::ClaimLost)));
}

/// The sweep turns dead holders' `processing` records into `unknown`, releases those whose
/// route was declared re-executable, and leaves live leases alone.
pub async fn sweep_marks_stale_leases_unknown_and_releases_reexecutable<S: Store + Admin>(store: S) {
    let fp = fingerprint(33);
    let (marked, released, alive) = (fresh_id("sweep-marked"), fresh_id("sweep-released"), fresh_id("sweep-alive"));
    let short = Duration::from_millis(200);
    std::mem::forget(claim(&store, labelled(&marked, &fp).lease(short)).await);
    std::mem::forget(
        claim(&store, labelled(&released, &fp).lease(short).stale_lease(StaleLeasePolicy::Reexecute)).await,
    );
    let live = claim(&store, labelled(&alive, &fp).lease(Duration::from_secs(30))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sweep = store.sweep_leases(10).await.expect("sweep");
    assert_eq!((sweep.marked_unknown, sweep.released), (1, 1), "{sweep:?}");
    assert_eq!(info(&store, &marked).await.state, RecordState::Unknown);
    assert!(store.inspect(&released).await.expect("inspect").is_none(), "released: the next retry executes");
    assert_eq!(info(&store, &alive).await.state, RecordState::Processing, "a live lease is left alone");
    let again = store.sweep_leases(10).await.expect("sweep");
    assert_eq!((again.marked_unknown, again.released), (0, 0), "nothing twice");
    live.finish(Outcome::Complete(answer("alive"))).await.expect("the live holder still finishes");
}

/// A `processing` record whose holder never comes back expires after the unsettled retention,
/// whatever its lease says.
pub async fn abandoned_processing_record_expires_after_its_retention<S: Store + Admin>(store: S) {
    let retention =
        Retention { unsettled: Duration::from_millis(300), tombstone: Duration::from_secs(60), ..Retention::default() };
    let (id, fp) = (fresh_id("processing-expires"), fingerprint(34));
    let request = labelled(&id, &fp).lease(Duration::from_secs(60)).retention(retention);
    std::mem::forget(claim(&store, request).await);
    assert_eq!(store.open_counts().await.expect("open counts").processing, 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(existing(&store, labelled(&id, &fp)).await.state, RecordState::Expired);
    assert_eq!(info(&store, &id).await.state, RecordState::Expired);
    assert_eq!(store.open_counts().await.expect("open counts").processing, 0, "past its retention it is not open");
}

/// Two workers at once over the records of crashed holders: every record is marked, asked
/// about and settled exactly once between them.
pub async fn workers_at_once_settle_each_record_once<S: Store + Admin>(store: S) {
    let fp = fingerprint(35);
    let ids: Vec<RecordId> = (0..6).map(|_| fresh_id("crashed")).collect();
    for id in &ids {
        std::mem::forget(claim(&store, labelled(id, &fp).lease(Duration::from_millis(200))).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Arc::new(AtomicUsize::new(0));
    let worker = |asked: Arc<AtomicUsize>| {
        RecoveryWorker::new(store.clone()).batch(2).reconciler(OPERATION, move |_record: crate::store::RecordInfo| {
            asked.fetch_add(1, Ordering::SeqCst);
            async { Reconciliation::Completed(answer("reconciled")) }
        })
    };
    let (one, two) = (worker(asked.clone()), worker(asked.clone()));
    let (a, b) = (tokio::spawn(async move { one.run_once().await }), tokio::spawn(async move { two.run_once().await }));
    let (a, b) = (a.await.expect("worker").expect("a pass"), b.await.expect("worker").expect("a pass"));
    assert_eq!(a.marked_unknown + b.marked_unknown, ids.len(), "{a:?} {b:?}");
    assert_eq!(a.reconciled + b.reconciled, ids.len(), "{a:?} {b:?}");
    assert_eq!(a.superseded + b.superseded, 0, "{a:?} {b:?}");
    assert_eq!(asked.load(Ordering::SeqCst), ids.len(), "each record is asked about once");
    for id in &ids {
        assert_eq!(existing(&store, labelled(id, &fp)).await.response, Some(answer("reconciled")));
    }
}
