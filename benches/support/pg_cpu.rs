//! PostgreSQL's CPU, read from `/proc` of the server's processes (the server must run on this
//! machine; elsewhere every reading is `None` and the benchmarks print `n/a`).
//!
//! Two measures, each sampled before and after a measured window:
//!
//! - **database**: the CPU time of the backends connected to the benchmark's own database (their
//!   pids from `pg_stat_activity`, read over a connection to another database so the sampler
//!   is not counted), from `/proc/<pid>/schedstat` (nanoseconds). The pools keep their
//!   connections open across the windows, so no backend of ours exits inside one; a backend
//!   that appears during a window is counted whole. Other sessions on the same server (other
//!   benchmarks, tests) do not enter it.
//! - **server**: every process of the server: the postmaster, each of its children (backends,
//!   WAL writer, checkpointer, ...), plus the postmaster's cumulative time of reaped children
//!   (`cutime + cstime` in `/proc/<postmaster>/stat`), so a backend that exits inside the
//!   window still counts. This includes the background processes our commits keep busy, but
//!   also anything else the server does at the time.

use std::collections::HashMap;

use sqlx::PgPool;

/// Nanoseconds per clock tick of `/proc/<pid>/stat` (`USER_HZ` is 100 on Linux).
const TICK_NS: u64 = 10_000_000;

/// Samples the CPU of a local PostgreSQL server.
pub struct PgCpu {
    admin: PgPool,
    database: String,
    postmaster: Option<u32>,
}

/// One reading: CPU so far of the database's backends and of the whole server.
#[derive(Debug, Clone)]
pub struct CpuSample {
    backends: HashMap<u32, u64>,
    server_ns: Option<u64>,
}

/// CPU spent between two samples, in nanoseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSpent {
    pub database_ns: Option<u64>,
    pub server_ns: Option<u64>,
}

impl PgCpu {
    /// A sampler of the backends of `database` (and of the whole server), over a connection of
    /// its own to the server's own database (`bench_db::database_url`).
    pub async fn of_database(database: &str) -> Self {
        let url = crate::bench_db::database_url();
        let admin = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await;
        Self::new(admin.expect("connect to the server's own database"), database).await
    }

    /// A sampler of the backends of `database` (and of the whole server), over `admin`, a pool on
    /// another database of the same server.
    async fn new(admin: PgPool, database: &str) -> Self {
        let backend: i32 =
            sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&admin).await.expect("a backend pid");
        let postmaster = u32::try_from(backend).ok().and_then(stat_fields).map(|fields| fields.ppid);
        Self { admin, database: database.to_owned(), postmaster }
    }

    /// Reads the CPU of every process now.
    pub async fn sample(&self) -> CpuSample {
        let pids: Vec<i32> = sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE datname = $1")
            .bind(&self.database)
            .fetch_all(&self.admin)
            .await
            .unwrap_or_default();
        let backends = pids
            .into_iter()
            .filter_map(|pid| u32::try_from(pid).ok())
            .filter_map(|pid| schedstat_ns(pid).map(|ns| (pid, ns)))
            .collect();
        CpuSample { backends, server_ns: self.postmaster.and_then(server_ns) }
    }
}

impl CpuSample {
    /// What was spent from `self` to `later`.
    pub fn until(&self, later: &CpuSample) -> CpuSpent {
        let database_ns = (!later.backends.is_empty()).then(|| {
            later.backends.iter().map(|(pid, ns)| ns.saturating_sub(self.backends.get(pid).copied().unwrap_or(0))).sum()
        });
        let server_ns = self.server_ns.zip(later.server_ns).map(|(before, after)| after.saturating_sub(before));
        CpuSpent { database_ns, server_ns }
    }
}

impl std::ops::AddAssign for CpuSpent {
    fn add_assign(&mut self, other: Self) {
        let add = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.database_ns = add(self.database_ns, other.database_ns);
        self.server_ns = add(self.server_ns, other.server_ns);
    }
}

/// The fields of `/proc/<pid>/stat` this module reads.
struct StatFields {
    ppid: u32,
    /// utime + stime, in ticks.
    own_ticks: u64,
    /// cutime + cstime (reaped children), in ticks.
    children_ticks: u64,
}

fn stat_fields(pid: u32) -> Option<StatFields> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state) of proc(5): field n is fields[n - 3].
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    Some(StatFields {
        ppid: u32::try_from(field(4)?).ok()?,
        own_ticks: field(14)? + field(15)?,
        children_ticks: field(16)? + field(17)?,
    })
}

/// The CPU time a process has run, in nanoseconds (`/proc/<pid>/schedstat`; `/proc/<pid>/stat`'s
/// ticks if that is missing).
fn schedstat_ns(pid: u32) -> Option<u64> {
    let from_schedstat = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()
        .and_then(|text| text.split_whitespace().next().and_then(|ns| ns.parse().ok()));
    from_schedstat.or_else(|| stat_fields(pid).map(|f| f.own_ticks * TICK_NS))
}

/// The whole server's CPU so far: the postmaster's own and its reaped children's time, plus
/// every live child's.
fn server_ns(postmaster: u32) -> Option<u64> {
    let main = stat_fields(postmaster)?;
    let mut total = main.own_ticks * TICK_NS + main.children_ticks * TICK_NS;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        if let Some(fields) = stat_fields(pid).filter(|fields| fields.ppid == postmaster) {
            total += schedstat_ns(pid).unwrap_or(fields.own_ticks * TICK_NS);
        }
    }
    Some(total)
}
