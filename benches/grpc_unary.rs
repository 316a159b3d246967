//! A unary gRPC call (`proto/conformance.proto`, `Things/Create`, a handler that does no work)
//! through a real tonic client and server on loopback, in one run:
//!
//! - `no layer`: the server without the idempotency layer;
//! - `passthrough`: the layer, with the method not named (what unguarded methods pay);
//! - `memory`: the layer over `MemoryStore`, every call a new key (the layer's own cost);
//! - `memory replay`: the layer over `MemoryStore`, every call a retry of a completed key;
//! - `pg atomic`: the layer over `PostgresStore` in atomic mode, every call a new key (the claim,
//!   the stored answer and the COMMIT: the durable cost);
//! - `pg replay`: the same store, every call a retry.
//!
//! Each scenario gets a warm-up, then `ROUNDS` windows of `WINDOW` (`GRPC_UNARY_ROUNDS=9` for
//! more) with `CONCURRENCY` callers spread over `CONNECTIONS` HTTP/2 connections; each round takes
//! the scenarios in turn, in an order rotated by one each round, so that load from other work on
//! a shared machine spreads over all of them and no scenario always follows the same one.
//! It prints throughput, p50 and p99 latency, and the ratio to `no layer`; and the CPU time this
//! process (client and server) spent per call, with its ratio to `no layer`'s (calls per CPU
//! second; on a machine that other work keeps busy it moves far less than throughput does).
//! Then both ratios round by round, against `no layer` in the same round: their median and
//! range. `GRPC_UNARY_ONLY=memory,passthrough` runs only the scenarios named (and `no layer`);
//! `GRPC_UNARY_WORKERS=1` runs client and server on one worker thread. Run with `cargo bench --bench grpc_unary --features grpc-example,postgres`
//! (PostgreSQL must be running; `DATABASE_URL` overrides the server, default
//! `postgres://postgres@127.0.0.1:5432/test`).

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/echo_things.rs"]
mod echo_things;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Server};
use tower_idempotency::{CouplingMode, IdempotencyLayer, MemoryStore, PostgresStore, Store};

use echo_things::proto::CreateThing;
use echo_things::proto::things_client::ThingsClient;
use echo_things::proto::things_server::ThingsServer;
use echo_things::{Echo, authenticate};

use bench_db::BenchDatabase;

const CONCURRENCY: usize = 16;
const CONNECTIONS: usize = 4;
const WARM_UP: Duration = Duration::from_secs(1);
const WINDOW: Duration = Duration::from_secs(2);
/// Rounds, unless `GRPC_UNARY_ROUNDS` says otherwise.
const ROUNDS: usize = 3;
const METHOD: &str = "/conformance.v1.Things/Create";

async fn listener() -> (tokio::net::TcpListener, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    (listener, addr)
}

/// The server without the idempotency layer (the same interceptor).
async fn serve_bare() -> SocketAddr {
    let (listener, addr) = listener().await;
    let server = Server::builder()
        .layer(tonic::service::InterceptorLayer::new(authenticate))
        .add_service(ThingsServer::new(Echo))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("server") });
    addr
}

/// The server with the idempotency layer over `store`, guarding `method`.
async fn serve_with<St: Store>(store: St, method: &str) -> SocketAddr {
    let (listener, addr) = listener().await;
    let server = Server::builder()
        .layer(tonic::service::InterceptorLayer::new(authenticate))
        .layer(IdempotencyLayer::new(store).grpc_methods([method]).into_tonic())
        .add_service(ThingsServer::new(Echo))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("server") });
    addr
}

