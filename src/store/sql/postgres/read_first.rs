//! Whether an atomic claim on [`PostgresStore`](super::PostgresStore) reads the record first.
//!
//! Reading first makes a retry of a finished request cheap (one plain read, no transaction, no
//! lock), and costs a new key one more statement on the records table and one more round trip.
//! Claiming first (migration 8's `<table>_claim_first`) is the other way round: a new key costs
//! one statement, and a retry two round trips (the claim refused, then the read). Which is
//! cheaper depends on how many requests find a record, so by default the store counts them.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// When an atomic-mode [`PostgresStore`](super::PostgresStore) reads a request's record before
/// it claims the identity ([`PostgresStore::read_before_claim`](super::PostgresStore::read_before_claim)).
///
/// Both ways keep every guarantee: the claim waits for a concurrent claimant and refuses when
/// a live record is there, whether or not a read came first. Only the cost moves:
///
/// | | a new key | a retry of a finished request |
/// |---|---|---|
/// | read first | the read, then `BEGIN` with the claim | the read alone |
/// | claim first | `BEGIN` with the claim | `BEGIN` with the claim (refused), then `ROLLBACK` with the read |
///
/// Claiming first needs migration 8 ([`PostgresStore::migrate`](super::PostgresStore::migrate)
/// creates it). A store whose database lacks it reads first again from the first refusal on
/// (that request answers 503 `idempotency_store_unavailable`, and its retry goes through).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReadBeforeClaim {
    /// Read first while at least a third of the store's recent atomic requests found a record
    /// (retries, conflicts, requests still in flight), claim first otherwise. A store starts by
    /// reading first, and counts its requests with a decay of half every 256.
    #[default]
    Adaptive,
    /// Always read first: retries are as cheap as they can be.
    Always,
    /// Never read first: new keys are as cheap as they can be.
    Never,
}

/// Requests counted before [`ReadBeforeClaim::Adaptive`] may claim first.
const WARM_UP: u32 = 32;

/// When the count reaches this, both counts are halved: what happened long ago weighs less.
const DECAY_AT: u32 = 256;

/// A store's choice, and for [`ReadBeforeClaim::Adaptive`] what it has seen (shared by the
/// store's clones).
#[derive(Debug, Default)]
pub(super) struct ReadFirst {
    policy: ReadBeforeClaim,
    /// Atomic requests counted, and of them those that found a record.
    seen: AtomicU32,
    found: AtomicU32,
    /// The database has no `<table>_claim_first` function (migration 8 has not run).
    unmigrated: AtomicBool,
}

impl ReadFirst {
    pub(super) fn new(policy: ReadBeforeClaim) -> Self {
        Self { policy, ..Self::default() }
    }

    pub(super) fn policy(&self) -> ReadBeforeClaim {
        self.policy
    }

    /// Whether the next request reads its record before it claims.
    pub(super) fn reads_first(&self) -> bool {
        if self.unmigrated.load(Ordering::Relaxed) {
            return true;
        }
        match self.policy {
            ReadBeforeClaim::Always => true,
            ReadBeforeClaim::Never => false,
            ReadBeforeClaim::Adaptive => {
                let (seen, found) = (self.seen.load(Ordering::Relaxed), self.found.load(Ordering::Relaxed));
                seen < WARM_UP || found.saturating_mul(3) >= seen
            }
        }
    }

    /// Counts a request that found a record (`found`) or claimed a new identity.
    pub(super) fn observe(&self, found: bool) {
        if self.policy != ReadBeforeClaim::Adaptive {
            return;
        }
        if found {
            self.found.fetch_add(1, Ordering::Relaxed);
        }
        // Racing clones may halve twice or count across a halving: the counts stay a rough
        // recent share, which is all the choice needs.
        if self.seen.fetch_add(1, Ordering::Relaxed) + 1 >= DECAY_AT {
            self.seen.store(DECAY_AT / 2, Ordering::Relaxed);
            let found = self.found.load(Ordering::Relaxed);
            self.found.store((found / 2).min(DECAY_AT / 2), Ordering::Relaxed);
        }
    }

    /// [`observe`](Self::observe), unless this request was counted already (`observed`).
    pub(super) fn observe_once(&self, observed: &mut bool, found: bool) {
        if !std::mem::replace(observed, true) {
            self.observe(found);
        }
    }

    /// The database lacks migration 8: read first from now on.
    pub(super) fn unmigrated(&self) {
        self.unmigrated.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(read_first: &ReadFirst, new_keys: u32, found: u32) {
        for _ in 0..new_keys {
            read_first.observe(false);
        }
        for _ in 0..found {
            read_first.observe(true);
        }
    }

    #[test]
    fn adaptive_reads_first_until_it_has_seen_enough_new_keys() {
        let read_first = ReadFirst::new(ReadBeforeClaim::Adaptive);
        assert!(read_first.reads_first(), "a fresh store reads first");
        seen(&read_first, WARM_UP - 1, 0);
        assert!(read_first.reads_first(), "still warming up");
        seen(&read_first, 1, 0);
        assert!(!read_first.reads_first(), "only new keys: claim first");
    }

    #[test]
    fn adaptive_goes_back_to_reading_first_when_retries_come() {
        let read_first = ReadFirst::new(ReadBeforeClaim::Adaptive);
        seen(&read_first, 2_000, 0);
        assert!(!read_first.reads_first());
        // A burst of retries: the share passes a third within a few dozen of them, because the
        // counts decay.
        let mut retries = 0;
        while !read_first.reads_first() {
            read_first.observe(true);
            retries += 1;
            assert!(retries < 300, "still claiming first after {retries} retries");
        }
        // And back to claiming first once new keys are most of the traffic again.
        seen(&read_first, 2_000, 0);
        assert!(!read_first.reads_first());
    }

    #[test]
    fn a_mix_of_a_fifth_retries_claims_first_and_of_a_half_reads_first() {
        let fifth = ReadFirst::new(ReadBeforeClaim::Adaptive);
        let half = ReadFirst::new(ReadBeforeClaim::Adaptive);
        for _ in 0..1_000 {
            seen(&fifth, 4, 1);
            seen(&half, 1, 1);
        }
        assert!(!fifth.reads_first());
        assert!(half.reads_first());
    }

    #[test]
    fn fixed_choices_ignore_what_they_see_and_a_missing_migration_reads_first() {
        let always = ReadFirst::new(ReadBeforeClaim::Always);
        let never = ReadFirst::new(ReadBeforeClaim::Never);
        seen(&always, 1_000, 0);
        seen(&never, 0, 1_000);
        assert!(always.reads_first());
        assert!(!never.reads_first());
        never.unmigrated();
        assert!(never.reads_first());
    }
}
