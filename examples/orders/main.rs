//! # An orders service whose `POST /orders` is safe to retry
//!
//! The reference example of `tower-idempotency`: a small axum service that creates orders in
//! a database. A client that times out can send the same `POST /orders` again with the same
//! `Idempotency-Key`; the service creates the order at most once and answers every retry
//! with the first answer, byte for byte, marked `Idempotent-Replayed: true`.
//!
//! What it shows:
//!
//! - **One transaction for the order and its answer.** The idempotency store runs in atomic
//!   mode: the layer opens a database transaction, claims the key in it, and hands it to the
//!   handler as a `TxHandle`. The handler `INSERT`s the order on that transaction
//!   (`OrderTx`) and gives the handle back; the layer then stores the response in the same
//!   transaction and commits. The order row and the stored answer commit together or not at
//!   all, and the response leaves only after `COMMIT`: a crash before it leaves neither (the
//!   retry executes afresh), and every retry after it replays.
//! - **Per-route opt-in.** Only `POST /orders` is wrapped by `IdempotencyLayer` (with the
//!   explicit operation name `orders.create`); the `GET` routes are not.
//! - **Authentication before idempotency.** An axum middleware turns `Authorization: Bearer
//!   <account>` into the request's `Scope` (and an `Account`) *before* the idempotency
//!   layer runs, so a refused request stores nothing, and a key of one account never replays
//!   another account's answer.
//! - **The handler's context.** The create handler takes `IdempotencyContext` as an
//!   extractor and records `ctx.operation_id()` with the order.
//! - **Release on bad input.** A 422 `validation_failed` is released by the layer's default
//!   rule (4xx → release, the transaction rolls back): the client fixes the body and retries
//!   with the same key.
//! - **Exact money.** `amount_minor` is kept as the client's integer literal (any size), never
//!   through `f64` or `u64`, and stored as its digits.
//! - **Keyset pagination** with an opaque, HMAC-signed cursor, over an index.
//!
//! ## Storage
//!
//! The orders and the idempotency records live in the **same database**, so one transaction
//! covers both. `DATABASE_URL` chooses it:
//!
//! - unset: **SQLite**, the file `orders.db` in the working directory, created on first start.
//!   Nothing to install or set up.
//! - `sqlite:PATH` (`sqlite:orders.db`, `sqlite:///var/lib/orders/orders.db`): SQLite in that
//!   file, created if missing.
//! - `postgres://…` or `postgresql://…`: **PostgreSQL**, in a build with the `postgres`
//!   feature (`--features postgres`; without it the service refuses to start and says so).
//!   The database must exist; the tables go where the connection's `search_path` puts them
//!   (`public` by default).
//! - anything else is refused at start.
//!
//! SQLite runs in WAL mode (readers do not block the writer) with a 5 s busy timeout (a
//! writer waits for another instead of failing at once), and `synchronous = FULL`, so an
//! answer sent after `COMMIT` survives a power cut.
//!
//! On every start the service creates the `orders` table and its page index if they are
//! missing, and runs the idempotency store's migration (the `idempotency_records` table).
//! The SQL is in `book/sql.rs` (`sqlite_sql` and `postgres_sql`); each backend's code is one
//! arm of a `match`. Everything PostgreSQL-only (its variants, its arms, `postgres_sql`,
//! `open_postgres`) is marked `#[cfg(feature = "postgres")]`: a copy for SQLite alone deletes
//! those items, a copy for PostgreSQL alone deletes the SQLite ones.
//!
//! ## Run it
//!
//! ```text
//! cargo run --example orders
//! DATABASE_URL=postgres://postgres@127.0.0.1/orders cargo run --features postgres --example orders
//! ```
//!
//! The first runs on SQLite (`orders.db` in the working directory) with the crate's default
//! features; the second needs the `postgres` feature.
//!
//! It prints `listening on 127.0.0.1:3000` once bound (then `admin listening on
//! 127.0.0.1:3001` for the operator listener), and stops cleanly on Ctrl-C or SIGTERM
//! (in-flight requests finish, the recovery worker stops, then the pools close). Environment:
//!
//! - `DATABASE_URL`: where orders and idempotency records live (see *Storage*).
//! - `ORDERS_ADDR`: the address to bind (default `127.0.0.1:3000`; port `0` picks a free one).
//! - `ORDERS_ADMIN_ADDR`: the operator listener's address (default `127.0.0.1:3001`; port `0`
//!   picks a free one). It prints `admin listening on HOST:PORT` once bound, after the public
//!   `listening on` line. See `admin.rs`.
//! - `ORDERS_ADMIN_TOKEN`: the bearer token of the operator routes (`/admin/...`), at least 16
//!   visible ASCII characters. Unset: every `/admin/` route answers 404.
//! - `ORDERS_IDEMPOTENCY_MODE` (`enforce`, the default, `shadow` or `off`) and
//!   `ORDERS_IDEMPOTENCY_COHORT` (account ids, comma-separated: enforced whatever the mode): the
//!   idempotency layer's rollout, changeable at run time with `GET`/`PUT
//!   /admin/idempotency/rollout` on the operator listener. In `off` and `shadow` mode
//!   `POST /orders` takes the old path: every call creates an order, 201 as before, without
//!   `idempotent-replayed`. See `rollout.rs`.
//! - `ORDERS_AUDIT_SECS` (default 60; fractions allowed): how often the audit behind
//!   `orders_duplicate_effects` runs. `GET /metrics` on the operator listener (no token) shows it,
//!   and the layer's and the recovery workers' metrics in a build with the `metrics` feature
//!   (`cargo run --features metrics --example orders`). See `telemetry.rs`.
//! - `ORDERS_CURSOR_SECRET`: the key that signs pagination cursors, at least 16 bytes. Unset:
//!   a random key per process (cursors then stop working after a restart).
//! - `REDIS_URL` (`redis://127.0.0.1:6379/`, in a build with the `redis` feature): puts the
//!   Redis fast path in front of the idempotency store: replays answered from Redis, concurrent
//!   duplicates kept off the database. Redis is never what keeps the promise; while it is down
//!   the service runs on its database alone. Services with their own databases may share one
//!   Redis: each database's deployment secret namespaces and seals its entries.
//! - `ORDERS_BODY_TIMEOUT_SECS` (default 30): a `POST /orders` body not complete within this
//!   many seconds is answered 408 `idempotency_body_timeout` (a client that stalls mid-body
//!   holds nothing for longer).
//! - `ORDERS_BUFFER_BUDGET_BYTES` (default 67108864, 64 MiB; at least 1048576): the bytes of
//!   `POST /orders` bodies held in memory at once. A request whose body does not fit is refused
//!   before it is read with 503 `idempotency_buffer_budget_exhausted` and `Retry-After: 1`. A
//!   body is charged its `Content-Length`; one without is charged as it arrives (and refused
//!   the same way when the budget cannot take its next chunk).
//! - `ORDERS_RETENTION_SECS` (default 86400, one day): how long an answer replays.
//! - `ORDERS_TOMBSTONE_SECS` (default 604800, seven days): how long after that a retry with
//!   the same key gets 422 `idempotency_key_expired` (instead of executing again); then the key
//!   is forgotten.
//! - `ORDERS_JANITOR_SECS` (default 60): how often the recovery worker runs (stale leases,
//!   reconciliation, purge of what is past its retention; see `recovery.rs`).
//! - `ORDERS_CENSUS_SECS` (default: unset, at every pass): how often the recovery worker counts
//!   every record by state for the `completed`, `failed` and `expired` gauges, a read of the
//!   whole records table; the passes between count the open records alone, from their index.
//!   With hundreds of millions of records, set it to hours.
//!
//!   These four are seconds, fractions allowed (`0.5`), greater than zero and at most ten
//!   years; anything else stops the start (see `lifecycle.rs`).
//! - `ORDERS_PURGE_RATE` (default: unset, no limit): the most records a second the recovery
//!   worker purges, so that a backlog past its retention does not take the database's CPU
//!   from serving; a whole number greater than zero, else the start stops.
//! - `PSP_URL` (`http://127.0.0.1:3100`): the payment provider (`cargo run --example psp`);
//!   unset, the payment routes answer 503 `payments_unavailable`. `ORDERS_PSP_TIMEOUT_MS`
//!   (default 2000) bounds one provider call, `ORDERS_RECONCILE_SECS` (default 5) is how often
//!   unknown payments are reconciled, `ORDERS_LEASE_SECS` (default 30) is the payment route's
//!   lease, and `ORDERS_PSP_IDEMPOTENT` (default `true`) says whether the provider honours keys
//!   and has a lookup. See `payments/mod.rs`.
//! - `ORDERS_ANSWERS_APART` (default `false`; `true` or `false`; PostgreSQL only): keep the
//!   stored answers in a table of their own (`PostgresStore::answers_apart`), which makes the
//!   purge's tombstones far cheaper at scale (`docs/scale.md`). Once a database has been started
//!   with it, it must stay `true`: the migration is one way, and a start without it is refused.
//!
//! - `ORDERS_WEBHOOK_URL` and `ORDERS_WEBHOOK_SECRET` (in a build with the `outbox` feature):
//!   every order's `order.created` event, written to the outbox in the create transaction, and
//!   every settled payment's `payment.succeeded` or `payment.declined`, written in the
//!   settlement's, are delivered there as signed Standard Webhooks; the secret (`whsec_…`) is required when the URL
//!   is set. `GET /admin/outbox/counts` on the operator listener. See `events.rs`.
//!
//! It speaks HTTP/1.1 and HTTP/2 (h2c, prior knowledge) on the same port, with limits on what
//! one connection can hold: 32 concurrent streams, 16 KiB of headers, 30 s for an HTTP/1.1
//! request head, bounded flow-control windows and resets (the table is in `serve.rs`).
//!
//! Create an order:
//!
//! ```text
//! curl -i http://127.0.0.1:3000/orders \
//!   -H 'authorization: Bearer acct_1' \
//!   -H 'idempotency-key: 8e0c3c3a-4b7f-4a53-9d0e-1f6c2b8a7d11' \
//!   -H 'content-type: application/json' \
//!   -d '{"sku":"book-42","quantity":1,"amount_minor":9007199254740993,"currency":"JPY"}'
//! # HTTP/1.1 201 Created
//! # location: /orders/5b0e…
//! ```
//!
//! Send exactly the same request again: the same status, `Location` and body, plus
//! `idempotent-replayed: true`, and still only one order.
//!
//! Reuse the key with a different body (here another amount):
//!
//! ```text
//! curl -i http://127.0.0.1:3000/orders \
//!   -H 'authorization: Bearer acct_1' \
//!   -H 'idempotency-key: 8e0c3c3a-4b7f-4a53-9d0e-1f6c2b8a7d11' \
//!   -H 'content-type: application/json' \
//!   -d '{"sku":"book-42","quantity":1,"amount_minor":9007199254740992,"currency":"JPY"}'
//! # HTTP/1.1 422 Unprocessable Entity
//! # {"type":"urn:tower-idempotency:problem:idempotency_key_reused", …, "code":"idempotency_key_reused"}
//! ```
//!
//! List the account's orders, newest first, then follow `next_cursor`:
//!
//! ```text
//! curl -s 'http://127.0.0.1:3000/orders?limit=10' -H 'authorization: Bearer acct_1'
//! # {"orders":[…],"next_cursor":"eyJ2Ijox….Qm9n…"}
//! curl -s 'http://127.0.0.1:3000/orders?limit=10&cursor=eyJ2Ijox….Qm9n…' -H 'authorization: Bearer acct_1'
//! curl -s http://127.0.0.1:3000/orders/5b0e… -H 'authorization: Bearer acct_1'
//! ```
//!
//! ## The interface
//!
//! Every error is `application/problem+json` (RFC 9457: `type`, `title`, `status`, `detail`,
//! `code`). The idempotency layer's own answers (`idempotency_key_missing`,
//! `idempotency_key_reused`, …) come from the crate.
//!
//! A storage failure (a lost or terminated database connection, an aborted transaction, a
//! statement the database refuses) answers 503 `storage_unavailable` with `Retry-After: 1`,
//! on every route. On `POST /orders` the layer releases the 503 like any non-2xx answer: the
//! transaction rolls back, neither the order nor an answer is stored, and a retry with the
//! same `Idempotency-Key` executes afresh. A genuine bug (no transaction handle, a stored row
//! that is not a valid order) answers 500 `internal`. Either way the cause goes to stderr,
//! never to the client.
//!
//! - **Authentication**: `Authorization: Bearer <account>`, where the token *is* the account
//!   id (a stand-in for real authentication): 1 to 64 visible ASCII characters (`!` to `~`),
//!   the scheme matched case-insensitively. Missing, repeated or malformed: 401
//!   `unauthenticated` with `WWW-Authenticate: Bearer realm="orders"`, on every route.
//! - **`POST /orders`**, `Idempotency-Key` required. The body must be `application/json` (or
//!   `*+json`), else 415 `unsupported_media_type`. Members:
//!   - `sku`: a string of 1 to 64 characters, no control characters;
//!   - `quantity`: an integer from 1 to 2^63 − 1;
//!   - `amount_minor`: a JSON integer literal `>= 0` of any size, kept exactly as written
//!     (digits only: no sign, fraction or exponent; `1.0` and `1e2` are refused, not
//!     normalised). JSON itself forbids leading zeros, so `007` never arrives as a number;
//!     a string such as `"100"` is refused;
//!   - `currency`: three uppercase ASCII letters (`JPY`); not checked against ISO 4217.
//!
//!   Unknown members are **refused** (a misspelt `ammount_minor` must not be silently
//!   dropped from a payment), as are duplicate members. Any of this: 422
//!   `validation_failed` with a `detail` naming the problem; nothing is stored, so the
//!   corrected request may reuse the key. Success: 201, `Location: /orders/{order_id}`,
//!   `content-type: application/json` and the order.
//! - **An order** is `{"order_id", "account_id", "sku", "quantity", "amount_minor",
//!   "currency", "created_at", "idempotency_operation_id"}`. `order_id` is a UUID v4 in
//!   lowercase hyphenated form; `created_at` is RFC 3339 UTC with microseconds
//!   (`2025-01-02T03:04:05.000006Z`). `idempotency_operation_id` is the layer's stable id
//!   for *(account, `orders.create`, key)*: it is the same on every retry, shows which
//!   request created the order, and is derived one-way (it reveals neither key nor account).
//! - **`GET /orders/{order_id}`**: the order if it belongs to the caller. Another account's
//!   order, an unknown id and a malformed id all answer the same 404 `order_not_found`.
//! - **`GET /operations/{operation_id}`**: what became of one of the caller's idempotent
//!   requests, by its operation id (an order's `idempotency_operation_id`): 200
//!   `{"operation_id", "state", "status", "location"}`, `state` one of `processing`,
//!   `succeeded`, `failed`, `unknown`, `expired`, `status` and `location` those of the stored
//!   answer (or null). Another account's operation, an unknown id and a malformed id all
//!   answer the same 404 `operation_not_found`.
//! - **`GET /orders?limit=&cursor=`**: `{"orders": [...], "next_cursor": string | null}`,
//!   newest first by `(created_at, order_id)` descending. `limit` is 1 to 100 (default 20);
//!   anything else is 400 `invalid_limit`. `cursor` is the previous page's `next_cursor`;
//!   a tampered, malformed, empty or other account's cursor, or one of another version, is
//!   400 `invalid_cursor`. `next_cursor` is null on the last page. Unknown query
//!   parameters are ignored; a query that cannot be read (a repeated `limit`, say) is 400
//!   `invalid_query`.
//!
//! **Retention**: an answer replays for `ORDERS_RETENTION_SECS` (a day by default); for
//! `ORDERS_TOMBSTONE_SECS` after that (seven days) a retry gets 422 `idempotency_key_expired`
//! and is not executed; after both the key is new again. README.md says the same for clients.
//!
//! **Payments**: `POST /orders/{order_id}/payments` (`Idempotency-Key` required, body `{}`),
//! `GET /orders/{order_id}/payments` and `GET /orders/{order_id}/payments/{payment_id}`, and the
//! operator's `POST /admin/payments/{payment_id}/settle`: the answers and the attempt's states
//! are in `payments/mod.rs`.
//!
//! **Operator routes**, on the operator listener behind `ORDERS_ADMIN_TOKEN` (see
//! `operator.rs` for the answers): `GET` and `DELETE /admin/idempotency/record`, `POST
//! /admin/idempotency/record/settle` (the record named by `account`, `operation` and `key`
//! query parameters), `GET /admin/idempotency/unknown?limit=N` and `GET
//! /admin/idempotency/counts`.
//!
//! The cursor is `base64url(payload) "." base64url(HMAC-SHA256(secret, payload))` where the
//! payload is JSON `{"v":1,"created_at":<unix microseconds>,"order_id":"…","account":"…"}`
//! and `account` is a digest of the account id. The account is always the authenticated one;
//! the cursor only has to match it.
//!
//! ## The code
//!
//! One module per step, in the order a request meets them:
//!
//! - `admin`: the operator listener and its token;
//! - `rollout`: the idempotency layer's mode and cohort, and their operator routes;
//! - `telemetry`: `GET /metrics` and the duplicate-effects audit;
//! - `operator` and `operator_request`: the operator routes of the idempotency records, and
//!   what they read from a request;
//! - `operations`: `GET /operations/{operation_id}`;
//! - `lifecycle` and `recovery`: retention from the environment, and the recovery worker;
//! - `payments`: payments through a provider (a leased route, the `payment_attempts` table, its
//!   reconciler and operator route);
//! - `drill`: the crash drill, a leased route the crash test turns on (`ORDERS_CRASH_DRILL`;
//!   not part of the interface);
//! - `auth`: `Authorization: Bearer <account>` becomes the account and the idempotency scope;
//! - `api`: the routes (idempotency on `POST /orders` only) and their handlers;
//! - `create_request`: the body of `POST /orders`, read strictly;
//! - `cursor`: the signed pagination cursors;
//! - `events`: `order.created` and `payment.succeeded`/`payment.declined` in the outbox, the webhook relay, the outbox counts;
//! - `problem`: every error answer;
//! - `book`: the orders, their rules and their table, shared with the gRPC example;
//! - `limits`: the body deadline and the buffer budget, from the environment;
//! - `startup`, `serve` and `shutdown`: opening the database, serving HTTP/1.1 and HTTP/2 with
//!   limits, and stopping cleanly.