/// One scenario: its server, how it names keys, and what it measured so far.
struct Scenario {
    name: &'static str,
    channels: Vec<Channel>,
    key_of: fn(&'static str, u64) -> String,
    counter: Arc<AtomicU64>,
    latencies: Vec<Duration>,
    elapsed: Duration,
    /// CPU time of this process (client and server) in the measured windows.
    cpu: Duration,
    /// Each measured window's throughput and CPU µs per call.
    rounds: Vec<(f64, f64)>,
}

impl Scenario {
    async fn new(name: &'static str, addr: SocketAddr, key_of: fn(&'static str, u64) -> String) -> Self {
        let channels = connect(addr).await;
        let counter = Arc::new(AtomicU64::new(0));
        Self {
            name,
            channels,
            key_of,
            counter,
            latencies: Vec::new(),
            elapsed: Duration::ZERO,
            cpu: Duration::ZERO,
            rounds: Vec::new(),
        }
    }

    /// Calls for `window` with `CONCURRENCY` callers; keeps the latencies when `record`.
    async fn run(&mut self, window: Duration, record: bool) {
        let (name, key_of) = (self.name, self.key_of);
        let (started, cpu_before) = (Instant::now(), process_cpu());
        let latencies = {
            let (channels, counter) = (self.channels.clone(), self.counter.clone());
            let deadline = Instant::now() + window;
            let mut workers = Vec::new();
            for worker in 0..CONCURRENCY {
                let mut client = ThingsClient::new(channels[worker % CONNECTIONS].clone());
                let counter = counter.clone();
                workers.push(tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    while Instant::now() < deadline {
                        let key = key_of(name, counter.fetch_add(1, Ordering::Relaxed));
                        let mut request = Request::new(CreateThing { name: "book-42".to_owned(), amount: 129_900 });
                        request.metadata_mut().insert("idempotency-key", MetadataValue::try_from(key).expect("key"));
                        let started = Instant::now();
                        let answer = client.create(request).await;
                        assert!(answer.is_ok(), "{name}: every call must succeed: {answer:?}");
                        if record {
                            latencies.push(started.elapsed());
                        }
                    }
                    latencies
                }));
            }
            let mut all = Vec::new();
            for worker in workers {
                all.extend(worker.await.expect("worker"));
            }
            all
        };
        if record {
            let (elapsed, cpu) = (started.elapsed(), process_cpu().saturating_sub(cpu_before));
            let calls = latencies.len() as f64;
            self.rounds.push((calls / elapsed.as_secs_f64(), cpu.as_secs_f64() * 1e6 / calls));
            self.elapsed += elapsed;
            self.cpu += cpu;
            self.latencies.extend(latencies);
        }
    }

    fn throughput(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }

    /// CPU time of this process per call, in microseconds.
    fn cpu_per_call(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.latencies.len() as f64
    }

    fn quantile(&mut self, q: f64) -> Duration {
        self.latencies.sort_unstable();
        self.latencies[((self.latencies.len() as f64 * q) as usize).min(self.latencies.len() - 1)]
    }
}

/// `CONNECTIONS` HTTP/2 connections to `addr`.
async fn connect(addr: SocketAddr) -> Vec<Channel> {
    let mut channels = Vec::new();
    for _ in 0..CONNECTIONS {
        let channel = Channel::from_shared(format!("http://{addr}")).expect("uri").connect().await;
        channels.push(channel.expect("connect"));
    }
    channels
}

/// CPU time (user and system) this process has used so far, from its CPU clock. On a shared
/// machine it moves far less with other work than throughput does.
fn process_cpu() -> Duration {
    let time = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(time.tv_sec as u64, time.tv_nsec as u32)
}

/// A new key per call.
fn unique(name: &'static str, n: u64) -> String {
    format!("{}-{n}", name.replace(' ', "-"))
}

/// Retries of 1000 keys completed in the warm-up.
fn retry(name: &'static str, n: u64) -> String {
    format!("{}-{}", name.replace(' ', "-"), n % 1000)
}

