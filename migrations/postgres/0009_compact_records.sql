-- tower-idempotency: a smaller record (issue 16). {schema} and {table} as in 0001.
--
-- An atomic record (the most common) never held a lease, was never updated and was never given
-- to a reconciler, so its fencing token (0), its updated_at (its created_at) and its attempts (0)
-- said nothing its other columns do not. From this migration on the store writes them as NULL
-- and reads NULL as those values: 20 bytes less in every such row, and no NOT NULL left that
-- would refuse them. Dropping NOT NULL changes the catalog only: no row is read or rewritten, and
-- a partitioned table passes it on to its partitions.
--
-- The store also stops writing scope_digest (33 bytes): operation_id now holds a digest of the
-- operation id and the scope's digest together, so the operation id lookup finds a record only
-- within its own scope without a second column (records written before keep both columns and are
-- found as before). Nothing in the schema changes for that.
ALTER TABLE "{schema}"."{table}"
    ALTER COLUMN fencing_token DROP NOT NULL,
    ALTER COLUMN updated_at DROP NOT NULL,
    ALTER COLUMN attempts DROP NOT NULL;
