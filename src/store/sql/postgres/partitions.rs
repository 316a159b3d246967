//! Hash partitions of the records table ([`PostgresStore::hash_partitions`]): the layout a store
//! is configured for, the first migration's text for it, the check that the table in the
//! database has that layout, and the names of the partitions and their primary keys.
//!
//! [`PostgresStore::hash_partitions`]: super::PostgresStore::hash_partitions

use sqlx::PgPool;

/// The one partition statement, repeated for each remainder (see the file's own comment).
const PARTITION: &str = include_str!("../../../../migrations/postgres/0001_hash_partition.sql");

/// Where migration 0001's `CREATE TABLE` ends: the only line that is a bare `);`.
const TABLE_END: &str = "\n);\n";

/// The fewest partitions [`PostgresStore::hash_partitions`](super::PostgresStore::hash_partitions) takes.
pub const MIN_PARTITIONS: u16 = 2;

/// The most partitions [`PostgresStore::hash_partitions`](super::PostgresStore::hash_partitions) takes.
pub const MAX_PARTITIONS: u16 = 1024;

/// How a store's records table is laid out: one table or hash partitions, its answers inline or
/// apart. The two choices are independent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Layout {
    /// `PARTITION BY HASH (record_id)` into this many partitions (0: one table, the default).
    partitions: u16,
    /// Its answers in `<table>_answers` (migration 11).
    answers_apart: bool,
}

impl Layout {
    /// How many partitions the table has (0: it is one table).
    pub(super) fn partitions(self) -> u16 {
        self.partitions
    }

    /// Whether its answers are apart.
    pub(super) fn answers_apart(self) -> bool {
        self.answers_apart
    }

    /// The same layout, hash partitioned into `partitions` (checked by [`check_count`]).
    pub(super) fn with_partitions(self, partitions: u16) -> Self {
        Self { partitions, ..self }
    }

    /// The same layout, its answers apart.
    pub(super) fn with_answers_apart(self) -> Self {
        Self { answers_apart: true, ..self }
    }

    fn describe(self) -> String {
        match (self.partitions, self.answers_apart) {
            (0, false) => "one table (no hash_partitions)".to_owned(),
            (0, true) => "answers_apart".to_owned(),
            (n, false) => format!("hash_partitions({n})"),
            (n, true) => format!("hash_partitions({n}) with answers_apart"),
        }
    }
}

/// A partition count [`PostgresStore::hash_partitions`](super::PostgresStore::hash_partitions)
/// refused: it takes [`MIN_PARTITIONS`] to [`MAX_PARTITIONS`].
///
/// ```
/// use tower_idempotency::store::postgres::InvalidPartitions;
/// # fn demo(store: tower_idempotency::PostgresStore) {
/// let refused: InvalidPartitions = store.hash_partitions(1).unwrap_err();
/// assert_eq!(refused.requested(), 1);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("hash_partitions({requested}): a records table takes {MIN_PARTITIONS} to {MAX_PARTITIONS} hash partitions")]
pub struct InvalidPartitions {
    requested: u16,
}

impl InvalidPartitions {
    /// The count that was refused.
    pub fn requested(&self) -> u16 {
        self.requested
    }
}

/// Checks a requested partition count.
pub(super) fn check_count(requested: u16) -> Result<u16, InvalidPartitions> {
    if (MIN_PARTITIONS..=MAX_PARTITIONS).contains(&requested) {
        Ok(requested)
    } else {
        Err(InvalidPartitions { requested })
    }
}

