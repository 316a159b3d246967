//! The reconciler of `payments.create`: it settles the `unknown` records of the payment route
//! from evidence, through the attempt row (the single source of truth for the answer).
//!
//! Given an `unknown` record, it finds the attempt by the record's operation id:
//!
//! - no attempt: the handler died before it wrote one, so nothing was sent. Not executed: the
//!   record is released and the next retry executes.
//! - `succeeded` or `declined`: the record settles with the answer the handler would have given.
//! - `pending` or `unknown`, provider **idempotent**: the attempt is marked `unknown`, then the
//!   provider is asked by the attempt's key. A charge found settles the attempt and the record.
//!   No charge: the call is re-sent with the **same** key (the provider deduplicates; while the
//!   first call is still in flight there, its own 409 keeps the attempt unknown). No answer:
//!   still unknown, asked again at the next look (every `ORDERS_RECONCILE_SECS`).
//! - `pending` with no open call, provider **not idempotent**: nothing was sent (the permit is
//!   taken before sending), so not executed: the record is released, the attempt stays pending.
//! - `pending` with an open call or `unknown`, provider **not idempotent**: the provider is never
//!   called again: the attempt is marked `unknown` and stays so, with its record, until an
//!   operator settles it (`POST /admin/payments/{payment_id}/settle`). The seed's at-most-once
//!   permit.

use tower_idempotency::recovery::Reconciliation;
use tower_idempotency::store::RecordInfo;

use super::super::book::storage::OrderBook;
use super::attempts::{self, Attempt};
use super::provider::{Charged, Looked, Provider};
use super::{answer, settle_from_charge};

/// What the reconciler needs.
#[derive(Clone)]
pub(crate) struct PaymentReconciler {
    pub(crate) book: OrderBook,
    pub(crate) provider: Provider,
    pub(crate) idempotent: bool,
}

impl PaymentReconciler {
    /// Looks at one `unknown` record of `payments.create`.
    pub(crate) async fn reconcile(self, record: RecordInfo) -> Reconciliation {
        let attempt = match attempts::by_operation(&self.book, &record.operation_id).await {
            Ok(Some(attempt)) => attempt,
            Ok(None) => return Reconciliation::NotExecuted,
            Err(error) => return still_unknown("read the attempt", &error),
        };
        if let Some(settled) = settled(&attempt) {
            return settled;
        }
        if !self.idempotent {
            if attempt.state == "pending" && !attempt.call_open() {
                return Reconciliation::NotExecuted;
            }
            if let Err(error) = attempts::mark_unknown(&self.book, &attempt.payment_id).await {
                return still_unknown("mark the attempt unknown", &error);
            }
            // Re-read: a late answer may have settled it meanwhile.
            return self.reread(&attempt).await;
        }
        if let Err(error) = attempts::mark_unknown(&self.book, &attempt.payment_id).await {
            return still_unknown("mark the attempt unknown", &error);
        }
        let charge = match self.provider.lookup(&attempt.provider_key).await {
            Looked::Found(charge) => charge,
            Looked::Failed(why) => return still_unknown("look the charge up", &why),
            Looked::None => {
                match self
                    .provider
                    .charge(&attempt.provider_key, &attempt.amount_minor, &attempt.currency, &attempt.order_id)
                    .await
                {
                    Charged::Done(charge) => charge,
                    Charged::NotExecuted => return Reconciliation::StillUnknown,
                    Charged::Unknown(why) => return still_unknown("re-send the charge", &why),
                }
            }
        };
        match settle_from_charge(&self.book, &attempt, &charge).await {
            Ok(now) => settled(&now).unwrap_or(Reconciliation::StillUnknown),
            Err(error) => still_unknown("record the charge", &error),
        }
    }

    async fn reread(&self, attempt: &Attempt) -> Reconciliation {
        match attempts::by_id(&self.book, &attempt.payment_id).await {
            Ok(Some(now)) => settled(&now).unwrap_or(Reconciliation::StillUnknown),
            Ok(None) => Reconciliation::StillUnknown,
            Err(error) => still_unknown("read the attempt", &error),
        }
    }
}

/// The record's settlement for a settled attempt.
fn settled(attempt: &Attempt) -> Option<Reconciliation> {
    match attempt.state.as_str() {
        "succeeded" => Some(Reconciliation::Completed(answer::succeeded(attempt))),
        "declined" => Some(Reconciliation::Failed(answer::declined(attempt))),
        _ => None,
    }
}

fn still_unknown(step: &str, error: &dyn std::fmt::Display) -> Reconciliation {
    eprintln!("orders: the payment reconciler could not {step}: {error}");
    Reconciliation::StillUnknown
}
