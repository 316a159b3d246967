-- tower-idempotency: the purge's index on tombstones only (issue 16). {schema} and {table} as
-- in 0001.
--
-- 0001's forget_at_idx held an entry for every record, though the purge deletes only records
-- past their tombstone time, and a record reaches that time as a tombstone: its response
-- retention ends first (response_until is never later than forget_at) and the purge's other
-- statement turns it into one. So the purge now deletes tombstones only, found through this
-- index, and a record with its answer carries one index entry fewer (22.5 bytes, and one index
-- insert less a claim). A record past both times is deleted one purge later than before: made a
-- tombstone, then deleted. Claims never relied on the purge: a record past forget_at is taken
-- over by the next claim of its identity whatever its state.
--
-- On a large table this builds the index under a lock that holds writes back. To avoid that,
-- create it first with CREATE INDEX CONCURRENTLY under this name (the migration then finds it)
-- and drop the old one the same way; on a partitioned table, per partition (see docs/scale.md).
CREATE INDEX IF NOT EXISTS "{table}_tombstone_forget_idx"
    ON "{schema}"."{table}" (forget_at) WHERE state = 'expired';
DROP INDEX IF EXISTS "{schema}"."{table}_forget_at_idx";
