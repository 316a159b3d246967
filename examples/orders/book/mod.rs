//! The orders themselves, apart from any protocol: what an order is, the rules its fields
//! follow, and the table that keeps them.
//!
//! The HTTP service (this example) and its gRPC twin (`examples/grpc_orders.rs`) both mount
//! this module, so they serve one database by the same rules; the tests mount it too. Its files
//! name each other with `super::`, never `crate::`, so it works wherever it is mounted.

pub(crate) mod account;
pub(crate) mod created_at;
pub(crate) mod order;
mod sql;
pub(crate) mod storage;
