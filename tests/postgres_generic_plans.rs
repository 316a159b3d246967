//! The layout `docs/scale.md` recommends for billions of records (hash partitions with the
//! answers apart) on connections that set `plan_cache_mode = force_generic_plan`, as it
//! recommends deploying it, against the real PostgreSQL on this machine: a generic plan prunes
//! partitions when it runs instead of when it is made, and locks every partition as it does, so
//! the store, lifecycle and HTTP contract suites run again in both modes on such connections,
//! with the purge's walk, a record beaten to its partition, duplicates released together and the
//! HTTP storm.
#![cfg(all(feature = "testkit", feature = "postgres"))]

mod support;

support::suites_in_both_modes!(crate::support::pg_generic_plan_store);

use std::time::Duration;

use sqlx::PgPool;
use tower_idempotency::store::FinishError;
use tower_idempotency::testkit::store::{answer, fingerprint, fresh_id};
use tower_idempotency::{
    Begin, BeginRequest, Claim, CouplingMode, Outcome, PostgresStore, RecordState, Retention, Store,
};

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}"))).fetch_one(pool).await.unwrap()
}

/// Every connection the store uses plans generically, and a lookup of one record on the
/// partitioned table really is a generic plan that prunes when it runs: what the suites in this
/// file run on.
#[tokio::test]
async fn the_store_s_statements_are_planned_generically_and_pruned_when_they_run() {
    let store = support::pg_generic_plan_store(CouplingMode::Atomic).await;
    let mut connections = Vec::new();
    for _ in 0..3 {
        connections.push(store.pool().acquire().await.expect("a connection"));
    }
    for connection in &mut connections {
        let mode: String = sqlx::query_scalar("SHOW plan_cache_mode").fetch_one(&mut **connection).await.unwrap();
        assert_eq!(mode, "force_generic_plan");
    }
    let connection = &mut *connections[0];
    sqlx::query("PREPARE lookup(bytea) AS SELECT state FROM idempotency_records WHERE record_id = $1")
        .execute(&mut *connection)
        .await
        .unwrap();
    let plan: Vec<String> =
        sqlx::query_scalar("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) EXECUTE lookup('\\x00')")
            .fetch_all(&mut *connection)
            .await
            .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("Subplans Removed"), "a generic plan, pruned at execution:\n{plan}");
}

/// A replay's read, planned generically on 64 partitions while the answers table is new (its
/// statistics unknown, so PostgreSQL guesses it at ten pages), still looks the answer up by its
/// key. The generic plan counts a row from every partition (64 where one is found), and a read
/// that joined the answers table plainly was planned as a hash of the whole answers table,
/// scanned on every replay from then on.
#[tokio::test]
async fn a_replay_looks_its_answer_up_by_its_key_in_a_generic_plan_on_64_partitions() {
    let schema = support::unique_name("tidem");
    // One connection: the read the store prepares is the one this test finds on it.
    let pool = support::pg_generic_plan_pool(&schema, 1).await;
    let store = PostgresStore::new(pool.clone()).schema(&schema).unwrap().hash_partitions(64).unwrap().answers_apart();
    store.migrate().await.expect("migrate");
    let (id, fp) = (fresh_id("read"), fingerprint(5));
    let Begin::Claimed(claim) = store.begin(BeginRequest::new(&id, &fp)).await.unwrap() else { panic!("claimed") };
    claim.finish(Outcome::Complete(answer("replayed"))).await.expect("finish");
    let Begin::Existing(record) = store.begin(BeginRequest::new(&id, &fp)).await.unwrap() else { panic!("a replay") };
    assert_eq!(record.response, Some(answer("replayed")));

    let mut connection = pool.acquire().await.unwrap();
    let read: String = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements \
         WHERE statement LIKE '%answer_seq%' AND statement LIKE '%WHERE record_id = $1'",
    )
    .fetch_one(&mut *connection)
    .await
    .expect("the store's read, prepared on its connection");
    sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE replay_read AS {read}"))).execute(&mut *connection).await.unwrap();
    let explain = format!("EXPLAIN (COSTS OFF) EXECUTE replay_read('\\x{}')", id.to_hex());
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain)).fetch_all(&mut *connection).await.unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("Subplans Removed: 63"), "a generic plan, pruned when it runs:\n{plan}");
    assert!(plan.contains("Index Scan using idempotency_records_answers_pkey"), "the answer by its key:\n{plan}");
    assert!(!plan.contains("Hash") && !plan.contains("Seq Scan"), "no scan of the answers:\n{plan}");
}

