//! The [`Admin`](crate::store::Admin) operations of both SQL stores, written once over a
//! [`Dialect`]: their statements, and reading a record's row into a [`RecordInfo`].
//!
//! Every transition names the state (and, for a settlement, the fencing token) it expects, so
//! zero rows changed means someone else moved the record first. The recovery statements pick
//! their batch with the dialect's batch lock (PostgreSQL: `FOR UPDATE SKIP LOCKED`, so
//! concurrent workers take disjoint batches; SQLite: none, one write statement holds the
//! database's single write lock) and check the state again on the rows they change. The batch
//! is picked once, in a materialized CTE: as a plain `IN (subquery)` PostgreSQL may rescan it
//! while the statement changes rows, and hand out more than its limit. The rows it picked are
//! then found by their primary key ([`Dialect::IN_PICKED`]): a semi-join planned on stale
//! statistics would walk the whole batch once per unknown record.

use std::marker::PhantomData;
use std::time::{Duration, SystemTime};

use http::StatusCode;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::answers::{AnswerSql, Answers};
use super::dialect::{Arg, Bound, Dialect, InfoRow};
use super::{Records, millis, unavailable};
use crate::key::{RecordId, Scope, scoped_operation_key};
use crate::record::{RecordState, StoredResponse};
use crate::store::admin::{
    Backoff, LeaseSweep, RecordInfo, SettleError, SettleRequest, Settlement, StateCounts, parse_operation_id,
};
use crate::store::decide::ABANDONED;
use crate::store::{Retention, StoreError};

const PROCESSING: &str = RecordState::Processing.as_str();
const UNKNOWN: &str = ABANDONED.as_str();
const EXPIRED: &str = RecordState::Expired.as_str();

/// The state check of a settlement, on one row found by its primary key. Written so that it
/// does not imply the `state = 'unknown'` predicate of the partial indexes over unknown
/// records: right after a crash, when many records turned unknown at once and the statistics
/// still say there are none, PostgreSQL would otherwise walk such an index, filtering on the
/// id, for every settlement.
const IS_UNKNOWN: &str = "state || '' = 'unknown'";

/// The longest first backoff the checkout statement shifts (2^32 ms, about 50 days), so that
/// doubling it 30 times stays within a bigint.
const MAX_FIRST_BACKOFF_MS: i64 = 1 << 32;

