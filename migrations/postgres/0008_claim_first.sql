-- tower-idempotency: atomic mode's claim for a request that was not read first (issue 16).
-- {schema} and {table} as in 0001.
--
-- When few requests find a record already there, the store skips the plain read before the
-- claim and sends BEGIN with this function at once: one statement on the records table for a new
-- key instead of two. It is 0001's `<table>_claim` (the same bounded wait on the same advisory
-- lock, the same TI001 when a live record is there), and it also does, under the lock, what the
-- read would have told the store to do: a forgotten record, or a dead lease on a re-executable
-- route whose fingerprint matches, is deleted so that the outcome's INSERT can take its place.
--
-- A live record (a retry of a finished request, most often) is refused before the lock is taken,
-- by a probe of the primary key: retries of one identity never queue on each other's lock, which
-- a claim holds until its ROLLBACK. Only when nothing live is there does the function take the
-- lock and look again (a claimant it waited for may have committed meanwhile): two probes for a
-- new key, one for a retry.
CREATE OR REPLACE FUNCTION "{schema}"."{table}_claim_first"(
    p_record_id bytea,
    p_lock_key bigint,
    p_lock_ms integer,
    p_fingerprint bytea,
    p_reexecute boolean
) RETURNS void LANGUAGE plpgsql AS $claim$
DECLARE
    v_lock_timeout text;
    v_replaceable boolean;
BEGIN
    IF EXISTS (
        SELECT 1 FROM "{schema}"."{table}" r
         WHERE r.record_id = p_record_id
           AND NOT COALESCE(r.forget_at <= clock_timestamp(), false)
           AND NOT (p_reexecute AND r.state = 'processing' AND COALESCE(r.lease_until <= clock_timestamp(), false)
                    AND r.fingerprint = p_fingerprint)
    ) THEN
        RAISE EXCEPTION USING ERRCODE = 'TI001', MESSAGE = 'an idempotency record exists for this identity';
    END IF;
    IF NOT pg_try_advisory_xact_lock(p_lock_key) THEN
        v_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_lock_ms::text, true);
        PERFORM pg_advisory_xact_lock(p_lock_key);
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
    END IF;
    SELECT COALESCE(r.forget_at <= clock_timestamp(), false)
           OR (p_reexecute AND r.state = 'processing' AND COALESCE(r.lease_until <= clock_timestamp(), false)
               AND r.fingerprint = p_fingerprint)
      INTO v_replaceable
      FROM "{schema}"."{table}" r
     WHERE r.record_id = p_record_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_replaceable THEN
        -- The condition again, on the row the DELETE finds: a writer that changed it since (a
        -- leased claim taking the identity over) keeps it, and this claim reads what is there.
        DELETE FROM "{schema}"."{table}" r
         WHERE r.record_id = p_record_id
           AND (COALESCE(r.forget_at <= clock_timestamp(), false)
                OR (p_reexecute AND r.state = 'processing' AND COALESCE(r.lease_until <= clock_timestamp(), false)
                    AND r.fingerprint = p_fingerprint));
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'TI001', MESSAGE = 'an idempotency record exists for this identity';
END
$claim$;
