//! What `big`, the records table `pg_scale` fills, takes on disk: in all, and heap, TOAST and
//! each index apart, summed over its partitions if it has them, with its answers table
//! (`big_answers`) if its answers are apart.

use sqlx::PgPool;

/// Whether `big` keeps its answers apart (`PostgresStore::answers_apart`): it has `big_answers`.
pub async fn answers_apart(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT to_regclass('big_answers') IS NOT NULL").fetch_one(pool).await.unwrap()
}

/// Vacuums and analyses `big` (and its answers table), so that its sizes are what its rows need.
pub async fn vacuum(pool: &PgPool) {
    sqlx::raw_sql("VACUUM (ANALYZE) big").execute(pool).await.expect("vacuum");
    if answers_apart(pool).await {
        sqlx::raw_sql("VACUUM (ANALYZE) big_answers").execute(pool).await.expect("vacuum");
    }
}

/// `big` and, if it is partitioned, its partitions (a partitioned table holds no data itself).
const BIG_TABLES: &str = "SELECT 'big'::regclass AS rel UNION SELECT relid FROM pg_partition_tree('big')";

/// [`BIG_TABLES`] and the answers table, if there is one.
const BIG_RELATIONS: &str = "SELECT 'big'::regclass AS rel UNION SELECT relid FROM pg_partition_tree('big') \
                             UNION SELECT to_regclass('big_answers') WHERE to_regclass('big_answers') IS NOT NULL";

/// Heap, TOAST and indexes of `big`, in bytes.
pub async fn total_bytes(pool: &PgPool) -> u64 {
    let sql = format!("SELECT sum(pg_total_relation_size(rel))::bigint FROM ({BIG_RELATIONS}) r");
    let bytes: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap();
    bytes as u64
}

/// Prints `big`'s heap, TOAST and each index: MiB, and bytes a record of `records`.
pub async fn print_sizes(pool: &PgPool, records: u64) {
    // An index of a partitioned table is the sum of its partitions' indexes.
    let sql = format!(
        "SELECT 'heap', sum(pg_relation_size(rel))::bigint FROM ({BIG_TABLES}) r \
         UNION ALL SELECT 'big_answers heap', pg_relation_size(to_regclass('big_answers')) \
             WHERE to_regclass('big_answers') IS NOT NULL \
         UNION ALL SELECT 'toast', COALESCE(sum(pg_total_relation_size(reltoastrelid)), 0)::bigint FROM pg_class \
             WHERE oid IN (SELECT rel FROM ({BIG_RELATIONS}) r) AND reltoastrelid <> 0 \
         UNION ALL SELECT indexrelid::regclass::text, \
                (SELECT sum(pg_relation_size(part)) FROM (SELECT indexrelid AS part \
                     UNION SELECT relid FROM pg_partition_tree(indexrelid)) p)::bigint \
             FROM pg_index WHERE indrelid = 'big'::regclass OR indrelid = to_regclass('big_answers')"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(pool).await.unwrap();
    for (name, bytes) in rows {
        println!(
            "  {name:<28} {:>8.1} MiB  {:>6.1} bytes/record",
            bytes as f64 / 1048576.0,
            bytes as f64 / records as f64
        );
    }
}
