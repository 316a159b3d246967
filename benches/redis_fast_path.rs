//! The Redis fast path under concurrent load, in one run, through real sockets: `POST /orders`
//! guarded by the layer in atomic mode on PostgreSQL, with and without [`FastPath`] in front of
//! the store.
//!
//! - `first/pg`, `first/fast`: first executions (every request a new key), without and with the
//!   fast path. The fast path's cost: one script call before the claim, one after the commit.
//!   The three first-execution scenarios (with `first/floor`, below) are measured in turns,
//!   the order rotated each round, so that a drift of the machine or the table's growth weighs
//!   on all alike.
//! - `first/floor`: first executions without the fast path, each wrapped in the least that any
//!   Redis lock in front of the database costs: two plain commands, `SET <lock> <value> NX PX`
//!   before the request and `DEL <lock>` after it, one round trip each, no script, no cache
//!   write. `first/floor / first/pg` bounds what `first/fast / first/pg` can reach on this
//!   machine, where the bench process, PostgreSQL and Redis share the CPUs: each round trip
//!   costs CPU on both ends, and throughput here follows CPU.
//! - `replay/pg`, `replay/fast`: every request a retry of a completed key, answered from
//!   PostgreSQL (the store's read-first lookup) or from Redis.
//!
//! Each scenario gets a warm-up, then a fixed measuring window with `CONCURRENCY` keep-alive
//! clients. It prints throughput, p50 and p99 latency, and the ratios the project tracks.
//! Run with `cargo bench --bench redis_fast_path --all-features`. PostgreSQL must be running
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`); Redis is a
//! `redis-server` the benchmark starts on a free loopback port, or `REDIS_URL` if set.

#[path = "support/bench_db.rs"]
mod bench_db;
#[path = "support/http_load.rs"]
mod http_load;
#[path = "support/orders_app.rs"]
mod orders_app;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use bench_db::BenchDatabase;
use http_load::KeyOf;
use orders_app::{BODY, serve, serve_wrapped};
use tower_idempotency::{FastPath, IdempotencyLayer, PostgresStore};

const CONCURRENCY: usize = 32;
const WARM_UP: Duration = Duration::from_secs(1);
const MEASURE: Duration = Duration::from_secs(3);
/// First executions: rounds of short runs of the three first-execution scenarios, the order rotated,
/// so that the machine's noise (other builds, other tests) weighs on all alike.
const ROUNDS: usize = 6;
const ROUND_WARM_UP: Duration = Duration::from_millis(300);
const ROUND_MEASURE: Duration = Duration::from_millis(1500);
const POOL: u32 = 40;
/// Completed keys the replay scenarios retry.
const REPLAYED_KEYS: u64 = 1000;

struct Measured {
    name: &'static str,
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    /// CPU time spent during the measuring window: this process, PostgreSQL, Redis.
    cpu: [Duration; 3],
}

impl Measured {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    fn at(&self, q: f64) -> Duration {
        http_load::quantile(&self.latencies, q)
    }

    /// Two measurements of the same scenario as one.
    fn merge(mut self, other: Measured) -> Measured {
        self.requests += other.requests;
        self.elapsed += other.elapsed;
        self.latencies.extend(other.latencies);
        self.latencies.sort();
        for (mine, theirs) in self.cpu.iter_mut().zip(other.cpu) {
            *mine += theirs;
        }
        self
    }

    /// CPU time per request, in microseconds: this process, PostgreSQL, Redis.
    fn cpu_per_request(&self) -> [f64; 3] {
        self.cpu.map(|cpu| cpu.as_secs_f64() * 1e6 / self.requests as f64)
    }
}

/// CPU time used so far by this process, by every PostgreSQL process and by Redis (when it is
/// ours), from `/proc` (zero where it cannot be read).
fn cpu_times(redis_pid: Option<u32>) -> [Duration; 3] {
    fn ticks(stat: &str) -> Option<u64> {
        // The fields after the command name (which may hold spaces), closed by ')'.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
    }
    let read = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    let tick = Duration::from_secs(1) / 100;
    let own = read("self").as_deref().and_then(ticks).unwrap_or(0);
    let mut postgres = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if let Some(stat) = read(&pid).filter(|stat| stat.contains("(postgres)")) {
            postgres += ticks(&stat).unwrap_or(0);
        }
    }
    let redis = redis_pid.and_then(|pid| read(&pid.to_string())).as_deref().and_then(ticks).unwrap_or(0);
    [own, postgres, redis].map(|t| tick * t as u32)
}

/// Drives `addr` with `CONCURRENCY` clients, a warm-up and then the measured window, with the
/// CPU time the bench process, PostgreSQL and Redis spent in it; `key_of(n)` names the key of
/// request `n`.
async fn load(
    name: &'static str,
    addr: std::net::SocketAddr,
    counter: Arc<AtomicU64>,
    key_of: KeyOf,
    redis_pid: Option<u32>,
    (warm_up, measure): (Duration, Duration),
) -> Measured {
    http_load::post_orders(name, addr, CONCURRENCY, BODY, counter.clone(), key_of.clone(), warm_up).await;
    let (started, cpu_before) = (Instant::now(), cpu_times(redis_pid));
    let latencies = http_load::post_orders(name, addr, CONCURRENCY, BODY, counter, key_of, measure).await;
    let (elapsed, cpu_after) = (started.elapsed(), cpu_times(redis_pid));
    let cpu = [0, 1, 2].map(|i| cpu_after[i].saturating_sub(cpu_before[i]));
    Measured { name, requests: latencies.len(), elapsed, latencies, cpu }
}

/// `REDIS_URL`, or a `redis-server` of our own on a free loopback port (killed at the end).
fn redis() -> (String, Option<Child>) {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return (url, None);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--loglevel", "warning", "--dir", &std::env::temp_dir().display().to_string()])
        .stdout(Stdio::null())
        .spawn()
        .expect("start redis-server");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (format!("redis://127.0.0.1:{port}/"), Some(child))
}

fn main() {
    let (redis_url, mut redis_server) = redis();
    let redis_pid = redis_server.as_ref().map(Child::id);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let database = BenchDatabase::create("tidem_rbench", POOL).await;
        let pool = database.pool.clone();
        orders_app::create_orders_table(&pool).await;
        let store = PostgresStore::new(pool.clone());
        store.migrate().await.unwrap();
        let prefix = format!("tidem_bench_{}", std::process::id());
        let fast = FastPath::connect(store.clone(), &redis_url).unwrap().prefix(&prefix).unwrap();

        let plain = serve(pool.clone(), Some(IdempotencyLayer::new(store.clone()))).await;
        let with_fast = serve(pool.clone(), Some(IdempotencyLayer::new(fast.clone()))).await;
        let (pg_keys, fast_keys) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let unique = |prefix: &'static str| -> KeyOf { Arc::new(move |n| format!("{prefix}-{n}")) };
        let replay = |prefix: &'static str| -> KeyOf { Arc::new(move |n| format!("{prefix}-{}", n % REPLAYED_KEYS)) };

        // The floor: two plain commands around each request, on a connection of its own.
        let floor_redis =
            redis::Client::open(redis_url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let floor_prefix = format!("{prefix}:floor");
        let with_floor = serve_wrapped(pool.clone(), Some(IdempotencyLayer::new(store.clone())), move |router| {
            router.layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let (mut redis, lock_prefix) = (floor_redis.clone(), floor_prefix.clone());
                    async move {
                        let key = request.headers().get("idempotency-key").and_then(|k| k.to_str().ok()).unwrap_or("");
                        let lock = format!("{lock_prefix}:{{{key}}}:l");
                        let _: Option<String> = redis::cmd("SET")
                            .arg(&lock)
                            .arg("0123456789abcdef")
                            .arg("NX")
                            .arg("PX")
                            .arg(30_000)
                            .query_async(&mut redis)
                            .await
                            .expect("SET NX PX");
                        let response = next.run(request).await;
                        let _: i64 = redis::cmd("DEL").arg(&lock).query_async(&mut redis).await.expect("DEL");
                        response
                    }
                },
            ))
        })
        .await;

        // First executions, in rounds of short runs of the three scenarios, the order rotated.
        let round = (ROUND_WARM_UP, ROUND_MEASURE);
        let floor_keys = Arc::new(AtomicU64::new(0));
        let mut first: [Option<Measured>; 3] = [None, None, None];
        let (mut ratios, mut floor_ratios) = (Vec::new(), Vec::new());
        for n in 0..ROUNDS {
            let mut runs: [Option<Measured>; 3] = [None, None, None];
            for step in 0..3 {
                let which = (step + n) % 3;
                let (name, addr, keys, prefix) = match which {
                    0 => ("first/pg", plain, pg_keys.clone(), "pg"),
                    1 => ("first/fast", with_fast, fast_keys.clone(), "fast"),
                    _ => ("first/floor", with_floor, floor_keys.clone(), "floor"),
                };
                runs[which] = Some(load(name, addr, keys, unique(prefix), redis_pid, round).await);
            }
            let [pg, fast, floor] = runs.map(|run| run.expect("each scenario ran"));
            ratios.push(fast.throughput() / pg.throughput());
            floor_ratios.push(floor.throughput() / pg.throughput());
            for (all, run) in first.iter_mut().zip([pg, fast, floor]) {
                *all = Some(match all.take() {
                    Some(all) => all.merge(run),
                    None => run,
                });
            }
        }
        let [first_pg, first_fast, first_floor] = first.map(|all| all.expect("rounds"));
        ratios.sort_by(f64::total_cmp);
        floor_ratios.sort_by(f64::total_cmp);
        let median = |ratios: &[f64]| (ratios[(ROUNDS - 1) / 2] + ratios[ROUNDS / 2]) / 2.0;
        let misses_before = fast.stats().misses;
        // Replays of keys the first scenarios completed (the fast path's are in Redis).
        let replay_pg =
            load("replay/pg", plain, Arc::new(AtomicU64::new(0)), replay("pg"), redis_pid, (WARM_UP, MEASURE)).await;
        let replay_fast =
            load("replay/fast", with_fast, Arc::new(AtomicU64::new(0)), replay("fast"), redis_pid, (WARM_UP, MEASURE))
                .await;
        let stats = fast.stats();

        println!(
            "\nPOST /orders, atomic PostgreSQL, {CONCURRENCY} concurrent keep-alive clients; first executions: \
             {ROUNDS} alternating runs of {ROUND_MEASURE:?} each; replays: {MEASURE:?}"
        );
        println!(
            "{:<12} {:>10} {:>12} {:>10} {:>10}   CPU µs/request: bench process + PostgreSQL + Redis",
            "scenario", "requests", "req/s", "p50", "p99"
        );
        let results = [&first_pg, &first_fast, &first_floor, &replay_pg, &replay_fast];
        for m in results {
            let [own, postgres, redis] = m.cpu_per_request();
            println!(
                "{:<12} {:>10} {:>12.0} {:>10.2?} {:>10.2?}   {own:.0} + {postgres:.0} + {redis:.0} = {:.0}",
                m.name,
                m.requests,
                m.throughput(),
                m.at(0.50),
                m.at(0.99),
                own + postgres + redis
            );
        }
        println!(
            "replay/fast / replay/pg : {:.2}x throughput, p50 {:.2}x faster (aim >= 2x)",
            replay_fast.throughput() / replay_pg.throughput(),
            replay_pg.at(0.50).as_secs_f64() / replay_fast.at(0.50).as_secs_f64()
        );
        println!(
            "first/fast / first/pg   : {:.2}x throughput (median of the {ROUNDS} rounds {:.2}x, range {:.2}x..{:.2}x), \
             {:+.1}% p50 (aim: the fast path costs < 10%, >= 0.90x)",
            first_fast.throughput() / first_pg.throughput(),
            median(&ratios),
            ratios[0],
            ratios[ROUNDS - 1],
            (first_fast.at(0.50).as_secs_f64() / first_pg.at(0.50).as_secs_f64() - 1.0) * 100.0
        );
        println!(
            "first/floor / first/pg  : {:.2}x throughput (median of the {ROUNDS} rounds {:.2}x, range {:.2}x..{:.2}x): \
             two plain Redis round trips alone",
            first_floor.throughput() / first_pg.throughput(),
            median(&floor_ratios),
            floor_ratios[0],
            floor_ratios[ROUNDS - 1],
        );
        println!("first/fast / first/floor: {:.2}x throughput", first_fast.throughput() / first_floor.throughput());
        println!(
            "fast path: replays that missed Redis: {} (warm-up included); {stats:?}",
            stats.misses - misses_before
        );

        database.drop().await;
    });
    if let Some(server) = redis_server.as_mut() {
        let _ = server.kill();
        let _ = server.wait();
    }
}
