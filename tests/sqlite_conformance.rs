//! The conformance suites against SQLite (a fresh database file per case), both modes.
#![cfg(all(feature = "testkit", feature = "sqlite"))]

mod support;

support::suites_in_both_modes!(crate::support::sqlite_store);

/// What the shared suites cannot see: the handler's writes in the claim's transaction, the
/// single write lock, the fencing counter across releases, migrations and the purge.
mod sqlite_specifics {
    use std::time::Duration;

    use http::StatusCode;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    use tower_idempotency::store::sqlite::SqliteClaim;
    use tower_idempotency::store::{FinishError, StoreError};
    use tower_idempotency::testkit::store::{fingerprint, fresh_id};
    use tower_idempotency::{
        Begin, BeginRequest, Claim, CouplingMode, Outcome, RecordState, Retention, SqliteStore, Store, StoredResponse,
    };

    use crate::support::sqlite_store;

    fn run(case: impl std::future::Future<Output = ()>) {
        tower_idempotency::testkit::run(case);
    }

    async fn claimed(store: &SqliteStore, request: BeginRequest<'_>) -> SqliteClaim {
        match store.begin(request).await.expect("begin") {
            Begin::Claimed(claim) => claim,
            other => panic!("expected a claim, got {other:?}"),
        }
    }

