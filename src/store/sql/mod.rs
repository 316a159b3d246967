//! What the SQL stores share: the records table and its statements, the leased claim, reading
//! a record row back and deciding what it means, and the transaction handle of atomic mode.
//! What differs between PostgreSQL and SQLite is their [`Dialect`](dialect::Dialect) and
//! their atomic claims.

mod acquire;
pub(crate) mod admin;
mod answers;
mod claim;
mod deployment;
mod dialect;
mod leased;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod purge;
pub(crate) mod shadow;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;
mod statements;
pub mod tx;

use crate::name::InvalidName;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr};
use tokio::time::Instant;

pub(crate) use self::acquire::{acquire_by, begin_by};
use self::dialect::{Bound, Dialect};
use self::statements::Statements;
use self::tx::{HandleStillHeld, TxHandle};
use super::decide::{ABANDONED, Decision, Found, decide};
use super::{Begin, BeginRequest, CouplingMode, FinishError, PlainTransaction, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::{Record, RecordState, StoredResponse};

/// A record row as read back, with the time comparisons done in the statement.
#[derive(Debug)]
pub(crate) struct RecordRow {
    pub(crate) state: String,
    pub(crate) fingerprint_version: i16,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) fencing_token: i64,
    /// How long the lease has left, in milliseconds (negative or zero: expired).
    pub(crate) lease_left_ms: Option<i64>,
    pub(crate) response_expired: bool,
    pub(crate) forgotten: bool,
    pub(crate) response_status: Option<i16>,
    pub(crate) response_headers: Option<Vec<u8>>,
    pub(crate) response_body: Option<Vec<u8>>,
}

impl RecordRow {
    /// The row as the shared decision sees it.
    pub(crate) fn found(&self) -> Result<Found, StoreError> {
        let state = RecordState::parse(&self.state)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown record state {:?}", self.state)))?;
        let digest: [u8; 32] = self
            .fingerprint
            .as_slice()
            .try_into()
            .map_err(|_| StoreError::Corrupt("fingerprint is not 32 bytes".into()))?;
        let version = u8::try_from(self.fingerprint_version)
            .map_err(|_| StoreError::Corrupt("fingerprint version out of range".into()))?;
        let lease_left = Duration::from_millis(self.lease_left_ms.unwrap_or(0).max(0) as u64);
        Ok(Found {
            state,
            fingerprint: Fingerprint::from_parts(version, digest),
            lease_left,
            response_expired: self.response_expired,
            forgotten: self.forgotten,
        })
    }

    /// The record to answer with, as a record in `state`: with its stored response when it is a
    /// finished record of the same request, or of a fingerprint version other than the
    /// request's (the layer compares those at the record's version).
    fn answer(&self, found: &Found, state: RecordState, fingerprint: &Fingerprint) -> Result<Record, StoreError> {
        let replayable = matches!(state, RecordState::Completed | RecordState::Failed);
        let comparable_here = found.fingerprint.version() == fingerprint.version();
        if replayable && (found.fingerprint == *fingerprint || !comparable_here) {
            Ok(Record::with_response(state, found.fingerprint, self.response()?))
        } else {
            Ok(Record::new(state, found.fingerprint))
        }
    }

    pub(crate) fn response(&self) -> Result<StoredResponse, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("stored response {what}"));
        let status = self.response_status.ok_or_else(|| corrupt("has no status"))?;
        let status = u16::try_from(status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| corrupt("status is invalid"))?;
        let (headers, trailers) = StoredResponse::decode_fields(self.response_headers.as_deref().unwrap_or_default())
            .ok_or_else(|| corrupt("headers are unreadable"))?;
        let body = Bytes::from(self.response_body.clone().unwrap_or_default());
        Ok(StoredResponse { status, headers, trailers, body })
    }
}

/// Checks that a schema or table name (`what`) is a plain lowercase SQL identifier: SQL stores
/// splice these names into their statements.
pub(crate) fn check_identifier(name: &str, what: &'static str) -> Result<(), InvalidName> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(InvalidName::new(name, what, "a plain lowercase SQL identifier ([a-z_][a-z0-9_]*, at most 48 bytes)"))
    }
}

/// Milliseconds of a duration, saturating, for SQL intervals.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The database failed or could not be reached: nothing was claimed or stored.
pub(crate) fn unavailable(error: sqlx::Error) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

