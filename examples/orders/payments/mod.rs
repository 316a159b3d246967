//! Payments through a provider, with zero double charges: `POST /orders/{order_id}/payments`.
//!
//! A charge is a side effect the database cannot roll back, so the route runs in the
//! idempotency layer's **leased** mode (operation `payments.create`, lease
//! `ORDERS_LEASE_SECS`, kept alive by the heartbeat while the handler runs), and the payment
//! attempt is a row of its own (`attempts.rs`), written before the provider is called. The
//! provider's idempotency key is the context's downstream key: the same on every retry of the
//! request and in every reconciliation.
//!
//! ## The attempt's states
//!
//! ```text
//!            insert (no live attempt on the order)
//!   (none) ─────────────────────────────────────► pending, no open call
//!   pending, no open call ──permit, before sending──► pending, open call
//!   pending, open call ──provider 201 succeeded────► succeeded   (final; 201, replayed)
//!   pending, open call ──provider 201 declined─────► declined    (final; 402, replayed)
//!   pending, open call ──provider 503 / no connection──► pending, no open call (503, released)
//!   pending, open call ──timeout / lost / 409 / unreadable──► unknown (202; record unknown)
//!   pending (process died) ──reconciler────────────► unknown
//!   unknown ──reconciler, evidence from the provider (idempotent)──► succeeded | declined
//!   unknown ──operator settles──► succeeded | declined | pending, no open call (not_executed)
//! ```
//!
//! Every change is a conditional update naming the state it expects (`attempts.rs`). A change to
//! `succeeded` or `declined` enqueues `payment.succeeded` or `payment.declined` in its own
//! transaction (built with `outbox`; see `events.rs`), whichever path made it. With a
//! provider that is not idempotent (`ORDERS_PSP_IDEMPOTENT=false`) an open call is never sent
//! again: only the provider's own "not executed" (its 503, or a connection never made) gives
//! the permit back; anything else stays `unknown` for an operator. With an idempotent one, an
//! open call may be re-sent with the same key, which the provider deduplicates.
//!
//! ## The answers
//!
//! 201 `{"payment_id", "order_id", "status": "succeeded", "charge_id", "amount_minor",
//! "currency"}` with `Location: /orders/{order_id}/payments/{payment_id}` (stored, replayed);
//! 402 `payment_declined` (stored, replayed); 202 `{"payment_id", "order_id", "status":
//! "unknown", "operation_id"}` with `Location: /operations/{operation_id}` (the record is
//! `unknown`: retries get 409 `idempotency_outcome_unknown` until it is settled, then replay);
//! 503 `payment_provider_unavailable` (released: the same key tries again with the same
//! attempt); 404 `order_not_found`; 409 `order_already_paid`; 409 `payment_in_progress`; 503
//! `payments_unavailable` when `PSP_URL` is unset.
//!
//! `GET /orders/{order_id}/payments` lists the order's attempts, `GET
//! /orders/{order_id}/payments/{payment_id}` shows one. Unknown attempts are reconciled every
//! `ORDERS_RECONCILE_SECS` by a recovery worker of their own (`reconcile.rs`); an operator
//! settles what no evidence can (`operator.rs`).

mod answer;
mod attempts;
mod config;
mod operator;
mod problems;
mod provider;
mod reconcile;
mod route;

use axum::Router;
use tower_idempotency::recovery::RecoveryWorker;
use tower_idempotency::store::{Admin, Backoff, RecordInfo};
use tower_idempotency::{BoxError, Store};

pub(crate) use config::PaymentSettings;

use super::book::created_at::CreatedAt;
use super::book::storage::OrderBook;
use super::lifecycle::Lifecycle;
pub(crate) use attempts::Attempt;
use provider::{Charge, Provider};
use reconcile::PaymentReconciler;

/// The payment route's operation name.
pub(crate) const PAYMENTS_OPERATION: &str = "payments.create";
/// The purpose the provider key is derived for.
const PROVIDER_KEY_PURPOSE: &str = "psp/charges";

/// Creates the `payment_attempts` table if it is missing.
pub(crate) async fn create_table(book: &OrderBook) -> Result<(), BoxError> {
    attempts::create_table(book).await
}

/// The payment routes over the leased store `records`.
pub(crate) fn routes<St: Store>(
    book: OrderBook,
    records: St,
    lifecycle: &Lifecycle,
    settings: &PaymentSettings,
) -> Router {
    route::routes(book, records, lifecycle, settings)
}

/// The operator route over `records`.
pub(crate) fn operator_routes<A: Admin>(book: OrderBook, records: A, lifecycle: &Lifecycle) -> Router {
    operator::routes(book, records, lifecycle.retention())
}

/// The recovery worker of the payment records, every `ORDERS_RECONCILE_SECS`, with the payment
/// reconciler; `None` when payments are off. It takes no census of the records: the service's
/// own worker does (`recovery.rs`, at most every `ORDERS_CENSUS_SECS`), and a census every few
/// seconds would read the whole records table that often. Its passes count the open records
/// alone, from their index.
pub(crate) fn worker<St: Store + Admin>(
    records: St,
    book: &OrderBook,
    lifecycle: &Lifecycle,
    settings: &PaymentSettings,
) -> Option<RecoveryWorker<St>> {
    let provider = Provider::new(settings.provider.as_ref()?, settings.timeout);
    let reconciler = PaymentReconciler { book: book.clone(), provider, idempotent: settings.idempotent };
    let every = settings.reconcile_every;
    Some(
        RecoveryWorker::new(records)
            .every(every)
            // Every unknown payment is looked at again each period, not less and less often.
            .backoff(Backoff { first: every, max: every })
            .retention(lifecycle.retention())
            .without_census()
            // A lookup and a re-sent charge, each bounded by the provider timeout.
            .reconcile_timeout(settings.timeout * 3)
            .reconciler(PAYMENTS_OPERATION, move |record: RecordInfo| reconciler.clone().reconcile(record)),
    )
}

/// Settles `attempt` from the provider's `charge` (conditional on its being pending or
/// unknown) and returns the attempt as it is now.
async fn settle_from_charge(book: &OrderBook, attempt: &Attempt, charge: &Charge) -> Result<Attempt, sqlx::Error> {
    let now = CreatedAt::now().unix_micros();
    if charge.declined() {
        attempts::settle_declined(book, &attempt.payment_id, Some(&charge.charge_id), now).await?;
    } else {
        attempts::settle_succeeded(book, &attempt.payment_id, &charge.charge_id, now).await?;
    }
    Ok(attempts::by_id(book, &attempt.payment_id).await?.unwrap_or_else(|| attempt.clone()))
}

#[cfg(test)]
mod tests {
    use sqlx::sqlite::SqlitePoolOptions;
    use tower_idempotency::MemoryStore;

    use super::*;

    #[tokio::test]
    async fn the_payment_worker_counts_the_open_records_alone() {
        let pool = SqlitePoolOptions::new().connect("sqlite::memory:").await.expect("a pool");
        let settings = PaymentSettings::from_vars(|name| (name == "PSP_URL").then(|| "http://127.0.0.1:9".to_owned()))
            .expect("payments on");
        let worker = worker(MemoryStore::new(), &OrderBook::Sqlite(pool), &Lifecycle::default(), &settings)
            .expect("payments on");
        for _ in 0..2 {
            let pass = worker.run_once().await.expect("a pass");
            assert!(!pass.census, "{pass:?}");
            assert!(pass.counts.is_some(), "the open records still counted: {pass:?}");
        }
    }
}
