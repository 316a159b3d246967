//! `GET /metrics` on the operator listener, in the Prometheus text format, with no
//! authentication: the idempotency layer's metrics and its recovery workers'
//! (`idempotency_recovery_total`, `idempotency_records`, `idempotency_oldest_unknown_seconds`),
//! in a build with the crate's `metrics` feature (the table is in the crate's `telemetry` module
//! docs), and the service's own:
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `orders_duplicate_effects` | gauge | operation ids that own more than one order: keys that really executed twice (the old path in `off` or `shadow`, or a key executed again after it was forgotten) |
//!
//! The gauge comes from an audit query that runs at start and then every `ORDERS_AUDIT_SECS`
//! seconds (default 60; fractions allowed, at least 0.01). It reads 0 while every key executed
//! once.
//!
//! Histograms are exported with buckets (`_bucket` series), so `histogram_quantile` works on
//! them: seconds from 0.25 ms to 10 s, stored bytes from 64 B to 4 MiB.

use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tower_idempotency::BoxError;
use tower_idempotency::telemetry::{BYTES_BUCKETS, SECONDS_BUCKETS};

use super::admin::AdminRoutes;
use super::book::storage::OrderBook;

/// The service's own gauge.
pub(crate) const DUPLICATE_EFFECTS: &str = "orders_duplicate_effects";

/// The audit's SQL, the same for both databases.
const DUPLICATES: &str = "SELECT count(*) FROM (
    SELECT idempotency_operation_id FROM orders GROUP BY idempotency_operation_id HAVING count(*) > 1
) AS duplicated";

/// Installs the Prometheus recorder as the process's `metrics` recorder.
pub(crate) fn install() -> Result<PrometheusHandle, BoxError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_bytes".into()), &BYTES_BUCKETS)?
        .install_recorder()?;
    metrics::describe_gauge!(DUPLICATE_EFFECTS, "operation ids that own more than one order");
    Ok(handle)
}

/// `ORDERS_AUDIT_SECS`: how often the audit runs (default 60 s).
pub(crate) fn audit_interval_from_env() -> Result<Duration, BoxError> {
    audit_interval(std::env::var("ORDERS_AUDIT_SECS").ok().as_deref())
}

fn audit_interval(raw: Option<&str>) -> Result<Duration, BoxError> {
    let Some(raw) = raw.filter(|raw| !raw.is_empty()) else {
        return Ok(Duration::from_secs(60));
    };
    match raw.parse::<f64>() {
        Ok(secs) if secs.is_finite() && (0.01..=86_400.0).contains(&secs) => Ok(Duration::from_secs_f64(secs)),
        _ => Err("ORDERS_AUDIT_SECS must be a number of seconds from 0.01 to 86400".into()),
    }
}

/// Runs the audit now and then every `every`, on its own task, setting the gauge. A failed
/// query is reported on stderr and leaves the gauge as it was.
pub(crate) fn spawn_audit(orders: OrderBook, every: Duration) {
    let gauge = metrics::gauge!(DUPLICATE_EFFECTS);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match duplicate_effects(&orders).await {
                Ok(count) => gauge.set(count as f64),
                Err(error) => eprintln!("orders: the duplicate-effects audit failed: {error}"),
            }
        }
    });
}

/// Operation ids that own more than one order.
async fn duplicate_effects(orders: &OrderBook) -> Result<i64, sqlx::Error> {
    match orders {
        OrderBook::Sqlite(pool) => sqlx::query_scalar(DUPLICATES).fetch_one(pool).await,
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pool) => sqlx::query_scalar(DUPLICATES).fetch_one(pool).await,
    }
}

/// `GET /metrics`, on the open part of the operator listener.
pub(crate) fn routes(handle: PrometheusHandle) -> AdminRoutes {
    let open = Router::new().route("/metrics", get(render)).with_state(handle);
    AdminRoutes { open, operator: Router::new() }
}

async fn render(State(handle): State<PrometheusHandle>) -> impl IntoResponse {
    // Histograms are drained into their buckets here, on each scrape.
    handle.run_upkeep();
    ([(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_audit_interval_allows_fractions_and_refuses_nonsense() {
        assert_eq!(audit_interval(None).unwrap(), Duration::from_secs(60));
        assert_eq!(audit_interval(Some("0.25")).unwrap(), Duration::from_millis(250));
        for bad in ["0", "-1", "NaN", "inf", "soon", "0.001"] {
            assert!(audit_interval(Some(bad)).is_err(), "{bad}");
        }
    }
}
