//! The purge's statements: the steps it takes, in order, each a statement for every table it
//! walks (the records table or each of its partitions; the answers table, when answers are
//! apart), run in bounded batches picked with the dialect's batch lock.
//!
//! - **Answers inline** (every store's default): delete the tombstones past their tombstone
//!   time, then make tombstones of the records past their response retention (the answer's
//!   columns emptied in place).
//! - **Answers apart**: delete every record past its tombstone time (a record is never written
//!   to become a tombstone, so whatever its state says), empty in place the answers written
//!   inline before the layout, then delete the answers that are due, the earliest due first.
//!   The first and last walks start where they last reached ([`Reach`]); the answers table is
//!   walked once, however many partitions the records have. The middle step finds only what was
//!   there before the layout, so once it finds nothing due it is taken again only by every
//!   [`LEFTOVERS_EVERY`]th purge ([`Leftovers`]).
//!
//! On partitions, a step first asks which partitions have rows due, all in one statement
//! ([`Purge::probe`]), and sends its statement only to those: a purge that sent one statement
//! to each of 64 partitions for each step spent its time on the partitions with nothing due.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::answers::Answers;
use super::dialect::{Arg, Bound, Dialect};
use crate::store::decide::EXPIRED;

/// The purge's statements, step by step and table by table.
#[derive(Debug)]
pub(crate) struct Purge {
    /// For each step, in the order they run, its statement on each table it walks.
    steps: Vec<Vec<PurgeStep>>,
    /// For each step that walks several tables (the partitions), its probe of them
    /// ([`probe`](Self::probe)).
    probes: Vec<Option<SqlStr>>,
    /// Where the next purge starts walking the partitions, so that a purge whose limit runs out
    /// early does not always favour the first ones.
    start: AtomicUsize,
    /// The step that finds only rows written before the layout, if there is one.
    leftovers: Option<Leftovers>,
}

/// One statement of the purge on one table, what it finds due there, and where its walk
/// reached, if it keeps track.
#[derive(Debug)]
struct PurgeStep {
    /// The table (qualified and quoted).
    table: String,
    /// The condition of the rows due, with `{from}` where a reaching walk starts.
    due: String,
    /// The column whose index the walk follows, the earliest due first.
    order: &'static str,
    sql: SqlStr,
    reach: Option<Reach>,
}

impl Purge {
    /// The purge of `records` (qualified and quoted: the records table, or each of its
    /// partitions), its answers kept as `answers` says.
    pub(crate) fn new<D: Dialect>(records: &[String], answers: &Answers) -> Self {
        let each = |step: fn(&str) -> PurgeStep| records.iter().map(|t| step(t)).collect::<Vec<_>>();
        let (steps, leftovers) = match answers.table() {
            None => (vec![each(delete_tombstones::<D>), each(expire_live::<D>)], None),
            Some(answers) => (
                vec![
                    each(|t| reaching::<D>(t, "forget_at")),
                    each(|t| expire::<D>(t, "response_headers IS NOT NULL")),
                    vec![reaching::<D>(answers, "keep_until")],
                ],
                // The second step finds only the answers written inline before the layout.
                Some(Leftovers::of(1)),
            ),
        };
        let probes = steps.iter().map(|tables| probe_of(tables)).collect();
        Self { steps, probes, start: AtomicUsize::new(0), leftovers }
    }

    /// Whether this purge takes step `step`: every purge takes every step, but for the step of
    /// leftovers ([`Leftovers`]), which after a purge that left none of them due is taken again
    /// only by the [`LEFTOVERS_EVERY`]th purge from it.
    pub(crate) fn takes(&self, step: usize) -> bool {
        self.leftovers.as_ref().is_none_or(|leftovers| leftovers.step != step || leftovers.takes())
    }

    /// Notes that this purge's step `step` left none of its rows due: its probe found none, or
    /// its statements purged fewer than its limit.
    pub(crate) fn cleared(&self, step: usize) {
        if let Some(leftovers) = self.leftovers.as_ref().filter(|leftovers| leftovers.step == step) {
            leftovers.skip.store(LEFTOVERS_EVERY - 1, Ordering::Relaxed);
        }
    }

    /// Where this purge starts walking each step's tables (taken modulo their count).
    pub(crate) fn start(&self) -> usize {
        self.start.fetch_add(1, Ordering::Relaxed)
    }

    /// How many steps a purge takes, in order.
    pub(crate) fn steps(&self) -> usize {
        self.steps.len()
    }

    /// Whether the records are partitioned (the purge then stops walking a step's tables once
    /// its limit is spent; on one table every step runs, as it always has).
    pub(crate) fn partitioned(&self) -> bool {
        self.steps[0].len() > 1
    }

    /// Where this purge's walk of step `step` starts on each of its tables, in microseconds
    /// since the epoch (0 for a step that does not keep track, or a walk from the beginning).
    pub(crate) fn froms(&self, step: usize) -> Vec<i64> {
        self.steps[step].iter().map(|table| table.reach.as_ref().map_or(0, Reach::start)).collect()
    }

