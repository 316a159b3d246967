//! The transactions `pg_claim_parts` and `pg_instructions` take apart: the statements the store
//! and the `pg_orders` floors send, piece by piece, as plain sqlx transactions with no layer
//! (`pg_claim_parts`' module documentation says what each part is).

use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, PgPool};
use tower_idempotency::{PostgresStore, Scope};

/// The records table `PostgresStore::new` migrates, and its claim function.
pub const RECORDS: &str = "\"public\".\"idempotency_records\"";
pub const CLAIM_FIRST: &str = "\"public\".\"idempotency_records_claim_first\"";

/// The order every transaction writes (the body `pg_orders` posts).
pub const ORDER: &str = "{\"sku\":\"book-42\",\"quantity\":1,\"amount_minor\":129900,\"currency\":\"EUR\"}";

/// The pieces, in the order they are printed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Part {
    BeginCommit,
    BeginSelect,
    BeginRead,
    PreparedRead,
    BeginClaim,
    PreparedClaim,
    Floor,
    FloorLabels,
    FloorRead,
    FloorPreparedRead,
    Atomic,
    AtomicPreparedClaim,
    InsertClaim,
    LockThenRead,
}

pub const PARTS: [Part; 14] = [
    Part::BeginCommit,
    Part::BeginSelect,
    Part::BeginRead,
    Part::PreparedRead,
    Part::BeginClaim,
    Part::PreparedClaim,
    Part::Floor,
    Part::FloorLabels,
    Part::FloorRead,
    Part::FloorPreparedRead,
    Part::Atomic,
    Part::AtomicPreparedClaim,
    Part::InsertClaim,
    Part::LockThenRead,
];

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::BeginCommit => "begin/commit",
            Part::BeginSelect => "begin+select",
            Part::BeginRead => "begin+read",
            Part::PreparedRead => "prepared read",
            Part::BeginClaim => "begin+claim",
            Part::PreparedClaim => "prepared claim",
            Part::Floor => "floor",
            Part::FloorLabels => "floor+labels",
            Part::FloorRead => "floor+read",
            Part::FloorPreparedRead => "floor+prepared read",
            Part::Atomic => "atomic",
            Part::AtomicPreparedClaim => "atomic, prepared claim",
            Part::InsertClaim => "insert claim",
            Part::LockThenRead => "lock, prepared read",
        }
    }
}

/// One transaction's identity: a record id, and the values derived from it as the store
/// derives them.
struct Identity {
    record_id: [u8; 32],
    hex: String,
}

impl Identity {
    fn new(n: u64) -> Self {
        let record_id: [u8; 32] = Sha256::digest(format!("parts-{}-{n}", std::process::id())).into();
        let hex = record_id.iter().map(|byte| format!("{byte:02x}")).collect();
        Self { record_id, hex }
    }

    fn literal(&self) -> String {
        format!("E'\\\\x{}'::bytea", self.hex)
    }

    /// `BEGIN` with the store's claim of a new key (a 10 s wait, not re-executable).
    fn begin_and_claim(&self) -> String {
        let lock_key = i64::from_be_bytes(self.record_id[..8].try_into().expect("8 bytes"));
        let fingerprint = format!("E'\\\\x{}'::bytea", "ab".repeat(32));
        format!("BEGIN; SELECT {CLAIM_FIRST}({}, {lock_key}, 10000, {fingerprint}, false)", self.literal())
    }

    fn begin_and_read(&self) -> String {
        format!("BEGIN; SELECT 1 FROM {RECORDS} WHERE record_id = {}", self.literal())
    }
}

/// Which labels the answer's row carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Labels {
    /// None, as the floor writes it.
    None,
    /// All three, as the store writes them.
    All,
}