/// The old path's transaction on `records` (see [`Store::plain_transaction`](crate::Store::plain_transaction)):
/// begun with `begin` on a connection taken within `wait`, in atomic mode only.
pub(crate) async fn plain_transaction<D: Dialect>(
    records: &Records<D>,
    begin: &'static str,
    wait: Duration,
) -> Result<Option<PlainTransaction<TxHandle<D::Db>>>, StoreError> {
    if records.mode != CouplingMode::Atomic {
        return Ok(None);
    }
    let tx = begin_by(&records.pool, begin.into_sql_str(), Instant::now() + wait).await.map_err(unavailable)?;
    Ok(Some(PlainTransaction::new(TxHandle::new(tx), finish_plain)))
}

/// Ends a plain transaction: fails closed if the handler still holds the handle, else commits
/// (`commit`) or rolls back.
async fn finish_plain<DB: sqlx::Database>(handle: TxHandle<DB>, commit: bool) -> Result<(), FinishError> {
    let tx = handle.take_to_finish().await?;
    if commit {
        tx.commit().await.map_err(|error| FinishError::CommitUncertain(Box::new(error)))
    } else {
        tx.discard().await;
        Ok(())
    }
}

impl From<HandleStillHeld> for FinishError {
    fn from(_: HandleStillHeld) -> Self {
        FinishError::HandleStillHeld
    }
}

/// The crate's migrations of a records table, in order (their versions start at 1), with their
/// descriptions. Never edit one that has shipped: its checksum is in users' databases.
const MIGRATIONS: [&str; 3] = ["create idempotency records", "deployment secret", "record lifecycle"];

