-- tower-idempotency: the record lifecycle (issue 12): what recovery, reconciliation, expiry of
-- every state and the admin operations need. {table} as in 0001.

-- The route identity the record was claimed under (a route name, never a key): reconcilers are
-- registered per operation. NULL for records written before this migration.
ALTER TABLE "{table}" ADD COLUMN operation TEXT;
-- SHA-256 of the scope (never the scope itself) and the operation id handlers see: a record is
-- found by its operation id only within its own scope.
ALTER TABLE "{table}" ADD COLUMN scope_digest BLOB;
ALTER TABLE "{table}" ADD COLUMN operation_id BLOB;
-- The claim declared its route safe to re-execute: a dead lease is released, not marked unknown.
ALTER TABLE "{table}" ADD COLUMN reexecutable INTEGER NOT NULL DEFAULT 0;
-- How often a reconciler was given the record, and when (unix ms) it may be given it again (its
-- backoff, which also keeps concurrent workers from asking about it twice).
ALTER TABLE "{table}" ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE "{table}" ADD COLUMN recheck_at INTEGER;

-- Every state has a retention now: unsettled records written before carried none, so they get
-- the default (30 days, then the default 7-day tombstone), counted from their last change.
UPDATE "{table}"
   SET response_until = updated_at + 2592000000, forget_at = updated_at + 3196800000
 WHERE state IN ('processing', 'unknown') AND response_until IS NULL;

-- The purge's expiry covers every live state, so its index does too (it replaces 0001's, which
-- covered completed and failed records only).
CREATE INDEX IF NOT EXISTS "{table}_live_until_idx" ON "{table}" (response_until) WHERE state <> 'expired';
DROP INDEX IF EXISTS "{table}_response_until_idx";
-- Operation status lookups.
CREATE INDEX IF NOT EXISTS "{table}_operation_id_idx" ON "{table}" (operation_id) WHERE operation_id IS NOT NULL;
-- Unknown records, oldest first: for operators, and per operation for its reconciler.
CREATE INDEX IF NOT EXISTS "{table}_unknown_idx" ON "{table}" (operation, created_at) WHERE state = 'unknown';
CREATE INDEX IF NOT EXISTS "{table}_unknown_age_idx" ON "{table}" (created_at) WHERE state = 'unknown';
