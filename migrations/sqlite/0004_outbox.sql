-- tower-idempotency: the transactional outbox (feature `outbox`), one row per event.
-- {table} is the table's validated name. Run by the outbox's own migrator (history in
-- _<table>_migrations), apart from the records'. Times are INTEGER unix milliseconds from the
-- application's clock, as in the records table.
CREATE TABLE IF NOT EXISTS "{table}" (
    -- Stable for the business operation that enqueued it (derived from its operation id), so a
    -- redelivery carries the same id and the receiver can recognise it.
    event_id     TEXT    NOT NULL PRIMARY KEY,
    event_type   TEXT    NOT NULL,
    -- The webhook body, fixed at enqueue and sent byte for byte on every delivery.
    body         BLOB    NOT NULL,
    -- pending: still to deliver (due, leased or waiting for a retry); delivered; dead: given up
    -- after the deadline. Nothing leaves delivered or dead.
    state        TEXT    NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    -- Bumped by every claim: a relay finishes an attempt only under the token it claimed with.
    lease_token  INTEGER NOT NULL DEFAULT 0,
    -- When a relay may claim the event: at once for a new event, the lease's end while a relay
    -- holds it, the retry's time after a failure.
    available_at INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    delivered_at INTEGER,
    -- The last failure, for operators (a status code or a transport error; never the body).
    last_error   TEXT
) STRICT;

-- The relay's claim walks due events in this order; delivered and dead rows are not in it.
CREATE INDEX IF NOT EXISTS "{table}_due_idx" ON "{table}" (available_at) WHERE state = 'pending';