/// The answer's row, as the floor writes it (no labels) or as the store does (with labels).
async fn insert_record(conn: &mut sqlx::PgConnection, id: &Identity, labels: Labels) {
    let body = format!("{{\"order_id\":\"{}\",\"body\":{ORDER}}}", uuid::Uuid::new_v4());
    let headers = b"content-type: application/json\nlocation: /orders/0f8fad5b-d9cb-469f-a165-70867728950e".to_vec();
    let fingerprint = Sha256::digest(ORDER.as_bytes()).to_vec();
    let query = if labels != Labels::None {
        sqlx::query(
            "INSERT INTO \"public\".\"idempotency_records\" (record_id, state, fingerprint_version, fingerprint, \
                 fencing_token, response_status, response_headers, response_body, response_until, forget_at, \
                 operation, scope_digest, operation_id) \
             VALUES ($1, 'completed', 1, $2, 0, 201, $3, $4, clock_timestamp() + ($5) * interval '1 millisecond', \
                 clock_timestamp() + ($6) * interval '1 millisecond', $7, $8, $9)",
        )
        .bind(id.record_id.to_vec())
        .bind(fingerprint)
        .bind(headers)
        .bind(body.into_bytes())
        .bind(86_400_000_i64)
        .bind(172_800_000_i64)
        .bind("POST /orders")
        .bind(Scope::new("bench-account").digest().to_vec())
        .bind(id.record_id[..16].to_vec())
    } else {
        sqlx::query(
            "INSERT INTO \"public\".\"idempotency_records\" (record_id, state, fingerprint_version, fingerprint, \
                 fencing_token, response_status, response_headers, response_body, response_until, forget_at) \
             VALUES ($1, 'completed', 1, $2, 0, 201, $3, $4, clock_timestamp() + interval '1 day', \
                 clock_timestamp() + interval '2 days')",
        )
        .bind(id.record_id.to_vec())
        .bind(fingerprint)
        .bind(headers)
        .bind(body.into_bytes())
    };
    query.execute(conn).await.expect("insert the record");
}

/// The claim as the record's own row: inserted first, with its labels and a placeholder
/// answer (a concurrent claimant of the identity would wait on the primary key), and the answer
/// written over it at the end (only columns no index covers, so the update can be HOT).
async fn insert_claim(conn: &mut sqlx::PgConnection, id: &Identity) {
    let inserted = sqlx::query(
        "INSERT INTO \"public\".\"idempotency_records\" (record_id, state, fingerprint_version, fingerprint, \
             fencing_token, response_status, response_until, forget_at, operation, scope_digest, operation_id) \
         VALUES ($1, 'completed', 1, $2, 0, 0, clock_timestamp() + ($3) * interval '1 millisecond', \
             clock_timestamp() + ($4) * interval '1 millisecond', $5, $6, $7) \
         ON CONFLICT DO NOTHING",
    )
    .bind(id.record_id.to_vec())
    .bind(Sha256::digest(ORDER.as_bytes()).to_vec())
    .bind(86_400_000_i64)
    .bind(172_800_000_i64)
    .bind("POST /orders")
    .bind(Scope::new("bench-account").digest().to_vec())
    .bind(id.record_id[..16].to_vec())
    .execute(conn)
    .await
    .expect("claim by insert");
    assert_eq!(inserted.rows_affected(), 1, "a new identity");
}

async fn update_answer(conn: &mut sqlx::PgConnection, id: &Identity) {
    let body = format!("{{\"order_id\":\"{}\",\"body\":{ORDER}}}", uuid::Uuid::new_v4());
    sqlx::query(
        "UPDATE \"public\".\"idempotency_records\" SET response_status = 201, response_headers = $2, \
             response_body = $3 WHERE record_id = $1",
    )
    .bind(id.record_id.to_vec())
    .bind(b"content-type: application/json\nlocation: /orders/0f8fad5b-d9cb-469f-a165-70867728950e".to_vec())
    .bind(body.into_bytes())
    .execute(conn)
    .await
    .expect("write the answer");
}

pub async fn insert_order(conn: &mut sqlx::PgConnection) {
    sqlx::query("INSERT INTO bench_orders (order_id, operation_id, body) VALUES ($1, $2, $3)")
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(ORDER)
        .execute(conn)
        .await
        .expect("insert the order");
}