    /// For a step that walks several tables (the partitions), one statement that returns the
    /// number of each table with rows due from `froms` (see [`froms`](Self::froms)), so that
    /// the purge sends its statement only to those: one probe of each partition's index in one
    /// round trip, instead of a statement for each partition, most of which find nothing.
    /// `None` for a step on one table. The statement is the same on every call, where each
    /// walk starts bound as a parameter, so that it is prepared once on a connection: written
    /// afresh with the starts in its text, it was parsed and planned on every call (on 64
    /// partitions, about 1.5 ms of PostgreSQL's CPU each time, against 0.05 ms for its plan
    /// kept on the connection).
    pub(crate) fn probe(&self, step: usize, froms: &[i64]) -> Option<Bound> {
        let sql = self.probes[step].as_ref()?;
        let args = self.steps[step]
            .iter()
            .zip(froms)
            .filter(|(table, _)| table.reach.is_some())
            .map(|(_, &from)| Arg::Int(Some(from)))
            .collect();
        Some(Bound::new(sql, args, None))
    }

    /// The tables step `step` walks, in order: starting at `start` (taken modulo their count),
    /// and, if a probe answered (`due`, see [`probe`](Self::probe)), only those it found rows due
    /// in.
    pub(crate) fn walk(&self, step: usize, start: usize, due: Option<&[i64]>) -> impl Iterator<Item = usize> {
        let tables = self.steps[step].len();
        (0..tables)
            .map(move |i| (start + i) % tables)
            .filter(move |&table| due.is_none_or(|due| i64::try_from(table).is_ok_and(|table| due.contains(&table))))
    }

    /// Whether step `step` on table `table` keeps track of where its walk reached: it is run
    /// with [`Dialect::fetch_reach`], and what it reached noted with [`reached`](Self::reached).
    pub(crate) fn reaches(&self, step: usize, table: usize) -> bool {
        self.steps[step][table].reach.is_some()
    }

    /// Notes the latest time among the rows step `step` deleted from table `table`.
    pub(crate) fn reached(&self, step: usize, table: usize, reached: Option<i64>) {
        if let (Some(reach), Some(reached)) = (&self.steps[step][table].reach, reached) {
            reach.from.fetch_max(reached, Ordering::Relaxed);
        }
    }

    /// Step `step` of the purge on its table number `table`, for at most `limit` rows, its walk
    /// starting at `from` (see [`froms`](Self::froms)).
    pub(crate) fn bound<D: Dialect>(&self, step: usize, table: usize, limit: i64, from: i64) -> Bound {
        let statement = &self.steps[step][table];
        let mut args = vec![Arg::Int(Some(limit))];
        if statement.reach.is_some() {
            args.push(Arg::Int(Some(from)));
        }
        let bound = Bound::new(&statement.sql, args, D::now_value());
        // On partitions, not kept on the connection: a statement for each partition would
        // crowd the claims' statements out of the connection's cache.
        if self.partitioned() { bound.unprepared() } else { bound }
    }
}

impl PurgeStep {
    /// The statement `sql` on `table`, for the rows that meet `due`, walked in `order`.
    fn new(table: &str, due: String, order: &'static str, sql: String, reaches: bool) -> Self {
        let sql = AssertSqlSafe(sql).into_sql_str();
        Self { table: table.to_owned(), due, order, sql, reach: reaches.then(Reach::default) }
    }
}

