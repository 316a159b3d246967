-- tower-idempotency: the deployment's secret (Store::deployment_secret), one row drawn once, here,
-- and kept with the records. The Redis fast path derives its key namespace and the MAC key of
-- its cached values from it, so deployments sharing one Redis never trust each other's entries.
-- randomblob() draws from SQLite's generator, seeded from the operating system's random source.
CREATE TABLE IF NOT EXISTS "{table}_deployment" (
    id     INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    secret BLOB    NOT NULL CHECK (length(secret) = 32)
) STRICT;
INSERT OR IGNORE INTO "{table}_deployment" (id, secret) VALUES (1, randomblob(32));
