//! The outbox on PostgreSQL and SQLite: an event commits with the request's transaction or not
//! at all; relays claiming at once take disjoint batches; a claimed event comes back only after
//! its lease, and a relay that lost its lease changes nothing; failures back off and end as
//! `dead` after the deadline; the webhook sender delivers signed, byte-for-byte bodies.
#![cfg(all(feature = "postgres", feature = "sqlite", feature = "outbox"))]

mod support;

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tower_idempotency::TxHandle;
use tower_idempotency::outbox::{
    EventId, Finish, NewEvent, OutboxStore, PendingEvent, PostgresOutbox, Relay, RelayConfig, SendError, Sender,
    SqliteOutbox, WebhookSecret, WebhookSender, WebhookVerifier,
};

type Enqueue = Box<dyn Fn(Vec<NewEvent>, bool) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// An outbox, and a way to enqueue events in a transaction that commits (`true`) or rolls back.
struct Fixture<O> {
    outbox: O,
    enqueue: Enqueue,
}

async fn postgres() -> Fixture<PostgresOutbox> {
    let schema = support::unique_name("tidem_outbox");
    let pool = support::pg_pool(&schema, 8).await;
    let outbox = PostgresOutbox::new(pool.clone()).schema(&schema).unwrap();
    outbox.migrate().await.expect("migrate");
    outbox.migrate().await.expect("migrating again changes nothing");
    let writer = outbox.clone();
    let enqueue: Enqueue = Box::new(move |events, commit| {
        let (pool, outbox) = (pool.clone(), writer.clone());
        Box::pin(async move {
            let handle = TxHandle::new(pool.begin().await.unwrap());
            for event in &events {
                assert!(outbox.enqueue(&handle, event).await.unwrap());
            }
            let tx = handle.take().await.unwrap();
            if commit { tx.commit().await.unwrap() } else { tx.rollback().await.unwrap() }
        })
    });
    Fixture { outbox, enqueue }
}

async fn sqlite() -> Fixture<SqliteOutbox> {
    let pool = sqlite_pool().await;
    let outbox = SqliteOutbox::new(pool.clone());
    outbox.migrate().await.expect("migrate");
    outbox.migrate().await.expect("migrating again changes nothing");
    let writer = outbox.clone();
    let enqueue: Enqueue = Box::new(move |events, commit| {
        let (pool, outbox) = (pool.clone(), writer.clone());
        Box::pin(async move {
            let handle = TxHandle::new(pool.begin().await.unwrap());
            for event in &events {
                assert!(outbox.enqueue(&handle, event).await.unwrap());
            }
            let tx = handle.take().await.unwrap();
            if commit { tx.commit().await.unwrap() } else { tx.rollback().await.unwrap() }
        })
    });
    Fixture { outbox, enqueue }
}

/// A pool on a fresh SQLite file, removed when the test ends.
async fn sqlite_pool() -> sqlx::SqlitePool {
    let (path, cleanup) = support::sqlite_path("tidem_outbox");
    cleanup.until_test_ends();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    sqlx::sqlite::SqlitePoolOptions::new().max_connections(8).connect_with(options).await.unwrap()
}

fn events(prefix: &str, n: usize) -> Vec<NewEvent> {
    (0..n)
        .map(|i| {
            let id = EventId::new(format!("evt_{prefix}_{i}")).unwrap();
            NewEvent::new(id, "order.created", &serde_json::json!({"order_id": i}), SystemTime::now()).unwrap()
        })
        .collect()
}

/// A sender that records what it got and answers as told.
#[derive(Clone, Default)]
struct Recording {
    seen: Arc<Mutex<Vec<PendingEvent>>>,
    fail: bool,
}

impl Sender for Recording {
    async fn send(&self, event: &PendingEvent) -> Result<(), SendError> {
        self.seen.lock().unwrap().push(event.clone());
        if self.fail { Err(SendError::Status(http::StatusCode::INTERNAL_SERVER_ERROR)) } else { Ok(()) }
    }
}