/// The purge on generic plans: its probe of the partitions and each partition's walk make the
/// tombstones (deleting the answers, never writing a record) and delete the forgotten records,
/// never past its limit in one call.
#[tokio::test]
async fn the_purge_walks_the_partitions_within_its_limit_on_generic_plans() {
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_generic_plan_store(mode).await;
        let forget_now = Retention { response: Duration::ZERO, tombstone: Duration::ZERO, ..Retention::default() };
        let expire_now = Retention { response: Duration::ZERO, ..Retention::default() };
        let mut ids = Vec::new();
        for (n, retention) in [(30, forget_now), (20, expire_now), (10, Retention::default())] {
            for _ in 0..n {
                let id = fresh_id("generic");
                let begun = store.begin(BeginRequest::new(&id, &fingerprint(3)).retention(retention)).await.unwrap();
                let Begin::Claimed(claim) = begun else { panic!("a fresh identity is claimed") };
                claim.finish(Outcome::Complete(answer("kept or not"))).await.expect("finish");
                ids.push((id, n));
            }
        }
        assert_eq!(count(store.pool(), "idempotency_records_answers").await, 60);
        let mut calls = Vec::new();
        loop {
            let n = store.purge(7).await.expect("purge");
            calls.push(n);
            if n == 0 {
                break;
            }
        }
        assert!(calls.iter().all(|&n| n <= 7), "{mode:?}: never past the limit: {calls:?}");
        assert_eq!(count(store.pool(), "idempotency_records").await, 30, "{mode:?}: 30 forgotten");
        assert_eq!(count(store.pool(), "idempotency_records_answers").await, 10, "{mode:?}: 50 answers gone");
        for (id, group) in &ids {
            let info = tower_idempotency::Admin::inspect(&store, id).await.unwrap();
            match group {
                30 => assert!(info.is_none(), "{mode:?}: forgotten"),
                20 => assert_eq!(info.expect("a tombstone").state, RecordState::Expired, "{mode:?}"),
                _ => assert_eq!(info.expect("kept").state, RecordState::Completed, "{mode:?}"),
            }
        }
    }
}

/// The purge's probes of the partitions (one for each step that walks them) are prepared once
/// on a connection and run on their kept generic plan: written afresh on every call, they were
/// parsed and planned each time (`docs/scale.md`, "What a call of the purge costs on
/// partitions"). The probe of the inline leftovers runs only in the first call, which finds none.
#[tokio::test]
async fn the_purge_s_probes_are_prepared_once_and_run_on_their_generic_plan() {
    let schema = support::unique_name("tidem");
    // One connection: every purge runs on it.
    let pool = support::pg_generic_plan_pool(&schema, 1).await;
    let store = PostgresStore::new(pool.clone()).schema(&schema).unwrap().hash_partitions(64).unwrap().answers_apart();
    store.migrate().await.expect("migrate");
    const CALLS: i64 = 4;
    for _ in 0..CALLS {
        assert_eq!(store.purge(100).await.expect("purge"), 0, "nothing due");
    }
    let probes: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements \
         WHERE statement LIKE 'SELECT 0::bigint WHERE (SELECT %'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut runs: Vec<(i64, i64)> = probes.iter().map(|(_, generic, custom)| (*generic, *custom)).collect();
    runs.sort_unstable();
    // The probe of the answers left inline from before the layout runs in the first call only:
    // it finds none, so the next calls skip that step.
    assert_eq!(runs, [(1, 0), (CALLS, 0)], "the records' two steps' probes, each kept and run on its generic plan");
    for (statement, _, _) in &probes {
        assert_eq!(statement.matches("UNION ALL").count(), 63, "one subquery a partition");
    }
}

/// An atomic claim whose record another writer commits first: on generic plans the violation
/// still names a partition's primary key, and the claim still reports the identity lost.
#[tokio::test]
async fn a_record_committed_first_by_another_writer_is_the_identity_lost_on_generic_plans() {
    let store = support::pg_generic_plan_store(CouplingMode::Atomic).await;
    let id = fresh_id("raced");
    let Begin::Claimed(claim) = store.begin(BeginRequest::new(&id, &fingerprint(4))).await.unwrap() else {
        panic!("claimed")
    };
    // A writer that skips the claim's lock.
    sqlx::query(
        "INSERT INTO idempotency_records (record_id, state, fingerprint_version, fingerprint, fencing_token) \
         VALUES (decode($1, 'hex'), 'processing', 1, $2, 0)",
    )
    .bind(id.to_hex())
    .bind(vec![7_u8; 32])
    .execute(store.pool())
    .await
    .expect("the other writer's record");
    let finished = claim.finish(Outcome::Complete(answer("mine"))).await;
    assert!(matches!(finished, Err(FinishError::ClaimLost)), "{finished:?}");
    assert_eq!(count(store.pool(), "idempotency_records_answers").await, 0, "the lost claim's answer is not kept");
}

