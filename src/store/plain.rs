//! The old path's transaction: what a store hands a handler in `Off` and `Shadow` mode (see
//! [`rollout`](crate::rollout)), so that a handler written for atomic mode keeps working.

use std::future::Future;
use std::pin::Pin;

use http::StatusCode;

use super::{FinishError, Retention, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::Record;

/// How a [`PlainTransaction`] ends: `true` commits, `false` rolls back.
type Finisher<H> = Box<dyn FnOnce(H, bool) -> Pin<Box<dyn Future<Output = Result<(), FinishError>> + Send>> + Send>;

/// How a [`PlainTransaction`] commits with shadow mode's record of its request.
type Recorder<H> = Box<dyn FnOnce(H, ShadowEntry) -> Pin<Box<dyn Future<Output = ShadowCommit> + Send>> + Send>;

/// What shadow mode records of a request whose handler's writes commit: its shadow identity,
/// its fingerprint and its answer's status (never the body: a shadow record is never
/// replayed). See [`PlainTransaction::commit_recording`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ShadowEntry {
    /// The request's shadow identity ([`RecordId::shadow`]).
    pub id: RecordId,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The status of the answer the handler produced.
    pub status: StatusCode,
    /// How long the record is kept: as a completed record of enforce mode.
    pub retention: Retention,
}

impl ShadowEntry {
    /// The entry of a request under `id` with `fingerprint`, answered `status`, kept for
    /// `retention`.
    pub fn new(id: RecordId, fingerprint: Fingerprint, status: StatusCode, retention: Retention) -> Self {
        Self { id, fingerprint, status, retention }
    }
}

/// What the store found under the shadow identity when it recorded a [`ShadowEntry`].
#[derive(Debug)]
#[non_exhaustive]
pub enum ShadowSeen {
    /// Nothing live held the identity: the entry is recorded (enforce mode would have
    /// executed the request).
    Recorded,
    /// A live record held it, and was kept as it is: enforce mode would have answered the
    /// request from it (a replay, or a refusal for a reused key, an expired key, ...).
    Existing(Record),
    /// A record whose request is still in flight held it (only a store that records shadow
    /// requests with a claim leaves one): enforce mode would have answered 409.
    InFlight,
    /// The shadow write failed or was not tried; the handler's writes are committed (or not)
    /// as [`ShadowCommit::committed`] says, whatever became of it.
    NotRecorded(Option<StoreError>),
}

/// The end of [`PlainTransaction::commit_recording`].
#[derive(Debug)]
pub struct ShadowCommit {
    /// The handler's writes: committed, or why not (as [`PlainTransaction::commit`]).
    pub committed: Result<(), FinishError>,
    /// What became of the shadow record.
    pub seen: ShadowSeen,
}

/// A plain database transaction from the store, handed to the handler as the store's claim
/// handle (a `TxHandle` for the SQL stores), with no claim in it and no answer stored: the
/// old path of a route while the layer is off or in shadow mode
/// ([`Store::plain_transaction`](super::Store::plain_transaction)).
pub struct PlainTransaction<H> {
    handle: H,
    finish: Finisher<H>,
    recorder: Option<Recorder<H>>,
}

impl<H: Clone> PlainTransaction<H> {
    /// A transaction on `handle`, ended by `finish(handle, commit)`. `finish` must fail closed
    /// the way a claim does: a handle still held by anyone but the layer rolls back with
    /// [`FinishError::HandleStillHeld`].
    pub fn new<F, Fut>(handle: H, finish: F) -> Self
    where
        F: FnOnce(H, bool) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), FinishError>> + Send + 'static,
    {
        Self { handle, finish: Box::new(move |handle, commit| Box::pin(finish(handle, commit))), recorder: None }
    }

    /// The same transaction, committed by `record(handle, entry)` when shadow mode has a
    /// request to record ([`commit_recording`](Self::commit_recording)). `record` commits the
    /// handler's writes as [`commit`](Self::commit) does, and writes the shadow record in the
    /// same transaction or right after it; a failure of the shadow write must leave the
    /// handler's writes committed (a shadow store failure never changes the answer). The SQL
    /// stores write it in the same transaction, by one prepared statement before the COMMIT.
    pub fn recording_shadow<F, Fut>(mut self, record: F) -> Self
    where
        F: FnOnce(H, ShadowEntry) -> Fut + Send + 'static,
        Fut: Future<Output = ShadowCommit> + Send + 'static,
    {
        self.recorder = Some(Box::new(move |handle, entry| Box::pin(record(handle, entry))));
        self
    }

    /// Whether this transaction records shadow requests in its commit
    /// ([`recording_shadow`](Self::recording_shadow)).
    pub fn records_shadow(&self) -> bool {
        self.recorder.is_some()
    }

    /// The handle for the handler (a clone; give it back before the layer finishes).
    pub fn handle(&self) -> H {
        self.handle.clone()
    }

    /// Commits the handler's writes.
    pub async fn commit(self) -> Result<(), FinishError> {
        (self.finish)(self.handle, true).await
    }

    /// Rolls the handler's writes back.
    pub async fn rollback(self) -> Result<(), FinishError> {
        (self.finish)(self.handle, false).await
    }

    /// Commits the handler's writes and records `entry` for shadow mode, if the store can do
    /// both at once; else only commits (the entry [`NotRecorded`](ShadowSeen::NotRecorded)).
    pub async fn commit_recording(self, entry: ShadowEntry) -> ShadowCommit {
        match self.recorder {
            Some(record) => record(self.handle, entry).await,
            None => {
                ShadowCommit { committed: (self.finish)(self.handle, true).await, seen: ShadowSeen::NotRecorded(None) }
            }
        }
    }
}

impl<H> std::fmt::Debug for PlainTransaction<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainTransaction").finish_non_exhaustive()
    }
}
