-- tower-idempotency: migration 8's `<table>_claim_first` with the lock tried first (issue 16).
-- {schema} and {table} as in 0001.
--
-- 8's function looked at the record before it took the lock and again after, so a new key cost
-- two probes of the primary key. Tried first, the lock (`pg_try_advisory_xact_lock`, which never
-- waits) is most often free: then one look under it is enough, since no claimant can commit a
-- record of the identity while this transaction holds the lock, and the look is a statement of
-- its own with a snapshot taken after the lock was, so it sees every record committed before.
-- About 32,000 instructions of the backend less a new key, 9% (`benches/pg_instructions.rs`).
--
-- When the lock is held, the function does as 8's did: it refuses a live record before it waits
-- (retries of one identity never queue on each other's lock), waits at most p_lock_ms, and looks
-- again. A retry that finds the lock free now takes it for the moment it takes to be refused; one
-- that arrives meanwhile finds it held and is refused by the look before the wait, as before.
-- The same arguments, the same answers, the same SQLSTATE TI001: binaries from before this
-- migration call it as they called 8's.
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
    IF NOT pg_try_advisory_xact_lock(p_lock_key) THEN
        IF EXISTS (
            SELECT 1 FROM "{schema}"."{table}" r
             WHERE r.record_id = p_record_id
               AND NOT COALESCE(r.forget_at <= clock_timestamp(), false)
               AND NOT (p_reexecute AND r.state = 'processing' AND COALESCE(r.lease_until <= clock_timestamp(), false)
                        AND r.fingerprint = p_fingerprint)
        ) THEN
            RAISE EXCEPTION USING ERRCODE = 'TI001', MESSAGE = 'an idempotency record exists for this identity';
        END IF;
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
