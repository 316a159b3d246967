//! The one error for a name the crate cannot use: a SQL schema or table name, which the SQL
//! stores splice into their statements, or a Redis key prefix, which the fast path splices into
//! its keys. Each is checked when it is set, so a bad name fails at start-up, never mid-request.

/// A name the crate refused, with the rule it breaks.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use tower_idempotency::SqliteStore;
///
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
/// let refused = SqliteStore::new(pool).table("Orders; DROP TABLE orders").unwrap_err();
/// assert_eq!(refused.name(), "Orders; DROP TABLE orders");
/// println!("{refused}"); // says what the name is for and what it must be
/// # });
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} cannot be used as {what}: it must be {rule}")]
pub struct InvalidName {
    name: String,
    what: &'static str,
    rule: &'static str,
}

impl InvalidName {
    /// `name` refused as `what` (a SQL table name, a Redis key prefix) for breaking `rule`.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite", feature = "redis")), allow(dead_code))]
    pub(crate) fn new(name: &str, what: &'static str, rule: &'static str) -> Self {
        Self { name: name.to_owned(), what, rule }
    }

    /// The name that was refused.
    pub fn name(&self) -> &str {
        &self.name
    }
}
