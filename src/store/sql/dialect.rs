//! What differs between the SQL databases the stores speak to, and nothing else: how a
//! parameter is written, where "now" comes from, how a point in time after now is written, and
//! how a statement with its arguments is run.

use std::future::Future;
use std::time::Duration;

use sqlx::{Database, SqlStr};

use super::{RecordRow, millis};
use crate::store::StoreError;

/// A statement's argument, as the shared statements produce it.
#[derive(Debug, Clone)]
pub(crate) enum Arg {
    /// A digest, a fingerprint, headers or a body.
    Bytes(Vec<u8>),
    /// A token, a count, or a time in a dialect's own form (`NULL` when `None`).
    Int(Option<i64>),
    /// A fingerprint version or a status code.
    Small(i16),
    /// A policy flag.
    Flag(bool),
    /// A state's name.
    Text(&'static str),
    /// An operation's name, or `NULL`.
    OptText(Option<String>),
    /// A digest, or `NULL`.
    OptBytes(Option<Vec<u8>>),
}

/// A statement with its arguments, ready to run.
#[derive(Debug)]
pub(crate) struct Bound {
    pub(crate) sql: SqlStr,
    pub(crate) args: Vec<Arg>,
    /// Whether the statement is prepared and kept in the connection's statement cache (the
    /// default), or parsed and planned for this one run.
    pub(crate) prepared: bool,
}

impl Bound {
    /// `sql` with `args`, then the dialect's "now" if it binds one (always the last parameter).
    pub(crate) fn new(sql: &SqlStr, mut args: Vec<Arg>, now: Option<i64>) -> Self {
        args.extend(now.map(|now| Arg::Int(Some(now))));
        Self { sql: sql.clone(), args, prepared: true }
    }

    /// The statement, not kept in the connection's statement cache: for the many rarely run
    /// statements that would otherwise crowd out the ones every request runs.
    pub(crate) fn unprepared(mut self) -> Self {
        self.prepared = false;
        self
    }
}

/// The SQL a database speaks, for the statements written once in `statements`.
pub(crate) trait Dialect: std::fmt::Debug + Clone + Send + Sync + 'static {
    /// The sqlx database.
    type Db: Database;

    /// What a parameter's number follows (`$` or `?`).
    const SIGIL: &'static str;

    /// The literal false, for `COALESCE` over a comparison with `NULL`.
    const FALSE: &'static str;

    /// What follows a batch selection (row locks skipped by concurrent workers).
    const BATCH_LOCK: &'static str = "";

    /// The `WHERE` clause of a purge statement on `t` (qualified and quoted): at most `limit`
    /// rows that meet `condition`, earliest `order` first, picked by their physical address so
    /// that no primary-key lookup follows the pick (SQLite's `rowid`). The order walks the
    /// index on `order` from its start and stops at the first row not yet due, whatever the
    /// statistics say: with nothing due the pick reads one index page, not the table.
    fn purge_pick(t: &str, condition: &str, order: &str, limit: &str) -> String {
        format!("rowid IN (SELECT rowid FROM {t} WHERE {condition} ORDER BY {order} LIMIT {limit})")
    }

    /// The `n`th parameter (1-based).
    fn param(n: usize) -> String {
        format!("{}{n}", Self::SIGIL)
    }

    /// The value of "now" to bind as a statement's last parameter, or `None` where the
    /// database's own clock is read in the statement.
    fn now_value() -> Option<i64> {
        None
    }

    /// "Now" in a statement whose last parameter, if bound, is number `n` (by default, that
    /// parameter).
    fn now(n: usize) -> String {
        Self::param(n)
    }

    /// "Now" as [`now`](Self::now), but one value for the whole statement, which an index
    /// condition can compare with (a clock read row by row can only filter what a scan found).
    fn stable_now(n: usize) -> String {
        Self::now(n)
    }

    /// The point in time that parameter `n` stands for, `n` carrying [`later_arg`](Self::later_arg)
    /// (by default, the parameter is that time itself).
    fn later(n: usize) -> String {
        Self::param(n)
    }

    /// The argument for [`later`](Self::later): `after` past `now` (by default, in the
    /// milliseconds of the bound "now").
    fn later_arg(now: Option<i64>, after: Duration) -> Arg {
        Arg::Int(now.map(|now| now.saturating_add(millis(after))))
    }

    /// Whole milliseconds from `now` until the time in `column` (negative: passed).
    fn millis_until(column: &str, now: &str) -> String;

    /// The time in `column` as unix milliseconds (a bigint; `NULL` stays `NULL`).
    fn epoch_ms(column: &str) -> String;

