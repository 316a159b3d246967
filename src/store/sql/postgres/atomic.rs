//! The atomic path of [`PostgresStore`]: the claim that begins the handler's transaction, and
//! the outcome written with a prepared INSERT and committed (see the module docs of `postgres`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr, SqlStr};
use tokio::time::Instant;

use super::super::RecordRow;
use super::super::answers::Answers;
use super::super::claim::{self, Held};
use super::super::dialect::{Arg, Bound};
use super::super::tx::{ManagedTx, OpenTx, TxHandle};
use super::super::{acquire_by, millis, unavailable};
use super::{Pg, PgClaim, PostgresStore, record_row};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::RecordState;
use crate::record::StoredResponse;
use crate::store::sql::dialect::Dialect;
use crate::store::{Begin, BeginRequest, FinishError, Outcome, Retention, StaleLeasePolicy, StoreError};

/// The SQLSTATE the `_claim` function raises when a live record is in the way.
const RECORD_EXISTS: &str = "TI001";

/// The function called does not exist: the `_claim_first` of a database without migration 8.
const UNDEFINED_FUNCTION: &str = "42883";

/// A unique violation; on the records table's primary key, another record holds the identity.
const UNIQUE_VIOLATION: &str = "23505";
/// A NULL where a column refuses one: a compact record in a table without migration 9.
const NOT_NULL_VIOLATION: &str = "23502";

/// The bounded wait on a concurrent claimant ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";

impl PostgresStore {
    pub(super) async fn begin_atomic(&self, request: &BeginRequest<'_>) -> Result<Begin<PgClaim>, StoreError> {
        let deadline = Instant::now() + request.wait;
        let mut conn = acquire_by(&self.records.pool, deadline).await.map_err(unavailable)?;
        // Retries of finished requests are cheap when the record is read first: one plain read,
        // no transaction, no lock; a new key then goes on to claim on the same connection, so
        // the miss costs one round trip and no extra trip through the pool. When few requests
        // find a record, the claim comes first instead, and itself deletes what the read would
        // have had it replace (see `ReadBeforeClaim`).
        let claim_first = !self.read_first.reads_first();
        let mut found = if claim_first {
            None
        } else {
            Pg::fetch_record(&mut conn, self.records.statements.read(request.id)).await?
        };
        let mut held = Some(conn);
        // Whether the claim deletes a forgotten record, or a dead lease on a re-executable
        // route, under the lock, so that the outcome can take its place.
        let mut replace = false;
        // Whether this request was counted yet (as finding a record or not), for the choice.
        let mut observed = false;
        loop {
            if let Some(row) = found.take() {
                self.read_first.observe_once(&mut observed, true);
                // Something is in the way: resolve it without holding a connection while it waits.
                held = None;
                match self.records.resolve_existing(request, deadline, Some(row)).await? {
                    Some(answer) => return Ok(answer),
                    None => replace = true,
                }
            }
            let conn = match held.take() {
                Some(conn) => conn,
                None => acquire_by(&self.records.pool, deadline).await.map_err(unavailable)?,
            };
            let lock_ms = millis(deadline.saturating_duration_since(Instant::now()));
            // The first claim of a request not read first finds out for itself what is there.
            let first = claim_first && !observed;
            let begin =
                self.atomic.begin_claim(request.id, request.fingerprint, request.stale_lease, lock_ms, replace, first);
            let failed = match ManagedTx::begin(conn, begin).await {
                Ok(tx) => {
                    self.read_first.observe_once(&mut observed, false);
                    let handle = TxHandle::from_open(OpenTx::Managed(tx));
                    let claim = AtomicClaim::new(self, request, handle, replace || claim_first);
                    return Ok(Begin::Claimed(PgClaim(Held::Atomic(claim))));
                }
                Err((error, failed)) => match sqlstate(&error).as_deref() {
                    Some(RECORD_EXISTS) => failed,
                    Some(LOCK_NOT_AVAILABLE) if first => {
                        // Claiming first, this request has not read the record: its holder may
                        // have committed one as the wait ran out. Read it, as reading first would
                        // have, and answer from it; only with nothing there is the holder still in
                        // flight. (Only the first claim reads here, so this cannot loop.)
                        self.read_first.observe_once(&mut observed, true);
                        replace = false;
                        found = rollback_and_read(failed, &self.atomic.read_literal(request.id)).await?;
                        if found.is_none() {
                            return Ok(Begin::InFlight { retry_after: Duration::from_secs(1) });
                        }
                        continue;
                    }
                    Some(LOCK_NOT_AVAILABLE) => {
                        self.read_first.observe_once(&mut observed, true);
                        roll_back_failed_claim(failed).await;
                        return Ok(Begin::InFlight { retry_after: Duration::from_secs(1) });
                    }
                    Some(SERIALIZATION_FAILURE | DEADLOCK_DETECTED) if Instant::now() < deadline => {
                        roll_back_failed_claim(failed).await;
                        continue;
                    }
                    Some(UNDEFINED_FUNCTION) if first => {
                        // Migration 8 has not run: read first from now on.
                        tracing::warn!(
                            "idempotency: the records table has no claim_first function; run PostgresStore::migrate (reading first until then)"
                        );
                        self.read_first.unmigrated();
                        roll_back_failed_claim(failed).await;
                        return Err(unavailable(error));
                    }
                    _ => {
                        roll_back_failed_claim(failed).await;
                        return Err(unavailable(error));
                    }
                },
            };
            // A record is there: one a concurrent claimant committed while this request waited
            // for it, or (claiming first) one that was there all along. Roll the failed claim
            // back and read the record in one round trip: a new statement, outside any
            // transaction, so the read sees it whatever the isolation level.
            replace = false;
            found = rollback_and_read(failed, &self.atomic.read_literal(request.id)).await?;
        }
    }

