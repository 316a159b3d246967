//! The recovery worker, run by the service every `ORDERS_JANITOR_SECS` (default 60) until it
//! stops: it turns `processing` records whose lease ran out (their process died) into
//! `unknown`, asks the registered reconcilers about `unknown` records, and purges what is past
//! its retention (`ORDERS_RETENTION_SECS`, `ORDERS_TOMBSTONE_SECS`). See the crate's
//! `recovery` module for what one pass does, and how several instances of the service share
//! the work.
//!
//! `POST /orders` is atomic and never leaves a `processing` or `unknown` record behind, so it
//! registers no reconciler; an `unknown` record of it could only come from an operator's hands
//! (and is settled by them, `POST /admin/idempotency/record/settle`). The crash drill's leased
//! route registers one (`drill.rs`). The payments have a worker of their own, every
//! `ORDERS_RECONCILE_SECS`, with the payment reconciler (`payments/mod.rs`); it runs beside this
//! one over the same records, which the crate's worker allows.
//!
//! Each pass ends by counting the records by state for the `idempotency_records` gauges: a
//! census of every record at every pass, or at most every `ORDERS_CENSUS_SECS` if that is set
//! (the passes between count the open records alone, from their index).
//!
//! What a pass did is written to stderr when it did anything; a pass that fails is written
//! there too, and the next one tried. On shutdown the pass in progress stops between two store
//! calls (every step is safe to repeat), before the database connections close.

use std::future::Future;

#[cfg(feature = "postgres")]
use tower_idempotency::PostgresStore;
use tower_idempotency::SqliteStore;
use tower_idempotency::Store;
use tower_idempotency::recovery::{RecoveryReport, RecoveryWorker};
use tower_idempotency::store::{Admin, RecordInfo};

use super::book::storage::OrderBook;
use super::drill::{self, DRILL_OPERATION};
use super::lifecycle::Lifecycle;

/// The service's recovery worker, over its database's idempotency store.
pub(crate) enum Recovery {
    /// Over the SQLite store.
    Sqlite(RecoveryWorker<SqliteStore>),
    /// Over the PostgreSQL store.
    #[cfg(feature = "postgres")]
    Postgres(RecoveryWorker<PostgresStore>),
}

/// A worker over `store` with the service's lifecycle, and the drill's reconciler if the
/// drill is on.
pub(crate) fn worker<St: Store + Admin>(
    store: St,
    lifecycle: &Lifecycle,
    drill_on: Option<&OrderBook>,
) -> RecoveryWorker<St> {
    let worker = RecoveryWorker::new(store).every(lifecycle.janitor_every).retention(lifecycle.retention());
    let worker = match lifecycle.census_every {
        Some(every) => worker.census_every(every),
        None => worker,
    };
    let worker = match lifecycle.purge_rate {
        Some(rate) => worker.purge_rate(rate),
        None => worker,
    };
    match drill_on {
        None => worker,
        Some(book) => {
            let book = book.clone();
            worker.reconciler(DRILL_OPERATION, move |record: RecordInfo| drill::reconcile(book.clone(), record))
        }
    }
}

impl Recovery {
    /// Runs a pass every `ORDERS_JANITOR_SECS` until `shutdown` resolves.
    pub(crate) async fn run(self, every: std::time::Duration, shutdown: impl Future<Output = ()>) {
        match self {
            Self::Sqlite(worker) => run(worker, every, shutdown).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(worker) => run(worker, every, shutdown).await,
        }
    }
}

/// The loop: a pass, then a pause, each cut short by `shutdown`.
async fn run<St: Store + Admin>(
    worker: RecoveryWorker<St>,
    every: std::time::Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            pass = worker.run_once() => match pass {
                Ok(report) => log(&report),
                Err(error) => eprintln!("orders: a recovery pass failed, trying again in {every:?}: {error}"),
            },
        }
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// Writes what a pass did to stderr, if it did anything.
fn log(report: &RecoveryReport) {
    let acted = report.marked_unknown + report.released + report.reconciled + report.superseded + report.purged;
    if acted == 0 && report.still_unknown == 0 {
        return;
    }
    eprintln!(
        "orders: recovery: {} stale leases marked unknown, {} reconciled, {} released, {} still unknown, \
         {} superseded, {} purged",
        report.marked_unknown,
        report.reconciled,
        report.released,
        report.still_unknown,
        report.superseded,
        report.purged
    );
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tower_idempotency::MemoryStore;

    use super::*;

    /// Whether each of three passes of the service's worker, with `lifecycle`, took a census.
    async fn censuses(lifecycle: Lifecycle) -> Vec<bool> {
        let worker = worker(MemoryStore::new(), &lifecycle, None);
        let mut taken = Vec::new();
        for _ in 0..3 {
            taken.push(worker.run_once().await.expect("a pass").census);
        }
        taken
    }

    #[tokio::test]
    async fn a_census_every_pass_unless_orders_census_secs_spaces_them() {
        assert_eq!(censuses(Lifecycle::default()).await, [true, true, true]);
        let hourly = Lifecycle { census_every: Some(Duration::from_secs(3600)), ..Lifecycle::default() };
        assert_eq!(censuses(hourly).await, [true, false, false]);
    }

    #[test]
    fn the_worker_purges_at_orders_purge_rate_when_it_is_set() {
        let unset = worker(MemoryStore::new(), &Lifecycle::default(), None);
        assert!(format!("{unset:?}").contains("purge_rate: None"), "{unset:?}");
        let paced = Lifecycle { purge_rate: Some(50_000), ..Lifecycle::default() };
        let paced = worker(MemoryStore::new(), &paced, None);
        assert!(format!("{paced:?}").contains("purge_rate: Some(50000)"), "{paced:?}");
    }
}
