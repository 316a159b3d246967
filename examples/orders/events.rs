//! The service's events (feature `outbox`): `order.created` written to the outbox table in the
//! create transaction, `payment.succeeded` / `payment.declined` in the settlement's, the relay that delivers them as Standard Webhooks, and
//! `GET /admin/outbox/counts` on the operator listener.
//!
//! - `ORDERS_WEBHOOK_URL` (`http://…`): where the relay `POST`s each event. Unset: events stay
//!   queued in `outbox_events`, nothing is sent.
//! - `ORDERS_WEBHOOK_SECRET` (`whsec_…`): the Standard Webhooks signing secret, required when
//!   the URL is set (the service refuses to start without it, and says so).
//!
//! The event's id (`webhook-id`) is derived from the create request's operation id, so every
//! delivery of it, and a retried request's (which replays and enqueues nothing), carry the
//! same id. A request without a key (in `off` or `shadow` mode, the old path) has no operation
//! identity: its event's id is derived from the order's id instead. The body is `{"type":"order.created","timestamp":…,"data":<the order>}`, the order
//! exactly as `POST /orders` answered it.
//!
//! Every settlement of a payment attempt to `succeeded` or `declined` (by the handler, the
//! reconciler or the operator's `POST /admin/payments/{payment_id}/settle`) enqueues
//! `payment.succeeded` or `payment.declined` in the transaction of its conditional update
//! (`payments/attempts.rs`): a settlement that loses its race changes nothing and enqueues
//! nothing, and a replay settles nothing. Its id is `evt_payment.<status>_<payment_id>`, the same
//! whichever path settled it; its data is the payment as `GET /orders/{order_id}/payments` shows
//! it (`payment_id`, `status`, `charge_id`, `created_at`, `settled_at`) with `order_id`,
//! `amount_minor` (exact) and `currency`; its timestamp is `settled_at`.
//!
//! In a build without the `outbox` feature no event (of either kind) is written and setting
//! `ORDERS_WEBHOOK_URL` refuses to start: `cargo run --features outbox --example orders`.

#[cfg(all(feature = "outbox", feature = "postgres"))]
pub(crate) use with_outbox::payment_settled_postgres;
#[cfg(feature = "outbox")]
pub(crate) use with_outbox::{order_created, payment_settled_sqlite, start};
#[cfg(all(not(feature = "outbox"), feature = "postgres"))]
pub(crate) use without_outbox::payment_settled_postgres;
#[cfg(not(feature = "outbox"))]
pub(crate) use without_outbox::{order_created, payment_settled_sqlite, start};

#[cfg(feature = "outbox")]
mod with_outbox {
    use axum::Json;
    use axum::Router;
    use axum::extract::State;
    use axum::response::{IntoResponse, Response};
    use axum::routing::get;
    use serde_json::json;
    use tower_idempotency::outbox::{
        EventId, NewEvent, OutboxError, OutboxStore, PostgresOutbox, Relay, RelayConfig, SqliteOutbox, WebhookSecret,
        WebhookSender,
    };
    use tower_idempotency::{BoxError, IdempotencyContext};

    use super::super::book::created_at::CreatedAt;
    use super::super::book::order::Order;
    use super::super::book::storage::{OrderBook, OrderTx, StorageError};
    use super::super::payments::Attempt;
    use super::super::problem::ApiProblem;

    /// Writes `order.created` for `order` in the create transaction `tx` (before `insert`
    /// consumes it): it commits with the order and the stored answer, or not at all.
    pub(crate) async fn order_created(
        orders: &OrderBook,
        tx: &OrderTx,
        context: Option<&IdempotencyContext>,
        order: &Order,
    ) -> Result<(), ApiProblem> {
        let event = match context {
            Some(context) => NewEvent::for_operation(context, "order.created", order),
            None => {
                let id = EventId::new(format!("evt_{}", order.order_id.simple())).ok_or_else(ApiProblem::internal)?;
                NewEvent::new(id, "order.created", order, std::time::SystemTime::now())
            }
        }
        .map_err(|_| ApiProblem::internal())?;
        let enqueued = match (orders, tx) {
            (OrderBook::Sqlite(pool), OrderTx::Sqlite(handle)) => {
                SqliteOutbox::new(pool.clone()).enqueue(handle, &event).await
            }
            #[cfg(feature = "postgres")]
            (OrderBook::Postgres(pool), OrderTx::Postgres(handle)) => {
                PostgresOutbox::new(pool.clone()).enqueue(handle, &event).await
            }
            #[cfg(feature = "postgres")]
            _ => return Err(ApiProblem::internal()),
        };
        enqueued.map(drop).map_err(|error| ApiProblem::create_failed(storage_error(error)))
    }