/// Identical requests released together, for several keys at once, in both modes, on generic
/// plans: exactly one of each key's contenders claims it.
#[tokio::test]
async fn duplicates_released_together_claim_each_identity_once_on_generic_plans() {
    const KEYS: usize = 24;
    const DUPLICATES: usize = 16;
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let store = support::pg_generic_plan_store(mode).await;
        support::each_identity_claimed_once(&store, KEYS, DUPLICATES, &format!("{mode:?}")).await;
        assert_eq!(count(store.pool(), "idempotency_records").await, KEYS as i64, "one record per key");
    }
}

/// The HTTP storm on generic plans: many identical requests released together, one order row
/// per key.
#[cfg(feature = "axum")]
#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key_on_generic_plans() {
    const KEYS: usize = 40;
    const DUPLICATES: usize = 32;
    tower_idempotency::testkit::run(async {
        let store = support::pg_generic_plan_store(CouplingMode::Atomic).await;
        let conflicts = support::storm::pg_storm(&store, "gstorm", KEYS, DUPLICATES, 4).await;
        assert_eq!(count(store.pool(), "idempotency_records").await, KEYS as i64);
        println!("generic-plan storm: {KEYS} keys x {DUPLICATES} requests, {conflicts} answers were 409");
    });
}

/// The plans PostgreSQL sends a connection of [`support::pg_explained_generic_plan_pool`]: each
/// notice that carries one (`auto_explain`'s "duration: … plan:" message).
#[derive(Clone, Default)]
struct Plans(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Plans {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

struct Message<'a>(&'a mut Option<String>);

impl tracing::field::Visit for Message<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            *self.0 = Some(format!("{value:?}"));
        }
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            *self.0 = Some(value.to_owned());
        }
    }
}

