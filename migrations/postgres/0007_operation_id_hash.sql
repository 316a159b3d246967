-- tower-idempotency: the operation-id index as a hash index. {schema} and {table} as in 0001.
-- Operation status is looked up by equality only, and the operation id is 16 random bytes, so
-- a hash index (a 4-byte hash code per entry) serves every lookup 0003's B-tree did, in about
-- half its bytes: 28 a record against 52.5 (the B-tree's leaves fill to about 70 % from keys
-- arriving in random order). The uniqueness of records stays the primary key's.
--
-- On a large table this builds the index under a lock that holds writes back. To avoid that,
-- create it first with CREATE INDEX CONCURRENTLY under this name (the migration then finds it)
-- and drop the old one the same way; on a partitioned table, per partition (see docs/scale.md).
CREATE INDEX IF NOT EXISTS "{table}_operation_id_hash"
    ON "{schema}"."{table}" USING hash (operation_id) WHERE operation_id IS NOT NULL;
DROP INDEX IF EXISTS "{schema}"."{table}_operation_id_idx";