    /// Whether `error` is the records table's primary key turning this claim's record away
    /// (another request's record holds the identity). A unique violation of any other
    /// constraint, such as a deferred one of the application's at COMMIT, is not. On a
    /// partitioned table the violation names the primary key of the partition the record went
    /// to, `<table>_pNNN_pkey`.
    fn is_identity_conflict(&self, error: &sqlx::Error) -> bool {
        error.as_database_error().is_some_and(|e| {
            e.code().as_deref() == Some(UNIQUE_VIOLATION)
                && e.constraint().is_some_and(|constraint| self.atomic.is_primary_key(constraint))
        })
    }
}

/// An atomic claim: the transaction the handler writes in, before any record exists.
#[derive(Debug)]
pub(super) struct AtomicClaim {
    store: PostgresStore,
    id: RecordId,
    fingerprint: Fingerprint,
    reexecute: bool,
    retention: Retention,
    /// The bounded wait of the request, for a stored failure's fresh claim.
    wait: Duration,
    /// The claim deleted a forgotten record or a dead lease (so must a fresh claim).
    replace: bool,
    /// The transaction, until the claim is finished.
    handle: Option<TxHandle<Postgres>>,
    /// The operation and scope digest the record is labelled with.
    labels: (Option<String>, Option<[u8; 32]>),
}

impl AtomicClaim {
    pub(super) fn new(
        store: &PostgresStore,
        request: &BeginRequest<'_>,
        handle: TxHandle<Postgres>,
        replace: bool,
    ) -> Self {
        Self {
            store: store.clone(),
            id: *request.id,
            fingerprint: *request.fingerprint,
            reexecute: request.stale_lease == StaleLeasePolicy::Reexecute,
            retention: request.retention,
            wait: request.wait,
            replace,
            handle: Some(handle),
            labels: (
                crate::store::admin::kept_operation(request.operation).map(str::to_owned),
                request.scope.map(|scope| scope.digest()),
            ),
        }
    }

