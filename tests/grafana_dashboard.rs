//! `docs/grafana-dashboard.json` reads only metrics that exist: every `idempotency_*` name in a
//! panel's query is one the crate documents in `telemetry` (or its histogram's `_bucket`), and
//! the panels the rollout needs are there.
#![cfg(feature = "metrics")]

use tower_idempotency::telemetry;

#[test]
fn the_dashboard_uses_the_documented_metric_names() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/grafana-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let known = [
        telemetry::REQUESTS,
        telemetry::SHADOW,
        telemetry::OVERHEAD,
        telemetry::STORE,
        telemetry::STORED_BYTES,
        telemetry::FAST_PATH,
        telemetry::RECORDS,
        telemetry::OLDEST_UNKNOWN,
        telemetry::RECOVERY,
    ];
    let mut used = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("a query");
            for (at, _) in expr.match_indices("idempotency_") {
                let name: String = expr[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                let base = name.strip_suffix("_bucket").unwrap_or(&name);
                assert!(known.contains(&base), "{name} is not a documented metric");
                used.push(base.to_owned());
            }
        }
    }
    for needed in [telemetry::REQUESTS, telemetry::SHADOW, telemetry::OVERHEAD] {
        assert!(used.iter().any(|name| name == needed), "no panel reads {needed}");
    }
    assert!(text.contains("orders_duplicate_effects"), "the duplicate-effects panel");
}
