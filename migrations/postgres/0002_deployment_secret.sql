-- tower-idempotency: the deployment's secret (Store::deployment_secret), one row drawn once, here,
-- and kept with the records. The Redis fast path derives its key namespace and the MAC key of
-- its cached values from it, so deployments sharing one Redis never trust each other's entries.
-- gen_random_uuid() draws from the server's strong random source: two of them make 32 bytes.
CREATE TABLE IF NOT EXISTS "{schema}"."{table}_deployment" (
    id     smallint NOT NULL PRIMARY KEY CHECK (id = 1),
    secret bytea    NOT NULL CHECK (length(secret) = 32)
);
INSERT INTO "{schema}"."{table}_deployment" (id, secret)
VALUES (1, uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()))
ON CONFLICT (id) DO NOTHING;