    async fn finish_atomic(mut self, outcome: Outcome) -> Result<(), FinishError> {
        let Some((mut tx, state, response)) = claim::take_to_store(&mut self.handle, outcome).await? else {
            return Ok(());
        };
        if state == RecordState::Failed {
            // The handler's writes go; the failure is stored under a fresh claim. (A savepoint
            // would keep the first claim, but costs a subtransaction on every request for the
            // sake of this rare path.) A duplicate that claims in between wins, and this answer
            // is not stored.
            tx.discard().await;
            tx = self.reclaim().await?;
        }
        // The record is written once, with its outcome (atomic mode never commits a
        // `processing` row), by a prepared INSERT, then committed. The primary key decides: if
        // another record holds the identity, the INSERT fails, the COMMIT never runs, and the
        // business write rolls back.
        let insert = self.store.atomic.store_outcome(
            &self.id,
            state,
            &self.fingerprint,
            &response,
            self.retention,
            &self.labels,
        );
        if let Err(error) = Pg::execute(&mut tx, insert).await {
            let lost = self.store.is_identity_conflict(&error);
            self.store.atomic.note_insert_error(&error);
            tx.discard().await;
            return Err(if lost {
                // Another request's record won: this execution's writes rolled back.
                FinishError::ClaimLost
            } else {
                // Nothing committed, but the cause is unknown: a retry with the same key is safe.
                FinishError::CommitUncertain(Box::new(error))
            });
        }
        // A COMMIT that fails leaves its fate unknown: a retry with the same key is safe.
        tx.commit().await.map_err(|error| FinishError::CommitUncertain(Box::new(error)))
    }

    /// Claims this identity again, in a new transaction, to store a failure: taking the
    /// connection and the lock are both bounded by the request's in-flight wait.
    async fn reclaim(&self) -> Result<OpenTx<Postgres>, FinishError> {
        let store = &self.store;
        let deadline = Instant::now() + self.wait;
        let conn = acquire_by(&store.records.pool, deadline).await.map_err(|e| FinishError::Store(unavailable(e)))?;
        let policy = if self.reexecute { StaleLeasePolicy::Reexecute } else { StaleLeasePolicy::MarkUnknown };
        let begin =
            store.atomic.begin_claim(&self.id, &self.fingerprint, policy, millis(self.wait), self.replace, false);
        match ManagedTx::begin(conn, begin).await {
            Ok(tx) => Ok(OpenTx::Managed(tx)),
            Err((error, conn)) => {
                let lost = matches!(sqlstate(&error).as_deref(), Some(RECORD_EXISTS | LOCK_NOT_AVAILABLE));
                roll_back_failed_claim(conn).await;
                Err(if lost { FinishError::ClaimLost } else { FinishError::Store(unavailable(error)) })
            }
        }
    }
}

impl claim::AtomicClaim for AtomicClaim {
    type Db = Postgres;

    fn handle(&self) -> Option<TxHandle<Postgres>> {
        self.handle.clone()
    }

    async fn finish(self, outcome: Outcome) -> Result<(), FinishError> {
        self.finish_atomic(outcome).await
    }
}

impl Drop for AtomicClaim {
    /// An unfinished claim's transaction rolls back.
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            drop(handle.try_take());
        }
    }
}

/// The statements of the atomic path, and what it checks errors by: the claim and the read
/// after a lost wait go with the simple-query protocol (values written in as hex literals and
/// numbers we produced, never client text), so that BEGIN travels with the claim; the outcome's
/// INSERT is prepared.
#[derive(Debug)]
pub(super) struct AtomicStatements {
    /// The read, for the simple-query protocol: `{id}` is replaced with a hex digest.
    read_template: String,
    /// The table, qualified.
    table: String,
    /// The table's primary key constraint: a violation of it is another record's claim.
    primary_key: String,
    /// The table's bare name, and how many hash partitions it has (0: none), whose primary
    /// keys are the table's too.
    bare_table: String,
    partitions: u16,
    /// The `_claim` function, qualified.
    claim_function: String,
    /// Migration 8's `_claim_first` function, qualified.
    claim_first_function: String,
    /// The prepared INSERT of a record with its outcome, in migration 9's compact form (no
    /// fencing token, `updated_at` or attempts: an atomic record never had them).
    store_insert: SqlStr,
    /// The same INSERT for a table without migration 9, whose columns refuse NULL.
    store_insert_uncompacted: SqlStr,
    /// Whether the table took a compact record: until an INSERT finds a column that refuses NULL
    /// (migration 9 not run), then the uncompacted INSERT from there on.
    compact: AtomicBool,
}

