//! The relay: claims due events in batches under a lease, delivers them through a [`Sender`],
//! and writes each attempt's end back under the lease's token.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Finish, Leased, OutboxError, OutboxStore, RelayConfig, SendError, Sender};

/// Delivers an outbox's committed events. Run as many as you like, in one process or many:
/// each claims its own batches.
#[derive(Debug)]
pub struct Relay<O, S> {
    outbox: O,
    sender: Arc<S>,
    config: RelayConfig,
}

/// What one batch came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// Delivered (a 2xx) and marked so.
    pub delivered: usize,
    /// Failed and scheduled for another attempt.
    pub retried: usize,
    /// Failed past the deadline and parked as dead.
    pub dead: usize,
    /// Attempts whose end could not be written because the lease was lost (another relay
    /// claimed the event after it ran out) or the database failed: those events are delivered
    /// again after their lease.
    pub unrecorded: usize,
}

impl<O: OutboxStore, S: Sender> Relay<O, S> {
    /// A relay over `outbox`, delivering through `sender`.
    pub fn new(outbox: O, sender: S, config: RelayConfig) -> Self {
        Self { outbox, sender: Arc::new(sender), config }
    }

    /// Claims one batch of due events and delivers it, `concurrency` at a time.
    pub async fn run_once(&self) -> Result<BatchReport, OutboxError> {
        let batch = self.outbox.claim(self.config.batch.max(1), self.config.lease).await?;
        let mut report = BatchReport { claimed: batch.len(), ..BatchReport::default() };
        let mut running = JoinSet::new();
        for leased in batch {
            if running.len() >= self.config.concurrency.max(1) {
                tally(&mut report, running.join_next().await);
            }
            let (outbox, sender, config) = (self.outbox.clone(), self.sender.clone(), self.config);
            running.spawn(async move { attempt(&outbox, &*sender, &config, leased).await });
        }
        while let Some(done) = running.join_next().await {
            tally(&mut report, Some(done));
        }
        Ok(report)
    }

    /// Runs until `shutdown` completes: a full batch is followed at once by the next, an
    /// empty or partial one by a pause of `idle_poll`. The batch in hand is finished before it
    /// stops. A database error pauses the relay (1 s doubling to 30 s); a closed pool stops it.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut error_pause = Duration::from_secs(1);
        let mut gauge_at = Instant::now();
        loop {
            if tokio::time::timeout(Duration::ZERO, &mut shutdown).await.is_ok() {
                return;
            }
            let pause = match self.run_once().await {
                Ok(report) => {
                    error_pause = Duration::from_secs(1);
                    if report.claimed >= self.config.batch.max(1) { Duration::ZERO } else { self.config.idle_poll }
                }
                Err(error) if error.pool_closed() => return,
                Err(error) => {
                    tracing::warn!(%error, "outbox relay: claiming events failed; pausing");
                    let pause = error_pause;
                    error_pause = (error_pause * 2).min(Duration::from_secs(30));
                    pause
                }
            };
            if Instant::now() >= gauge_at {
                gauge_at = Instant::now() + Duration::from_secs(1);
                self.publish_oldest_pending().await;
            }
            if !pause.is_zero() && tokio::time::timeout(pause, &mut shutdown).await.is_ok() {
                return;
            }
        }
    }

    /// Sets `outbox_oldest_pending_seconds` (feature `metrics`; 0 when nothing is pending).
    async fn publish_oldest_pending(&self) {
        #[cfg(feature = "metrics")]
        if let Ok(oldest) = self.outbox.oldest_pending().await {
            metrics::gauge!(OLDEST_PENDING).set(oldest.unwrap_or_default().as_secs_f64());
        }
    }
}

/// The counter of attempts' ends, labelled `result` = `delivered`, `failed` (retried later) or
/// `dead`.
#[cfg(feature = "metrics")]
const EVENTS_TOTAL: &str = "outbox_events_total";
/// The gauge of the oldest pending event's age, in seconds.
#[cfg(feature = "metrics")]
const OLDEST_PENDING: &str = "outbox_oldest_pending_seconds";

/// How one attempt ended, as far as the relay could record it.
enum Ended {
    Delivered,
    Retried,
    Dead,
    Unrecorded,
}

fn tally(report: &mut BatchReport, done: Option<Result<Ended, tokio::task::JoinError>>) {
    match done {
        Some(Ok(Ended::Delivered)) => report.delivered += 1,
        Some(Ok(Ended::Retried)) => report.retried += 1,
        Some(Ok(Ended::Dead)) => report.dead += 1,
        // A sender that panicked: its event is delivered again after the lease.
        Some(Ok(Ended::Unrecorded) | Err(_)) => report.unrecorded += 1,
        None => {}
    }
}

/// Delivers one leased event and writes the attempt's end.
async fn attempt<O: OutboxStore, S: Sender>(outbox: &O, sender: &S, config: &RelayConfig, leased: Leased) -> Ended {
    let sent = match tokio::time::timeout(config.effective_send_timeout(), sender.send(&leased.event)).await {
        Ok(sent) => sent,
        Err(_) => Err(SendError::Timeout),
    };
    let (finish, ended) = match sent {
        Ok(()) => (Finish::Delivered, Ended::Delivered),
        // The deadline counts from enqueue: an event that has failed for that long is parked.
        Err(error) if leased.event.age >= config.deadline => (Finish::Dead { error: error.to_string() }, Ended::Dead),
        Err(error) => {
            let after = config.backoff(leased.event.attempt);
            (Finish::Retry { after, error: error.to_string() }, Ended::Retried)
        }
    };
    match outbox.finish(&leased, &finish).await {
        Ok(true) => {
            count(&ended);
            ended
        }
        Ok(false) => Ended::Unrecorded,
        Err(error) => {
            tracing::warn!(%error, event_id = %leased.event.id, "outbox relay: recording an attempt failed");
            Ended::Unrecorded
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
fn count(ended: &Ended) {
    #[cfg(feature = "metrics")]
    {
        let result = match ended {
            Ended::Delivered => "delivered",
            Ended::Retried => "failed",
            Ended::Dead => "dead",
            Ended::Unrecorded => return,
        };
        metrics::counter!(EVENTS_TOTAL, "result" => result).increment(1);
    }
}

impl OutboxError {
    /// The pool was closed (the application is shutting down).
    fn pool_closed(&self) -> bool {
        #[cfg(any(feature = "postgres", feature = "sqlite"))]
        if let OutboxError::Unavailable(error) = self {
            return matches!(error.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolClosed));
        }
        false
    }
}
