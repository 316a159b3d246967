-- tower-idempotency: the idempotency records (CONTRACT §5), one row per scoped identity.
-- {table} is replaced with the store's configured, validated identifier.
--
-- SQLite has no timestamp type: every time is INTEGER milliseconds since the Unix epoch, computed
-- by the store from the application's clock and bound as a parameter, so every comparison in the
-- store's statements uses one "now" per statement. STRICT makes SQLite refuse values of the wrong
-- type instead of storing them (a text "fingerprint" would otherwise be accepted silently).
CREATE TABLE IF NOT EXISTS "{table}" (
    -- SHA-256 of (scope, operation, key): raw keys and scopes are never stored.
    record_id           BLOB    NOT NULL,
    state               TEXT    NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    fingerprint         BLOB    NOT NULL,
    -- Strictly increasing per claim (one counter for the table, in "{table}_fencing"), so a
    -- superseded holder's late completion matches no row.
    fencing_token       INTEGER NOT NULL,
    -- Leased mode only: a processing row whose lease has passed belongs to a dead holder.
    -- Atomic mode never commits a processing row, so it leaves this NULL.
    lease_until         INTEGER,
    response_status     INTEGER,
    -- The stored headers and trailers, in StoredResponse::encode_fields form.
    response_headers    BLOB,
    response_body       BLOB,
    -- After response_until a completed or failed record answers idempotency_key_expired
    -- (a tombstone); after forget_at the identity may be claimed again.
    response_until      INTEGER,
    forget_at           INTEGER,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    -- The one constraint the claim relies on: uniqueness of the scoped identity decides which
    -- of many concurrent requests runs.
    CONSTRAINT "{table}_pkey" PRIMARY KEY (record_id),
    CONSTRAINT "{table}_state_check"
        CHECK (state IN ('processing', 'completed', 'failed', 'unknown', 'expired')),
    CONSTRAINT "{table}_response_check"
        CHECK (state NOT IN ('completed', 'failed') OR response_status IS NOT NULL)
) STRICT;

-- SQLite has no sequences. The fencing counter is one row, bumped by every claim in the same
-- write transaction as the claim itself; it only ever grows, so tokens keep increasing after
-- records are released or purged (a MAX(fencing_token) over the table would not).
CREATE TABLE IF NOT EXISTS "{table}_fencing" (
    id   INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    last INTEGER NOT NULL
) STRICT;
INSERT OR IGNORE INTO "{table}_fencing" (id, last) VALUES (1, 0);

-- The purge walks these in bounded batches.
CREATE INDEX IF NOT EXISTS "{table}_forget_at_idx"
    ON "{table}" (forget_at) WHERE forget_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS "{table}_response_until_idx"
    ON "{table}" (response_until) WHERE state IN ('completed', 'failed');
-- Recovery looks for stale leases and unknown outcomes.
CREATE INDEX IF NOT EXISTS "{table}_open_idx"
    ON "{table}" (lease_until) WHERE state IN ('processing', 'unknown');