/// [`PostgresStore::migrate`](super::PostgresStore::migrate) found the records table laid out
/// otherwise than the store is configured for (one table where hash partitions are configured,
/// another partition count, or the other way round), and changed nothing.
///
/// A table's layout is fixed when it is created: PostgreSQL cannot partition a table that holds
/// records in place, nor change a hash partitioning's modulus. Configure the store for the
/// layout the table has, or create a new table (another [`table`](super::PostgresStore::table)
/// name) and copy the records into it.
///
/// It reaches the caller as [`sqlx::migrate::MigrateError::Source`], whose source downcasts to
/// it:
///
/// ```no_run
/// use tower_idempotency::store::postgres::LayoutMismatch;
/// # async fn demo(store: tower_idempotency::PostgresStore) {
/// match store.migrate().await {
///     Err(sqlx::migrate::MigrateError::Source(source)) if source.is::<LayoutMismatch>() => {
///         eprintln!("not migrated: {source}");
///     }
///     other => other.expect("migrate"),
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the records table {table} is {found}, but the store is configured for {configured}: a table's layout is fixed when it is created, so configure the store for the table's layout, or migrate a new table and copy the records into it"
)]
pub struct LayoutMismatch {
    table: String,
    found: String,
    configured: String,
}

impl LayoutMismatch {
    /// The table, schema-qualified and quoted.
    pub fn table(&self) -> &str {
        &self.table
    }
}

/// The name of the partition that holds remainder `remainder`: the table's name, `_p` and the
/// remainder in at least three digits (`idempotency_records_p000` ...). A table name has at most
/// 48 bytes, so the partition's name and its primary key's (`..._p1023_pkey`) fit in
/// PostgreSQL's 63.
pub(super) fn partition_name(table: &str, remainder: u16) -> String {
    format!("{table}_p{remainder:03}")
}

/// Whether `constraint` is the primary key of one of `partitions` partitions of `table`: a
/// unique violation on a partitioned table names the partition's index, not the table's.
pub(super) fn is_partition_key(table: &str, partitions: u16, constraint: &str) -> bool {
    let remainder = constraint.strip_prefix(table).and_then(|rest| rest.strip_prefix("_p"));
    let Some(remainder) = remainder.and_then(|rest| rest.strip_suffix("_pkey")) else { return false };
    remainder.parse::<u16>().is_ok_and(|r| r < partitions && format!("{}_pkey", partition_name(table, r)) == constraint)
}

/// Migration 0001 for `partitions` hash partitions: `create_records` (0001's text, placeholders
/// still in) with its table created `PARTITION BY HASH (record_id)` and the partitions created
/// right after it, before the sequence, indexes and functions that follow, which then apply to
/// the partitioned table as they are. Everything else in the text is 0001's.
pub(super) fn create_records(create_records: &str, partitions: u16) -> String {
    debug_assert_eq!(create_records.matches(TABLE_END).count(), 1, "0001's CREATE TABLE ends on the one bare `);`");
    // The file's comment once, then its statement for each remainder.
    let (comment, statement): (Vec<&str>, Vec<&str>) = PARTITION.lines().partition(|line| line.starts_with("--"));
    let mut tail = format!("\n) PARTITION BY HASH (record_id);\n\n{}\n", comment.join("\n"));
    let statement = statement.join("\n");
    for remainder in 0..partitions {
        tail.push_str(
            &statement
                .replace("{partition}", &partition_name("{table}", remainder))
                .replace("{modulus}", &partitions.to_string())
                .replace("{remainder}", &remainder.to_string()),
        );
        tail.push('\n');
    }
    create_records.replacen(TABLE_END, &tail, 1)
}

