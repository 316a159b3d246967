-- tower-idempotency: the records table without its two CHECK constraints (issue 16). {schema}
-- and {table} as in 0001.
--
-- PostgreSQL 15 does not keep a table's CHECK constraints ready between statements: every
-- INSERT and UPDATE of a row reads each constraint's expression back from the catalog's text
-- form and builds it again before it checks the row. For these two (the state's five names and
-- the answer of a completed or failed record) that came to about 80,000 instructions of the
-- backend a statement (`benches/pg_instructions.rs`): 18% of a new key's in atomic mode, more
-- than any statement of the claim.
--
-- What they guarded holds without them. The store is the table's one writer and writes a state
-- from a closed set, with the answer in the same statement; a row that breaks either rule anyway
-- (written by hand, say) is never replayed: the store reads a state it does not know, or a
-- completed or failed record without its answer, as a corrupt record, and the request is answered
-- 503 with nothing run (tests/postgres_record_checks.rs). The primary key, which uniqueness rests
-- on, stays.
--
-- Dropping a constraint changes the catalog only; a partitioned table passes it on to its
-- partitions. Binaries from before this migration write the same rows as ever.
ALTER TABLE "{schema}"."{table}"
    DROP CONSTRAINT IF EXISTS "{table}_state_check",
    DROP CONSTRAINT IF EXISTS "{table}_response_check";
