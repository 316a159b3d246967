-- tower-idempotency: shadow mode's record (issue 13), written in the handler's own transaction by
-- one prepared call just before its COMMIT. {schema} and {table} as in 0001.
--
-- The record is a completed one with the answer's status and no body, no labels and fencing
-- token 0 (never replayed, never found by an operation id). It takes the place of a forgotten
-- record; any other record already there is kept. Returns 1 when the record was written, 0 when
-- another was there, and -1 when the write failed: the failure is caught here (the EXCEPTION
-- block is a subtransaction), so it never aborts the handler's transaction, whose writes still
-- commit. A function, so that PostgreSQL plans the upsert once per session.
CREATE OR REPLACE FUNCTION "{schema}"."{table}_shadow"(
    p_record_id bytea,
    p_fingerprint_version smallint,
    p_fingerprint bytea,
    p_status smallint,
    p_fields bytea,
    p_keep_ms bigint,
    p_forget_ms bigint
) RETURNS bigint LANGUAGE plpgsql AS $shadow$
DECLARE
    v_changed bigint;
BEGIN
    INSERT INTO "{schema}"."{table}" AS r (record_id, state, fingerprint_version, fingerprint, fencing_token,
        response_status, response_headers, response_body, response_until, forget_at, created_at, updated_at)
    VALUES (p_record_id, 'completed', p_fingerprint_version, p_fingerprint, 0, p_status, p_fields, ''::bytea,
        clock_timestamp() + p_keep_ms * interval '1 millisecond',
        clock_timestamp() + p_forget_ms * interval '1 millisecond',
        clock_timestamp(), clock_timestamp())
    ON CONFLICT ON CONSTRAINT "{table}_pkey" DO UPDATE SET
        state = excluded.state, fingerprint_version = excluded.fingerprint_version,
        fingerprint = excluded.fingerprint, fencing_token = 0, lease_until = NULL,
        response_status = excluded.response_status, response_headers = excluded.response_headers,
        response_body = excluded.response_body, response_until = excluded.response_until,
        forget_at = excluded.forget_at, created_at = excluded.created_at, updated_at = excluded.updated_at,
        reexecutable = false, operation = NULL, scope_digest = NULL, operation_id = NULL, attempts = 0,
        recheck_at = NULL
    WHERE r.forget_at <= clock_timestamp();
    GET DIAGNOSTICS v_changed = ROW_COUNT;
    RETURN v_changed;
EXCEPTION WHEN OTHERS THEN
    RAISE WARNING 'tower-idempotency: the shadow record was not written: % (%)', SQLERRM, SQLSTATE;
    RETURN -1;
END
$shadow$;
