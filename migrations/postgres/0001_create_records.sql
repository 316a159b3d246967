-- tower-idempotency: the idempotency records (CONTRACT §5), one row per scoped identity.
-- {schema} and {table} are replaced with the store's configured, validated identifiers.
CREATE TABLE IF NOT EXISTS "{schema}"."{table}" (
    -- SHA-256 of (scope, operation, key): raw keys and scopes are never stored.
    record_id           bytea       NOT NULL,
    state               text        NOT NULL,
    fingerprint_version smallint    NOT NULL,
    fingerprint         bytea       NOT NULL,
    -- Strictly increasing per leased claim (one sequence for the table), so a superseded
    -- holder's late completion matches no row. 0 for atomic mode's records, which never hold a
    -- lease (and so never contend for the sequence).
    fencing_token       bigint      NOT NULL,
    -- Leased mode only: a processing row whose lease has passed belongs to a dead holder.
    -- Atomic mode never commits a processing row, so it leaves this NULL.
    lease_until         timestamptz,
    response_status     smallint,
    -- The stored headers and trailers, in StoredResponse::encode_fields form.
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

-- Atomic mode's claim, sent in the same round trip as BEGIN. It waits, for at most
-- p_lock_ms, for a concurrent claimant of the same identity (a transaction-scoped advisory
-- lock: released by that claimant's COMMIT or ROLLBACK), then refuses with SQLSTATE TI001 if a
-- live record is there, so the store reads it and replays. The lock only orders waiters, so
-- that a duplicate sees the first request's outcome instead of running the handler again;
-- uniqueness is the primary key's, enforced once more by the INSERT that stores the outcome
-- (which is what decides at isolation levels where this check cannot see a fresh commit).
CREATE OR REPLACE FUNCTION "{schema}"."{table}_claim"(
    p_record_id bytea,
    p_lock_key bigint,
    p_lock_ms integer,
    p_fingerprint bytea,
    p_reexecute boolean
) RETURNS void LANGUAGE plpgsql AS $claim$
DECLARE
    v_lock_timeout text;
BEGIN
    -- Uncontended (the common case): take the lock at once. Contended: wait for it, bounded.
    IF NOT pg_try_advisory_xact_lock(p_lock_key) THEN
        v_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_lock_ms::text, true);
        PERFORM pg_advisory_xact_lock(p_lock_key);
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
    END IF;
    IF EXISTS (
        SELECT 1 FROM "{schema}"."{table}" r
        WHERE r.record_id = p_record_id
          AND NOT COALESCE(r.forget_at <= clock_timestamp(), false)
          AND NOT (p_reexecute AND r.state = 'processing' AND r.lease_until <= clock_timestamp()
                   AND r.fingerprint = p_fingerprint)
    ) THEN
        RAISE EXCEPTION USING ERRCODE = 'TI001', MESSAGE = 'an idempotency record exists for this identity';
    END IF;
END
$claim$;

-- Atomic mode's outcome: the record, written once with the answer, at the end of the claiming
-- transaction (atomic mode never commits a processing row), and sent in one round trip with the
-- COMMIT. A plain INSERT: the claim has already deleted a forgotten record or a dead lease it
-- takes over, so if another record holds the identity the primary key raises a unique violation,
-- the COMMIT after it never runs, and the business write rolls back with the claim. An atomic
-- record never held a lease, so its fencing token is 0 (leased claims draw theirs from the
-- sequence). A function, so that PostgreSQL plans the INSERT once per session, not per request.
CREATE OR REPLACE FUNCTION "{schema}"."{table}_store"(
    p_record_id bytea,
    p_state text,
    p_fingerprint_version smallint,
    p_fingerprint bytea,
    p_status smallint,
    p_fields bytea,
    p_body bytea,
    p_keep_ms bigint,
    p_forget_ms bigint
) RETURNS void LANGUAGE plpgsql AS $store$
BEGIN
    INSERT INTO "{schema}"."{table}" (record_id, state, fingerprint_version, fingerprint, fencing_token,
        response_status, response_headers, response_body, response_until, forget_at)
    VALUES (p_record_id, p_state, p_fingerprint_version, p_fingerprint, 0, p_status, p_fields, p_body,
        clock_timestamp() + p_keep_ms * interval '1 millisecond',
        clock_timestamp() + p_forget_ms * interval '1 millisecond');
END
$store$;
