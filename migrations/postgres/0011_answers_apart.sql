-- tower-idempotency: answers apart (issue 16), for a store with PostgresStore::answers_apart
-- only. {schema} and {table} as in 0001.
--
-- A record's answer (status, fields, body) moves to a table of its own, numbered in the order
-- answers are written and carrying the time its replay ends; the record points at it by
-- answer_seq. A record past its response retention is a tombstone by its time alone (every read
-- compares it), so making tombstones no longer rewrites the record and its index entries: the
-- purge deletes the answers that are due, the earliest due first, and deletes records past their tombstone
-- time, found through an index on forget_at over every record (0010's index held tombstones
-- only; 0003's index on response_until held every live record for the purge that rewrote them).
--
-- Nothing is copied: records written before keep their answers inline and are read as before;
-- the purge empties those through an index on them alone, which only they are ever in, and
-- then forgets them like the rest. A store without answers_apart refuses this table (its
-- migrate finds the answers table and reports a layout mismatch), and reading a record
-- written apart it finds no status and refuses the request (503, the handler not run), never
-- an empty replay.
--
-- On a large table the two CREATE INDEX take a lock that holds writes back while they build; to
-- avoid that, create them first with CREATE INDEX CONCURRENTLY under these names (the migration
-- then finds them).
CREATE TABLE IF NOT EXISTS "{schema}"."{table}_answers" (
    seq         bigint GENERATED ALWAYS AS IDENTITY,
    keep_until  timestamptz NOT NULL,
    status      smallint NOT NULL,
    headers     bytea NOT NULL,
    body        bytea NOT NULL,
    CONSTRAINT "{table}_answers_pkey" PRIMARY KEY (seq)
);
-- The purge's walk over the answers that are due, the earliest first: routes may keep their answers
-- for different times, so the order answers were written in is not the order they fall due.
CREATE INDEX IF NOT EXISTS "{table}_answers_due_idx" ON "{schema}"."{table}_answers" (keep_until);
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS answer_seq bigint;
-- A completed or failed record has its answer's status inline or apart. Every row already there
-- has it inline (0001's check), so the new check is not validated against them (NOT VALID: no
-- scan of the table); it holds for every row written from now on.
ALTER TABLE "{schema}"."{table}" DROP CONSTRAINT IF EXISTS "{table}_response_check";
ALTER TABLE "{schema}"."{table}" ADD CONSTRAINT "{table}_response_check"
    CHECK (state NOT IN ('completed', 'failed') OR response_status IS NOT NULL OR answer_seq IS NOT NULL)
    NOT VALID;
CREATE INDEX IF NOT EXISTS "{table}_forget_idx" ON "{schema}"."{table}" (forget_at);
CREATE INDEX IF NOT EXISTS "{table}_inline_idx"
    ON "{schema}"."{table}" (response_until) WHERE response_headers IS NOT NULL;
DROP INDEX IF EXISTS "{schema}"."{table}_live_until_idx";
DROP INDEX IF EXISTS "{schema}"."{table}_tombstone_forget_idx";
