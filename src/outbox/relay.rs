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
    /// Claimed but not sent: the delivery could no longer have ended inside the lease (earlier
    /// deliveries of the batch were slow). They come back after their lease.
    pub deferred: usize,
}

impl<O: OutboxStore, S: Sender> Relay<O, S> {
    /// A relay over `outbox`, delivering through `sender`.
    pub fn new(outbox: O, sender: S, config: RelayConfig) -> Self {
        Self { outbox, sender: Arc::new(sender), config }
    }

    /// Claims one batch of due events, delivers it `concurrency` at a time, and writes the
    /// attempts' ends in one transaction. A delivery starts only while it can still end inside
    /// the lease (its send timeout is shorter than the lease); an event it cannot reach in time
    /// stays claimed until its lease runs out, then comes back.
    pub async fn run_once(&self) -> Result<BatchReport, OutboxError> {
        let claimed_at = Instant::now();
        let batch = self.outbox.claim(self.config.batch.max(1), self.config.lease).await?;
        let mut report = BatchReport { claimed: batch.len(), ..BatchReport::default() };
        let last_start = (claimed_at + self.config.lease).checked_sub(self.config.effective_send_timeout());
        let mut running = JoinSet::new();
        let mut ends = Vec::with_capacity(batch.len());
        for leased in batch {
            if running.len() >= self.config.concurrency.max(1) {
                collect(&mut ends, &mut report, running.join_next().await);
            }
            if last_start.is_none_or(|last| Instant::now() > last) {
                report.deferred += 1;
                continue;
            }
            let (sender, config) = (self.sender.clone(), self.config);
            running.spawn(async move {
                let finish = attempt(&*sender, &config, &leased).await;
                (leased, finish)
            });
        }
        while let Some(done) = running.join_next().await {
            collect(&mut ends, &mut report, Some(done));
        }
        if ends.is_empty() {
            return Ok(report);
        }
        match self.outbox.finish_all(&ends).await {
            Ok(written) => {
                for ((_, finish), written) in ends.iter().zip(written) {
                    if written {
                        tally(&mut report, finish);
                    } else {
                        report.unrecorded += 1;
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, "outbox relay: recording a batch's attempts failed; they come back after the lease");
                report.unrecorded += ends.len();
            }
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

/// Keeps a finished attempt's end; a sender that panicked leaves its event to come back after
/// the lease.
fn collect(
    ends: &mut Vec<(Leased, Finish)>,
    report: &mut BatchReport,
    done: Option<Result<(Leased, Finish), tokio::task::JoinError>>,
) {
    match done {
        Some(Ok(end)) => ends.push(end),
        Some(Err(_)) => report.unrecorded += 1,
        None => {}
    }
}

/// Counts a recorded end in the report and in `outbox_events_total`.
fn tally(report: &mut BatchReport, finish: &Finish) {
    let result = match finish {
        Finish::Delivered => {
            report.delivered += 1;
            "delivered"
        }
        Finish::Retry { .. } => {
            report.retried += 1;
            "failed"
        }
        Finish::Dead { .. } => {
            report.dead += 1;
            "dead"
        }
    };
    #[cfg(feature = "metrics")]
    metrics::counter!(EVENTS_TOTAL, "result" => result).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// Delivers one leased event: how its attempt ends.
async fn attempt<S: Sender>(sender: &S, config: &RelayConfig, leased: &Leased) -> Finish {
    let sent = match tokio::time::timeout(config.effective_send_timeout(), sender.send(&leased.event)).await {
        Ok(sent) => sent,
        Err(_) => Err(SendError::Timeout),
    };
    match sent {
        Ok(()) => Finish::Delivered,
        // The deadline counts from enqueue: an event that has failed for that long is parked.
        Err(error) if leased.event.age >= config.deadline => Finish::Dead { error: error.to_string() },
        Err(error) => Finish::Retry { after: config.backoff(leased.event.attempt), error: error.to_string() },
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
