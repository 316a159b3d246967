-- tower-idempotency: smaller indexes (issue 16). {schema} and {table} as in 0001.
--
-- The purge's index on tombstones only. 0001's forget_at_idx held an entry for every record,
-- though the purge deletes only records past their tombstone time, and a record reaches that time
-- as a tombstone: its response retention ends first (response_until is never later than
-- forget_at) and the purge's other statement turns it into one. So the purge now deletes
-- tombstones only, found through this index, and a record with its answer carries one index
-- entry fewer (22.5 bytes, and one index insert less a claim). A record past both times is
-- deleted one purge later than before: made a tombstone, then deleted. Claims never relied on
-- the purge: a record past forget_at is taken over by the next claim of its identity whatever
-- its state.
--
-- The operation id's hash index with its buckets filled to 100 % before they split, where 0007's
-- split at the default 75 %: 30 bytes a record where it took 37. Its keys are digests, spread
-- evenly over the buckets, so full buckets rarely overflow; and it serves the operation id
-- lookups only, never a claim.
--
-- On a large table this builds both indexes under a lock that holds writes back. To avoid that,
-- create them first with CREATE INDEX CONCURRENTLY under these names (the migration then finds
-- them) and drop the old ones the same way; on a partitioned table, per partition (see
-- docs/scale.md).
CREATE INDEX IF NOT EXISTS "{table}_tombstone_forget_idx"
    ON "{schema}"."{table}" (forget_at) WHERE state = 'expired';
DROP INDEX IF EXISTS "{schema}"."{table}_forget_at_idx";
CREATE INDEX IF NOT EXISTS "{table}_operation_key_hash"
    ON "{schema}"."{table}" USING hash (operation_id) WITH (fillfactor = 100) WHERE operation_id IS NOT NULL;
DROP INDEX IF EXISTS "{schema}"."{table}_operation_id_hash";
