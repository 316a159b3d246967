-- tower-idempotency: the record lifecycle (issue 12): what recovery, reconciliation, expiry of
-- every state and the admin operations need. {schema} and {table} as in 0001.
ALTER TABLE "{schema}"."{table}"
    -- The route identity the record was claimed under (a route name, never a key): reconcilers
    -- are registered per operation. NULL for records written before this migration.
    ADD COLUMN IF NOT EXISTS operation    text,
    -- SHA-256 of the scope (never the scope itself) and the operation id handlers see: a record
    -- is found by its operation id only within its own scope.
    ADD COLUMN IF NOT EXISTS scope_digest bytea,
    ADD COLUMN IF NOT EXISTS operation_id bytea,
    -- The claim declared its route safe to re-execute: a dead lease is released, not marked
    -- unknown.
    ADD COLUMN IF NOT EXISTS reexecutable boolean NOT NULL DEFAULT false,
    -- How often a reconciler was given the record, and when it may be given it again (its
    -- backoff, which also keeps concurrent workers from asking about it twice).
    ADD COLUMN IF NOT EXISTS attempts     integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS recheck_at   timestamptz;

-- Every state has a retention now: unsettled records written before carried none, so they get
-- the default (30 days, then the default 7-day tombstone), counted from their last change.
UPDATE "{schema}"."{table}"
   SET response_until = updated_at + interval '30 days', forget_at = updated_at + interval '37 days'
 WHERE state IN ('processing', 'unknown') AND response_until IS NULL;

-- The purge's expiry covers every live state, so its index does too (it replaces 0001's, which
-- covered completed and failed records only).
CREATE INDEX IF NOT EXISTS "{table}_live_until_idx"
    ON "{schema}"."{table}" (response_until) WHERE state <> 'expired';
DROP INDEX IF EXISTS "{schema}"."{table}_response_until_idx";
-- Operation status lookups.
CREATE INDEX IF NOT EXISTS "{table}_operation_id_idx"
    ON "{schema}"."{table}" (operation_id) WHERE operation_id IS NOT NULL;
-- Unknown records, oldest first: for operators, and per operation for its reconciler.
CREATE INDEX IF NOT EXISTS "{table}_unknown_idx"
    ON "{schema}"."{table}" (operation, created_at) WHERE state = 'unknown';
CREATE INDEX IF NOT EXISTS "{table}_unknown_age_idx"
    ON "{schema}"."{table}" (created_at) WHERE state = 'unknown';

-- Atomic mode's outcome, as 0001's function, and with the record's labels (an overload: 0001's
-- stays for binaries that still call it). An unknown outcome commits with the business write
-- like any other, kept for the unsettled retention the caller passes in p_keep_ms.
CREATE OR REPLACE FUNCTION "{schema}"."{table}_store"(
    p_record_id bytea,
    p_state text,
    p_fingerprint_version smallint,
    p_fingerprint bytea,
    p_status smallint,
    p_fields bytea,
    p_body bytea,
    p_keep_ms bigint,
    p_forget_ms bigint,
    p_operation text,
    p_scope_digest bytea,
    p_operation_id bytea
) RETURNS void LANGUAGE plpgsql AS $store$
BEGIN
    INSERT INTO "{schema}"."{table}" (record_id, state, fingerprint_version, fingerprint, fencing_token,
        response_status, response_headers, response_body, response_until, forget_at,
        operation, scope_digest, operation_id)
    VALUES (p_record_id, p_state, p_fingerprint_version, p_fingerprint, 0, p_status, p_fields, p_body,
        clock_timestamp() + p_keep_ms * interval '1 millisecond',
        clock_timestamp() + p_forget_ms * interval '1 millisecond',
        p_operation, p_scope_digest, p_operation_id);
END
$store$;
