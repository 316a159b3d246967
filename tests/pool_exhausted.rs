//! The bounded wait holds when the store's pool is exhausted (issue 11, item 6).
//!
//! A small pool is filled by handlers blocked inside the layer (in atomic mode each holds its
//! claim's transaction; in leased mode each holds a connection of its own, as a handler doing
//! its business through the pool does). Then a duplicate of a blocked request, a replay of a
//! finished one and a request with a new key must each get their answer: the contract's 503
//! `idempotency_store_unavailable` with `Retry-After` when no connection comes in time (SQLite's
//! in-process duplicate is told 409 in flight, as it is without a full pool), not a wait for the
//! pool's own acquire timeout (an hour here). Nothing runs twice, and once the handlers finish,
//! everything is answered as before. After the handler, a leased claim's outcome waits for a
//! connection until the claim's lease runs out, no longer.
//!
//! No timing thresholds: the only bound is the liveness bound of 30 s on each answer.
#![cfg(all(feature = "axum", any(feature = "postgres", feature = "sqlite")))]

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::{CouplingMode, IdempotencyLayer, Store};

/// The pool's own acquire timeout: far beyond the liveness bound, so a store that waits for it
/// fails the test.
const POOL_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long any one answer may take at all.
const LIVENESS: Duration = Duration::from_secs(30);

/// Takes a connection from the store's pool and keeps it until the returned value drops.
type Hold = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Box<dyn Send>> + Send>> + Send + Sync>;

#[derive(Clone)]
struct Handlers {
    /// How many times a handler ran.
    executions: Arc<AtomicUsize>,
    /// A permit for each blocking handler that is inside (and holds what it holds).
    entered: Arc<Semaphore>,
    /// A permit lets one blocking handler answer.
    release: Arc<Semaphore>,
    /// Leased mode: what a blocking handler holds from the pool while it waits.
    hold: Option<Hold>,
}

/// Answers 201 with its body; a body starting with `block` first holds a connection (leased
/// mode) and waits to be released.
async fn create(State(handlers): State<Handlers>, body: Bytes) -> (StatusCode, String) {
    let n = handlers.executions.fetch_add(1, Ordering::SeqCst) + 1;
    if body.starts_with(b"block") {
        let held = match &handlers.hold {
            Some(hold) => Some(hold().await),
            None => None,
        };
        handlers.entered.add_permits(1);
        handlers.release.acquire().await.expect("open").forget();
        drop(held);
    }
    (StatusCode::CREATED, format!("execution {n}: {}", String::from_utf8_lossy(&body)))
}

/// What came back.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    code: Option<String>,
    retry_after: bool,
    replayed: bool,
    body: String,
}

async fn send(app: &Router, key: &str, body: &'static str) -> Answer {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Body::from(body))
        .unwrap();
    let exchange = async {
        let response = app.clone().oneshot(request).await.unwrap();
        let (status, headers) = (response.status(), response.headers().clone());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body).into_owned();
        let code = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|problem| problem.get("code")?.as_str().map(str::to_owned));
        Answer {
            status,
            code,
            retry_after: headers.contains_key("retry-after"),
            replayed: headers.contains_key("idempotent-replayed"),
            body,
        }
    };
    tokio::time::timeout(LIVENESS, exchange)
        .await
        .unwrap_or_else(|_| panic!("{key}: no answer within {LIVENESS:?} (the wait is not bounded)"))
}

fn assert_store_unavailable(what: &str, answer: &Answer) {
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{what}: {answer:?}");
    assert_eq!(answer.code.as_deref(), Some("idempotency_store_unavailable"), "{what}: {answer:?}");
    assert!(answer.retry_after, "{what}: a 503 says when to retry: {answer:?}");
}

/// What the duplicate of a blocked request is told while the pool is exhausted.
#[derive(Clone, Copy)]
enum Duplicate {
    /// 503: without a connection the store cannot even tell it is in flight.
    StoreUnavailable,
    /// 409 in flight: SQLite's in-process gate tells without a connection.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    InFlight,
}

