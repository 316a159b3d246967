//! The in-process gates of SQLite's atomic claims: a duplicate of a claim this process holds
//! queues on its identity's gate, bounded by the in-flight wait, because the holder's
//! uncommitted row is invisible to every other connection.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

/// The identities this store's atomic claims hold in this process, each with a FIFO lock that
/// duplicates queue on.
#[derive(Debug, Default)]
pub(super) struct Gates(Mutex<HashMap<[u8; 32], Arc<tokio::sync::Mutex<()>>>>);

impl Gates {
    /// Enters the gate of `key`, waiting until `deadline` at most (an open gate is entered
    /// even when the deadline has passed). `None`: still held by someone else.
    pub(super) async fn enter(self: &Arc<Self>, key: [u8; 32], deadline: Instant) -> Option<Gate> {
        let lock = self.0.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_default().clone();
        let mut gate = Gate { gates: self.clone(), key, guard: None };
        // Dropping `gate` (on timeout or cancellation) tidies the map.
        gate.guard = tokio::time::timeout_at(deadline, lock.lock_owned()).await.ok();
        gate.guard.is_some().then_some(gate)
    }

    /// Forgets `key`'s gate once nobody holds or waits on it.
    fn tidy(&self, key: &[u8; 32]) {
        let mut gates = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if gates.get(key).is_some_and(|lock| Arc::strong_count(lock) == 1) {
            gates.remove(key);
        }
    }
}

/// A place in an identity's gate (held once `guard` is set).
pub(super) struct Gate {
    gates: Arc<Gates>,
    key: [u8; 32],
    guard: Option<OwnedMutexGuard<()>>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("held", &self.guard.is_some()).finish_non_exhaustive()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.gates.tidy(&self.key);
    }
}