    /// Writes `payment.succeeded` or `payment.declined` for the just-settled `attempt` on `conn`,
    /// the settlement's own transaction: it commits with the state change, or not at all.
    pub(crate) async fn payment_settled_sqlite(
        pool: &sqlx::SqlitePool,
        conn: &mut sqlx::SqliteConnection,
        attempt: &Attempt,
    ) -> Result<(), sqlx::Error> {
        let event = payment_event(attempt)?;
        SqliteOutbox::new(pool.clone()).enqueue_on(conn, &event).await.map(drop).map_err(sqlx_error)
    }

    /// [`payment_settled_sqlite`] on PostgreSQL.
    #[cfg(feature = "postgres")]
    pub(crate) async fn payment_settled_postgres(
        pool: &sqlx::PgPool,
        conn: &mut sqlx::PgConnection,
        attempt: &Attempt,
    ) -> Result<(), sqlx::Error> {
        let event = payment_event(attempt)?;
        PostgresOutbox::new(pool.clone()).enqueue_on(conn, &event).await.map(drop).map_err(sqlx_error)
    }

    /// The payment as `GET /orders/{order_id}/payments` shows it, with its order and amount.
    #[derive(serde::Serialize)]
    struct PaymentData<'a> {
        payment_id: &'a str,
        order_id: &'a str,
        status: &'a str,
        charge_id: Option<&'a str>,
        amount_minor: &'a serde_json::value::RawValue,
        currency: &'a str,
        created_at: String,
        settled_at: Option<String>,
    }

    /// The settled attempt's event: `payment.<state>`, its id `evt_payment.<state>_<payment_id>`
    /// (the same whichever path settled it), timestamped when it settled.
    fn payment_event(attempt: &Attempt) -> Result<NewEvent, sqlx::Error> {
        let event_type = format!("payment.{}", attempt.state);
        let encode = |error: serde_json::Error| sqlx::Error::Encode(error.into());
        let amount: Box<serde_json::value::RawValue> =
            serde_json::value::RawValue::from_string(attempt.amount_minor.clone()).map_err(encode)?;
        let data = PaymentData {
            payment_id: &attempt.payment_id,
            order_id: &attempt.order_id,
            status: &attempt.state,
            charge_id: attempt.charge_id.as_deref(),
            amount_minor: &amount,
            currency: &attempt.currency,
            created_at: CreatedAt::from_unix_micros(attempt.created_at).to_string(),
            settled_at: attempt.settled_at.map(|at| CreatedAt::from_unix_micros(at).to_string()),
        };
        let id = EventId::new(format!("evt_{event_type}_{}", attempt.payment_id))
            .ok_or_else(|| sqlx::Error::Encode("the payment id makes no event id".into()))?;
        let settled = attempt.settled_at.and_then(|at| u64::try_from(at).ok()).unwrap_or(0);
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_micros(settled);
        NewEvent::new(id, &event_type, &data, time).map_err(encode)
    }

    /// An outbox failure as the settlement's: the database's, or a bug.
    fn sqlx_error(error: OutboxError) -> sqlx::Error {
        match error {
            OutboxError::Unavailable(error) => match error.downcast::<sqlx::Error>() {
                Ok(error) => *error,
                Err(error) => sqlx::Error::Encode(error),
            },
            error => sqlx::Error::Encode(error.into()),
        }
    }

    /// Creates the outbox table, starts the relay when `ORDERS_WEBHOOK_URL` is set, and returns
    /// the operator route `GET /admin/outbox/counts` (for the operator listener's `/admin/`
    /// routes).
    pub(crate) async fn start(orders: &OrderBook) -> Result<Router, BoxError> {
        let webhook = webhook_from_env()?;
        match orders {
            OrderBook::Sqlite(pool) => serve(SqliteOutbox::new(pool.clone()), webhook).await,
            #[cfg(feature = "postgres")]
            OrderBook::Postgres(pool) => serve(PostgresOutbox::new(pool.clone()), webhook).await,
        }
    }

    /// The outbox's migration, its relay (if there is a webhook) and its route.
    async fn serve<O: Outbox>(outbox: O, webhook: Option<WebhookSender>) -> Result<Router, BoxError> {
        outbox.migrate().await?;
        if let Some(sender) = webhook {
            eprintln!("orders: delivering events to ORDERS_WEBHOOK_URL");
            // Stops by itself when the pool closes at shutdown.
            tokio::spawn(Relay::new(outbox.clone(), sender, RelayConfig::default()).run(std::future::pending()));
        }
        Ok(Router::new().route("/admin/outbox/counts", get(counts::<O>)).with_state(outbox))
    }

    /// `GET /admin/outbox/counts` → `{"pending": n, "delivered": n, "dead": n}`.
    async fn counts<O: Outbox>(State(outbox): State<O>) -> Response {
        match outbox.counts().await {
            Ok(counts) => Json(json!({"pending": counts.pending, "delivered": counts.delivered, "dead": counts.dead}))
                .into_response(),
            Err(error) => ApiProblem::read_failed(storage_error(error)).into_response(),
        }
    }

    /// An outbox failure, sorted as the order book's are: the database's (503, retry) or a bug
    /// (500).
    fn storage_error(error: OutboxError) -> StorageError {
        match error {
            OutboxError::Unavailable(error) => match error.downcast::<sqlx::Error>() {
                Ok(error) => StorageError::Unavailable(*error),
                Err(error) => StorageError::Internal(error),
            },
            error => StorageError::Internal(error.into()),
        }
    }

    /// The relay's sender, from `ORDERS_WEBHOOK_URL` and `ORDERS_WEBHOOK_SECRET`.
    fn webhook_from_env() -> Result<Option<WebhookSender>, BoxError> {
        let Some(url) = std::env::var("ORDERS_WEBHOOK_URL").ok().filter(|url| !url.is_empty()) else {
            return Ok(None);
        };
        let url: axum::http::Uri =
            url.parse().map_err(|_| "ORDERS_WEBHOOK_URL is not a URL (http://host:port/path)")?;
        if url.scheme_str() != Some("http") || url.host().is_none() {
            return Err("ORDERS_WEBHOOK_URL must be an http:// URL with a host".into());
        }
        let secret = std::env::var("ORDERS_WEBHOOK_SECRET").ok().filter(|secret| !secret.is_empty()).ok_or(
            "ORDERS_WEBHOOK_URL is set but ORDERS_WEBHOOK_SECRET is not: \
             set it to the receiver's whsec_ signing secret",
        )?;
        // Not echoed: it is a secret.
        let secret = WebhookSecret::parse(&secret)
            .map_err(|_| "ORDERS_WEBHOOK_SECRET must be whsec_ and base64 of 16+ bytes")?;
        Ok(Some(WebhookSender::new(url, secret)))
    }

    /// An outbox table of either backend, as start-up needs it.
    trait Outbox: OutboxStore {
        fn migrate(&self) -> impl Future<Output = Result<(), sqlx::migrate::MigrateError>>;
    }

    impl Outbox for SqliteOutbox {
        async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
            SqliteOutbox::migrate(self).await
        }
    }

    #[cfg(feature = "postgres")]
    impl Outbox for PostgresOutbox {
        async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
            PostgresOutbox::migrate(self).await
        }
    }
}

