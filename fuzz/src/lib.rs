//! Reference models the fuzz targets compare the crate against: small, slow and obviously
//! correct, written from the documented canonical forms (`tower_idempotency::fingerprint`),
//! not from the crate's code.

pub mod form_model;
pub mod json_model;
