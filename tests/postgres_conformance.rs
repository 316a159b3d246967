//! The conformance suites against the real PostgreSQL on this machine, both modes.
#![cfg(all(feature = "testkit", feature = "postgres"))]

mod support;

support::suites_in_both_modes!(crate::support::pg_store);
