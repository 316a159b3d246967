//! [`BufferBudget`]: how many bytes of request bodies the layer may hold in memory at once,
//! across every request and (by default) every layer of the process.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// A budget of bytes for the request bodies that idempotency layers buffer at the same time.
///
/// Before a guarded request's body is read, the layer reserves its `Content-Length`; a
/// request whose reservation does not fit is refused at once, before its body is read, with
/// 503 `idempotency_buffer_budget_exhausted` and `Retry-After`. A body without
/// `Content-Length` (chunked, or HTTP/2 and gRPC, whose clients rarely send one) is charged as
/// it arrives, chunk by chunk: when the budget cannot take the next chunk, the request is
/// refused with the same 503 and what was read is dropped. The reservation is given back when
/// the handler has answered (the buffered body goes to the handler), or as soon as the request
/// is refused or cancelled.
///
/// Every layer shares [`BufferBudget::process`] (64 MiB) unless it is given another with
/// [`buffer_budget`](crate::IdempotencyLayer::buffer_budget); clones of a budget share it. Keep
/// the budget above `max_request_body`, or the largest bodies are never admitted.
///
/// ```
/// use tower_idempotency::{BufferBudget, IdempotencyLayer, MemoryStore};
///
/// // One budget for every layer of this service: 16 MiB of bodies in memory at once.
/// let budget = BufferBudget::new(16 * 1024 * 1024);
/// let layer = IdempotencyLayer::new(MemoryStore::new()).buffer_budget(budget.clone());
/// assert_eq!((budget.capacity(), budget.in_use()), (16 * 1024 * 1024, 0));
/// # drop(layer);
/// ```
#[derive(Clone)]
pub struct BufferBudget(Arc<Shared>);

struct Shared {
    capacity: usize,
    in_use: AtomicUsize,
}

impl BufferBudget {
    /// The capacity of [`BufferBudget::process`]: 64 MiB.
    pub const DEFAULT_CAPACITY: usize = 64 * 1024 * 1024;

    /// A budget of its own, of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self(Arc::new(Shared { capacity, in_use: AtomicUsize::new(0) }))
    }

    /// The process-wide budget ([`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY)) that every layer
    /// uses unless it is given another.
    pub fn process() -> Self {
        static PROCESS: OnceLock<BufferBudget> = OnceLock::new();
        PROCESS.get_or_init(|| BufferBudget::new(Self::DEFAULT_CAPACITY)).clone()
    }

    /// The most bytes it admits at once.
    pub fn capacity(&self) -> usize {
        self.0.capacity
    }

    /// The bytes reserved now.
    pub fn in_use(&self) -> usize {
        self.0.in_use.load(Ordering::Acquire)
    }

    /// Reserves `bytes`, or `None` when they do not fit.
    pub(crate) fn try_reserve(&self, bytes: usize) -> Option<Reservation> {
        let shared = &self.0;
        shared
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |in_use| {
                in_use.checked_add(bytes).filter(|&total| total <= shared.capacity)
            })
            .ok()?;
        Some(Reservation { budget: self.clone(), bytes })
    }
}

impl fmt::Debug for BufferBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferBudget").field("capacity", &self.capacity()).field("in_use", &self.in_use()).finish()
    }
}

/// Bytes reserved in a [`BufferBudget`], given back when dropped.
pub(crate) struct Reservation {
    budget: BufferBudget,
    bytes: usize,
}

impl Reservation {
    /// Grows the reservation to `bytes`; false, and unchanged, when that does not fit.
    pub(crate) fn grow_to(&mut self, bytes: usize) -> bool {
        if bytes <= self.bytes {
            return true;
        }
        match self.budget.try_reserve(bytes - self.bytes) {
            Some(mut more) => {
                // The two become one: this reservation gives the whole back when dropped.
                more.bytes = 0;
                self.bytes = bytes;
                true
            }
            None => false,
        }
    }

    /// Gives back all but `bytes` of the reservation (nothing when it holds no more).
    pub(crate) fn shrink_to(&mut self, bytes: usize) {
        if bytes < self.bytes {
            self.budget.0.in_use.fetch_sub(self.bytes - bytes, Ordering::AcqRel);
            self.bytes = bytes;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_the_capacity_and_are_given_back_when_dropped_or_shrunk() {
        let budget = BufferBudget::new(10);
        let mut six = budget.try_reserve(6).unwrap();
        assert!(budget.try_reserve(5).is_none(), "6 + 5 is over 10");
        let four = budget.try_reserve(4).unwrap();
        assert_eq!(budget.in_use(), 10);
        assert!(budget.try_reserve(1).is_none());
        assert!(budget.try_reserve(0).is_some(), "nothing always fits");
        assert!(!six.grow_to(7), "6 + 4 is the whole budget");
        six.shrink_to(2);
        assert_eq!(budget.in_use(), 6);
        six.shrink_to(5);
        assert_eq!((six.bytes, budget.in_use()), (2, 6), "a reservation never grows");
        drop(four);
        assert!(six.grow_to(9));
        assert_eq!(budget.in_use(), 9);
        drop(six);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.try_reserve(11).is_none());
        assert!(budget.try_reserve(usize::MAX).is_none());
    }

    #[test]
    fn the_process_budget_is_one_budget() {
        let (a, b) = (BufferBudget::process(), BufferBudget::process());
        assert!(Arc::ptr_eq(&a.0, &b.0));
        assert_eq!(a.capacity(), BufferBudget::DEFAULT_CAPACITY);
    }
}