use std::process::ExitCode;
use std::sync::Arc;

use tower_idempotency::BoxError;

mod admin;
mod api;
mod auth;
mod book;
mod create_request;
mod cursor;
mod drill;
mod events;
mod lifecycle;
mod limits;
mod operations;
mod operator;
mod operator_request;
mod payments;
mod problem;
mod recovery;
mod rollout;
mod serve;
mod shutdown;
mod startup;
mod telemetry;

use admin::{AdminToken, DEFAULT_ADMIN_ADDR};
use book::created_at::CreatedAt;
use cursor::CursorCodec;
use lifecycle::Lifecycle;
use limits::RequestLimits;
use shutdown::shutdown_signal;
use startup::Settings;

#[tokio::main]
async fn main() -> ExitCode {
    match serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Display, not Debug; no startup error repeats DATABASE_URL (it may hold a password).
            eprintln!("orders: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Opens the database, binds both listeners, announces `listening on <addr>` as the first line
/// of stdout and `admin listening on <addr>` as the second, and serves until Ctrl-C or SIGTERM.
async fn serve() -> Result<(), BoxError> {
    let address = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let admin_address = std::env::var("ORDERS_ADMIN_ADDR").unwrap_or_else(|_| DEFAULT_ADMIN_ADDR.to_owned());
    let admin_token = AdminToken::from_env()?;
    let settings = Settings {
        cursors: CursorCodec::from_env()?,
        limits: RequestLimits::from_env()?,
        lifecycle: Lifecycle::from_env()?,
        drill: drill::mode_from_env()?,
        clock: Arc::new(CreatedAt::now),
        payments: payments::PaymentSettings::from_env()?,
        rollout: rollout::switch_from_env()?,
    };
    let audit_every = telemetry::audit_interval_from_env()?;
    let janitor_every = settings.lifecycle.janitor_every;
    let database_url = std::env::var("DATABASE_URL").ok().filter(|url| !url.is_empty());
    // Before anything emits: the layer's handles, the recovery workers' metrics and the audit's
    // gauge bind to this recorder.
    let metrics = telemetry::install()?;
    let opened = startup::open(database_url.as_deref(), settings).await?;
    let listener = tokio::net::TcpListener::bind(&address).await?;
    let admin_listener = tokio::net::TcpListener::bind(&admin_address).await?;
    announce(&format!("listening on {}", listener.local_addr()?));
    announce(&format!("admin listening on {}", admin_listener.local_addr()?));

    // One signal stops both listeners.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(true);
    });
    let until_stopped = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    telemetry::spawn_audit(opened.orders.clone(), audit_every);
    let admin_router = opened.admin.merge(telemetry::routes(metrics)).into_router(admin_token);
    let payments_recovery = async {
        if let Some((worker, every)) = opened.payments {
            worker.run(every, until_stopped(stopped.clone())).await;
        }
    };
    let (api, admin, (), ()) = tokio::join!(
        serve::serve(listener, opened.api, until_stopped(stopped.clone())),
        serve::serve(admin_listener, admin_router, until_stopped(stopped.clone())),
        opened.recovery.run(janitor_every, until_stopped(stopped.clone())),
        payments_recovery,
    );
    api?;
    admin?;
    // In-flight requests have finished (their transactions are committed or rolled back), and
    // the recovery worker has stopped: close the database connections.
    opened.orders.close().await;
    Ok(())
}

/// Writes one line to stdout and flushes it. A stdout nobody reads any more (a supervisor that
/// read the first line and closed the pipe) is not a reason to stop serving, so a failed write
/// is ignored, where `println!` would panic.
fn announce(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}").and_then(|()| stdout.flush());
}
