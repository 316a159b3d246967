-- tower-idempotency: the answer's CHECK constraint of 0011 dropped again (issue 16). {schema} and
-- {table} as in 0001.
--
-- 0011 (answers apart) puts back the response check that 0012 drops, with the answer's own row as
-- a third way to hold it. A table migrated by 0012 before its answers were moved apart gets 0011
-- after it, so this drops the check once more, for the reason 0012 gives. On a table whose
-- answers were apart before 0012 ran, it finds nothing to drop.
ALTER TABLE "{schema}"."{table}" DROP CONSTRAINT IF EXISTS "{table}_response_check";
