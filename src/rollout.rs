//! Rolling the layer out: the [`RolloutMode`] (enforce, shadow, off) and the enforced
//! [`Cohort`], both held by a [`RolloutSwitch`] that an operator changes at run time.
//!
//! A guarded request's mode is decided from its scope, once the scope is known:
//!
//! | switch's mode | cohort | request in the cohort | request outside it |
//! |---|---|---|---|
//! | `Enforce` | any | enforced | enforced |
//! | `Shadow` or `Off` | none | the switch's mode | the switch's mode |
//! | `Shadow` or `Off` | set | enforced | the switch's mode |
//!
//! A request whose scope cannot be determined is outside every cohort.
//!
//! What each mode does:
//!
//! - **`Enforce`**: the contract: claim, replay, refuse.
//! - **`Shadow`**: the request takes the old path (as in `Off`) and its answer is never changed,
//!   replayed or refused. The layer still reads the key and the scope, buffers the body and
//!   computes the fingerprint; nothing more happens before the handler runs, and nothing is
//!   written while the request waits. Once the answer has been produced (and the old path's
//!   transaction committed or rolled back, by the same rule: a *released* answer records
//!   nothing; a stored failure rolls back and is recorded as `failed`), the request is queued
//!   for the layer's shadow log, whose writer task records the queued requests under their
//!   shadow identities in batches, every second by default, with one call of the store
//!   ([`Store::record_shadow`](crate::Store::record_shadow); on the SQL stores one statement),
//!   off the requests' path ([`IdempotencyLayer::shadow_log`](crate::IdempotencyLayer::shadow_log)),
//!   in the layer's store or in one of its own
//!   ([`IdempotencyLayer::shadow_store`](crate::IdempotencyLayer::shadow_store): on SQLite, a
//!   second file keeps the batches off the write lock the old path's writes need).
//!   What enforce mode would have done is counted in `idempotency_shadow_total` and logged at
//!   debug once the batch is recorded. A store failure is counted (`store_unavailable`) and
//!   changes nothing else: the handler's writes committed long before. One exception
//!   to "never changes the answer": a body that cannot be read whole (over the limit without a
//!   `Content-Length`, broken, or late) cannot be handed on, and is answered as enforce mode
//!   answers it; a body refused before it is read (over the limit by its `Content-Length`, or
//!   over the buffer budget) is counted and handed on untouched.
//! - **`Off`**: the kill switch: the request takes the old path, as if the layer were absent.
//!
//! **The old path** (in `Shadow` and `Off`): a handler written for atomic mode keeps working.
//! When the store is an atomic SQL store, the handler still gets a `TxHandle`: a plain
//! transaction from the same store ([`Store::plain_transaction`](crate::Store::plain_transaction)),
//! with no claim and no stored answer. It commits when the handler is done, by the same rule as
//! atomic mode (an answer that would be *complete*, or whose outcome is *unknown*, commits; one
//! that would be *released* or *stored as a failure* rolls back), and the answer leaves only
//! after the COMMIT. The handler also gets an
//! [`IdempotencyContext`](crate::IdempotencyContext) when the request carries a valid key and a
//! scope, with the same operation id as in enforce mode, so business rows keep their link to
//! the request.
//!
//! **Shadow records are kept apart** from enforced ones: they are stored under a separate
//! identity, [`RecordId::shadow`](crate::RecordId::shadow), a one-way derivation of the
//! enforced identity's digest. Enforce mode never looks one up, so turning enforcement on later
//! never replays an answer that shadow mode saw (the first enforced request with a key runs
//! the handler).
//!
//! ```
//! use tower_idempotency::{Cohort, IdempotencyLayer, MemoryStore, RolloutMode, RolloutSwitch};
//!
//! let switch = RolloutSwitch::new(RolloutMode::Shadow);
//! let layer = IdempotencyLayer::new(MemoryStore::new()).rollout(switch.clone());
//! // Tenants acct_1 and acct_2 are enforced; everyone else stays in shadow mode.
//! switch.set_cohort(Some(Cohort::scopes(["acct_1", "acct_2"])));
//! // On trouble: everyone back to the old path.
//! switch.set(RolloutMode::Off);
//! switch.set_cohort(None);
//! # drop(layer);
//! ```

use std::collections::HashSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, RwLock};

use crate::key::Scope;

/// How the layer treats guarded requests, switchable at run time through a [`RolloutSwitch`].
/// See the [module docs](crate::rollout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RolloutMode {
    /// Keep the contract: claim, replay, refuse.
    Enforce,
    /// The kill switch: every request takes the old path, as if the layer were absent (a
    /// handler that takes a `TxHandle` still gets a plain transaction from an atomic store).
    Off,
    /// Record and count what enforce mode would have done, in `idempotency_shadow_total`, and
    /// answer exactly as `Off` does.
    Shadow,
}

impl RolloutMode {
    /// `enforce`, `shadow` or `off`.
    pub const fn as_str(self) -> &'static str {
        match self {
            RolloutMode::Enforce => "enforce",
            RolloutMode::Off => "off",
            RolloutMode::Shadow => "shadow",
        }
    }

    /// The mode named `enforce`, `shadow` or `off`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "enforce" => Some(RolloutMode::Enforce),
            "shadow" => Some(RolloutMode::Shadow),
            "off" => Some(RolloutMode::Off),
            _ => None,
        }
    }

    fn from_u8(value: u8) -> Self {
        match value {
            v if v == RolloutMode::Off as u8 => RolloutMode::Off,
            v if v == RolloutMode::Shadow as u8 => RolloutMode::Shadow,
            _ => RolloutMode::Enforce,
        }
    }
}