fn main() {
    // `GRPC_UNARY_WORKERS=1` puts client and server on one worker thread: the layer's cost
    // without what threads add to it (wake-ups, the allocator's arenas). Default: one per CPU.
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = std::env::var("GRPC_UNARY_WORKERS").ok().and_then(|w| w.parse().ok()) {
        builder.worker_threads(workers);
    }
    let runtime = builder.enable_all().build().expect("runtime");
    runtime.block_on(async {
        let bare = serve_bare().await;
        let passthrough = serve_with(MemoryStore::new(), "/conformance.v1.Things/Unguarded").await;
        let memory = serve_with(MemoryStore::new(), METHOD).await;
        let database = BenchDatabase::create("tidem_grpc_bench", 32).await;
        let store = PostgresStore::new(database.pool.clone()).mode(CouplingMode::Atomic);
        store.migrate().await.expect("migrate");
        let pg = serve_with(store, METHOD).await;

        let mut scenarios = vec![
            Scenario::new("no layer", bare, unique).await,
            Scenario::new("passthrough", passthrough, unique).await,
            Scenario::new("memory", memory, unique).await,
            Scenario::new("memory replay", memory, retry).await,
            Scenario::new("pg atomic", pg, unique).await,
            Scenario::new("pg replay", pg, retry).await,
        ];
        // `GRPC_UNARY_ONLY=memory,passthrough` runs only those (and `no layer`, the baseline):
        // for profiling one path.
        if let Ok(only) = std::env::var("GRPC_UNARY_ONLY") {
            let only: Vec<&str> = only.split(',').map(str::trim).collect();
            scenarios.retain(|s| s.name == "no layer" || only.contains(&s.name));
        }
        for scenario in &mut scenarios {
            scenario.run(WARM_UP, false).await;
        }
        let rounds = std::env::var("GRPC_UNARY_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(ROUNDS);
        // The order rotated by one each round (see the module's documentation).
        for round in 0..rounds {
            for i in 0..scenarios.len() {
                let index = (i + round) % scenarios.len();
                scenarios[index].run(WINDOW, true).await;
            }
        }

        println!(
            "\nunary gRPC call, {CONCURRENCY} concurrent callers on {CONNECTIONS} HTTP/2 connections, \
             {rounds} x {WINDOW:?} each"
        );
        println!(
            "{:<14} {:>9} {:>10} {:>10} {:>10} {:>12} {:>12} {:>12}",
            "scenario", "calls", "calls/s", "p50", "p99", "vs no layer", "CPU µs/call", "per CPU-s"
        );
        let (base, base_cpu) = (scenarios[0].throughput(), scenarios[0].cpu_per_call());
        for s in &mut scenarios {
            let (p50, p99) = (s.quantile(0.50), s.quantile(0.99));
            let (calls, throughput, cpu) = (s.latencies.len(), s.throughput(), s.cpu_per_call());
            println!(
                "{:<14} {calls:>9} {throughput:>10.0} {p50:>10.2?} {p99:>10.2?} {:>11.2}x {cpu:>12.1} {:>11.2}x",
                s.name,
                throughput / base,
                base_cpu / cpu
            );
        }
        // The same ratios round by round (each scenario against `no layer` in the same round):
        // the spread says how far one run's ratio can be trusted on this machine.
        println!("\nper round, against `no layer` in the same round: median [lowest, highest]");
        println!("{:<14} {:>26} {:>26}", "scenario", "calls/s", "calls per CPU-s");
        for s in &scenarios[1..] {
            let ratios = |f: fn((f64, f64), (f64, f64)) -> f64| {
                let mut r: Vec<f64> = s.rounds.iter().zip(&scenarios[0].rounds).map(|(&a, &b)| f(a, b)).collect();
                r.sort_by(f64::total_cmp);
                format!("{:.2}x [{:.2}, {:.2}]", r[r.len() / 2], r[0], r[r.len() - 1])
            };
            let (throughput, cpu) = (ratios(|a, b| a.0 / b.0), ratios(|a, b| b.1 / a.1));
            println!("{:<14} {throughput:>26} {cpu:>26}", s.name);
        }
        database.drop().await;
    });
}