impl tracing::Subscriber for Plans {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.target() == "sqlx::postgres::notice"
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut message = None;
        event.record(&mut Message(&mut message));
        if let Some(plan) = message.filter(|m| m.contains("plan:")) {
            self.0.lock().unwrap().push(plan);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The partitions of the records table and of its answers table that `plan`'s nodes read or
/// write (a scan of one, or of its index): `idempotency_records_p012`,
/// `idempotency_records_answers_p012_pkey`. An `UPDATE` or `DELETE` on the partitioned table
/// lists every partition as its possible target ("Update on idempotency_records_p000", …),
/// opened only when a row the plan's scans found is written to it: those lines, and the
/// statement's text, are not counted.
fn partitions_named(plan: &str) -> std::collections::BTreeSet<String> {
    let targets = ["Query Text:", "Update on ", "Delete on ", "Insert on "];
    let nodes = plan.lines().filter(|line| !targets.iter().any(|target| line.trim_start().starts_with(target)));
    let mut named = std::collections::BTreeSet::new();
    for (line, at) in nodes.flat_map(|line| line.match_indices("idempotency_records_").map(move |(at, _)| (line, at))) {
        let rest = &line[at + "idempotency_records_".len()..];
        let (table, rest) = match rest.strip_prefix("answers_") {
            Some(rest) => ("answers", rest),
            None => ("records", rest),
        };
        let digits = rest.strip_prefix('p').map(|r| r.chars().take_while(char::is_ascii_digit).collect::<String>());
        if let Some(digits) = digits.filter(|d| d.len() == 3) {
            named.insert(format!("{table} p{digits}"));
        }
    }
    named
}

/// Whether `plan` names more than one partition of the records table or of its answers table.
fn more_than_one_partition_of_a_table(plan: &str) -> bool {
    let named = partitions_named(plan);
    ["records", "answers"].iter().any(|table| named.iter().filter(|name| name.starts_with(table)).count() > 1)
}

/// Every statement a request's life sends, in both modes, on the recommended layout (64 hash
/// partitions, answers apart) planned generically: each one's plan, as it ran (the claim's
/// function and what runs inside it, the read of a replay, an answer to a different body, a
/// request in flight, the finish of each outcome, a lease's renewal and a stale lease taken
/// over), reads or writes one partition of each table at most. At 3 billion records a
/// statement that visits every partition is a scan of each (`docs/scale.md`), so a change that
/// loses the pruning fails here. A count of every record, sent the same way, shows the check
/// sees such a statement.
#[tokio::test]
async fn every_statement_of_a_request_s_life_reads_one_partition_on_generic_plans() {
    for mode in [CouplingMode::Atomic, CouplingMode::Leased] {
        let schema = support::unique_name("tidem");
        let pool = support::pg_explained_generic_plan_pool(&schema, 4).await;
        let store = PostgresStore::new(pool.clone()).schema(&schema).unwrap().hash_partitions(64).unwrap();
        let store = store.answers_apart().mode(mode);
        store.migrate().await.expect("migrate");
        let plans = Plans::default();
        let seen = {
            let _default = tracing::subscriber::set_default(plans.clone());
            a_request_s_life(&store, mode).await;
            sqlx::query_scalar::<_, i64>("SELECT count(*) /* every record */ FROM idempotency_records")
                .fetch_one(&pool)
                .await
                .unwrap();
            plans.take()
        };
        let wide: Vec<&String> = seen.iter().filter(|plan| more_than_one_partition_of_a_table(plan)).collect();
        assert!(seen.len() >= 20, "{mode:?}: the plans of the request's statements: {}", seen.len());
        assert!(
            seen.iter().any(|plan| plan.contains("Subplans Removed: 63")),
            "{mode:?}: a generic plan pruned when it ran:\n{}",
            seen.join("\n\n")
        );
        let shown = wide.iter().map(|plan| plan.as_str()).collect::<Vec<_>>().join("\n\n");
        assert_eq!(wide.len(), 1, "{mode:?}: only the count visits more than one partition:\n{shown}");
        assert!(wide[0].contains("every record"), "{mode:?}: {shown}");
        println!("{mode:?}: {} plans, each of one partition of each table but the count's", seen.len());
    }
}

/// What [`every_statement_of_a_request_s_life_reads_one_partition_on_generic_plans`] sends: every
/// path of a request through `store` in mode `mode`.
async fn a_request_s_life(store: &PostgresStore, mode: CouplingMode) {
    let claim = |id, byte| async move {
        match store.begin(BeginRequest::new(id, &fingerprint(byte))).await.expect("begin") {
            Begin::Claimed(claim) => claim,
            _ => panic!("{mode:?}: a fresh identity is claimed"),
        }
    };
    // Completed, replayed, and asked again with another body.
    let completed = fresh_id("life");
    claim(&completed, 1).await.finish(Outcome::Complete(answer("done"))).await.expect("finish");
    for byte in [1, 2] {
        let begun = store.begin(BeginRequest::new(&completed, &fingerprint(byte))).await.unwrap();
        assert!(matches!(begun, Begin::Existing(_)), "{mode:?}: the record");
    }
    // Rejected; released and claimed again; unknown.
    let rejected = fresh_id("life");
    claim(&rejected, 1).await.finish(Outcome::Reject(answer("no"))).await.expect("reject");
    let released = fresh_id("life");
    claim(&released, 1).await.finish(Outcome::Release).await.expect("release");
    claim(&released, 1).await.finish(Outcome::Unknown(answer("unsure"))).await.expect("unknown");
    // In flight: a second request while the first holds it; the first renews and finishes.
    let in_flight = fresh_id("life");
    let first = claim(&in_flight, 1).await;
    let second = store.begin(BeginRequest::new(&in_flight, &fingerprint(1)).wait(Duration::ZERO)).await.unwrap();
    assert!(matches!(second, Begin::InFlight { .. }), "{mode:?}: in flight");
    first.renew(Duration::from_secs(30)).await.expect("renew");
    first.finish(Outcome::Complete(answer("after a wait"))).await.expect("finish");
    if mode == CouplingMode::Leased {
        // A lease that runs out: taken over to execute again, and marked unknown.
        for policy in [tower_idempotency::StaleLeasePolicy::Reexecute, tower_idempotency::StaleLeasePolicy::MarkUnknown]
        {
            let (stale, one) = (fresh_id("life"), fingerprint(1));
            let short = BeginRequest::new(&stale, &one).lease(Duration::from_millis(20));
            let Begin::Claimed(lost) = store.begin(short).await.unwrap() else { panic!("claimed") };
            tokio::time::sleep(Duration::from_millis(60)).await;
            let again = BeginRequest::new(&stale, &one).stale_lease(policy);
            let taken = store.begin(again).await.unwrap();
            if let Begin::Claimed(taken) = taken {
                taken.finish(Outcome::Complete(answer("taken over"))).await.expect("finish");
            }
            let finished = lost.finish(Outcome::Complete(answer("too late"))).await;
            assert!(finished.is_err(), "{mode:?}: the stale claim's answer is refused");
        }
    }
}