    /// What makes a CTE evaluated once, before the statement that uses it (PostgreSQL's
    /// `MATERIALIZED`; SQLite evaluates a CTE used once once).
    const MATERIALIZED: &'static str = "";

    /// How a statement names the rows of its `picked` CTE (record ids): by default a plain
    /// `IN`, which SQLite answers with primary key lookups.
    const IN_PICKED: &'static str = "record_id IN (SELECT record_id FROM picked)";

    /// The function that picks the least of two values.
    const LEAST: &'static str;

    /// Parameter `n`, an integer, where its type must be spelled out.
    fn bigint(n: usize) -> String {
        Self::param(n)
    }

    /// The time `ms` (an integer expression) milliseconds after `now`.
    fn plus_ms(now: &str, ms: &str) -> String;

    /// Shadow mode's batch as rows, for a `FROM`: parameter 1 is a JSON array of `[record id,
    /// state, fingerprint version, fingerprint, status, keep ms, forget ms]` (digests in hex),
    /// and each row has the columns `id`, `state`, `version`, `fingerprint`, `status`,
    /// `keep_ms`, `forget_ms` in their column types, and `empty` (no bytes) (see
    /// [`Statements::shadow_batch`](super::statements::Statements::shadow_batch)).
    fn shadow_rows() -> String;

    /// Whether a fenced write's error means the write surely never ran (by default, no error
    /// says so).
    fn never_ran(_error: &sqlx::Error) -> bool {
        false
    }

