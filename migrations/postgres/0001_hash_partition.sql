-- tower-idempotency: one hash partition of the records table (issue 16), for stores configured
-- with PostgresStore::hash_partitions(n). Not a migration of its own: migration 0001 of such a
-- store is 0001_create_records.sql with its CREATE TABLE partitioned by hash on record_id, and
-- this statement right after it, once for each remainder 0 to n - 1. {schema}, {table} as in 0001;
-- {partition} is the table's name, "_p" and the remainder in at least three digits; {modulus} is n.
-- The partition inherits every column, constraint and index of the partitioned table, those
-- 0001 and 0003 create after it included. Never edit: the text is in the migration's checksum.
CREATE TABLE IF NOT EXISTS "{schema}"."{partition}" PARTITION OF "{schema}"."{table}"
    FOR VALUES WITH (MODULUS {modulus}, REMAINDER {remainder});
