//! The records table `big` filled by SQL (`INSERT ... SELECT generate_series`, not through the
//! layer), for the benchmarks that need millions of records (`pg_scale`, `pg_vacuum`): SHA-256
//! identities and fingerprints, a 300-byte stored body and the two headers of a created order,
//! the labels the store writes with every record (operation, scope digest of one of 1000
//! tenants, operation id), in the groups of [`Groups`], in that order.

use std::time::Instant;

use sqlx::PgPool;

use crate::stored_answer::{answer, answer_body, hex};
use crate::table_size;

/// The operation every filled record is labelled with, as a route's under an authentication
/// layer's scope are.
pub const OPERATION: &str = "POST /orders";
/// Rows per fill statement.
const CHUNK: u64 = 500_000;

/// How many of the filled records fall in each group, written in this order (the rest, written
/// last, are tombstones past their time, which the purge deletes).
#[derive(Debug, Clone, Copy)]
pub struct Groups {
    /// Completed records whose answer is replayable.
    pub live: u64,
    /// Completed records past their response retention: the purge makes them tombstones.
    pub stale: u64,
    /// Tombstones not yet past their time: the purge leaves them.
    pub kept_tombstones: u64,
}

impl Groups {
    /// The records that carry an answer (the first two groups).
    pub fn answered(&self) -> u64 {
        self.live + self.stale
    }

    /// Where the records the purge deletes start.
    fn deletable_from(&self) -> u64 {
        self.answered() + self.kept_tombstones
    }
}

/// Fills `big`'s table by SQL to `rows` records in `groups` (with its answers in `big_answers` if
/// `apart`); returns the table's bytes when the records with an answer were in.
pub async fn fill(pool: &PgPool, rows: u64, groups: Groups, apart: bool) -> u64 {
    let (live, answered, deletable) = (groups.live, groups.answered(), groups.deletable_from());
    let headers = hex(&answer().encode_fields());
    let body = hex(answer_body().as_bytes());
    let started = Instant::now();
    let (mut from, mut answered_bytes) = (0, 0);
    while from < rows {
        // Chunks end where the answered records do, so their size is read on their own.
        let to = (from + CHUNK).min(if from < answered { answered } else { rows });
        // The identity and fingerprint are SHA-256 digests, as the layer's are (random order in
        // the primary key); the answer varies in its first 16 bytes, so no two rows are alike.
        // Every row's times differ (by a microsecond a row), as the store's `clock_timestamp()`
        // makes them: equal times would let the expiry indexes deduplicate their keys and look
        // several times smaller than they are. The rows take the form the store writes
        // (`pg_scale`'s `row_sizes` checks it): no fencing token, attempts or scope digest, the
        // scope inside the operation id's key, and `updated_at` only once a record changed (a
        // tombstone).
        let step = "g * interval '1 microsecond'";
        let statement = format!(
            "INSERT INTO big (record_id, state, fingerprint_version, fingerprint, fencing_token, response_status, \
                 response_headers, response_body, response_until, forget_at, created_at, updated_at, attempts, \
                 operation, scope_digest, operation_id) \
             SELECT sha256(int8send(g)), \
                 CASE WHEN g < {answered} THEN 'completed' ELSE 'expired' END, 2, sha256(int8send(-g)), NULL, \
                 CASE WHEN g < {answered} THEN 201 END, \
                 CASE WHEN g < {answered} THEN '\\x{headers}'::bytea END, \
                 CASE WHEN g < {answered} THEN overlay('\\x{body}'::bytea placing decode(md5(g::text), 'hex') from 1) END, \
                 CASE WHEN g < {live} THEN now() + interval '1 day' ELSE now() - interval '1 hour' END + {step}, \
                 CASE WHEN g < {deletable} THEN now() + interval '8 days' ELSE now() - interval '1 minute' END + {step}, \
                 now() - interval '1 day' + {step}, \
                 CASE WHEN g < {answered} THEN NULL ELSE now() - interval '1 hour' + {step} END, NULL, \
                 '{OPERATION}', NULL, substr(sha256(int8send(g) || '\\x01'::bytea), 1, 16) \
             FROM generate_series({from}::bigint, {to}::bigint - 1) g"
        );
        let statement = if apart { apart_fill(from, to, groups, &headers, &body) } else { statement };
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(pool).await.expect("fill");
        from = to;
        if from == answered {
            table_size::vacuum(pool).await;
            let bytes = table_size::total_bytes(pool).await;
            answered_bytes = bytes;
            println!(
                "filled {from} records with answers in {:.0?}: {} bytes per record (heap + indexes + TOAST)",
                started.elapsed(),
                bytes / from
            );
            table_size::print_sizes(pool, from).await;
        } else if from % 2_000_000 < CHUNK {
            println!("  {from} records, {:.0?}", started.elapsed());
        }
    }
    if apart {
        // The store's own answers are numbered after the fill's.
        let sql = "SELECT setval(pg_get_serial_sequence('big_answers', 'seq'), $1)";
        sqlx::query(sql).bind(rows as i64).execute(pool).await.expect("answer numbers");
    }
    answered_bytes
}

/// The fill's rows `from..to` with answers apart: the same records as the fill's statement, each
/// numbered `g`, its answer (if it has one) the answer numbered `g`, and the record in the form
/// the store writes it (no answer inline; a tombstone is a record whose answer is gone, never
/// written since).
fn apart_fill(from: u64, to: u64, groups: Groups, headers: &str, body: &str) -> String {
    let (live, answered, deletable) = (groups.live, groups.answered(), groups.deletable_from());
    let step = "g * interval '1 microsecond'";
    let until =
        format!("CASE WHEN g < {live} THEN now() + interval '1 day' ELSE now() - interval '1 hour' END + {step}");
    let answers = format!(
        "INSERT INTO big_answers (seq, keep_until, status, headers, body) OVERRIDING SYSTEM VALUE \
         SELECT g, {until}, 201, '\\x{headers}'::bytea, \
             overlay('\\x{body}'::bytea placing decode(md5(g::text), 'hex') from 1) \
         FROM generate_series({from}::bigint, {to}::bigint - 1) g WHERE g < {answered};"
    );
    format!(
        "{answers} \
         INSERT INTO big (record_id, state, fingerprint_version, fingerprint, fencing_token, response_until, forget_at, \
             created_at, updated_at, attempts, operation, scope_digest, operation_id, answer_seq) \
         SELECT sha256(int8send(g)), 'completed', 2, sha256(int8send(-g)), NULL, {until}, \
             CASE WHEN g < {deletable} THEN now() + interval '8 days' ELSE now() - interval '1 minute' END + {step}, \
             now() - interval '1 day' + {step}, NULL, NULL, '{OPERATION}', NULL, \
             substr(sha256(int8send(g) || '\\x01'::bytea), 1, 16), g \
         FROM generate_series({from}::bigint, {to}::bigint - 1) g"
    )
}
