//! The conformance suites, stamped out for the in-memory store.
#![cfg(feature = "testkit")]

use tower_idempotency::MemoryStore;

mod store {
    use super::*;
    tower_idempotency::store_suite!(leased, async { MemoryStore::new() });
}

mod lifecycle {
    use super::*;
    tower_idempotency::lifecycle_suite!(leased, async { MemoryStore::new() });
}

mod http {
    use super::*;
    tower_idempotency::http_contract_suite!(async { MemoryStore::new() });
}
