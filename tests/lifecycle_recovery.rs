//! Requests killed mid-handler, then recovered: leased requests on PostgreSQL whose handlers
//! are dropped while they run (half after their side effect, half before), the recovery worker
//! with a reconciler that looks for the effect, and the clients' retries. Every record is
//! settled, and every effect happened exactly once.
#![cfg(all(feature = "postgres", feature = "testkit"))]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tower::{Layer, ServiceExt};
use tower_idempotency::recovery::{Reconciliation, RecoveryWorker};
use tower_idempotency::store::RecordInfo;
use tower_idempotency::{CouplingMode, IdempotencyContext, IdempotencyLayer, StoredResponse};

const OPERATION: &str = "POST /effects";
const KEYS: usize = 20;

fn request(key: &str, effect: bool) -> Request<Full<Bytes>> {
    Request::post(if effect { "/effects?effect=1" } else { "/effects?effect=0" })
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

async fn effects(pool: &PgPool, operation_id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE operation_id = $1")
        .bind(operation_id)
        .fetch_one(pool)
        .await
        .expect("count effects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_handlers_are_reconciled_and_no_effect_happens_twice() {
    let store = support::pg_store(CouplingMode::Leased).await;
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE effects (operation_id text NOT NULL)").execute(&pool).await.expect("effects table");

    // The handler: its side effect (a row, outside the claim: leased mode), then, while
    // `hang` is set, it never answers, as a process killed mid-request never does.
    let hang = Arc::new(AtomicBool::new(true));
    let (reached, mut arrivals) = mpsc::unbounded_channel::<()>();
    let handler = {
        let (pool, hang) = (pool.clone(), hang.clone());
        tower::service_fn(move |request: Request<Full<Bytes>>| {
            let (pool, hang, reached) = (pool.clone(), hang.clone(), reached.clone());
            async move {
                let context = request.extensions().get::<IdempotencyContext>().cloned().expect("context");
                let effect = request.uri().query() == Some("effect=1");
                if effect || !hang.load(Ordering::SeqCst) {
                    sqlx::query("INSERT INTO effects (operation_id) VALUES ($1)")
                        .bind(context.operation_id())
                        .execute(&pool)
                        .await
                        .expect("the effect");
                }
                if hang.load(Ordering::SeqCst) {
                    let _ = reached.send(());
                    std::future::pending::<()>().await;
                }
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .body(Full::new(Bytes::from_static(b"done")))
                        .unwrap(),
                )
            }
        })
    };
    let layer = IdempotencyLayer::new(store.clone())
        .shared_scope("crash-test")
        .operation(OPERATION)
        .lease(Duration::from_millis(300))
        .in_flight_wait(Duration::ZERO);
    let service = layer.layer(handler);

    // First attempts: every handler is killed mid-request; even keys after their effect.
    let keys: Vec<String> = (0..KEYS).map(|n| format!("crash-{n}-{}", std::process::id())).collect();
    let mut attempts = Vec::new();
    for (n, key) in keys.iter().enumerate() {
        let (service, request) = (service.clone(), request(key, n % 2 == 0));
        attempts.push(tokio::spawn(async move { service.oneshot(request).await }));
    }
    for _ in 0..KEYS {
        arrivals.recv().await.expect("every handler reached its end");
    }
    for attempt in &attempts {
        attempt.abort();
    }
    for attempt in attempts {
        assert!(attempt.await.is_err_and(|e| e.is_cancelled()), "the request was killed, never answered");
    }
    hang.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(400)).await;

    // Before recovery, a retry is told the outcome is unknown (the default stale-lease policy).
    let before = service.clone().oneshot(request(&keys[0], true)).await.expect("answer");
    assert_eq!(before.status(), StatusCode::CONFLICT, "a dead holder's record is unknown until settled");

    // The worker: stale leases become unknown, and the reconciler looks for the effect.
    let evidence = pool.clone();
    let worker = RecoveryWorker::new(store.clone()).reconciler(OPERATION, move |record: RecordInfo| {
        let pool = evidence.clone();
        async move {
            if effects(&pool, &record.operation_id).await > 0 {
                Reconciliation::Completed(StoredResponse::new(StatusCode::CREATED, "recovered"))
            } else {
                Reconciliation::NotExecuted
            }
        }
    });
    let report = worker.run_once().await.expect("a recovery pass");
    assert_eq!(report.reconciled + report.released, KEYS, "every record is settled: {report:?}");
    assert_eq!((report.reconciled, report.released), (KEYS / 2, KEYS / 2), "{report:?}");
    assert_eq!(report.counts.map(|c| (c.unknown, c.processing)), Some((0, 0)), "{report:?}");

    // The clients retry: the effects that happened are replayed, the others execute now.
    for (n, key) in keys.iter().enumerate() {
        let answer = service.clone().oneshot(request(key, n % 2 == 0)).await.expect("answer");
        let replayed = answer.headers().get("idempotent-replayed").is_some();
        let (status, body) = (answer.status(), answer.into_body().collect().await.expect("body").to_bytes());
        assert_eq!(status, StatusCode::CREATED, "key {n}");
        if n % 2 == 0 {
            assert!(replayed, "key {n}: its effect happened, so the retry replays the reconciled answer");
            assert_eq!(body, "recovered");
        } else {
            assert!(!replayed, "key {n}: nothing happened, so the retry executes");
            assert_eq!(body, "done");
        }
    }
    let operation_ids: Vec<String> =
        sqlx::query_scalar("SELECT operation_id FROM effects").fetch_all(&pool).await.expect("effects");
    assert_eq!(operation_ids.len(), KEYS, "one effect per key, no duplicate: {operation_ids:?}");
    let distinct: std::collections::HashSet<_> = operation_ids.iter().collect();
    assert_eq!(distinct.len(), KEYS, "no operation's effect happened twice");
}