    async fn orders(store: &SqliteStore) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(store.pool()).await.expect("count orders")
    }

    async fn insert_order(claim: &SqliteClaim) {
        let handle = claim.handle().expect("an atomic claim hands out its transaction");
        let mut conn = handle.acquire().await.expect("open");
        sqlx::query("INSERT INTO orders (sku) VALUES ('A-1')").execute(&mut *conn).await.expect("insert");
    }

    /// A store whose writers give up on the write lock after `busy`.
    async fn store_with_busy_timeout(busy: Duration) -> SqliteStore {
        let (path, cleanup) = crate::support::sqlite_path("tidem");
        cleanup.until_test_ends();
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(busy);
        let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await.expect("open");
        let store = SqliteStore::new(pool);
        store.migrate().await.expect("migrate");
        store
    }

    #[test]
    fn handler_writes_commit_with_the_record_and_roll_back_otherwise() {
        run(async {
            let store = sqlite_store(CouplingMode::Atomic).await;
            sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL)")
                .execute(store.pool())
                .await
                .expect("create orders");
            let fp = fingerprint(1);

            let id = fresh_id("complete");
            let claim = claimed(&store, BeginRequest::new(&id, &fp)).await;
            insert_order(&claim).await;
            claim.finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "ok"))).await.expect("finish");
            assert_eq!(orders(&store).await, 1, "the business write commits with the record");

            let id = fresh_id("failure");
            let claim = claimed(&store, BeginRequest::new(&id, &fp)).await;
            insert_order(&claim).await;
            let declined = StoredResponse::new(StatusCode::PAYMENT_REQUIRED, "declined");
            claim.finish(Outcome::Reject(declined)).await.expect("finish");
            assert_eq!(orders(&store).await, 1, "a stored failure rolls the business write back");
            match store.begin(BeginRequest::new(&id, &fp)).await.expect("begin") {
                Begin::Existing(record) => assert_eq!(record.state, RecordState::Failed),
                other => panic!("expected the stored failure, got {other:?}"),
            }

            let id = fresh_id("release");
            let claim = claimed(&store, BeginRequest::new(&id, &fp)).await;
            assert_eq!(claim.fencing_token(), None, "an atomic claim is fenced by its transaction");
            insert_order(&claim).await;
            claim.finish(Outcome::Release).await.expect("finish");
            assert_eq!(orders(&store).await, 1, "a release keeps nothing of the handler's");
            let claim = claimed(&store, BeginRequest::new(&id, &fp)).await;

            // A handle kept past the response: rolled back, nothing kept, the identity is free.
            let kept = claim.handle().expect("handle");
            insert_order(&claim).await;
            assert!(matches!(
                claim.finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "x"))).await,
                Err(FinishError::HandleStillHeld)
            ));
            assert!(kept.acquire().await.is_err(), "the kept handle no longer reaches the transaction");
            assert_eq!(orders(&store).await, 1);
            claimed(&store, BeginRequest::new(&id, &fp)).await.finish(Outcome::Release).await.expect("finish");
        });
    }

    #[test]
    fn another_key_waits_for_the_write_lock_then_claims() {
        run(async {
            let store = sqlite_store(CouplingMode::Atomic).await;
            let (a, b, fp) = (fresh_id("holder"), fresh_id("other"), fingerprint(2));
            let holder = claimed(&store, BeginRequest::new(&a, &fp)).await;
            let other = tokio::spawn({
                let store = store.clone();
                async move {
                    let claim = claimed(&store, BeginRequest::new(&b, &fp)).await;
                    claim.finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "b"))).await
                }
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!other.is_finished(), "SQLite has one writer: the other key waits for the holder");
            holder.finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "a"))).await.expect("finish");
            other.await.expect("task").expect("the other key claims once the lock is free");
        });
    }

    #[test]
    fn stores_that_cannot_see_each_others_gates_still_grant_one_claim() {
        // Two stores over one file stand for two processes: neither sees the other's in-flight
        // claims, so their duplicates meet only at the write lock and the primary key.
        run(async {
            let first = sqlite_store(CouplingMode::Atomic).await;
            let second = SqliteStore::new(first.pool().clone());
            let (id, fp) = (fresh_id("two-stores"), fingerprint(7));
            let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(16));
            let mut tasks = Vec::new();
            for n in 0..16 {
                let store = if n % 2 == 0 { first.clone() } else { second.clone() };
                let barrier = barrier.clone();
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    match store.begin(BeginRequest::new(&id, &fp).wait(Duration::from_secs(10))).await.expect("begin") {
                        Begin::Claimed(claim) => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            let done = StoredResponse::new(StatusCode::CREATED, "once");
                            claim.finish(Outcome::Complete(done)).await.expect("finish");
                            1
                        }
                        Begin::Existing(record) => {
                            assert_eq!(record.state, RecordState::Completed);
                            0
                        }
                        Begin::InFlight { .. } => 0,
                    }
                }));
            }
            let mut claims = 0;
            for task in tasks {
                claims += task.await.expect("contender");
            }
            assert_eq!(claims, 1, "exactly one claim across both stores");
        });
    }

    #[test]
    fn busy_timeout_is_unavailable_not_in_flight() {
        run(async {
            let store = store_with_busy_timeout(Duration::from_millis(200)).await;
            let (a, b, fp) = (fresh_id("holder"), fresh_id("other"), fingerprint(3));
            let holder = claimed(&store, BeginRequest::new(&a, &fp)).await;
            match store.begin(BeginRequest::new(&b, &fp).wait(Duration::from_secs(5))).await {
                Err(StoreError::Unavailable(_)) => {}
                other => panic!("another key behind a busy writer is unavailable, got {other:?}"),
            }
            // A replay does not need the write lock.
            let (c, fp4) = (fresh_id("done"), fingerprint(4));
            holder.finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "a"))).await.expect("finish");
            claimed(&store, BeginRequest::new(&c, &fp4))
                .await
                .finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "c")))
                .await
                .expect("finish");
            let _busy = claimed(&store, BeginRequest::new(&b, &fp)).await;
            match store.begin(BeginRequest::new(&c, &fp4)).await.expect("a replay reads without the lock") {
                Begin::Existing(record) => assert_eq!(record.state, RecordState::Completed),
                other => panic!("expected the replay, got {other:?}"),
            }
        });
    }

    #[test]
    fn migrations_are_repeatable_concurrent_and_apart_from_the_application() {
        run(async {
            let store = sqlite_store(CouplingMode::Leased).await;
            let custom = store.clone().table("tidem_custom").expect("a plain name");
            let (one, two, three) = tokio::join!(store.migrate(), custom.migrate(), custom.migrate());
            one.and(two).and(three).expect("migrate again, concurrently");
            let tables: Vec<String> =
                sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
                    .fetch_all(store.pool())
                    .await
                    .expect("tables");
            for name in [
                "_idempotency_records_migrations",
                "_tidem_custom_migrations",
                "idempotency_records",
                "idempotency_records_fencing",
                "tidem_custom",
                "tidem_custom_fencing",
            ] {
                assert!(tables.iter().any(|t| t == name), "{name} missing from {tables:?}");
            }
            assert!(!tables.iter().any(|t| t == "_sqlx_migrations"), "the application's history is untouched");
            assert!(store.clone().table("Bad; DROP TABLE x").is_err());
            let (id, fp) = (fresh_id("custom"), fingerprint(5));
            claimed(&custom, BeginRequest::new(&id, &fp)).await.finish(Outcome::Release).await.expect("finish");
        });
    }

    #[test]
    fn purge_works_in_bounded_batches() {
        run(async {
            let store = sqlite_store(CouplingMode::Leased).await;
            let retention = Retention {
                response: Duration::from_millis(100),
                tombstone: Duration::from_millis(300),
                ..Retention::default()
            };
            let fp = fingerprint(6);
            let ids: Vec<_> = (0..5).map(|_| fresh_id("purge")).collect();
            let mut last_token = 0;
            for id in &ids {
                let claim = claimed(&store, BeginRequest::new(id, &fp).retention(retention)).await;
                last_token = claim.fencing_token().expect("a leased claim has a token");
                claim.finish(Outcome::Complete(StoredResponse::new(StatusCode::CREATED, "x"))).await.expect("finish");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(store.purge(2).await.expect("purge"), 2);
            assert_eq!(store.purge(10).await.expect("purge"), 3);
            assert_eq!(store.purge(10).await.expect("purge"), 0);
            let bodies: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idempotency_records WHERE state = 'expired' AND response_body IS NULL",
            )
            .fetch_one(store.pool())
            .await
            .expect("count");
            assert_eq!(bodies, 5, "expired tombstones keep no response");
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(store.purge(100).await.expect("purge"), 5);
            let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
                .fetch_one(store.pool())
                .await
                .expect("n");
            assert_eq!(left, 0);
            // The counter outlives the rows: a forgotten identity's new claim fences the old ones.
            let again = claimed(&store, BeginRequest::new(&ids[0], &fp)).await;
            assert!(again.fencing_token().expect("token") > last_token, "tokens keep increasing after a purge");
            again.finish(Outcome::Release).await.expect("finish");
        });
    }
}
