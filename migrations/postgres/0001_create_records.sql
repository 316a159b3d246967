-- tower-idempotency: the idempotency records (CONTRACT §5), one row per scoped identity.
-- {schema} and {table} are replaced with the store's configured, validated identifiers.
CREATE TABLE IF NOT EXISTS "{schema}"."{table}" (
    -- SHA-256 of (scope, operation, key): raw keys and scopes are never stored.
    record_id           bytea       NOT NULL,
    state               text        NOT NULL,
    fingerprint_version smallint    NOT NULL,
    fingerprint         bytea       NOT NULL,
    -- Strictly increasing per claim (one sequence for the table), so a superseded holder's
    -- late completion matches no row.
    fencing_token       bigint      NOT NULL,
    -- Leased mode only: a processing row whose lease has passed belongs to a dead holder.
    -- Atomic mode never commits a processing row, so it leaves this NULL.
    lease_until         timestamptz,
    response_status     smallint,
    response_headers    bytea,
    response_body       bytea,
    -- After response_until a completed or failed record answers idempotency_key_expired
    -- (a tombstone); after forget_at the identity may be claimed again.
    response_until      timestamptz,
    forget_at           timestamptz,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The one constraint the claim relies on: uniqueness of the scoped identity decides which
    -- of many concurrent requests runs, at any isolation level.
    CONSTRAINT "{table}_pkey" PRIMARY KEY (record_id),
    CONSTRAINT "{table}_state_check"
        CHECK (state IN ('processing', 'completed', 'failed', 'unknown', 'expired')),
    CONSTRAINT "{table}_response_check"
        CHECK (state NOT IN ('completed', 'failed') OR response_status IS NOT NULL)
);

CREATE SEQUENCE IF NOT EXISTS "{schema}"."{table}_fencing_seq";

-- The purge walks these in bounded batches.
CREATE INDEX IF NOT EXISTS "{table}_forget_at_idx"
    ON "{schema}"."{table}" (forget_at) WHERE forget_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS "{table}_response_until_idx"
    ON "{schema}"."{table}" (response_until) WHERE state IN ('completed', 'failed');
-- Recovery looks for stale leases and unknown outcomes.
CREATE INDEX IF NOT EXISTS "{table}_open_idx"
    ON "{schema}"."{table}" (lease_until) WHERE state IN ('processing', 'unknown');