    /// Runs `statement` on `conn`; how many rows it changed.
    fn execute(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs `statement` on `conn` and reads the record row it returns, if any.
    fn fetch_record(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<Option<RecordRow>, StoreError>> + Send;

    /// Runs `statement` on `conn` and reads the record rows of the admin statements.
    fn fetch_infos(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<Vec<InfoRow>, StoreError>> + Send;

    /// Runs the counting statement on `conn`: per state, its count and the oldest creation.
    fn fetch_counts(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<Vec<(String, i64, Option<i64>)>, sqlx::Error>> + Send;

    /// Runs `statement` on `conn` and reads the identities (digests) it returns.
    fn fetch_ids(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<Vec<Vec<u8>>, sqlx::Error>> + Send;

    /// Runs `statement` on `conn` and reads the integer (a fencing token) it returns, if any.
    fn fetch_token(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send;

    /// Runs a purge step that reports how far it reached: how many rows it deleted, and the
    /// latest time among them (`None` if none).
    fn fetch_reach(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<(i64, Option<i64>), sqlx::Error>> + Send;

    /// Runs a statement that returns one integer a row, and returns them (the purge's probe of
    /// which partitions have rows due).
    fn fetch_ints(
        conn: &mut <Self::Db as Database>::Connection,
        statement: Bound,
    ) -> impl Future<Output = Result<Vec<i64>, sqlx::Error>> + Send;
}

/// The part of a [`Dialect`] that is the same code for every database, but over its own
/// types: binding a [`Bound`]'s arguments and reading a record row back.
macro_rules! run_bound_statements {
    ($db:ty) => {
        async fn execute(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<u64, sqlx::Error> {
            Ok(bind(statement).execute(conn).await?.rows_affected())
        }

        async fn fetch_record(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<Option<$crate::store::sql::RecordRow>, $crate::store::StoreError> {
            let row = bind(statement).fetch_optional(conn).await.map_err($crate::store::sql::unavailable)?;
            row.as_ref().map(record_row).transpose()
        }

        async fn fetch_infos(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<Vec<$crate::store::sql::dialect::InfoRow>, $crate::store::StoreError> {
            let rows = bind(statement).fetch_all(conn).await.map_err($crate::store::sql::unavailable)?;
            rows.iter().map(info_row).collect()
        }

        async fn fetch_counts(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<Vec<(String, i64, Option<i64>)>, sqlx::Error> {
            use sqlx::Row;
            let rows = bind(statement).fetch_all(conn).await?;
            rows.iter().map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))).collect()
        }

        async fn fetch_ids(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
            use sqlx::Row;
            let rows = bind(statement).fetch_all(conn).await?;
            rows.iter().map(|row| row.try_get(0)).collect()
        }

        async fn fetch_token(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<Option<i64>, sqlx::Error> {
            use sqlx::Row;
            bind(statement).fetch_optional(conn).await?.map(|row| row.try_get(0)).transpose()
        }

        async fn fetch_reach(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<(i64, Option<i64>), sqlx::Error> {
            use sqlx::Row;
            let row = bind(statement).fetch_one(conn).await?;
            Ok((row.try_get(0)?, row.try_get(1)?))
        }

        async fn fetch_ints(
            conn: &mut <$db as sqlx::Database>::Connection,
            statement: $crate::store::sql::dialect::Bound,
        ) -> Result<Vec<i64>, sqlx::Error> {
            use sqlx::Row;
            bind(statement).fetch_all(conn).await?.iter().map(|row| row.try_get(0)).collect()
        }
    };
}

/// Binds a [`Bound`]'s arguments and decodes record rows, over one database's own types.
macro_rules! bind_and_decode {
    ($db:ty, $row:ty) => {
        fn bind(
            statement: $crate::store::sql::dialect::Bound,
        ) -> sqlx::query::Query<'static, $db, <$db as sqlx::Database>::Arguments> {
            use $crate::store::sql::dialect::Arg;
            let query = sqlx::query(statement.sql).persistent(statement.prepared);
            statement.args.into_iter().fold(query, |query, arg| match arg {
                Arg::Bytes(value) => query.bind(value),
                Arg::Int(value) => query.bind(value),
                Arg::Small(value) => query.bind(value),
                Arg::Flag(value) => query.bind(value),
                Arg::Text(value) => query.bind(value),
                Arg::OptText(value) => query.bind(value),
                Arg::OptBytes(value) => query.bind(value),
            })
        }

        /// A record row, in the column order of the shared read.
        fn record_row(row: &$row) -> Result<$crate::store::sql::RecordRow, $crate::store::StoreError> {
            use sqlx::Row;
            let corrupt = |e: sqlx::Error| $crate::store::StoreError::Corrupt(e.to_string());
            Ok($crate::store::sql::RecordRow {
                state: row.try_get(0).map_err(corrupt)?,
                fingerprint_version: row.try_get(1).map_err(corrupt)?,
                fingerprint: row.try_get(2).map_err(corrupt)?,
                fencing_token: row.try_get(3).map_err(corrupt)?,
                lease_left_ms: row.try_get(4).map_err(corrupt)?,
                response_expired: row.try_get(5).map_err(corrupt)?,
                forgotten: row.try_get(6).map_err(corrupt)?,
                response_status: row.try_get(7).map_err(corrupt)?,
                response_headers: row.try_get(8).map_err(corrupt)?,
                response_body: row.try_get(9).map_err(corrupt)?,
            })
        }

        /// A record row, in the column order of the admin statements.
        fn info_row(row: &$row) -> Result<$crate::store::sql::dialect::InfoRow, $crate::store::StoreError> {
            use sqlx::Row;
            let corrupt = |e: sqlx::Error| $crate::store::StoreError::Corrupt(e.to_string());
            Ok($crate::store::sql::dialect::InfoRow {
                record_id: row.try_get(0).map_err(corrupt)?,
                state: row.try_get(1).map_err(corrupt)?,
                operation: row.try_get(2).map_err(corrupt)?,
                fingerprint_version: row.try_get(3).map_err(corrupt)?,
                fencing_token: row.try_get(4).map_err(corrupt)?,
                created_ms: row.try_get(5).map_err(corrupt)?,
                updated_ms: row.try_get(6).map_err(corrupt)?,
                until_ms: row.try_get(7).map_err(corrupt)?,
                forget_ms: row.try_get(8).map_err(corrupt)?,
                lease_ms: row.try_get(9).map_err(corrupt)?,
                status: row.try_get(10).map_err(corrupt)?,
                headers: row.try_get(11).map_err(corrupt)?,
                attempts: row.try_get(12).map_err(corrupt)?,
                expired: row.try_get(13).map_err(corrupt)?,
                forgotten: row.try_get(14).map_err(corrupt)?,
            })
        }
    };
}

pub(crate) use {bind_and_decode, run_bound_statements};

/// A record's row as the admin statements read it, in their column order.
#[derive(Debug)]
pub(crate) struct InfoRow {
    pub(crate) record_id: Vec<u8>,
    pub(crate) state: String,
    pub(crate) operation: Option<String>,
    pub(crate) fingerprint_version: i16,
    pub(crate) fencing_token: i64,
    pub(crate) created_ms: i64,
    pub(crate) updated_ms: i64,
    pub(crate) until_ms: Option<i64>,
    pub(crate) forget_ms: Option<i64>,
    pub(crate) lease_ms: Option<i64>,
    pub(crate) status: Option<i16>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) attempts: i64,
    pub(crate) expired: bool,
    pub(crate) forgotten: bool,
}