async fn an_event_commits_with_the_transaction_or_not_at_all<O: OutboxStore>(f: Fixture<O>) {
    (f.enqueue)(events("rolled_back", 3), false).await;
    assert_eq!(f.outbox.counts().await.unwrap().pending, 0, "a rolled-back transaction leaves no event");
    (f.enqueue)(events("committed", 3), true).await;
    let counts = f.outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.delivered, counts.dead), (3, 0, 0));
    assert!(f.outbox.oldest_pending().await.unwrap().is_some());
}

async fn relays_claiming_at_once_take_disjoint_batches<O: OutboxStore>(f: Fixture<O>) {
    (f.enqueue)(events("disjoint", 60), true).await;
    let claims: Vec<_> = (0..4)
        .map(|_| {
            let outbox = f.outbox.clone();
            tokio::spawn(async move { outbox.claim(20, Duration::from_secs(30)).await.unwrap() })
        })
        .collect();
    let mut all = Vec::new();
    for claim in claims {
        all.extend(claim.await.unwrap().into_iter().map(|leased| leased.event.id.to_string()));
    }
    let distinct: BTreeSet<_> = all.iter().cloned().collect();
    assert_eq!(distinct.len(), all.len(), "no event was claimed twice");
    assert_eq!(all.len(), 60, "together the claims took every due event");
}

async fn an_event_comes_back_only_after_its_lease_and_a_lost_lease_changes_nothing<O: OutboxStore>(f: Fixture<O>) {
    (f.enqueue)(events("lease", 1), true).await;
    let first = f.outbox.claim(10, Duration::from_millis(400)).await.unwrap();
    assert_eq!(first.len(), 1);
    assert!(f.outbox.claim(10, Duration::from_millis(400)).await.unwrap().is_empty(), "leased: not due");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let second = f.outbox.claim(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(second.len(), 1, "due again once the lease ran out");
    assert_eq!(second[0].event.attempt, 2);
    assert_eq!(second[0].event.body, first[0].event.body, "the body is the same on every delivery");
    assert!(!f.outbox.finish(&first[0], &Finish::Delivered).await.unwrap(), "the first relay lost its lease");
    let stale = [(first[0].clone(), Finish::Delivered)];
    assert_eq!(f.outbox.finish_all(&stale).await.unwrap(), [false], "in a batch too");
    let both = [(second[0].clone(), Finish::Delivered), (first[0].clone(), Finish::Delivered)];
    assert_eq!(f.outbox.finish_all(&both).await.unwrap(), [true, false], "only the current holder writes");
    let counts = f.outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.delivered), (0, 1));
    assert!(f.outbox.claim(10, Duration::from_secs(30)).await.unwrap().is_empty(), "a delivered event stays so");
}

async fn a_failure_backs_off_and_one_past_the_deadline_is_dead<O: OutboxStore>(f: Fixture<O>) {
    (f.enqueue)(events("failing", 2), true).await;
    let failing = Recording { fail: true, ..Recording::default() };
    // A long backoff: the failed events are not due again at once. The wait is drawn uniformly
    // up to the ceiling (full jitter), so the ceiling is ten days, not the default 30 s cap.
    let ten_days = Duration::from_secs(10 * 86_400);
    let config = RelayConfig { backoff_base: ten_days, backoff_cap: ten_days, ..RelayConfig::default() };
    let report = Relay::new(f.outbox.clone(), failing.clone(), config).run_once().await.unwrap();
    assert_eq!((report.claimed, report.retried, report.dead), (2, 2, 0));
    let counts = f.outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead), (2, 0));

    (f.enqueue)(events("hopeless", 1), true).await;
    let config = RelayConfig { deadline: Duration::ZERO, ..RelayConfig::default() };
    let report = Relay::new(f.outbox.clone(), failing.clone(), config).run_once().await.unwrap();
    assert_eq!((report.claimed, report.dead), (1, 1), "only the due event was claimed, and given up");
    let counts = f.outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead), (2, 1));
    assert_eq!(failing.seen.lock().unwrap().len(), 3);
}

