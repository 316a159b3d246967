//! Scenarios of `POST /orders` measured side by side in one run (`pg_orders`, `pg_partitions`):
//! each scenario a server and the keys its requests carry, one measuring window per scenario per
//! round, the order rotated each round so that a slow stretch of this shared machine falls on
//! every scenario alike, and each window's PostgreSQL CPU read with it (`support/pg_cpu.rs`).
//! The ratios are printed overall and as the median and range of the per-round ratios (windows
//! of one round run minutes apart at most, so they share the machine's mood).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use crate::http_load::{self, KeyOf};
use crate::orders_app::BODY;
use crate::pg_cpu::{CpuSpent, PgCpu};

/// Keep-alive clients driving a scenario.
pub const CONCURRENCY: usize = 32;

/// The number of rounds: the environment variable `var`, else `default`.
pub fn rounds_from_env(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|r| r.parse().ok()).unwrap_or(default)
}

/// A scenario's server and the keys its requests carry.
pub struct Scenario {
    pub name: &'static str,
    addr: std::net::SocketAddr,
    key_of: KeyOf,
    counter: Arc<AtomicU64>,
}

impl Scenario {
    /// The scenario `name`, served at `addr`, request `n` carrying the key `key_of(n)`.
    pub fn new(name: &'static str, addr: std::net::SocketAddr, key_of: KeyOf) -> Self {
        Self { name, addr, key_of, counter: Arc::new(AtomicU64::new(0)) }
    }

    /// Drives the scenario for `window`; the latencies, sorted.
    pub async fn drive(&self, window: Duration) -> Vec<Duration> {
        let (counter, key_of) = (self.counter.clone(), self.key_of.clone());
        http_load::post_orders(self.name, self.addr, CONCURRENCY, BODY, counter, key_of, window).await
    }

    async fn measure(&self, window: Duration, cpu: &PgCpu) -> Run {
        let before = cpu.sample().await;
        let started = Instant::now();
        let latencies = self.drive(window).await;
        let elapsed = started.elapsed();
        let spent = before.until(&cpu.sample().await);
        Run { requests: latencies.len(), elapsed, latencies, cpu: spent }
    }
}

/// Keys unique to one scenario: `<prefix>-<n>`.
pub fn unique(prefix: &'static str) -> KeyOf {
    Arc::new(move |n| format!("{prefix}-{n}"))
}

/// Retries of the 1000 keys `<prefix>-0` to `<prefix>-999`, which the scenario whose keys are
/// [`unique`]`(prefix)` completes in its warm-up.
pub fn retries_of(prefix: &'static str) -> KeyOf {
    Arc::new(move |n| format!("{prefix}-{}", n % 1000))
}

/// Drives each scenario for `warm_up`, in order.
pub async fn warm_up(scenarios: &[Scenario], warm_up: Duration) {
    for scenario in scenarios {
        scenario.drive(warm_up).await;
    }
}

/// `rounds` rounds of one `window` per scenario, the order rotated each round; each scenario's
/// windows, in the scenarios' order.
pub async fn measure_in_rounds(scenarios: &[Scenario], rounds: usize, window: Duration, cpu: &PgCpu) -> Vec<Measured> {
    let mut results: Vec<Measured> = scenarios.iter().map(|s| Measured { name: s.name, runs: vec![] }).collect();
    for round in 0..rounds {
        for i in 0..scenarios.len() {
            let index = (i + round) % scenarios.len();
            let run = scenarios[index].measure(window, cpu).await;
            results[index].runs.push(run);
        }
    }
    results
}

/// One scenario's windows, over all rounds.
pub struct Measured {
    pub name: &'static str,
    runs: Vec<Run>,
}

/// One measured window of one scenario.
struct Run {
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    /// PostgreSQL's CPU over the window.
    cpu: CpuSpent,
}

impl Run {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    /// CPU microseconds per request, of the database's backends or of the whole server.
    fn cpu_per_request(&self, measure: Cpu) -> Option<f64> {
        measure.of(&self.cpu).map(|ns| ns as f64 / 1000.0 / self.requests as f64)
    }
}

/// Which of the two CPU readings.
#[derive(Clone, Copy)]
pub enum Cpu {
    /// The benchmark database's backends.
    Database,
    /// Every process of the server.
    Server,
}

impl Cpu {
    fn of(self, spent: &CpuSpent) -> Option<u64> {
        match self {
            Cpu::Database => spent.database_ns,
            Cpu::Server => spent.server_ns,
        }
    }
}

impl Measured {
    fn requests(&self) -> usize {
        self.runs.iter().map(|r| r.requests).sum()
    }