#[cfg(not(feature = "outbox"))]
mod without_outbox {
    use tower_idempotency::{BoxError, IdempotencyContext};

    use super::super::book::order::Order;
    use super::super::book::storage::{OrderBook, OrderTx};
    use super::super::payments::Attempt;
    use super::super::problem::ApiProblem;

    /// No outbox in this build: nothing is written.
    pub(crate) async fn order_created(
        _orders: &OrderBook,
        _tx: &OrderTx,
        _context: Option<&IdempotencyContext>,
        _order: &Order,
    ) -> Result<(), ApiProblem> {
        Ok(())
    }

    /// No outbox in this build: nothing is written.
    pub(crate) async fn payment_settled_sqlite(
        _pool: &sqlx::SqlitePool,
        _conn: &mut sqlx::SqliteConnection,
        _attempt: &Attempt,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// No outbox in this build: nothing is written.
    #[cfg(feature = "postgres")]
    pub(crate) async fn payment_settled_postgres(
        _pool: &sqlx::PgPool,
        _conn: &mut sqlx::PgConnection,
        _attempt: &Attempt,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// No outbox in this build: refuses `ORDERS_WEBHOOK_URL`, and says how to get one.
    pub(crate) async fn start(_orders: &OrderBook) -> Result<axum::Router, BoxError> {
        if std::env::var("ORDERS_WEBHOOK_URL").is_ok_and(|url| !url.is_empty()) {
            return Err("ORDERS_WEBHOOK_URL is set, but this build has no outbox; \
                        build with `--features outbox`: cargo run --features outbox --example orders"
                .into());
        }
        Ok(axum::Router::new())
    }
}
