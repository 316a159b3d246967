//! The statements both SQL stores run, written once over a [`Dialect`].
//!
//! Every statement that reads the clock takes "now" from the dialect: PostgreSQL's
//! `clock_timestamp()` in the statement, or (SQLite) a unix-millisecond value bound as the
//! statement's last parameter, so that one statement compares against one instant.

use std::marker::PhantomData;
use std::time::Duration;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::admin::AdminStatements;
use super::answers::{AnswerSql, Answers};
use super::dialect::{Arg, Bound, Dialect};
use super::purge::Purge;

use crate::key::RecordId;
use crate::record::{RecordState, StoredResponse};
use crate::store::admin::kept_operation;
use crate::store::decide::ABANDONED;
use crate::store::{BeginRequest, Retention, ShadowEntry, StaleLeasePolicy};

const PROCESSING: &str = RecordState::Processing.as_str();

/// The records table's statements, for one table in one dialect.
#[derive(Debug)]
pub(crate) struct Statements<D> {
    /// The record's columns as [`RecordRow`](super::RecordRow) reads them (from
    /// [`Answers::from`]), "now" being parameter 2. Only PostgreSQL's atomic statements read it.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) columns: String,
    claim: SqlStr,
    read: SqlStr,
    renew: SqlStr,
    mark_unknown: SqlStr,
    finish: SqlStr,
    release: SqlStr,
    abandon: SqlStr,
    /// The purge's statements, on the records table or each of its partitions
    /// ([`with_partitions`](Self::with_partitions)).
    purge: Purge,
    /// Where the answers are kept, which the purge's statements depend on.
    answers: Answers,
    /// The admin and recovery statements.
    pub(crate) admin: AdminStatements<D>,
    /// Shadow mode's write (see [`shadow_batch`](Self::shadow_batch)).
    shadow: SqlStr,
    dialect: PhantomData<D>,
}

impl<D: Dialect> Statements<D> {
    /// The statements on `table` (qualified and quoted), drawing fencing tokens with
    /// `next_token` (given the number of the parameter that may carry one), answers inline.
    pub(crate) fn new(table: &str, conflict_target: &str, next_token: impl Fn(usize) -> String) -> Self {
        Self::with_answers(table, conflict_target, next_token, Answers::Inline)
    }