    fn throughput(&self) -> f64 {
        let elapsed: Duration = self.runs.iter().map(|r| r.elapsed).sum();
        self.requests() as f64 / elapsed.as_secs_f64()
    }

    /// CPU microseconds per request over all windows.
    fn cpu_per_request(&self, measure: Cpu) -> Option<f64> {
        let mut spent = CpuSpent::default();
        for run in &self.runs {
            spent += run.cpu;
        }
        measure.of(&spent).map(|ns| ns as f64 / 1000.0 / self.requests() as f64)
    }

    fn quantile(&self, q: f64) -> Duration {
        let mut all: Vec<Duration> = self.runs.iter().flat_map(|r| r.latencies.iter().copied()).collect();
        all.sort_unstable();
        http_load::quantile(&all, q)
    }
}

/// Prints each scenario's requests, throughput, p50 and p99 latency, and CPU per request.
pub fn print_table(results: &[Measured], rounds: usize, window: Duration) {
    println!(
        "\nPOST /orders on PostgreSQL, {CONCURRENCY} concurrent keep-alive clients, \
         {rounds} rounds of {window:?} per scenario"
    );
    println!(
        "{:<10} {:>10} {:>12} {:>10} {:>10} {:>12} {:>12}",
        "scenario", "requests", "req/s", "p50", "p99", "db cpu/req", "server/req"
    );
    for m in results {
        let (throughput, p50, p99) = (m.throughput(), m.quantile(0.50), m.quantile(0.99));
        let (database_cpu, server_cpu) =
            (micros(m.cpu_per_request(Cpu::Database)), micros(m.cpu_per_request(Cpu::Server)));
        println!(
            "{:<10} {:>10} {throughput:>12.0} {p50:>10.2?} {p99:>10.2?} {database_cpu:>12} {server_cpu:>12}",
            m.name,
            m.requests()
        );
    }
}

/// Prints `numerator / denominator` in throughput, overall and per round, with the aim if any
/// (a floor).
pub fn print_throughput_ratio(label: &str, numerator: &Measured, denominator: &Measured, aim: Option<f64>) {
    let overall = numerator.throughput() / denominator.throughput();
    let (median, low, high) = ratio_over_rounds(numerator, denominator);
    let aim = aim.map_or(String::new(), |aim| format!(" (aim >= {aim}x)"));
    println!("{label} : {overall:.2}x overall; per round median {median:.2}x, range {low:.2}x..{high:.2}x{aim}");
}

/// Prints `numerator / denominator` in PostgreSQL CPU per request (the database's backends and
/// the whole server), overall and per round, with the aim if any (a ceiling).
pub fn print_cpu_ratio(label: &str, numerator: &Measured, denominator: &Measured, aim: Option<f64>) {
    let mut line = format!("{label} :");
    for (measure, what) in [(Cpu::Database, "db"), (Cpu::Server, "server")] {
        let overall = numerator.cpu_per_request(measure).zip(denominator.cpu_per_request(measure));
        match (overall, cpu_ratio_over_rounds(numerator, denominator, measure)) {
            (Some((n, d)), Some((median, low, high))) => line.push_str(&format!(
                " {what} {:.2}x overall, per round median {median:.2}x, range {low:.2}x..{high:.2}x;",
                n / d
            )),
            _ => line.push_str(&format!(" {what} n/a;")),
        }
    }
    println!("{line}{}", aim.map_or(String::new(), |aim| format!(" (aim <= {aim}x)")));
}

/// The median and range of `numerator / denominator` over the rounds.
fn ratio_over_rounds(numerator: &Measured, denominator: &Measured) -> (f64, f64, f64) {
    let ratios = numerator.runs.iter().zip(&denominator.runs).map(|(n, d)| n.throughput() / d.throughput()).collect();
    median_and_range(ratios)
}

/// The median and range of CPU per request, `numerator / denominator`, over the rounds.
fn cpu_ratio_over_rounds(numerator: &Measured, denominator: &Measured, measure: Cpu) -> Option<(f64, f64, f64)> {
    let ratios = numerator
        .runs
        .iter()
        .zip(&denominator.runs)
        .map(|(n, d)| Some(n.cpu_per_request(measure)? / d.cpu_per_request(measure)?))
        .collect::<Option<Vec<f64>>>()?;
    Some(median_and_range(ratios))
}

fn median_and_range(mut ratios: Vec<f64>) -> (f64, f64, f64) {
    ratios.sort_by(f64::total_cmp);
    (ratios[ratios.len() / 2], ratios[0], ratios[ratios.len() - 1])
}

/// Microseconds, or `n/a` when the server's processes cannot be read.
fn micros(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_owned(), |us| format!("{us:.0}us"))
}
