//! The storm: 64 identical requests released together, for each of 200 keys, against the real
//! PostgreSQL in atomic mode. Exactly one order row per key; every other answer is the
//! identical replay or a 409.
#![cfg(all(feature = "axum", feature = "postgres"))]

mod support;

use tower_idempotency::CouplingMode;

const KEYS: usize = 200;
const DUPLICATES: usize = 64;
/// Keys stormed at the same time (each with all its duplicates): enough to interleave keys,
/// few enough that the 2-core machine and the pool are not the bottleneck being measured.
const KEYS_AT_ONCE: usize = 4;

#[test]
fn storm_of_identical_requests_creates_exactly_one_order_per_key() {
    tower_idempotency::testkit::run(async {
        let store = support::pg_store(CouplingMode::Atomic).await;
        let conflicts = support::storm::pg_storm(&store, "storm", KEYS, DUPLICATES, KEYS_AT_ONCE).await;
        println!("storm: {KEYS} keys x {DUPLICATES} requests: {KEYS} orders, {conflicts} answers were 409");
    });
}