/// Fills the store's pool with `blocked` handlers inside the layer, then checks what a
/// duplicate, a replay and a new key are answered, and that all is well once they finish.
async fn exhaust_the_pool<S: Store>(store: S, blocked: usize, hold: Option<Hold>, duplicate: Duplicate) {
    let handlers = Handlers {
        executions: Arc::new(AtomicUsize::new(0)),
        entered: Arc::new(Semaphore::new(0)),
        release: Arc::new(Semaphore::new(0)),
        hold,
    };
    let app = Router::new()
        .route("/orders", post(create).layer(IdempotencyLayer::new(store).shared_scope("pool")))
        .with_state(handlers.clone());

    let done = send(&app, "done", "finished before").await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");

    let mut held = Vec::new();
    for i in 0..blocked {
        let app = app.clone();
        held.push(tokio::spawn(async move { send(&app, &format!("held-{i}"), "block").await }));
        // One at a time, so each gets its connection before the next asks.
        let entered = tokio::time::timeout(LIVENESS, handlers.entered.acquire()).await;
        entered.expect("the handler is entered").expect("open").forget();
    }
    let executions = handlers.executions.load(Ordering::SeqCst);
    assert_eq!(executions, blocked + 1);

    // The pool is exhausted. Each of these is answered, none executes.
    let (dup, replay, fresh) =
        tokio::join!(send(&app, "held-0", "block"), send(&app, "done", "finished before"), send(&app, "fresh", "new"));
    match duplicate {
        Duplicate::StoreUnavailable => assert_store_unavailable("the duplicate", &dup),
        Duplicate::InFlight => {
            assert_eq!(dup.status, StatusCode::CONFLICT, "{dup:?}");
            assert_eq!(dup.code.as_deref(), Some("idempotency_request_in_flight"), "{dup:?}");
            assert!(dup.retry_after, "{dup:?}");
        }
    }
    assert_store_unavailable("the replay", &replay);
    assert_store_unavailable("the new key", &fresh);
    assert_eq!(handlers.executions.load(Ordering::SeqCst), executions, "nothing ran while the pool was exhausted");

    // The handlers finish; their answers are stored, and everything is answered as usual.
    handlers.release.add_permits(blocked);
    for (i, answer) in held.into_iter().enumerate() {
        let answer = answer.await.expect("the blocked request");
        assert_eq!(answer.status, StatusCode::CREATED, "held-{i}: {answer:?}");
    }
    let dup = send(&app, "held-0", "block").await;
    assert_eq!((dup.status, dup.replayed), (StatusCode::CREATED, true), "{dup:?}");
    let replay = send(&app, "done", "finished before").await;
    assert_eq!((replay.status, replay.replayed, replay.body), (StatusCode::CREATED, true, done.body));
    let fresh = send(&app, "fresh", "new").await;
    assert_eq!((fresh.status, fresh.replayed), (StatusCode::CREATED, false), "{fresh:?}");
    assert_eq!(handlers.executions.load(Ordering::SeqCst), blocked + 2, "each request ran once");
}

/// Keeps what a handler took from the pool past its answer (a handler that leaks a connection).
type Kept = Arc<std::sync::Mutex<Vec<Box<dyn Send>>>>;