    /// The statements on `table` as [`new`](Self::new), with the answers kept as `answers`
    /// says.
    pub(crate) fn with_answers(
        table: &str,
        conflict_target: &str,
        next_token: impl Fn(usize) -> String,
        answers: Answers,
    ) -> Self {
        let t = table;
        let purge = Purge::new::<D>(&[t.to_owned()], &answers);
        let p = D::param;
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        let columns = |now: &str| {
            format!(
                "state, fingerprint_version, fingerprint, COALESCE(fencing_token, 0), {lease_left}, \
                 {expired}, COALESCE(forget_at <= {now}, {no}), {answer}",
                lease_left = D::millis_until("lease_until", now),
                expired = answers.expired(format!("COALESCE(response_until <= {now}, {no})", no = D::FALSE)),
                no = D::FALSE,
                answer = answers.read_columns(),
            )
        };
        let fenced = format!("record_id = {} AND fencing_token = {} AND state = '{PROCESSING}'", p(1), p(2));
        let now = D::now(2);
        Self {
            columns: columns(&now),
            // Claims a new identity, or takes over a forgotten record, or (when the route is
            // re-executable) a dead holder's lease on the same request. Any other existing row
            // returns nothing; a concurrent claimant's uncommitted row makes this wait.
            // The claim names its operation (for reconcilers) and the operation id's key, which
            // holds the scope (for the operation id lookup; the `scope_digest` column is left
            // empty since migration 9), and carries the unsettled retention: a claim whose holder
            // never finishes still expires.
            claim: {
                let now = D::now(11);
                sql(format!(
                    "INSERT INTO {t} AS r (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                                           lease_until, created_at, updated_at, reexecutable, operation, \
                                           operation_id, response_until, forget_at) \
                     VALUES ({id}, '{PROCESSING}', {version}, {fingerprint}, {token}, {lease}, {now}, {now}, \
                             {reexecute}, {operation}, {operation_id}, {until}, {forget}) \
                     ON CONFLICT {conflict_target} DO UPDATE SET \
                         state = '{PROCESSING}', fingerprint_version = excluded.fingerprint_version, \
                         fingerprint = excluded.fingerprint, fencing_token = excluded.fencing_token, \
                         lease_until = excluded.lease_until, response_status = NULL, response_headers = NULL, \
                         response_body = NULL, response_until = excluded.response_until, \
                         forget_at = excluded.forget_at, created_at = excluded.created_at, \
                         updated_at = excluded.updated_at, reexecutable = excluded.reexecutable, \
                         operation = excluded.operation, scope_digest = NULL, \
                         operation_id = excluded.operation_id, attempts = 0, recheck_at = NULL{unlink} \
                     WHERE r.forget_at <= {now} \
                        OR ({reexecute} AND r.state = '{PROCESSING}' AND r.lease_until <= {now} \
                            AND r.fingerprint = excluded.fingerprint) \
                     RETURNING fencing_token",
                    id = p(1),
                    version = p(2),
                    fingerprint = p(3),
                    lease = D::later(4),
                    reexecute = p(5),
                    operation = p(6),
                    operation_id = p(7),
                    until = D::later(8),
                    forget = D::later(9),
                    token = next_token(10),
                    unlink = answers.unlink(),
                ))
            },
            read: sql(format!(
                "SELECT {columns} FROM {from} WHERE record_id = {id}",
                columns = columns(&now),
                from = answers.from(t),
                id = p(1)
            )),
            mark_unknown: {
                let now = D::now(3);
                sql(format!(
                    "UPDATE {t} SET state = '{unknown}', updated_at = {now} WHERE {fenced} AND lease_until <= {now}",
                    unknown = ABANDONED.as_str(),
                ))
            },
            // Fenced and state-checked: zero rows means the claim is no longer ours. Apart, the
            // answer's row is written whatever the check finds: written only where the check
            // finds the record (as a settlement's is), every outcome paid a probe of the record
            // more (by hand, 4-11 % of the statement's time), for the rare claim that lost it,
            // whose answer row the purge then deletes at its time.
            finish: {
                let (status, fields, body, until) = (p(4), p(5), p(6), D::later(7));
                let answer = AnswerSql { status: &status, fields: &fields, body: &body, until: &until };
                sql(format!(
                    "{write}UPDATE {t} SET state = {state}, {answer}, lease_until = NULL, \
                         forget_at = {forget_at}, updated_at = {now} \
                     WHERE {fenced}",
                    write = answers.write(&answer),
                    state = p(3),
                    answer = answers.set(&answer),
                    forget_at = D::later(8),
                    now = D::now(9),
                ))
            },
            release: sql(format!("DELETE FROM {t} WHERE {fenced}")),
            // Fenced and state-checked like the outcome: a lease is only ever extended for the
            // claim that still holds the record.
            renew: sql(format!(
                "UPDATE {t} SET lease_until = {lease}, updated_at = {now} WHERE {fenced}",
                lease = D::later(3),
                now = D::now(4),
            )),
            abandon: {
                let now = D::now(3);
                sql(format!("UPDATE {t} SET lease_until = {now}, updated_at = {now} WHERE {fenced}"))
            },
            purge,
            admin: AdminStatements::new(t, &answers),
            // The batch's upsert: each record with the status only (a status-only answer's
            // fields encode as no bytes), taking the place of a forgotten one.
            shadow: {
                let now = D::now(2);
                sql(format!(
                    "INSERT INTO {t} AS r (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                                           response_status, response_headers, response_body, response_until, \
                                           forget_at, created_at, updated_at) \
                     SELECT b.id, b.state, b.version, b.fingerprint, 0, b.status, {empty}, {empty}, \
                            {keep}, {forget}, {now}, {now} \
                     FROM {rows} AS b WHERE true \
                     ON CONFLICT {conflict_target} DO UPDATE SET \
                         state = excluded.state, fingerprint_version = excluded.fingerprint_version, \
                         fingerprint = excluded.fingerprint, fencing_token = 0, lease_until = NULL, \
                         response_status = excluded.response_status, response_headers = excluded.response_headers, \
                         response_body = excluded.response_body, response_until = excluded.response_until, \
                         forget_at = excluded.forget_at, created_at = excluded.created_at, \
                         updated_at = excluded.updated_at, reexecutable = {no}, operation = NULL, \
                         scope_digest = NULL, operation_id = NULL, attempts = 0, recheck_at = NULL{unlink} \
                     WHERE r.forget_at <= {now} \
                     RETURNING record_id",
                    keep = D::plus_ms(&now, "b.keep_ms"),
                    forget = D::plus_ms(&now, "b.forget_ms"),
                    rows = D::shadow_rows(),
                    no = D::FALSE,
                    // A status-only answer: no fields or body to keep apart, and none inline
                    // for the purge of inline answers to find.
                    empty = if answers.table().is_some() { "NULL" } else { "b.empty" },
                    unlink = answers.unlink(),
                ))
            },
            answers,
            dialect: PhantomData,
        }
    }

