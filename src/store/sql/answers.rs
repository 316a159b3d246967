//! Where a SQL store keeps a record's answer: in the records table's own columns (inline, every
//! store's default), or in a table of its own beside it ("answers apart", PostgreSQL's
//! [`answers_apart`](super::postgres::PostgresStore::answers_apart)).
//!
//! Apart, the answer's status, fields and body are a row of `<table>_answers`, numbered in the
//! order answers are written and carrying the time its replay ends; the record points at it
//! (`answer_seq`). A record past its response retention is a tombstone by its time alone (every
//! read already compares it), so making one writes nothing: the purge deletes the answers that
//! are due, the earliest first, and the record row is not touched until it is forgotten.
//!
//! Each method gives the piece of SQL that differs; inline, the pieces are the statements'
//! text as it always was.

/// An answer written by a statement, each part given as SQL: its status, fields and body, and
/// the time its replay ends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AnswerSql<'a> {
    pub(crate) status: &'a str,
    pub(crate) fields: &'a str,
    pub(crate) body: &'a str,
    pub(crate) until: &'a str,
}

/// Where a store's answers are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answers {
    /// In the record's own `response_status`, `response_headers` and `response_body`.
    Inline,
    /// In a table of their own (qualified and quoted), found by the record's `answer_seq`.
    /// Records written inline before (by a store without it, or before its migration) keep
    /// their answers where they are and are read as before.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Apart(String),
}

impl Answers {
    /// The `FROM` of a read of the records table `t`: apart, joined to its answer, looked up
    /// by its key in a lateral subquery that the planner keeps apart (`OFFSET 0`), so that
    /// every plan of the read is a lookup of one answer. A plain join lets a generic plan on hash
    /// partitions (`plan_cache_mode = force_generic_plan`, `docs/scale.md`), which counts a row
    /// for every partition, hash the whole answers table instead while its statistics say it is
    /// small: a replay then scans every answer.
    pub(crate) fn from(&self, t: &str) -> String {
        match self {
            Answers::Inline => t.to_owned(),
            Answers::Apart(answers) => format!(
                "{t} LEFT JOIN LATERAL (SELECT seq, status, headers, body FROM {answers} \
                 WHERE seq = answer_seq OFFSET 0) answer ON true"
            ),
        }
    }

