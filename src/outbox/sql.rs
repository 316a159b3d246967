//! What the SQL outboxes share: their migrator, and reading a claimed row back.

use std::time::Duration;

use bytes::Bytes;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, SqlSafeStr};

use super::{EventId, Leased, OutboxError, PendingEvent};

/// The outbox migration's version: the file's number (`0004_outbox.sql`), in a history of its
/// own, so it never meets the records table's migrations.
const VERSION: i64 = 4;

/// The outbox's migrator: `sql` (the table's names already in), its history in `history`.
pub(super) fn migrator(sql: String, history: String) -> Migrator {
    let migration = Migration::new(
        VERSION,
        "create outbox".into(),
        MigrationType::Simple,
        AssertSqlSafe(sql).into_sql_str(),
        false,
    );
    let mut migrator = Migrator::with_migrations(vec![migration]);
    migrator.dangerous_set_table_name(history);
    migrator
}

/// The database failed or could not be reached.
pub(super) fn unavailable(error: sqlx::Error) -> OutboxError {
    OutboxError::Unavailable(Box::new(error))
}

/// A claimed row, as both backends return it.
#[derive(sqlx::FromRow)]
pub(super) struct ClaimedRow {
    event_id: String,
    event_type: String,
    body: Vec<u8>,
    attempts: i64,
    lease_token: i64,
    age_ms: i64,
}

impl ClaimedRow {
    pub(super) fn leased(self) -> Result<Leased, OutboxError> {
        let id = EventId::new(self.event_id).ok_or_else(|| OutboxError::Corrupt("an event id is not valid".into()))?;
        let attempt = u32::try_from(self.attempts).map_err(|_| OutboxError::Corrupt("attempts out of range".into()))?;
        let event = PendingEvent {
            id,
            event_type: self.event_type,
            body: Bytes::from(self.body),
            attempt,
            age: Duration::from_millis(self.age_ms.max(0) as u64),
        };
        Ok(Leased { event, lease_token: self.lease_token })
    }
}

/// Milliseconds of a duration, saturating, for SQL.
pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Bounds an error text kept for operators.
pub(super) fn short(error: &str) -> String {
    error.chars().take(500).collect()
}