/// The migrator of a records table: the crate's migrations (`migrations`, in order, with the
/// store's names already in, then a dialect's `later` ones with their versions, the numbers of
/// their files), their history kept in `history` (apart from the application's own sqlx
/// migrations).
pub(crate) fn migrator(migrations: [String; 3], later: Vec<(i64, &'static str, String)>, history: String) -> Migrator {
    let migrations = MIGRATIONS
        .iter()
        .zip(migrations)
        .zip(1..)
        .map(|((description, sql), version)| (version, *description, sql))
        .chain(later)
        .map(|(version, description, sql)| {
            Migration::new(version, description.into(), MigrationType::Simple, AssertSqlSafe(sql).into_sql_str(), false)
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(history);
    migrator
}

/// A SQL store's records table: its pool, coupling mode and statements. What both SQL stores
/// do the same way is done here.
#[derive(Debug)]
pub(crate) struct Records<D: Dialect> {
    pub(crate) pool: Pool<D::Db>,
    pub(crate) mode: CouplingMode,
    pub(crate) statements: Arc<Statements<D>>,
}

impl<D: Dialect> Clone for Records<D> {
    fn clone(&self) -> Self {
        Self { pool: self.pool.clone(), mode: self.mode, statements: self.statements.clone() }
    }
}

impl<D: Dialect> Records<D> {
    /// Runs `statement` on a pooled connection, for maintenance (no request waits on it):
    /// taking the connection is bounded by the pool's own acquire timeout. How many rows it
    /// changed.
    pub(crate) async fn execute(&self, statement: Bound) -> Result<u64, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        D::execute(&mut conn, statement).await
    }

    /// Runs `statement` on a request's behalf, taking the connection by `deadline` (see
    /// [`acquire_by`]); how many rows it changed.
    pub(crate) async fn execute_by(&self, statement: Bound, deadline: Instant) -> Result<u64, sqlx::Error> {
        let mut conn = acquire_by(&self.pool, deadline).await?;
        D::execute(&mut conn, statement).await
    }

    /// The record of `id`, read in a statement of its own, outside any transaction, on a
    /// connection taken by `deadline` (see [`acquire_by`]).
    pub(crate) async fn read(&self, id: &RecordId, deadline: Instant) -> Result<Option<RecordRow>, StoreError> {
        let mut conn = acquire_by(&self.pool, deadline).await.map_err(unavailable)?;
        D::fetch_record(&mut conn, self.statements.read(id)).await
    }

    /// Marks `id` unknown if it is still `processing` under `token` with its lease run out.
    /// Whether it did.
    async fn mark_unknown(&self, id: &RecordId, token: i64, deadline: Instant) -> Result<bool, StoreError> {
        let statement = self.statements.mark_unknown(id, token);
        let marked = self.execute_by(statement, deadline).await.map_err(unavailable)?;
        Ok(marked == 1)
    }

    /// Turns records past their retention into tombstones and deletes tombstones past theirs,
    /// at most `limit` records in all. The deletes come first; on a partitioned table each step
    /// first asks, in one statement, which partitions have rows due, then walks those one
    /// statement at a time (starting one further on each call) until the limit is spent. The
    /// step that finds only answers written before answers apart is skipped by most calls once
    /// it finds none due (see [`Purge::takes`](purge::Purge::takes)).
    pub(crate) async fn purge(&self, limit: usize) -> Result<usize, StoreError> {
        let mut left = i64::try_from(limit).unwrap_or(i64::MAX);
        let purge = self.statements.purge();
        let start = purge.start();
        let mut purged = 0u64;
        for step in 0..purge.steps() {
            if left == 0 && purge.partitioned() {
                break;
            }
            if !purge.takes(step) {
                continue;
            }
            let froms = purge.froms(step);
            // On partitions, only those with rows due (one probe for all of them).
            let due = match purge.probe(step, &froms) {
                Some(probe) => {
                    let mut conn = self.pool.acquire().await.map_err(unavailable)?;
                    Some(D::fetch_ints(&mut conn, probe).await.map_err(unavailable)?)
                }
                None => None,
            };
            for table in purge.walk(step, start, due.as_deref()) {
                // One table: every step runs, as it always has, even with nothing left.
                if left == 0 && purge.partitioned() {
                    break;
                }
                let statement = purge.bound::<D>(step, table, left, froms[table]);
                let n = if purge.reaches(step, table) {
                    let mut conn = self.pool.acquire().await.map_err(unavailable)?;
                    let (n, reached) = D::fetch_reach(&mut conn, statement).await.map_err(unavailable)?;
                    purge.reached(step, table, reached);
                    u64::try_from(n).unwrap_or(0)
                } else {
                    self.execute(statement).await.map_err(unavailable)?
                };
                purged += n;
                left = left.saturating_sub(i64::try_from(n).unwrap_or(i64::MAX));
            }
            // The step purged fewer than its limit: none of its rows is left due.
            if left > 0 {
                purge.cleared(step);
            }
        }
        Ok(purged as usize)
    }

    /// Resolves the record in the way of a claim, reading it first if `row` is `None`: answers
    /// from it, marks a dead holder's record `unknown`, or waits out a live holder (looking
    /// again with a 10 ms backoff doubling to 200 ms, never past `deadline`). `Ok(None)`:
    /// nothing is in the way (any more), claim (again).
    pub(crate) async fn resolve_existing<C>(
        &self,
        request: &BeginRequest<'_>,
        deadline: Instant,
        row: Option<RecordRow>,
    ) -> Result<Option<Begin<C>>, StoreError> {
        let mut backoff = Duration::from_millis(10);
        let mut row = match row {
            Some(row) => row,
            None => match self.read(request.id, deadline).await? {
                Some(row) => row,
                None => return Ok(None),
            },
        };
        loop {
            if row.forgotten {
                return Ok(None);
            }
            let found = row.found()?;
            match decide(&found, request.fingerprint, request.stale_lease) {
                // A dead lease on a re-executable route: the claim statement takes it over.
                Decision::Claim | Decision::TakeOver => return Ok(None),
                Decision::Answer(state) => {
                    return Ok(Some(Begin::Existing(row.answer(&found, state, request.fingerprint)?)));
                }
                Decision::MarkUnknown => {
                    if self.mark_unknown(request.id, row.fencing_token, deadline).await? {
                        return Ok(Some(Begin::Existing(Record::new(ABANDONED, found.fingerprint))));
                    }
                }
                Decision::Wait { lease_left } => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(Some(Begin::InFlight { retry_after: lease_left.min(request.lease) }));
                    }
                    tokio::time::sleep(backoff.min(lease_left).min(deadline - now)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
            }
            match self.read(request.id, deadline).await? {
                Some(fresh) => row = fresh,
                None => return Ok(None),
            }
        }
    }
}
