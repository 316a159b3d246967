//! The Prometheus recorders the metrics benchmarks install (`metrics-exporter-prometheus`).
//!
//! - [`bucketed`]: the reference service's (`examples/orders/telemetry.rs`): histograms with
//!   the crate's buckets (`telemetry::SECONDS_BUCKETS`, `BYTES_BUCKETS`), the `_bucket` series the PromQL of README reads. A sample is a bucket's
//!   count raised at the exporter's upkeep.
//! - [`summaries`]: the exporter's default, without buckets: each histogram is rendered as a
//!   summary, its samples kept in a rolling quantile sketch, which costs the upkeep more.

#![allow(dead_code)] // Each benchmark takes the parts it needs.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use tower_idempotency::telemetry::{BYTES_BUCKETS, SECONDS_BUCKETS};

/// A recorder with the reference service's histogram buckets.
pub fn bucketed() -> PrometheusRecorder {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .and_then(|builder| builder.set_buckets_for_metric(Matcher::Suffix("_bytes".into()), &BYTES_BUCKETS))
        .expect("buckets")
        .build_recorder()
}

/// A recorder as the exporter builds it by default (histograms as summaries).
pub fn summaries() -> PrometheusRecorder {
    PrometheusBuilder::new().build_recorder()
}