fn time(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

impl InfoRow {
    /// The record as an operator sees it, retention applied; `None` once it is forgotten.
    fn info(self) -> Result<Option<RecordInfo>, StoreError> {
        if self.forgotten {
            return Ok(None);
        }
        let corrupt = |what: &str| StoreError::Corrupt(format!("record {what}"));
        let digest: [u8; 32] = self.record_id.as_slice().try_into().map_err(|_| corrupt("id is not 32 bytes"))?;
        let id = RecordId::from_digest(digest);
        let stored = RecordState::parse(&self.state).ok_or_else(|| corrupt("state is unknown"))?;
        let state = if self.expired { RecordState::Expired } else { stored };
        let live = state != RecordState::Expired;
        let status = match self.status.filter(|_| live) {
            Some(status) => Some(
                u16::try_from(status)
                    .ok()
                    .and_then(|s| StatusCode::from_u16(s).ok())
                    .ok_or_else(|| corrupt("status"))?,
            ),
            None => None,
        };
        let location = match self.headers.as_deref().filter(|_| live) {
            Some(fields) => {
                let (headers, _) = StoredResponse::decode_fields(fields).ok_or_else(|| corrupt("headers"))?;
                headers.into_iter().find(|(name, _)| name == http::header::LOCATION).map(|(_, value)| value)
            }
            None => None,
        };
        Ok(Some(RecordInfo {
            id,
            state,
            operation: self.operation,
            operation_id: id.operation_id(),
            fingerprint_version: u8::try_from(self.fingerprint_version).map_err(|_| corrupt("fingerprint version"))?,
            fencing_token: u64::try_from(self.fencing_token).unwrap_or(0),
            created_at: time(self.created_ms),
            updated_at: time(self.updated_ms),
            expires_at: self.until_ms.filter(|_| live).map(time),
            forget_at: self.forget_ms.map(time),
            lease_until: self.lease_ms.filter(|_| stored == RecordState::Processing && live).map(time),
            status,
            location,
            attempts: u32::try_from(self.attempts).unwrap_or(u32::MAX),
        }))
    }
}

/// The admin and recovery statements, for one table in one dialect.
#[derive(Debug)]
pub(crate) struct AdminStatements<D> {
    inspect: SqlStr,
    inspect_operation: SqlStr,
    list_unknown: SqlStr,
    counts: SqlStr,
    open_counts: SqlStr,
    settle: SqlStr,
    settle_release: SqlStr,
    evict: SqlStr,
    sweep_unknown: SqlStr,
    sweep_release: SqlStr,
    checkout: SqlStr,
    dialect: PhantomData<D>,
}

impl<D: Dialect> AdminStatements<D> {
    /// The statements on `t` (qualified and quoted), its answers kept as `answers` says.
    pub(crate) fn new(t: &str, answers: &Answers) -> Self {
        let p = D::param;
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        let no = D::FALSE;
        let info = |now: &str| {
            let (answer, expired) = answers.looked_up(format!("COALESCE(response_until <= {now}, {no})"));
            format!(
                "record_id, state, operation, fingerprint_version, COALESCE(fencing_token, 0), {created}, {updated}, {until}, \
                 {forget}, {lease}, {answer}, CAST(COALESCE(attempts, 0) AS bigint), \
                 {expired}, COALESCE(forget_at <= {now}, {no})",
                created = D::epoch_ms("created_at"),
                updated = D::epoch_ms("COALESCE(updated_at, created_at)"),
                until = D::epoch_ms("response_until"),
                forget = D::epoch_ms("forget_at"),
                lease = D::epoch_ms("lease_until"),
            )
        };
        let live = |now: &str| format!("NOT COALESCE(response_until <= {now}, {no})");
        Self {
            inspect: {
                let now = D::now(2);
                sql(format!("SELECT {} FROM {t} WHERE record_id = {}", info(&now), p(1)))
            },
            // A record written since migration 9 (PostgreSQL) keeps its scope inside the
            // operation's key; one written before, the operation id and the scope's digest.
            inspect_operation: {
                let now = D::now(4);
                sql(format!(
                    "SELECT {} FROM {t} WHERE operation_id = {} OR (operation_id = {} AND scope_digest = {})",
                    info(&now),
                    p(1),
                    p(2),
                    p(3)
                ))
            },
            list_unknown: {
                let now = D::now(2);
                sql(format!(
                    "SELECT {info} FROM {t} WHERE state = '{UNKNOWN}' AND {live} ORDER BY created_at LIMIT {limit}",
                    info = info(&now),
                    live = live(&now),
                    limit = p(1),
                ))
            },
            // Retention applied: a record past it counts as a tombstone, one past its tombstone
            // time not at all.
            counts: {
                let now = D::now(1);
                sql(format!(
                    "SELECT CASE WHEN state <> '{EXPIRED}' AND COALESCE(response_until <= {now}, {no}) \
                                 THEN '{EXPIRED}' ELSE state END, \
                            count(*), MIN(CASE WHEN state = '{UNKNOWN}' THEN {created} END) \
                     FROM {t} WHERE NOT COALESCE(forget_at <= {now}, {no}) GROUP BY 1",
                    created = D::epoch_ms("created_at"),
                ))
            },
            // The same counts of the open states alone, whose condition is the predicate of the
            // index of open records (`open_idx`), so that only they are read.
            open_counts: {
                let now = D::now(1);
                sql(format!(
                    "SELECT state, count(*), MIN(CASE WHEN state = '{UNKNOWN}' THEN {created} END) \
                     FROM {t} WHERE state IN ('{PROCESSING}', '{UNKNOWN}') \
                       AND NOT COALESCE(response_until <= {now}, {no}) AND NOT COALESCE(forget_at <= {now}, {no}) \
                     GROUP BY state",
                    created = D::epoch_ms("created_at"),
                ))
            },
            // Fenced and state-checked: only an unknown record still under the token it was
            // decided on, and not past its retention.
            settle: {
                let now = D::now(9);
                let (status, fields, body, until) = (p(4), p(5), p(6), D::later(7));
                let answer = AnswerSql { status: &status, fields: &fields, body: &body, until: &until };
                let settled = format!(
                    "record_id = {id} AND COALESCE(fencing_token, 0) = {token} AND {IS_UNKNOWN} AND {live}",
                    id = p(1),
                    token = p(2),
                    live = live(&now),
                );
                sql(format!(
                    "{write}UPDATE {t} SET state = {state}, {answer}, lease_until = NULL, \
                         forget_at = {forget}, recheck_at = NULL, updated_at = {now} \
                     WHERE {settled}",
                    write = answers.replace_for(t, &settled, &answer),
                    answer = answers.set(&answer),
                    state = p(3),
                    forget = D::later(8),
                ))
            },
            settle_release: {
                let now = D::now(3);
                sql(format!(
                    "DELETE FROM {t} WHERE record_id = {id} AND COALESCE(fencing_token, 0) = {token} AND {is_unknown} \
                       AND {live}",
                    id = p(1),
                    token = p(2),
                    live = live(&now),
                    is_unknown = IS_UNKNOWN,
                ))
            },
            evict: sql(format!("DELETE FROM {t} WHERE record_id = {}", p(1))),
            sweep_unknown: {
                let now = D::now(2);
                let stale = format!("state = '{PROCESSING}' AND lease_until <= {now} AND NOT reexecutable");
                sql(format!(
                    "WITH picked AS{materialized} (SELECT record_id FROM {t} WHERE {stale} ORDER BY lease_until \
                                                  LIMIT {limit}{lock}) \
                     UPDATE {t} SET state = '{UNKNOWN}', lease_until = NULL, updated_at = {now} \
                     WHERE {picked} AND {stale}",
                    materialized = D::MATERIALIZED,
                    picked = D::IN_PICKED,
                    limit = p(1),
                    lock = D::BATCH_LOCK,
                ))
            },
            sweep_release: {
                let now = D::now(2);
                let stale = format!("state = '{PROCESSING}' AND lease_until <= {now} AND reexecutable");
                sql(format!(
                    "WITH picked AS{materialized} (SELECT record_id FROM {t} WHERE {stale} ORDER BY lease_until \
                                                  LIMIT {limit}{lock}) \
                     DELETE FROM {t} WHERE {picked} AND {stale}",
                    materialized = D::MATERIALIZED,
                    picked = D::IN_PICKED,
                    limit = p(1),
                    lock = D::BATCH_LOCK,
                ))
            },
            // Counts the look and pushes the next one back by the record's own backoff, in the
            // statement that hands the batch out: no other worker is given these records until
            // then.
            checkout: {
                let now = D::now(5);
                let wait = format!(
                    "{least}({first} << {least}(COALESCE(attempts, 0), 30), {max})",
                    least = D::LEAST,
                    first = D::bigint(3),
                    max = D::bigint(4),
                );
                let due = format!(
                    "state = '{UNKNOWN}' AND operation = {op} AND (recheck_at IS NULL OR recheck_at <= {now}) \
                     AND {live}",
                    op = p(1),
                    live = live(&now),
                );
                sql(format!(
                    "WITH picked AS{materialized} (SELECT record_id FROM {t} WHERE {due} ORDER BY created_at \
                                                  LIMIT {limit}{lock}) \
                     UPDATE {t} SET attempts = COALESCE(attempts, 0) + 1, recheck_at = {recheck} \
                     WHERE {picked} AND {due} \
                     RETURNING {info}",
                    materialized = D::MATERIALIZED,
                    picked = D::IN_PICKED,
                    recheck = D::plus_ms(&now, &wait),
                    limit = p(2),
                    lock = D::BATCH_LOCK,
                    info = info(&now),
                ))
            },
            dialect: PhantomData,
        }
    }
}

impl<D: Dialect> Records<D> {
    async fn infos(&self, statement: Bound) -> Result<Vec<RecordInfo>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(unavailable)?;
        let rows = D::fetch_infos(&mut conn, statement).await?;
        let mut infos = Vec::with_capacity(rows.len());
        for row in rows {
            infos.extend(row.info()?);
        }
        Ok(infos)
    }

    fn admin(&self) -> &AdminStatements<D> {
        &self.statements.admin
    }

    pub(crate) async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        let statement = Bound::new(&self.admin().inspect, vec![Arg::Bytes(id.digest().to_vec())], D::now_value());
        Ok(self.infos(statement).await?.pop())
    }

    pub(crate) async fn inspect_operation(
        &self,
        scope: &Scope,
        operation_id: &str,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let Some(operation_id) = parse_operation_id(operation_id) else { return Ok(None) };
        let scope = scope.digest();
        let args = vec![
            Arg::Bytes(scoped_operation_key(&operation_id, &scope).to_vec()),
            Arg::Bytes(operation_id.to_vec()),
            Arg::Bytes(scope.to_vec()),
        ];
        let statement = Bound::new(&self.admin().inspect_operation, args, D::now_value());
        Ok(self.infos(statement).await?.pop())
    }

    pub(crate) async fn list_unknown(&self, limit: usize) -> Result<Vec<RecordInfo>, StoreError> {
        let statement = Bound::new(&self.admin().list_unknown, vec![limit_arg(limit)], D::now_value());
        self.infos(statement).await
    }

    pub(crate) async fn counts(&self) -> Result<StateCounts, StoreError> {
        self.tally(&self.admin().counts).await
    }

    pub(crate) async fn open_counts(&self) -> Result<StateCounts, StoreError> {
        self.tally(&self.admin().open_counts).await
    }

    /// The text of [`open_counts`](Self::open_counts)' statement, for a test of its plan.
    #[cfg(test)]
    pub(crate) fn open_counts_sql(&self) -> &str {
        self.admin().open_counts.as_str()
    }

    /// Runs `counts`, a statement of rows (state, count, oldest unknown's claim in ms), and adds
    /// them up.
    async fn tally(&self, counts: &SqlStr) -> Result<StateCounts, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(unavailable)?;
        let statement = Bound::new(counts, Vec::new(), D::now_value());
        let rows = D::fetch_counts(&mut conn, statement).await.map_err(unavailable)?;
        let mut counts = StateCounts::default();
        for (state, n, oldest) in rows {
            let n = u64::try_from(n).unwrap_or(0);
            match RecordState::parse(&state) {
                Some(RecordState::Processing) => counts.processing += n,
                Some(RecordState::Completed) => counts.completed += n,
                Some(RecordState::Failed) => counts.failed += n,
                Some(RecordState::Unknown) => {
                    counts.unknown += n;
                    counts.oldest_unknown =
                        oldest.map(|ms| SystemTime::now().duration_since(time(ms)).unwrap_or_default());
                }
                Some(RecordState::Expired) => counts.expired += n,
                _ => return Err(StoreError::Corrupt(format!("unknown record state {state:?}"))),
            }
        }
        Ok(counts)
    }

    pub(crate) async fn settle(&self, request: SettleRequest<'_>) -> Result<(), SettleError> {
        let id = request.id;
        let token = match request.fencing_token {
            Some(token) => i64::try_from(token).map_err(|_| SettleError::Superseded)?,
            // Unfenced: whatever token the unknown record carries now, named in the write.
            None => match self.inspect(id).await? {
                None => return Err(SettleError::NotFound),
                Some(info) if info.state != RecordState::Unknown => return Err(SettleError::NotUnknown(info.state)),
                Some(info) => i64::try_from(info.fencing_token).unwrap_or(i64::MAX),
            },
        };
        let statement = match &request.settlement {
            Settlement::NotExecuted => {
                let args = vec![Arg::Bytes(id.digest().to_vec()), Arg::Int(Some(token))];
                Bound::new(&self.admin().settle_release, args, D::now_value())
            }
            Settlement::Completed(response) => {
                self.settle_statement(id, token, RecordState::Completed, response, request.retention)
            }
            Settlement::Failed(response) => {
                self.settle_statement(id, token, RecordState::Failed, response, request.retention)
            }
        };
        if self.execute(statement).await.map_err(unavailable)? == 1 {
            return Ok(());
        }
        // Nothing changed: say why.
        match self.inspect(id).await? {
            None => Err(SettleError::NotFound),
            Some(info) if info.state != RecordState::Unknown => Err(SettleError::NotUnknown(info.state)),
            Some(_) => Err(SettleError::Superseded),
        }
    }

    fn settle_statement(
        &self,
        id: &RecordId,
        token: i64,
        state: RecordState,
        response: &StoredResponse,
        retention: Retention,
    ) -> Bound {
        debug_assert!(RecordState::Unknown.can_become(state));
        let now = D::now_value();
        let args = vec![
            Arg::Bytes(id.digest().to_vec()),
            Arg::Int(Some(token)),
            Arg::Text(state.as_str()),
            Arg::Small(response.status.as_u16() as i16),
            Arg::Bytes(response.encode_fields()),
            Arg::Bytes(response.body.to_vec()),
            D::later_arg(now, retention.response),
            D::later_arg(now, retention.response.saturating_add(retention.tombstone)),
        ];
        Bound::new(&self.admin().settle, args, now)
    }

    pub(crate) async fn evict(&self, id: &RecordId) -> Result<bool, StoreError> {
        let statement = Bound::new(&self.admin().evict, vec![Arg::Bytes(id.digest().to_vec())], None);
        Ok(self.execute(statement).await.map_err(unavailable)? > 0)
    }

    pub(crate) async fn sweep_leases(&self, limit: usize) -> Result<LeaseSweep, StoreError> {
        let marked = Bound::new(&self.admin().sweep_unknown, vec![limit_arg(limit)], D::now_value());
        let marked = self.execute(marked).await.map_err(unavailable)? as usize;
        let left = limit.saturating_sub(marked);
        let mut sweep = LeaseSweep { marked_unknown: marked, released: 0 };
        if left > 0 {
            let released = Bound::new(&self.admin().sweep_release, vec![limit_arg(left)], D::now_value());
            sweep.released = self.execute(released).await.map_err(unavailable)? as usize;
        }
        Ok(sweep)
    }

    pub(crate) async fn checkout_unknown(
        &self,
        operation: &str,
        limit: usize,
        backoff: Backoff,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        let args = vec![
            Arg::OptText(Some(operation.to_owned())),
            limit_arg(limit),
            Arg::Int(Some(millis(backoff.first).min(MAX_FIRST_BACKOFF_MS))),
            Arg::Int(Some(millis(backoff.max))),
        ];
        let statement = Bound::new(&self.admin().checkout, args, D::now_value());
        let mut due = self.infos(statement).await?;
        due.sort_by_key(|info| info.created_at);
        Ok(due)
    }
}

fn limit_arg(limit: usize) -> Arg {
    Arg::Int(Some(i64::try_from(limit).unwrap_or(i64::MAX)))
}