/// A leased claim's outcome waits for a connection until its lease runs out, not for the
/// pool's acquire timeout: with the pool's only connection kept by the handler past its
/// answer, the outcome cannot be stored, and the client is told 503
/// `idempotency_commit_uncertain` (a retry is safe). Its retry, once the lease is over, finds
/// the outcome unknown (the default stale-lease policy): the handler never runs twice.
async fn finish_waits_for_the_lease_at_most<S: Store>(store: S, hold: Hold) {
    let executions = Arc::new(AtomicUsize::new(0));
    let kept: Kept = Arc::default();
    let handler = {
        let (executions, kept) = (executions.clone(), kept.clone());
        move || {
            let (executions, kept, hold) = (executions.clone(), kept.clone(), hold.clone());
            async move {
                executions.fetch_add(1, Ordering::SeqCst);
                let connection = hold().await;
                kept.lock().unwrap().push(connection);
                (StatusCode::CREATED, "created")
            }
        }
    };
    let layer = IdempotencyLayer::new(store).shared_scope("pool").lease(Duration::from_secs(2));
    let app = Router::new().route("/orders", post(handler).layer(layer));

    let first = send(&app, "kept", "order").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert_eq!(first.code.as_deref(), Some("idempotency_commit_uncertain"), "{first:?}");
    assert!(first.retry_after, "{first:?}");

    kept.lock().unwrap().clear();
    let mut retry = send(&app, "kept", "order").await;
    // Within what is left of the lease the retry is told the request is in flight.
    while retry.code.as_deref() == Some("idempotency_request_in_flight") {
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = send(&app, "kept", "order").await;
    }
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(retry.code.as_deref(), Some("idempotency_outcome_unknown"), "{retry:?}");
    assert_eq!(executions.load(Ordering::SeqCst), 1, "the handler ran once");
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use tower_idempotency::PostgresStore;

    async fn store(mode: CouplingMode, connections: u32) -> PostgresStore {
        let schema = support::unique_name("tidem_pool");
        let pool = support::pg_pool_with(&schema, connections, POOL_ACQUIRE_TIMEOUT).await;
        let store = PostgresStore::new(pool).schema(&schema).expect("schema name").mode(mode);
        store.migrate().await.expect("migrate");
        store
    }

    fn hold(store: &PostgresStore) -> Hold {
        let pool = store.pool().clone();
        Arc::new(move || {
            let pool = pool.clone();
            Box::pin(
                async move { Box::new(pool.acquire().await.expect("a connection for the handler")) as Box<dyn Send> },
            )
        })
    }

    /// Each blocked handler holds its claim's transaction: two fill the pool.
    #[tokio::test]
    async fn atomic_claims_filling_the_pool_leave_every_other_request_answered() {
        let store = store(CouplingMode::Atomic, 2).await;
        exhaust_the_pool(store, 2, None, Duplicate::StoreUnavailable).await;
    }

    /// Each blocked handler holds a connection of its own; the claims are committed leases.
    #[tokio::test]
    async fn handlers_holding_the_pool_in_leased_mode_leave_every_other_request_answered() {
        let store = store(CouplingMode::Leased, 2).await;
        let hold = hold(&store);
        exhaust_the_pool(store, 2, Some(hold), Duplicate::StoreUnavailable).await;
    }

    #[tokio::test]
    async fn a_leased_outcome_waits_for_a_connection_until_the_lease_runs_out() {
        let store = store(CouplingMode::Leased, 1).await;
        let hold = hold(&store);
        finish_waits_for_the_lease_at_most(store, hold).await;
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use tower_idempotency::SqliteStore;

    fn hold(store: &SqliteStore) -> Hold {
        let pool = store.pool().clone();
        Arc::new(move || {
            let pool = pool.clone();
            Box::pin(
                async move { Box::new(pool.acquire().await.expect("a connection for the handler")) as Box<dyn Send> },
            )
        })
    }

    /// One atomic claim at a time holds SQLite's write lock: with a pool of one, it fills it.
    /// Its duplicate queues on the in-process gate (which needs no connection) and is told 409.
    #[tokio::test]
    async fn an_atomic_claim_filling_the_pool_leaves_every_other_request_answered() {
        let store = support::sqlite_store_with(CouplingMode::Atomic, 1, POOL_ACQUIRE_TIMEOUT).await;
        exhaust_the_pool(store, 1, None, Duplicate::InFlight).await;
    }

    #[tokio::test]
    async fn handlers_holding_the_pool_in_leased_mode_leave_every_other_request_answered() {
        let store = support::sqlite_store_with(CouplingMode::Leased, 2, POOL_ACQUIRE_TIMEOUT).await;
        let hold = hold(&store);
        exhaust_the_pool(store, 2, Some(hold), Duplicate::StoreUnavailable).await;
    }

    #[tokio::test]
    async fn a_leased_outcome_waits_for_a_connection_until_the_lease_runs_out() {
        let store = support::sqlite_store_with(CouplingMode::Leased, 1, POOL_ACQUIRE_TIMEOUT).await;
        let hold = hold(&store);
        finish_waits_for_the_lease_at_most(store, hold).await;
    }
}
