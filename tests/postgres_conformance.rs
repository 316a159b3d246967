//! The conformance suites against the real PostgreSQL on this machine, both modes.
#![cfg(all(feature = "testkit", feature = "postgres"))]

mod support;

mod atomic {
    use tower_idempotency::CouplingMode;
    tower_idempotency::store_suite!(atomic, crate::support::pg_store(CouplingMode::Atomic));

    mod http {
        use tower_idempotency::CouplingMode;
        tower_idempotency::http_contract_suite!(crate::support::pg_store(CouplingMode::Atomic));
    }
}

mod leased {
    use tower_idempotency::CouplingMode;
    tower_idempotency::store_suite!(leased, crate::support::pg_store(CouplingMode::Leased));

    mod http {
        use tower_idempotency::CouplingMode;
        tower_idempotency::http_contract_suite!(crate::support::pg_store(CouplingMode::Leased));
    }
}