async fn the_webhook_sender_delivers_signed_bodies_byte_for_byte<O: OutboxStore>(f: Fixture<O>) {
    let enqueued = events("webhook", 40);
    let bodies: HashMap<String, Bytes> = enqueued.iter().map(|e| (e.id().to_string(), e.body().clone())).collect();
    (f.enqueue)(enqueued, true).await;
    let (url, received) = receiver().await;
    let sender = WebhookSender::new(url.parse().unwrap(), WebhookSecret::parse(SECRET).unwrap());
    let report = Relay::new(f.outbox.clone(), sender, RelayConfig::default()).run_once().await.unwrap();
    assert_eq!((report.claimed, report.delivered), (40, 40));
    let received = received.lock().unwrap().clone();
    assert_eq!(received.len(), 40);
    for (id, body) in received.iter() {
        assert_eq!(Some(body), bodies.get(id), "event {id} arrived as enqueued");
    }
    assert_eq!(f.outbox.counts().await.unwrap().delivered, 40);
}

/// A sender that takes `delay` per delivery.
struct Slow(Duration);

impl Sender for Slow {
    async fn send(&self, _: &PendingEvent) -> Result<(), SendError> {
        tokio::time::sleep(self.0).await;
        Ok(())
    }
}

async fn a_delivery_that_could_not_end_inside_the_lease_is_not_started<O: OutboxStore>(f: Fixture<O>) {
    (f.enqueue)(events("slow", 3), true).await;
    // A 4 s lease, so deliveries are cut off at 3 s and must start within 1 s of the claim; one
    // at a time, 2 s each: the first starts, the others could not end in time.
    let config = RelayConfig { lease: Duration::from_secs(4), concurrency: 1, ..RelayConfig::default() };
    let report = Relay::new(f.outbox.clone(), Slow(Duration::from_secs(2)), config).run_once().await.unwrap();
    assert_eq!((report.claimed, report.delivered, report.deferred), (3, 1, 2), "{report:?}");
    assert!(f.outbox.claim(10, Duration::from_secs(30)).await.unwrap().is_empty(), "still leased");
    assert_eq!(f.outbox.counts().await.unwrap().pending, 2);
}

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A receiver on a loopback port that checks each delivery's signature (401 if it fails) and
/// keeps what it accepted.
async fn receiver() -> (String, Arc<Mutex<Vec<(String, Bytes)>>>) {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/webhooks", listener.local_addr().unwrap());
    let received = Arc::new(Mutex::new(Vec::new()));
    let verifier = WebhookVerifier::new(WebhookSecret::parse(SECRET).unwrap());
    let kept = received.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let (verifier, kept) = (verifier.clone(), kept.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let (verifier, kept) = (verifier.clone(), kept.clone());
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await?.to_bytes();
                        let status = match verifier.verify(&parts.headers, &body) {
                            Ok(webhook) => {
                                kept.lock().unwrap().push((webhook.id, body));
                                204
                            }
                            Err(_) => 401,
                        };
                        let response =
                            http::Response::builder().status(status).body(http_body_util::Empty::<Bytes>::new());
                        Ok::<_, hyper::Error>(response.unwrap())
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    (url, received)
}

macro_rules! on_both_backends {
    ($($case:ident),+ $(,)?) => {
        mod postgres_outbox {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::postgres().await).await;
                }
            )+
        }
        mod sqlite_outbox {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::sqlite().await).await;
                }
            )+
        }
    };
}

on_both_backends!(
    an_event_commits_with_the_transaction_or_not_at_all,
    relays_claiming_at_once_take_disjoint_batches,
    an_event_comes_back_only_after_its_lease_and_a_lost_lease_changes_nothing,
    a_failure_backs_off_and_one_past_the_deadline_is_dead,
    the_webhook_sender_delivers_signed_bodies_byte_for_byte,
    a_delivery_that_could_not_end_inside_the_lease_is_not_started,
);