impl AtomicStatements {
    /// The statements on `schema`.`table`, reading `columns`, answers kept as `answers` says.
    pub(super) fn new(schema: &str, table: &str, columns: &str, answers: &Answers) -> Self {
        let t = format!("\"{schema}\".\"{table}\"");
        let until = Pg::plus_ms("clock_timestamp()", "$8");
        let forget = Pg::plus_ms("clock_timestamp()", "$9");
        let apart = answers.record_insert(&t, &until, &forget); // Migration 11's table has had 9.
        let insert = |inline: String| AssertSqlSafe(apart.clone().unwrap_or(inline)).into_sql_str();
        Self {
            read_template: format!(
                "SELECT {columns} FROM {} WHERE record_id = {}",
                answers.from(&t),
                bytea_literal("{id}")
            ),
            primary_key: format!("{table}_pkey"),
            bare_table: table.to_owned(),
            partitions: 0,
            claim_function: format!("\"{schema}\".\"{table}_claim\""),
            claim_first_function: format!("\"{schema}\".\"{table}_claim_first\""),
            store_insert: insert(format!(
                "INSERT INTO {t} (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                     response_status, response_headers, response_body, response_until, forget_at, \
                     updated_at, attempts, operation, operation_id) \
                 VALUES ($1, $2, $3, $4, NULL, $5, $6, $7, {until}, {forget}, NULL, NULL, $10, $11)"
            )),
            store_insert_uncompacted: insert(format!(
                "INSERT INTO {t} (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                     response_status, response_headers, response_body, response_until, forget_at, \
                     operation, operation_id) \
                 VALUES ($1, $2, $3, $4, 0, $5, $6, $7, {until}, {forget}, $10, $11)"
            )),
            compact: AtomicBool::new(true),
            table: t,
        }
    }

    /// The same statements, on a table hash partitioned into `partitions` (0: not partitioned).
    pub(super) fn partitioned(mut self, partitions: u16) -> Self {
        self.partitions = partitions;
        self
    }

    /// Whether `constraint` is the records table's primary key, or one of its partitions'.
    fn is_primary_key(&self, constraint: &str) -> bool {
        constraint == self.primary_key
            || (self.partitions > 0
                && super::partitions::is_partition_key(&self.bare_table, self.partitions, constraint))
    }
}

impl AtomicStatements {
    /// Atomic: BEGIN and the migration's `_claim` function, as one simple query: the bounded
    /// wait for a concurrent claimant (an advisory lock, taken at once when nobody holds it) and
    /// the check that no live record appeared meanwhile (SQLSTATE TI001 if one did). With
    /// `replace`, a forgotten record or a dead lease on a re-executable route is then deleted
    /// under the lock, so the outcome's INSERT can take its place. The values are ours (hex
    /// digests and integers), never the client's text.
    fn begin_claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        policy: StaleLeasePolicy,
        lock_ms: i64,
        replace: bool,
        first: bool,
    ) -> SqlStr {
        let lock_key = lock_key(id);
        let (id, fingerprint) = (bytea_literal(&id.to_hex()), bytea_literal(&fingerprint.to_hex()));
        let reexecute = policy == StaleLeasePolicy::Reexecute;
        // lock_timeout 0 would mean no bound at all.
        let lock_ms = lock_ms.clamp(1, i64::from(i32::MAX));
        // A request not read first: migration 8's function, which also deletes what `replace`
        // would (a forgotten record, a dead lease on a re-executable route).
        let function = if first && !replace { &self.claim_first_function } else { &self.claim_function };
        let mut statement =
            format!("BEGIN; SELECT {function}({id}, {lock_key}, {lock_ms}, {fingerprint}, {reexecute})");
        if replace {
            statement.push_str(&format!(
                "; DELETE FROM {table} WHERE record_id = {id} \
                   AND (forget_at <= clock_timestamp() \
                        OR ({reexecute} AND state = 'processing' AND lease_until <= clock_timestamp() \
                            AND fingerprint = {fingerprint}))",
                table = self.table,
            ));
        }
        AssertSqlSafe(statement).into_sql_str()
    }

    /// The read with the identity written in (it is our hex digest, never client text).
    fn read_literal(&self, id: &RecordId) -> String {
        self.read_template.replace("{id}", &id.to_hex())
    }

    /// Atomic: the prepared INSERT of the record with its outcome and labels (what the
    /// migration's `<table>_store` function does, without the function call's parse, plan and
    /// PL/pgSQL frame on every request).
    fn store_outcome(
        &self,
        id: &RecordId,
        state: RecordState,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        retention: Retention,
        (operation, scope): &(Option<String>, Option<[u8; 32]>),
    ) -> Bound {
        let keep = millis(retention.live_for(state));
        let args = vec![
            Arg::Bytes(id.digest().to_vec()),
            Arg::Text(state.as_str()),
            Arg::Small(i16::from(fingerprint.version())),
            Arg::Bytes(fingerprint.digest().to_vec()),
            Arg::Small(response.status.as_u16() as i16),
            Arg::Bytes(response.encode_fields()),
            Arg::Bytes(response.body.to_vec()),
            Arg::Int(Some(keep)),
            Arg::Int(Some(keep.saturating_add(millis(retention.tombstone)))),
            Arg::OptText(operation.clone()),
            Arg::OptBytes(scope.map(|digest| id.operation_key(&digest).to_vec())),
        ];
        let insert =
            if self.compact.load(Ordering::Relaxed) { &self.store_insert } else { &self.store_insert_uncompacted };
        Bound::new(insert, args, None)
    }

    /// Notes an INSERT's `error`: a table that refused a compact record (a column still NOT
    /// NULL, from a table that migration 9 has not reached) gets uncompacted records from then
    /// on (this request's own INSERT is lost with its transaction, as any failed INSERT is).
    fn note_insert_error(&self, error: &sqlx::Error) {
        let refused = error.as_database_error().is_some_and(|e| e.code().as_deref() == Some(NOT_NULL_VIOLATION));
        if refused && self.compact.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "tower-idempotency: the records table lacks migration 9 (run PostgresStore::migrate); \
                 writing records in the uncompacted form"
            );
        }
    }
}

