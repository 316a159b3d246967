//! PostgreSQL's SQL for the statements the SQL stores share ([`Dialect`]).

use std::time::Duration;

use sqlx::Postgres;

use super::{bind, info_row, millis, record_row};
use crate::store::sql::dialect::{Arg, Dialect, run_bound_statements};

/// PostgreSQL's SQL: `$n` parameters, the database's `clock_timestamp()` for "now", times as
/// `timestamptz`, fencing tokens from a sequence.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pg;

impl Dialect for Pg {
    type Db = Postgres;

    const SIGIL: &'static str = "$";

    const FALSE: &'static str = "false";

    const BATCH_LOCK: &'static str = " FOR UPDATE SKIP LOCKED";

    // The picked rows' `ctid`s as an array: one TID scan, no primary-key lookup per row (half
    // the purge's time at 5,000 a batch). Locked as they are picked, so concurrent purges skip
    // them; the condition is checked again on the row an address finds, so a row updated since
    // its pick (its old address then names a dead version) is left for the next batch.
    fn purge_pick(t: &str, condition: &str, order: &str, limit: &str) -> String {
        format!(
            "ctid = ANY(ARRAY(SELECT ctid FROM {t} WHERE {condition} ORDER BY {order} LIMIT {limit}{lock})) \
             AND {condition}",
            lock = Self::BATCH_LOCK
        )
    }

    fn now(_: usize) -> String {
        "clock_timestamp()".into()
    }

    // The statement's start: `clock_timestamp()` is volatile, so a comparison with it is
    // checked row by row after the scan and never bounds an index range.
    fn stable_now(_: usize) -> String {
        "statement_timestamp()".into()
    }

    fn later(n: usize) -> String {
        format!("clock_timestamp() + ${n}::float8 * interval '1 millisecond'")
    }

    fn later_arg(_: Option<i64>, after: Duration) -> Arg {
        Arg::Int(Some(millis(after)))
    }

    fn millis_until(column: &str, now: &str) -> String {
        format!("(EXTRACT(EPOCH FROM ({column} - {now})) * 1000)::bigint")
    }

    fn epoch_ms(column: &str) -> String {
        format!("(EXTRACT(EPOCH FROM {column}) * 1000)::bigint")
    }

    const LEAST: &'static str = "LEAST";

    const MATERIALIZED: &'static str = " MATERIALIZED";

    // An array of the picked ids, looked up on the primary key whatever the statistics say.
    const IN_PICKED: &'static str = "record_id = ANY(ARRAY(SELECT record_id FROM picked))";

    fn bigint(n: usize) -> String {
        format!("${n}::bigint")
    }

    fn plus_ms(now: &str, ms: &str) -> String {
        format!("{now} + ({ms}) * interval '1 millisecond'")
    }

    // `jsonb_array_elements` over the array; `decode` turns the digests back into bytes.
    // (Migration 0006's `<table>_shadow` function, which wrote one record in the handler's own
    // transaction, is no longer called; it stays for the binaries of a rolling upgrade.)
    fn shadow_rows() -> String {
        "(SELECT decode(e ->> 0, 'hex') AS id, e ->> 1 AS state, (e ->> 2)::smallint AS version, \
                 decode(e ->> 3, 'hex') AS fingerprint, (e ->> 4)::smallint AS status, \
                 (e ->> 5)::bigint AS keep_ms, (e ->> 6)::bigint AS forget_ms, ''::bytea AS empty \
          FROM jsonb_array_elements($1::text::jsonb) AS e)"
            .into()
    }

    run_bound_statements!(Postgres);
}