async fn prepared_claim(conn: &mut sqlx::PgConnection, id: &Identity) {
    let lock_key = i64::from_be_bytes(id.record_id[..8].try_into().expect("8 bytes"));
    sqlx::query(AssertSqlSafe(format!("SELECT {CLAIM_FIRST}($1, $2, $3, $4, $5)")))
        .bind(id.record_id.to_vec())
        .bind(lock_key)
        .bind(10_000_i32)
        .bind(vec![0xab_u8; 32])
        .bind(false)
        .execute(conn)
        .await
        .expect("claim");
}

async fn prepared_read(conn: &mut sqlx::PgConnection, id: &Identity) {
    let found = sqlx::query("SELECT 1 FROM \"public\".\"idempotency_records\" WHERE record_id = $1")
        .bind(id.record_id.to_vec())
        .fetch_optional(conn)
        .await
        .expect("read");
    assert!(found.is_none(), "every transaction is a new identity");
}

/// `statement` (which begins the transaction) in one round trip; it must find no record.
async fn simple(conn: &mut sqlx::PgConnection, statement: String) {
    let rows = sqlx::raw_sql(AssertSqlSafe(statement)).fetch_all(conn).await.expect("begin");
    assert!(rows.len() <= 1, "a new identity");
}

async fn commit(conn: &mut sqlx::PgConnection) {
    sqlx::raw_sql("COMMIT").execute(conn).await.expect("commit");
}

/// One transaction of `part`, for identity `n`.
pub async fn transaction(pool: &PgPool, part: Part, n: u64) {
    let id = Identity::new(n);
    match part {
        Part::BeginCommit
        | Part::PreparedRead
        | Part::Floor
        | Part::FloorLabels
        | Part::FloorPreparedRead
        | Part::PreparedClaim
        | Part::AtomicPreparedClaim
        | Part::InsertClaim => {
            let mut tx = pool.begin().await.expect("begin");
            if part == Part::InsertClaim {
                insert_claim(&mut tx, &id).await;
                insert_order(&mut tx).await;
                update_answer(&mut tx, &id).await;
            }
            if matches!(part, Part::PreparedClaim | Part::AtomicPreparedClaim) {
                prepared_claim(&mut tx, &id).await;
            }
            if matches!(part, Part::PreparedRead | Part::FloorPreparedRead) {
                prepared_read(&mut tx, &id).await;
            }
            let labels = match part {
                Part::Floor => Some(Labels::None),
                Part::FloorLabels | Part::FloorPreparedRead | Part::AtomicPreparedClaim => Some(Labels::All),
                _ => None,
            };
            if let Some(labels) = labels {
                insert_order(&mut tx).await;
                insert_record(&mut tx, &id, labels).await;
            }
            tx.commit().await.expect("commit");
        }
        Part::BeginSelect
        | Part::BeginRead
        | Part::BeginClaim
        | Part::FloorRead
        | Part::Atomic
        | Part::LockThenRead => {
            let mut conn = pool.acquire().await.expect("a connection");
            let begin = match part {
                Part::BeginSelect => "BEGIN; SELECT 1".to_owned(),
                Part::BeginRead | Part::FloorRead => id.begin_and_read(),
                Part::LockThenRead => format!(
                    "BEGIN; SELECT pg_try_advisory_xact_lock({})",
                    i64::from_be_bytes(id.record_id[..8].try_into().expect("8 bytes"))
                ),
                _ => id.begin_and_claim(),
            };
            simple(&mut conn, begin).await;
            if part == Part::LockThenRead {
                prepared_read(&mut conn, &id).await;
            }
            if matches!(part, Part::FloorRead | Part::Atomic | Part::LockThenRead) {
                insert_order(&mut conn).await;
                insert_record(&mut conn, &id, Labels::All).await;
            }
            commit(&mut conn).await;
        }
    }
}

/// The tables every part writes: the store's records table (migrated as `PostgresStore::new`
/// has it) and the orders.
pub async fn create_tables(pool: &PgPool) {
    PostgresStore::new(pool.clone()).migrate().await.expect("migrate the records table");
    sqlx::raw_sql(
        "CREATE TABLE bench_orders (order_id text PRIMARY KEY, operation_id text NOT NULL, body text NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await
    .expect("create bench_orders");
}