/// A bytea literal of hex digits, for the simple-query protocol: an escape string, so that it
/// reads the same whatever `standard_conforming_strings` says, and a constant the parser takes
/// as it is (a `decode(..)` call would cost a function lookup on every statement).
fn bytea_literal(hex: &str) -> String {
    format!("E'\\\\x{hex}'::bytea")
}

/// The advisory lock key of an identity: the first eight bytes of its digest.
fn lock_key(id: &RecordId) -> i64 {
    let (first, _) = id.digest().split_first_chunk::<8>().expect("a 32-byte digest");
    i64::from_be_bytes(*first)
}

fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned())
}

/// Serialization failures and deadlocks: the claim may simply be tried again.
pub(super) fn is_retryable(error: &sqlx::Error) -> bool {
    matches!(sqlstate(error).as_deref(), Some(SERIALIZATION_FAILURE | DEADLOCK_DETECTED))
}

/// Rolls back a connection whose claim statement failed, so it goes back to the pool clean; a
/// connection that cannot even do that is closed instead.
async fn roll_back_failed_claim(mut conn: PoolConnection<Postgres>) {
    if sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.is_err() {
        conn.close_on_drop();
    }
}

/// Rolls back a connection whose claim failed and reads the record, in one round trip; the
/// connection then goes back to the pool clean.
async fn rollback_and_read(mut conn: PoolConnection<Postgres>, read: &str) -> Result<Option<RecordRow>, StoreError> {
    let rows = sqlx::raw_sql(AssertSqlSafe(format!("ROLLBACK; {read}"))).fetch_all(&mut *conn).await;
    match rows {
        Ok(rows) => rows.first().map(record_row).transpose(),
        Err(error) => {
            // The connection's state is unknown: do not give it back to the pool.
            conn.close_on_drop();
            Err(unavailable(error))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Answers, AtomicStatements};
    use crate::store::sql::statements::Statements;

    /// The atomic path's read goes over the wire as it did before the statements were written
    /// once for both dialects: a retry's read is part of the tuned protocol.
    #[test]
    fn the_atomic_read_is_the_tuned_statement() {
        let statements = Statements::<super::Pg>::new("\"s\".\"t\"", "ON CONSTRAINT \"t_pkey\"", |_| String::new());
        let atomic = AtomicStatements::new("s", "t", &statements.columns, &Answers::Inline);
        assert_eq!(
            atomic.read_template,
            "SELECT state, fingerprint_version, fingerprint, COALESCE(fencing_token, 0), \
             (EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::bigint, \
             COALESCE(response_until <= clock_timestamp(), false), \
             COALESCE(forget_at <= clock_timestamp(), false), \
             response_status, response_headers, response_body \
             FROM \"s\".\"t\" WHERE record_id = E'\\\\x{id}'::bytea"
        );
    }
}
