//! Conformance kit.
