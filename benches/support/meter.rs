//! What one measure did and what it cost the PostgreSQL server, read from a fresh checkpoint:
//! records a second, PostgreSQL's CPU a record (the benchmark database's backends, `pg_cpu.rs`)
//! and bytes of write-ahead log a record (the whole server's), for `pg_scale` and `pg_layout`.

use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::pg_cpu::{CpuSample, PgCpu};
use crate::wal::{checkpoint, wal_position};

/// What one measure did and spent.
pub struct Spent {
    pub records: u64,
    pub elapsed: Duration,
    pub database_ns: Option<u64>,
    pub wal_bytes: i64,
}

impl Spent {
    /// Records a second.
    pub fn per_second(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64()
    }

    /// µs of the database's CPU a record, if it could be read and there were records.
    pub fn cpu_us(&self) -> Option<f64> {
        self.database_ns.filter(|_| self.records > 0).map(|ns| ns as f64 / 1_000.0 / self.records as f64)
    }

    /// Bytes of log a record.
    pub fn wal(&self) -> f64 {
        self.wal_bytes as f64 / self.records.max(1) as f64
    }
}

/// A measure under way: started on a fresh checkpoint, with the CPU and the log read then.
pub struct Meter {
    before: CpuSample,
    wal_before: i64,
    started: Instant,
}

impl Meter {
    /// Ends the log's checkpoint cycle (see [`checkpoint`]), then reads the CPU, the log and the
    /// clock.
    pub async fn start(pool: &PgPool, cpu: &PgCpu) -> Self {
        checkpoint(pool).await;
        let (before, wal_before) = (cpu.sample().await, wal_position(pool).await);
        Self { before, wal_before, started: Instant::now() }
    }

    /// How long the measure has run.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The measure's end: `records` done since [`start`](Self::start), and what they spent.
    pub async fn stop(self, pool: &PgPool, cpu: &PgCpu, records: u64) -> Spent {
        let elapsed = self.started.elapsed();
        let database_ns = self.before.until(&cpu.sample().await).database_ns;
        Spent { records, elapsed, database_ns, wal_bytes: wal_position(pool).await - self.wal_before }
    }
}