/// The enforced cohort: a predicate over a request's scope. Requests whose scope it accepts
/// are enforced whatever the switch's mode; see the [module docs](crate::rollout).
#[derive(Clone)]
pub struct Cohort {
    accepts: Arc<dyn Fn(&Scope) -> bool + Send + Sync>,
    /// The scopes, when the cohort is a list of them (for an admin endpoint to show).
    listed: Option<Arc<[String]>>,
}

impl Cohort {
    /// The cohort of the scopes (typically tenant ids) listed.
    pub fn scopes<I>(scopes: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let mut listed: Vec<String> = scopes.into_iter().map(Into::into).collect();
        listed.sort();
        listed.dedup();
        let set: HashSet<String> = listed.iter().cloned().collect();
        Self { accepts: Arc::new(move |scope: &Scope| set.contains(scope.as_str())), listed: Some(listed.into()) }
    }

    /// The cohort of the scopes `accepts` returns true for.
    pub fn with(accepts: impl Fn(&Scope) -> bool + Send + Sync + 'static) -> Self {
        Self { accepts: Arc::new(accepts), listed: None }
    }

    /// Whether `scope` is in the cohort.
    pub fn contains(&self, scope: &Scope) -> bool {
        (self.accepts)(scope)
    }

    /// The scopes of a cohort made with [`scopes`](Self::scopes), sorted; `None` for a
    /// predicate.
    pub fn listed(&self) -> Option<&[String]> {
        self.listed.as_deref()
    }
}

impl std::fmt::Debug for Cohort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.listed {
            // Only the count: scopes are tenant ids, which do not belong in logs.
            Some(listed) => write!(f, "Cohort({} scopes)", listed.len()),
            None => f.write_str("Cohort(predicate)"),
        }
    }
}

/// A shared, run-time switch of the [`RolloutMode`] and the enforced [`Cohort`]. Clones share
/// one setting, so an admin endpoint or a config watcher can change it without a restart; a
/// change applies to the next request.
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, RolloutMode, RolloutSwitch};
/// let switch = RolloutSwitch::new(RolloutMode::Enforce);
/// let layer = IdempotencyLayer::new(MemoryStore::new()).rollout(switch.clone());
/// switch.set(RolloutMode::Off); // every request now takes the old path
/// assert_eq!(switch.get(), RolloutMode::Off);
/// # drop(layer);
/// ```
#[derive(Debug, Clone)]
pub struct RolloutSwitch(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    mode: AtomicU8,
    cohort: RwLock<Option<Cohort>>,
}

impl RolloutSwitch {
    /// A switch set to `mode`, with no cohort.
    pub fn new(mode: RolloutMode) -> Self {
        Self(Arc::new(Shared { mode: AtomicU8::new(mode as u8), cohort: RwLock::new(None) }))
    }

    /// Changes the mode for every service sharing this switch.
    pub fn set(&self, mode: RolloutMode) {
        self.0.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// The current mode (for requests outside the cohort).
    pub fn get(&self) -> RolloutMode {
        RolloutMode::from_u8(self.0.mode.load(Ordering::Relaxed))
    }

    /// Sets the enforced cohort (`None`: every request gets the switch's mode).
    pub fn set_cohort(&self, cohort: Option<Cohort>) {
        *self.0.cohort.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = cohort;
    }

    /// The enforced cohort, if any.
    pub fn cohort(&self) -> Option<Cohort> {
        self.0.cohort.read().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// The mode of a request with `scope` (`None`: the scope could not be determined, so the
    /// request is outside every cohort).
    pub fn mode_for(&self, scope: Option<&Scope>) -> RolloutMode {
        let mode = self.get();
        if mode == RolloutMode::Enforce {
            return mode;
        }
        let Some(scope) = scope else { return mode };
        let cohort = self.0.cohort.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        match cohort.as_ref() {
            Some(cohort) if cohort.contains(scope) => RolloutMode::Enforce,
            _ => mode,
        }
    }
}

impl Default for RolloutSwitch {
    fn default() -> Self {
        Self::new(RolloutMode::Enforce)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cohort_is_enforced_and_everyone_else_gets_the_switch_mode() {
        let switch = RolloutSwitch::new(RolloutMode::Shadow);
        let (in_cohort, outside) = (Scope::new("acct_1"), Scope::new("acct_9"));
        assert_eq!(switch.mode_for(Some(&in_cohort)), RolloutMode::Shadow);
        switch.set_cohort(Some(Cohort::scopes(["acct_1", "acct_2"])));
        assert_eq!(switch.mode_for(Some(&in_cohort)), RolloutMode::Enforce);
        assert_eq!(switch.mode_for(Some(&outside)), RolloutMode::Shadow);
        assert_eq!(switch.mode_for(None), RolloutMode::Shadow);
        switch.set(RolloutMode::Off);
        assert_eq!(switch.mode_for(Some(&in_cohort)), RolloutMode::Enforce);
        assert_eq!(switch.mode_for(Some(&outside)), RolloutMode::Off);
        switch.set(RolloutMode::Enforce);
        assert_eq!(switch.mode_for(Some(&outside)), RolloutMode::Enforce);
        switch.set(RolloutMode::Off);
        switch.set_cohort(None);
        assert_eq!(switch.mode_for(Some(&in_cohort)), RolloutMode::Off);
    }

    #[test]
    fn modes_parse_from_their_names() {
        for mode in [RolloutMode::Enforce, RolloutMode::Shadow, RolloutMode::Off] {
            assert_eq!(RolloutMode::parse(mode.as_str()), Some(mode));
        }
        assert_eq!(RolloutMode::parse("ON"), None);
    }
}
