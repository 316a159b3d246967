//! The SQL of the orders table, one module per dialect: the same statements, each written for
//! its database.

// The orders table has no UNIQUE constraint on `idempotency_operation_id`, in either dialect,
// on purpose: this example's crash tests count the rows per operation id to prove that the idempotency layer
// alone prevents duplicate orders, and a constraint would make them unable to fail. A
// production table should add one, `UNIQUE (idempotency_operation_id)`, as a second guard
// behind the layer.

/// The SQLite dialect. `order_id` is TEXT in lowercase hyphenated form, whose bytewise order
/// (SQLite's default BINARY collation) is the UUID's, so the keyset order matches the cursor's.
pub(super) mod sqlite_sql {
    /// The orders table and the index of the page query, if missing.
    pub(crate) const CREATE_TABLE: &str = "
        CREATE TABLE IF NOT EXISTS orders (
            order_id                 TEXT   NOT NULL PRIMARY KEY,
            account_id               TEXT   NOT NULL,
            sku                      TEXT   NOT NULL,
            quantity                 BIGINT NOT NULL CHECK (quantity > 0),
            amount_minor             TEXT   NOT NULL CHECK (amount_minor <> '' AND amount_minor NOT GLOB '*[^0-9]*'),
            currency                 TEXT   NOT NULL,
            created_at               BIGINT NOT NULL,
            idempotency_operation_id TEXT   NOT NULL
        );
        CREATE INDEX IF NOT EXISTS orders_account_page_idx ON orders (account_id, created_at DESC, order_id DESC);";
    /// Binds: order_id, account_id, sku, quantity, amount_minor, currency, created_at,
    /// idempotency_operation_id.
    pub(crate) const INSERT: &str = "
        INSERT INTO orders (order_id, account_id, sku, quantity, amount_minor, currency, created_at,
                            idempotency_operation_id)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
    /// Binds: account_id, order_id.
    pub(crate) const GET: &str = "
        SELECT order_id, account_id, sku, quantity, amount_minor, currency, created_at, idempotency_operation_id
        FROM orders WHERE account_id = $1 AND order_id = $2";
    /// Binds: account_id, limit.
    pub(crate) const FIRST_PAGE: &str = "
        SELECT order_id, account_id, sku, quantity, amount_minor, currency, created_at, idempotency_operation_id
        FROM orders WHERE account_id = $1
        ORDER BY created_at DESC, order_id DESC LIMIT $2";
    /// Binds: account_id, the cursor's created_at and order_id, limit.
    pub(crate) const NEXT_PAGE: &str = "
        SELECT order_id, account_id, sku, quantity, amount_minor, currency, created_at, idempotency_operation_id
        FROM orders WHERE account_id = $1 AND (created_at, order_id) < ($2, $3)
        ORDER BY created_at DESC, order_id DESC LIMIT $4";
}

/// The PostgreSQL dialect (feature `postgres`): the same statements, with `order_id` a native
/// `uuid` (ordered bytewise, like the UUID), bound as text and cast, and read back as text.
#[cfg(feature = "postgres")]
pub(super) mod postgres_sql {
    /// The orders table and the index of the page query, if missing.
    pub(crate) const CREATE_TABLE: &str = "
        CREATE TABLE IF NOT EXISTS orders (
            order_id                 uuid   NOT NULL PRIMARY KEY,
            account_id               text   NOT NULL,
            sku                      text   NOT NULL,
            quantity                 bigint NOT NULL CHECK (quantity > 0),
            amount_minor             text   NOT NULL CHECK (amount_minor ~ '^[0-9]+$'),
            currency                 text   NOT NULL,
            created_at               bigint NOT NULL,
            idempotency_operation_id text   NOT NULL
        );
        CREATE INDEX IF NOT EXISTS orders_account_page_idx ON orders (account_id, created_at DESC, order_id DESC);";
    /// Binds: order_id, account_id, sku, quantity, amount_minor, currency, created_at,
    /// idempotency_operation_id.
    pub(crate) const INSERT: &str = "
        INSERT INTO orders (order_id, account_id, sku, quantity, amount_minor, currency, created_at,
                            idempotency_operation_id)
        VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8)";
    /// Binds: account_id, order_id.
    pub(crate) const GET: &str = "
        SELECT order_id::text AS order_id, account_id, sku, quantity, amount_minor, currency, created_at,
               idempotency_operation_id
        FROM orders WHERE account_id = $1 AND order_id = $2::uuid";
    /// Binds: account_id, limit.
    pub(crate) const FIRST_PAGE: &str = "
        SELECT order_id::text AS order_id, account_id, sku, quantity, amount_minor, currency, created_at,
               idempotency_operation_id
        FROM orders WHERE account_id = $1
        ORDER BY created_at DESC, order_id DESC LIMIT $2";
    /// Binds: account_id, the cursor's created_at and order_id, limit.
    pub(crate) const NEXT_PAGE: &str = "
        SELECT order_id::text AS order_id, account_id, sku, quantity, amount_minor, currency, created_at,
               idempotency_operation_id
        FROM orders WHERE account_id = $1 AND (created_at, order_id) < ($2, $3::uuid)
        ORDER BY created_at DESC, order_id DESC LIMIT $4";
}