    /// The answer's status, fields and body, as a read [`from`](Self::from) selects them.
    pub(crate) fn read_columns(&self) -> &'static str {
        match self {
            Answers::Inline => "response_status, response_headers, response_body",
            Answers::Apart(_) => {
                "COALESCE(status, response_status), COALESCE(headers, response_headers), COALESCE(body, response_body)"
            }
        }
    }

    /// Whether the record is past its response retention, given `past` (the comparison of its
    /// time), in a read [`from`](Self::from): apart, also a record whose answer is gone
    /// (deleted at its own time, which is the record's), so that a record is never answered
    /// without the answer it pointed at.
    pub(crate) fn expired(&self, past: String) -> String {
        match self {
            Answers::Inline => past,
            Answers::Apart(_) => format!("({past} OR (answer_seq IS NOT NULL AND seq IS NULL))"),
        }
    }

    /// The answer's status and fields, and whether the record is past its response retention
    /// (given `past`, as [`expired`](Self::expired)), for a statement on the records table
    /// alone (an `UPDATE`'s `RETURNING`): apart, the answer looked up by subqueries.
    pub(crate) fn looked_up(&self, past: String) -> (String, String) {
        match self {
            Answers::Inline => ("response_status, response_headers".to_owned(), past),
            Answers::Apart(answers) => {
                let of = |column: &str| format!("(SELECT {column} FROM {answers} a WHERE a.seq = answer_seq)");
                (
                    format!(
                        "COALESCE({}, response_status), COALESCE({}, response_headers)",
                        of("status"),
                        of("headers")
                    ),
                    format!("({past} OR (answer_seq IS NOT NULL AND {} IS NULL))", of("seq")),
                )
            }
        }
    }

    /// What a statement that writes `answer` starts with: apart, the answer's row, written in
    /// a `WITH`.
    pub(crate) fn write(&self, answer: &AnswerSql<'_>) -> String {
        let AnswerSql { status, fields, body, until } = answer;
        match self {
            Answers::Inline => String::new(),
            Answers::Apart(answers) => format!(
                "WITH answer AS (INSERT INTO {answers} (keep_until, status, headers, body) \
                 VALUES ({until}, {status}, {fields}, {body}) RETURNING seq, keep_until) "
            ),
        }
    }

    /// What an `UPDATE` of one record that writes its answer starts with, where the `UPDATE`
    /// finds the record by `condition` on `t` (its `WHERE`, which names the record's primary
    /// key): apart, the answer's row, written in a `WITH` only if `condition` finds the record.
    /// A settlement of a record no longer unknown under its token then writes no answer that
    /// nothing points at. (Two writers racing for one record can still both find it in their
    /// statements' snapshots; the loser's answer row is then deleted by the purge at its time,
    /// like any other.) It costs the statement a look at the record by its primary key, so a
    /// leased outcome, on every request, writes with [`write`](Self::write) instead.
    fn write_for(&self, t: &str, condition: &str, answer: &AnswerSql<'_>) -> String {
        let AnswerSql { status, fields, body, until } = answer;
        match self {
            Answers::Inline => String::new(),
            Answers::Apart(answers) => format!(
                "WITH answer AS (INSERT INTO {answers} (keep_until, status, headers, body) \
                 SELECT {until}, {status}, {fields}, {body} FROM {t} WHERE {condition} RETURNING seq, keep_until) "
            ),
        }
    }

    /// As [`write_for`](Self::write_for), for an `UPDATE` that replaces the record's answer
    /// (a settlement of an `unknown` record, which has its handler's answer): apart, the answer
    /// the record pointed at is deleted in the same statement, so that it does not stay behind,
    /// pointed at by nothing, until its own time. Should the `UPDATE` itself then not find the
    /// record (its retention ending between the two), the record is past its retention and a
    /// tombstone either way: a read of a record whose answer is gone answers that.
    pub(crate) fn replace_for(&self, t: &str, condition: &str, answer: &AnswerSql<'_>) -> String {
        let write = self.write_for(t, condition, answer);
        let Some(answers) = self.table() else { return write };
        format!(
            "{write}, replaced AS (DELETE FROM {answers} WHERE seq = (SELECT answer_seq FROM {t} WHERE {condition})) ",
            write = write.trim_end(),
        )
    }

    /// An `UPDATE`'s assignments of `answer` and of the record's response retention (the
    /// answer's `until`): inline, the columns; apart, the answer that [`write`](Self::write)
    /// wrote, and no answer inline.
    pub(crate) fn set(&self, answer: &AnswerSql<'_>) -> String {
        let AnswerSql { status, fields, body, until } = answer;
        match self {
            Answers::Inline => format!(
                "response_status = {status}, response_headers = {fields}, response_body = {body}, \
                 response_until = {until}"
            ),
            Answers::Apart(_) => "response_status = NULL, response_headers = NULL, response_body = NULL, \
                 answer_seq = (SELECT seq FROM answer), response_until = (SELECT keep_until FROM answer)"
                .to_owned(),
        }
    }

    /// The assignment that unlinks a record from its answer, where a statement takes the
    /// identity over or replaces its answer with none (with a leading comma; inline, nothing).
    pub(crate) fn unlink(&self) -> &'static str {
        match self {
            Answers::Inline => "",
            Answers::Apart(_) => ", answer_seq = NULL",
        }
    }

    /// Apart, atomic mode's INSERT of a record into `t` with its answer, the same parameters
    /// as the inline INSERT's (`until` and `forget` the times from them): the answer's row
    /// first, in the same statement, and the record pointing at it and taking its time.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn record_insert(&self, t: &str, until: &str, forget: &str) -> Option<String> {
        self.table()?;
        Some(format!(
            "{write}INSERT INTO {t} (record_id, state, fingerprint_version, fingerprint, fencing_token, \
                 response_until, forget_at, updated_at, attempts, operation, operation_id, answer_seq) \
             VALUES ($1, $2, $3, $4, NULL, (SELECT keep_until FROM answer), {forget}, NULL, NULL, $10, $11, \
                     (SELECT seq FROM answer))",
            write = self.write(&AnswerSql { status: "$5", fields: "$6", body: "$7", until }),
        ))
    }

    /// The answers table, if apart.
    pub(crate) fn table(&self) -> Option<&str> {
        match self {
            Answers::Inline => None,
            Answers::Apart(answers) => Some(answers),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{AnswerSql, Answers};

    const ANSWER: AnswerSql<'static> = AnswerSql { status: "$1", fields: "$2", body: "$3", until: "$4" };

    #[test]
    fn inline_pieces_leave_the_statements_as_they_were() {
        let inline = Answers::Inline;
        assert_eq!(inline.from("t"), "t");
        assert_eq!(inline.expired("x".into()), "x");
        assert_eq!(inline.looked_up("x".into()), ("response_status, response_headers".to_owned(), "x".to_owned()));
        assert_eq!(inline.write(&ANSWER), "");
        assert_eq!(inline.unlink(), "");
        assert_eq!(inline.table(), None);
    }

    #[test]
    fn apart_reads_join_the_answer_and_writes_go_through_it() {
        let apart = Answers::Apart("a".into());
        assert_eq!(
            apart.from("t"),
            "t LEFT JOIN LATERAL (SELECT seq, status, headers, body FROM a WHERE seq = answer_seq OFFSET 0) answer ON true"
        );
        assert!(apart.expired("x".into()).contains("answer_seq IS NOT NULL AND seq IS NULL"));
        assert!(apart.write(&ANSWER).starts_with("WITH answer AS (INSERT INTO a "));
        assert_eq!(
            apart.write_for("t", "record_id = $9", &ANSWER),
            "WITH answer AS (INSERT INTO a (keep_until, status, headers, body) \
             SELECT $4, $1, $2, $3 FROM t WHERE record_id = $9 RETURNING seq, keep_until) "
        );
        assert_eq!(Answers::Inline.write_for("t", "record_id = $9", &ANSWER), "");
        assert_eq!(
            apart.replace_for("t", "record_id = $9", &ANSWER),
            "WITH answer AS (INSERT INTO a (keep_until, status, headers, body) \
             SELECT $4, $1, $2, $3 FROM t WHERE record_id = $9 RETURNING seq, keep_until), \
             replaced AS (DELETE FROM a WHERE seq = (SELECT answer_seq FROM t WHERE record_id = $9)) "
        );
        assert_eq!(Answers::Inline.replace_for("t", "record_id = $9", &ANSWER), "");
        assert!(apart.set(&ANSWER).contains("answer_seq = (SELECT seq FROM answer)"));
        assert_eq!(apart.table(), Some("a"));
    }
}