    /// Shadow mode's records of `entries` (of distinct identities), written by one prepared
    /// statement over a JSON array of them ([`Dialect::shadow_rows`]). Each record is a
    /// completed one (failed, for a stored failure) with the answer's status and no body, no
    /// labels (an operation id lookup never finds a shadow record) and fencing token 0. It
    /// takes the place of a forgotten record; any other record already there is kept. The
    /// statement returns the identities it wrote.
    pub(crate) fn shadow_batch(&self, entries: &[ShadowEntry]) -> Bound {
        use std::fmt::Write as _;
        let mut batch = String::with_capacity(entries.len() * 170 + 2);
        batch.push('[');
        for (n, entry) in entries.iter().enumerate() {
            let state = if entry.failed { RecordState::Failed } else { RecordState::Completed };
            let keep = entry.retention.response;
            // Writing to a String cannot fail.
            let _ = write!(
                batch,
                "{comma}[\"{id}\",\"{state}\",{version},\"{fingerprint}\",{status},{keep},{forget}]",
                comma = if n == 0 { "" } else { "," },
                id = crate::hex::encode(entry.id.digest()),
                state = state.as_str(),
                version = entry.fingerprint.version(),
                fingerprint = crate::hex::encode(entry.fingerprint.digest()),
                status = entry.status.as_u16(),
                keep = super::millis(keep),
                forget = super::millis(keep.saturating_add(entry.retention.tombstone)),
            );
        }
        batch.push(']');
        let now = D::now_value();
        Bound::new(&self.shadow, vec![Arg::OptText(Some(batch))], now)
    }

    /// Claims `request`'s identity as `processing`, holding a lease of `lease` (`None`: no lease,
    /// for an atomic claim), with fencing token `token` where the dialect does not draw it.
    pub(crate) fn claim(&self, request: &BeginRequest<'_>, lease: Option<Duration>, token: Option<i64>) -> Bound {
        let now = D::now_value();
        let mut args = vec![
            Arg::Bytes(request.id.digest().to_vec()),
            Arg::Small(i16::from(request.fingerprint.version())),
            Arg::Bytes(request.fingerprint.digest().to_vec()),
            lease.map_or(Arg::Int(None), |lease| D::later_arg(now, lease)),
            Arg::Flag(request.stale_lease == StaleLeasePolicy::Reexecute),
            Arg::OptText(kept_operation(request.operation).map(str::to_owned)),
            // No scope: no key, as no lookup can name the record.
            Arg::OptBytes(request.scope.map(|scope| request.id.operation_key(&scope.digest()).to_vec())),
            D::later_arg(now, request.retention.unsettled),
            D::later_arg(now, request.retention.unsettled.saturating_add(request.retention.tombstone)),
        ];
        args.extend(token.map(|token| Arg::Int(Some(token))));
        Bound::new(&self.claim, args, now)
    }

    /// The record of `id`.
    pub(crate) fn read(&self, id: &RecordId) -> Bound {
        Bound::new(&self.read, vec![Arg::Bytes(id.digest().to_vec())], D::now_value())
    }

    /// Marks `id` unknown if it is still `processing` under `token` with its lease run out.
    pub(crate) fn mark_unknown(&self, id: &RecordId, token: i64) -> Bound {
        Bound::new(&self.mark_unknown, fenced(id, token), D::now_value())
    }

    /// Stores the outcome of the claim holding `token`, as a record in `state`.
    pub(crate) fn finish(
        &self,
        id: &RecordId,
        token: i64,
        state: RecordState,
        response: &StoredResponse,
        retention: Retention,
    ) -> Bound {
        let now = D::now_value();
        let mut args = fenced(id, token);
        args.extend([
            Arg::Text(state.as_str()),
            Arg::Small(response.status.as_u16() as i16),
            Arg::Bytes(response.encode_fields()),
            Arg::Bytes(response.body.to_vec()),
            D::later_arg(now, retention.live_for(state)),
            D::later_arg(now, retention.live_for(state).saturating_add(retention.tombstone)),
        ]);
        Bound::new(&self.finish, args, now)
    }

    /// Extends the lease of the claim holding `token` to `lease` from now.
    pub(crate) fn renew(&self, id: &RecordId, token: i64, lease: Duration) -> Bound {
        let now = D::now_value();
        let mut args = fenced(id, token);
        args.push(D::later_arg(now, lease));
        Bound::new(&self.renew, args, now)
    }

    /// Deletes the `processing` record of the claim holding `token`.
    pub(crate) fn release(&self, id: &RecordId, token: i64) -> Bound {
        Bound::new(&self.release, fenced(id, token), None)
    }

    /// Runs out the lease of the claim holding `token`, so the next retry applies the
    /// stale-lease policy at once.
    pub(crate) fn abandon(&self, id: &RecordId, token: i64) -> Bound {
        Bound::new(&self.abandon, fenced(id, token), D::now_value())
    }

    /// The same statements, with the purge walking `partitions` (qualified and quoted) one by
    /// one instead of the table. On the partitioned table PostgreSQL plans the purge as a join
    /// of its batch with a scan of every partition (nothing prunes it); on one partition it is
    /// the one-table statement on a small table. Only PostgreSQL's store has partitions.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn with_partitions(mut self, partitions: &[String]) -> Self {
        if !partitions.is_empty() {
            self.purge = Purge::new::<D>(partitions, &self.answers);
        }
        self
    }

    /// The purge's statements (see [`Purge`]).
    pub(crate) fn purge(&self) -> &Purge {
        &self.purge
    }
}

/// The arguments that pick a claim's own record: its identity and fencing token.
fn fenced(id: &RecordId, token: i64) -> Vec<Arg> {
    vec![Arg::Bytes(id.digest().to_vec()), Arg::Int(Some(token))]
}