/// Checks that the table `schema`.`table`, if it exists, is laid out as `layout` says: one
/// table, or hash partitioned on `record_id` into that many partitions. A table that does not
/// exist yet passes (the migration creates it). A table whose answers are apart
/// (`<table>_answers` exists) is refused to a store without them; a store with them takes its
/// table either way (its migration moves it to answers apart).
pub(super) async fn check_layout(
    pool: &PgPool,
    schema: &str,
    table: &str,
    layout: Layout,
) -> Result<(), sqlx::migrate::MigrateError> {
    let found: Option<(String, Option<String>, i64, bool)> = sqlx::query_as(
        "SELECT c.relkind::text, pg_get_partkeydef(c.oid), \
                (SELECT count(*) FROM pg_inherits i WHERE i.inhparent = c.oid), \
                EXISTS (SELECT 1 FROM pg_class a WHERE a.relnamespace = n.oid AND a.relname = $2 || '_answers') \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2",
    )
    .bind(schema)
    .bind(table)
    .fetch_optional(pool)
    .await?;
    let Some((kind, key, count, apart)) = found else { return Ok(()) };
    let partitions_match = match (layout.partitions, kind.as_str(), key.as_deref()) {
        (0, "r", _) => true,
        (n, "p", Some("HASH (record_id)")) => count == i64::from(n),
        _ => false,
    };
    let matches = partitions_match && (layout.answers_apart || !apart);
    if matches {
        return Ok(());
    }
    let found = match (kind.as_str(), key) {
        ("r", _) if apart => "one table with its answers apart (answers_apart)".to_owned(),
        ("r", _) => "one table, not partitioned".to_owned(),
        ("p", Some(key)) if key == "HASH (record_id)" && apart => {
            format!("hash partitioned into {count} partitions with its answers apart (answers_apart)")
        }
        ("p", Some(key)) if key == "HASH (record_id)" => format!("hash partitioned into {count} partitions"),
        ("p", Some(key)) => format!("partitioned by {key} into {count} partitions"),
        (kind, _) => format!("not a table (pg_class.relkind {kind:?})"),
    };
    Err(sqlx::migrate::MigrateError::Source(Box::new(LayoutMismatch {
        table: format!("\"{schema}\".\"{table}\""),
        found,
        configured: layout.describe(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sql::answers::Answers;
    use crate::store::sql::dialect::Arg;
    use crate::store::sql::postgres::Pg;
    use crate::store::sql::purge::Purge;

    const CREATE_RECORDS: &str = include_str!("../../../../migrations/postgres/0001_create_records.sql");

    #[test]
    fn the_partitioned_first_migration_is_0001_with_the_table_partitioned() {
        let sql = create_records(CREATE_RECORDS, 4);
        assert_eq!(sql.matches("PARTITION BY HASH (record_id)").count(), 1);
        assert_eq!(sql.matches("PARTITION OF \"{schema}\".\"{table}\"").count(), 4);
        assert!(sql.contains("\"{schema}\".\"{table}_p003\" PARTITION OF"));
        assert!(sql.contains("FOR VALUES WITH (MODULUS 4, REMAINDER 3)"));
        assert!(!sql.contains("REMAINDER 4)"));
        // The partitions come right after the table, before the sequence, indexes and functions.
        let (table, rest) = sql.split_once("PARTITION BY HASH").unwrap();
        assert!(table.contains("CONSTRAINT \"{table}_pkey\" PRIMARY KEY (record_id)"));
        assert!(rest.find("PARTITION OF").unwrap() < rest.find("CREATE SEQUENCE").unwrap());
        // Take the partitions out again and what is left is 0001, byte for byte.
        let partitions_start = sql.find(") PARTITION BY HASH").unwrap();
        let sequence = sql.find("\nCREATE SEQUENCE").unwrap();
        let unpartitioned = format!("{});\n{}", &sql[..partitions_start], &sql[sequence..]);
        assert_eq!(unpartitioned, CREATE_RECORDS);
    }

    #[test]
    fn partition_keys_are_recognised_by_name() {
        assert_eq!(partition_name("t", 7), "t_p007");
        assert_eq!(partition_name("t", 1023), "t_p1023");
        assert!(is_partition_key("t", 64, "t_p000_pkey"));
        assert!(is_partition_key("t", 64, "t_p063_pkey"));
        assert!(is_partition_key("t", 1024, "t_p1023_pkey"));
        for other in ["t_pkey", "t_p064_pkey", "t_p7_pkey", "t_p0007_pkey", "u_p001_pkey", "t_p001_other", "t_p_pkey"] {
            assert!(!is_partition_key("t", 64, other), "{other}");
        }
        assert!(!is_partition_key("t", 0, "t_p000_pkey"));
    }

    #[test]
    fn partition_counts_are_checked() {
        assert_eq!(check_count(1), Err(InvalidPartitions { requested: 1 }));
        assert_eq!(check_count(0).unwrap_err().requested(), 0);
        assert_eq!(check_count(1025).unwrap_err().requested(), 1025);
        assert_eq!(check_count(2), Ok(2));
        assert_eq!(check_count(1024), Ok(1024));
    }

    // The purge's probe of the partitions (`store::sql::purge`), with PostgreSQL's SQL.
    #[test]
    fn one_table_is_walked_without_a_probe() {
        let purge = Purge::new::<Pg>(&["t".to_owned()], &Answers::Inline);
        assert_eq!((purge.steps(), purge.partitioned()), (2, false));
        assert!(purge.probe(0, &purge.froms(0)).is_none());
    }

    #[test]
    fn partitions_are_probed_in_one_statement_from_where_each_walk_reached() {
        let partitions = ["p0".to_owned(), "p1".to_owned(), "p2".to_owned()];
        let purge = Purge::new::<Pg>(&partitions, &Answers::Apart("a".into()));
        assert_eq!((purge.steps(), purge.partitioned()), (3, true));
        let walked = |step| purge.walk(step, 0, None).count();
        assert_eq!((walked(0), walked(1), walked(2)), (3, 3, 1), "the answers table once");
        assert_eq!(purge.walk(0, 4, None).collect::<Vec<_>>(), vec![1, 2, 0], "starting one further on");
        assert_eq!(purge.walk(0, 4, Some(&[0, 2])).collect::<Vec<_>>(), vec![2, 0], "only those due");
        assert!(purge.probe(2, &[0]).is_none());
        purge.reached(0, 1, Some(42));
        purge.froms(0); // The first walk of each partition starts from the beginning.
        let froms = purge.froms(0);
        assert_eq!(froms, vec![0, 42, 0]);
        let probe = purge.probe(0, &froms).expect("a probe");
        let sql = probe.sql.as_str();
        assert_eq!(sql.matches("(SELECT forget_at FROM").count(), 3, "{sql}");
        assert_eq!(sql.matches("ORDER BY forget_at LIMIT 1) IS NOT NULL").count(), 3, "{sql}");
        assert!(
            sql.contains(
                "SELECT 1::bigint WHERE (SELECT forget_at FROM p1 WHERE forget_at >= 'epoch'::timestamptz + $2::bigint"
            ),
            "{sql}"
        );
        assert!(!sql.contains("{from}") && !sql.contains("$4"), "a parameter for each walk's start: {sql}");
        let starts: Vec<Option<i64>> =
            probe.args.iter().map(|arg| if let Arg::Int(from) = arg { *from } else { None }).collect();
        assert_eq!(starts, vec![Some(0), Some(42), Some(0)]);
        assert!(probe.prepared, "kept on the connection");
        // The same statement whatever the starts, so that it is prepared once.
        purge.reached(0, 2, Some(7));
        assert_eq!(purge.probe(0, &purge.froms(0)).expect("a probe").sql.as_str(), sql);
        // A step that does not keep track of where it reached has no parameters.
        let expire = purge.probe(1, &purge.froms(1)).expect("a probe");
        assert!(expire.args.is_empty() && !expire.sql.as_str().contains('$'), "{}", expire.sql.as_str());
    }

    #[test]
    fn the_step_of_inline_leftovers_is_taken_by_every_64th_purge_once_none_is_due() {
        let purge = Purge::new::<Pg>(&["p0".to_owned(), "p1".to_owned()], &Answers::Apart("a".into()));
        let taken = |purges: usize| (0..purges).map(|_| purge.takes(1)).filter(|&taken| taken).count();
        assert_eq!(taken(5), 5, "until a purge leaves none due, every purge takes it");
        purge.cleared(1);
        assert_eq!(taken(63), 0, "the next 63 skip it");
        assert!(purge.takes(1), "the 64th takes it");
        assert!(purge.takes(1), "and so does the next, until one leaves none due");
        purge.cleared(1);
        purge.cleared(0);
        purge.cleared(2);
        assert_eq!((0..10).filter(|_| purge.takes(0) && purge.takes(2)).count(), 10, "the other steps always");
        assert_eq!(taken(63), 0);
        let inline = Purge::new::<Pg>(&["p0".to_owned(), "p1".to_owned()], &Answers::Inline);
        inline.cleared(0);
        inline.cleared(1);
        assert!((0..10).all(|_| inline.takes(0) && inline.takes(1)), "inline, every step always");
    }
}