/// The probe of `tables`, one step's tables (see [`Purge::probe`]): `None` for one table. Where
/// a table's walk starts is a parameter, numbered in the order of the tables that keep track
/// of it ([`Reach`]; their condition has `{from}` where the walk starts). Only PostgreSQL partitions, so its SQL is written here.
fn probe_of(tables: &[PurgeStep]) -> Option<SqlStr> {
    if tables.len() < 2 {
        return None;
    }
    let mut parameters = 0;
    let sql = tables
        .iter()
        .enumerate()
        .map(|(n, table)| {
            let due = if table.reach.is_some() {
                parameters += 1;
                table.due.replace("{from}", &format!("${parameters}"))
            } else {
                table.due.clone()
            };
            // In the order of the index, as the statement walks it: the first entry due
            // answers, whatever the statistics say of a scan of the table. (Not `EXISTS`:
            // PostgreSQL drops the order and the limit of an `EXISTS` subquery, and may scan
            // the table instead.)
            format!(
                "SELECT {n}::bigint WHERE (SELECT {order} FROM {t} WHERE {due} ORDER BY {order} LIMIT 1) IS NOT NULL",
                t = table.table,
                order = table.order,
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    Some(AssertSqlSafe(sql).into_sql_str())
}

/// Inline: deletes from `t` the tombstones past their tombstone time. A record reaches that
/// time as one (its response retention ends first and [`expire_live`] makes it one), and
/// PostgreSQL's index covers only them.
fn delete_tombstones<D: Dialect>(t: &str) -> PurgeStep {
    // One "now" for the statement, so that the times bound the walk of their index.
    let now = D::stable_now(2);
    let due = format!("state = '{}' AND forget_at <= {now}", EXPIRED.as_str());
    let sql = format!("DELETE FROM {t} WHERE {picked}", picked = D::purge_pick(t, &due, "forget_at", &D::param(1)));
    PurgeStep::new(t, due, "forget_at", sql, false)
}

/// Inline: makes tombstones of the records past their response retention.
fn expire_live<D: Dialect>(t: &str) -> PurgeStep {
    expire::<D>(t, &format!("state <> '{}'", EXPIRED.as_str()))
}

/// Makes tombstones in place, in `t`, of the records past their response retention that meet
/// `condition`: their answer's columns emptied.
fn expire<D: Dialect>(t: &str, condition: &str) -> PurgeStep {
    let now = D::stable_now(2);
    let due = format!("{condition} AND response_until <= {now}");
    let sql = format!(
        "UPDATE {t} SET state = '{expired}', response_status = NULL, response_headers = NULL, \
             response_body = NULL, updated_at = {now} \
         WHERE {picked}",
        expired = EXPIRED.as_str(),
        picked = D::purge_pick(t, &due, "response_until", &D::param(1)),
    );
    PurgeStep::new(t, due, "response_until", sql, false)
}

/// Apart: deletes from `table` the rows whose `time` is due, walking its index from where the
/// last walk reached (`$2`, microseconds since the epoch), and reports how many and the latest
/// time among them. Only PostgreSQL keeps answers apart, so its SQL is written here as it is.
fn reaching<D: Dialect>(table: &str, time: &'static str) -> PurgeStep {
    let now = D::stable_now(2);
    let due =
        format!("{time} >= 'epoch'::timestamptz + {{from}}::bigint * interval '1 microsecond' AND {time} <= {now}");
    let sql = format!(
        "WITH gone AS (DELETE FROM {table} WHERE {picked} RETURNING {time}) \
         SELECT count(*), (EXTRACT(EPOCH FROM max({time})) * 1000000)::bigint FROM gone",
        picked = D::purge_pick(table, &due.replace("{from}", &D::param(2)), time, &D::param(1)),
    );
    PurgeStep::new(table, due, time, sql, true)
}

/// Where a purge step's walk over the due rows of one table starts (answers apart: the records
/// past their tombstone time, and the answers past theirs), so that it does not walk again over
/// the rows it deleted before (a deleted row's index entry stays until vacuum, and a walk from
/// the start over a million of them costs more than the deletes it leads to): the latest time a
/// walk of that table reached. Rows written or moved later fall due later (each time is set as
/// "now" plus a retention that is never negative), so none is left behind; one that a concurrent
/// purge had locked and then did not delete is, so every [`FULL_WALK_EVERY`]th walk starts from
/// the beginning. Each partition keeps its own: one partition's walk says nothing of another's.
#[derive(Debug, Default)]
struct Reach {
    /// Microseconds since the epoch.
    from: AtomicI64,
    walks: AtomicUsize,
}

/// How often a walk over the due rows starts from the beginning.
const FULL_WALK_EVERY: usize = 256;

impl Reach {
    /// Where this walk starts, in microseconds since the epoch.
    fn start(&self) -> i64 {
        if self.walks.fetch_add(1, Ordering::Relaxed).is_multiple_of(FULL_WALK_EVERY) {
            0
        } else {
            self.from.load(Ordering::Relaxed)
        }
    }
}

/// The purge's step that finds only rows written before the store's layout: answers apart, the
/// answers written inline before it, which nothing writes any more (a binary of the layout
/// writes every answer apart). Once a purge leaves none of them due, the next
/// [`LEFTOVERS_EVERY`]` - 1` purges skip the step, so that a purge does not send, on every call,
/// a statement that finds nothing: on 64 partitions its probe of every partition's index cost
/// about as much PostgreSQL time as the probe of the records past their tombstone time (a
/// generic plan locks each partition and its index on every run). A leftover falling due
/// meanwhile waits for the next purge that takes the step; every read already compares its
/// time, so until then it only takes its room on disk.
#[derive(Debug)]
struct Leftovers {
    /// The step's number.
    step: usize,
    /// How many purges still skip it.
    skip: AtomicUsize,
}

/// After a purge that left no leftover due, every this many purges take that step
/// ([`Leftovers`]).
const LEFTOVERS_EVERY: usize = 64;

impl Leftovers {
    /// Leftovers found by step `step`, taken by the next purge.
    fn of(step: usize) -> Self {
        Self { step, skip: AtomicUsize::new(0) }
    }

    /// Whether this purge takes the step (and if not, one fewer purge skips it).
    fn takes(&self) -> bool {
        self.skip.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |skip| skip.checked_sub(1)).is_err()
    }
}
