//! Outbox benchmarks (written in the next commit).

fn main() {}
