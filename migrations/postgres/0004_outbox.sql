-- tower-idempotency: the transactional outbox (feature `outbox`), one row per event.
-- {qualified} is the table's validated name, schema-qualified or not; {table} is its bare name.
-- Run by the outbox's own migrator (history in _<table>_migrations), apart from the records'.
CREATE TABLE IF NOT EXISTS {qualified} (
    -- Stable for the business operation that enqueued it (derived from its operation id), so a
    -- redelivery carries the same id and the receiver can recognise it.
    event_id     text        NOT NULL,
    event_type   text        NOT NULL,
    -- The webhook body, fixed at enqueue and sent byte for byte on every delivery.
    body         bytea       NOT NULL,
    -- pending: still to deliver (due, leased or waiting for a retry); delivered; dead: given up
    -- after the deadline. Nothing leaves delivered or dead.
    state        text        NOT NULL DEFAULT 'pending',
    attempts     integer     NOT NULL DEFAULT 0,
    -- Bumped by every claim: a relay finishes an attempt only under the token it claimed with,
    -- so a relay whose lease ran out (and whose event another relay took) changes nothing.
    lease_token  bigint      NOT NULL DEFAULT 0,
    -- When a relay may claim the event: now for a new event, the lease's end while a relay
    -- holds it, the retry's time after a failure. One column, so "due" is one index range.
    available_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at timestamptz,
    -- The last failure, for operators (a status code or a transport error; never the body).
    last_error   text,
    CONSTRAINT "{table}_pkey" PRIMARY KEY (event_id),
    CONSTRAINT "{table}_state_check" CHECK (state IN ('pending', 'delivered', 'dead'))
);

-- The relay's claim walks due events in this order; delivered and dead rows are not in it.
CREATE INDEX IF NOT EXISTS "{table}_due_idx" ON {qualified} (available_at) WHERE state = 'pending';
