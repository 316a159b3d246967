//! The Prometheus recorders the metrics benchmarks install (`metrics-exporter-prometheus`).
//!
//! - [`bucketed`]: the reference service's (`examples/orders/telemetry.rs`): histograms with
//!   fixed buckets, the `_bucket` series the PromQL of README reads. A sample is a bucket's
//!   count raised at the exporter's upkeep.
//! - [`summaries`]: the exporter's default, without buckets: each histogram is rendered as a
//!   summary, its samples kept in a rolling quantile sketch, which costs the upkeep more.

#![allow(dead_code)] // Each benchmark takes the parts it needs.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

/// The reference service's buckets of the `_seconds` histograms.
const SECONDS: [f64; 14] = [0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
/// The reference service's buckets of the `_bytes` histograms.
const BYTES: [f64; 9] = [64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0];

/// A recorder with the reference service's histogram buckets.
pub fn bucketed() -> PrometheusRecorder {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)
        .and_then(|builder| builder.set_buckets_for_metric(Matcher::Suffix("_bytes".into()), &BYTES))
        .expect("buckets")
        .build_recorder()
}

/// A recorder as the exporter builds it by default (histograms as summaries).
pub fn summaries() -> PrometheusRecorder {
    PrometheusBuilder::new().build_recorder()
}
