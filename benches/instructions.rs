//! The layer's work per request counted in instructions, under `valgrind --tool=callgrind`:
//! the same count on a quiet machine or a loaded one, so that a change to the layer's path can
//! be judged by a few hundred instructions where timings on a shared machine move by tens of
//! per cent.
//!
//! The request shape is that of `benches/layer.rs` (a POST with a 256-byte JSON body, a trivial
//! handler answering 201, the in-memory store). Five scenarios:
//!
//! - `bare`: the handler alone;
//! - `new_key`: through the layer, a fresh key every time (claim, execute, store);
//! - `replay`: through the layer, the same key every time (answered from the store);
//! - `floor`: the work a new key cannot do without, with no layer (the request's fingerprint,
//!   the record's identity, one map insert of both with a copy of the answer), as
//!   `benches/layer.rs` defines it;
//! - `http_floor`: a fresh key every time through `HttpFloor` (`benches/support/http_floor.rs`),
//!   the floor's work with what any HTTP middleware must do around it and nothing else.
//!
//! Each scenario runs in a child process of this benchmark under callgrind, which counts only
//! inside the child's measured loop, after a warm-up of its own (the runtime, the store and the
//! lazily set-up parts past their first use). It runs twice, with `CALLS_LOW` and `CALLS_HIGH`
//! requests: the difference of the two counts, divided by the difference of the requests, is
//! what one request costs.
//!
//! **SHA-256 is counted apart.** Valgrind does not run the SHA extensions of x86-64, so under
//! it the `sha2` crate takes its portable code, about 3,400 instructions a 64-byte block, where
//! the CPU's own SHA instructions take about 60 ns a block. Each scenario therefore runs a
//! third and fourth time with only SHA-256's compression counted
//! (`--toggle-collect=sha2::sha256::compress256`), and the table shows the instructions
//! outside it (the layer's own code, the allocator, the canonical JSON reader) beside the
//! blocks hashed.
//!
//! With the `metrics` feature it also counts a new key with a Prometheus recorder installed
//! (`metrics-exporter-prometheus`, its samples drained every thousand requests: with the
//! reference service's histogram buckets, then with the exporter's default summaries), against
//! the same without one: the metrics' share of the layer's own instructions, and of that the
//! recorder's own code (its calls and its upkeep) apart from the layer's.
//!
//! With the `grpc-example` feature it also counts a unary gRPC call (the `Things/Create` echo of
//! `benches/grpc_unary.rs`, through a real tonic client and server over loopback, both on the
//! child's one thread): without the layer, through the layer with the method not named
//! (passthrough), with a new key, and as a replay. Callgrind counts the process's own
//! instructions, not the kernel's, so the socket's system calls, the same with the layer and
//! without, are outside every count: the ratios overstate what the layer costs a call. A call
//! costs a dozen in-process requests, so these scenarios run a quarter of the calls.
//!
//! Run with `cargo bench --features metrics,grpc-example --bench instructions` (valgrind must
//! be installed; without it the benchmark says so and measures nothing). It takes about two
//! minutes; without the features, half a minute.

#[cfg(feature = "grpc-example")]
#[path = "support/echo_things.rs"]
mod echo_things;
#[path = "support/http_floor.rs"]
mod http_floor;
#[path = "support/json_order.rs"]
mod json_order;
#[cfg(feature = "metrics")]
#[path = "support/prometheus.rs"]
mod prometheus;

use std::process::Command;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use json_order::{body, handler, request};
use sha2::Digest;
use tower::{Layer, ServiceExt};
use tower_idempotency::fingerprint::{Fingerprint, FingerprintSpec, fingerprint};
use tower_idempotency::{IdempotencyBody, IdempotencyKey, IdempotencyLayer, MemoryStore, RecordId, Scope};

/// The two request counts whose difference is measured.
const CALLS_LOW: u64 = 2_000;
const CALLS_HIGH: u64 = 6_000;

/// The scenarios, in the order of the table.
const SCENARIOS: [&str; 5] = ["bare", "new_key", "replay", "floor", "http_floor"];

/// Set in a child process: the scenario and how many requests it runs.
const CHILD: &str = "INSTRUCTIONS_CHILD";

/// The child's measured loop ([`measured`]).
const MEASURED: &str = "instructions::measured";

/// The function whose instructions are SHA-256's (the compression of whole blocks).
const SHA256: &str = "sha2::sha256::compress256";

fn main() {
    if let Ok(child) = std::env::var(CHILD) {
        let (scenario, calls) = child.split_once(':').expect("scenario:calls");
        return run(scenario, calls.parse().expect("calls"));
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("instructions: valgrind is not installed; nothing measured");
        return;
    }
    let me = std::env::current_exe().expect("the benchmark's own path");
    // One block's instructions in `sha2`'s portable code, to turn the compression's count
    // into blocks.
    let block = per_request(&me, "sha256_block", &[SHA256]);
    println!(
        "instructions per request (callgrind, {CALLS_HIGH} less {CALLS_LOW} requests; a SHA-256 block is {block:.0})"
    );
    println!("{:<10} {:>12} {:>14} {:>12}", "scenario", "all", "outside SHA", "SHA blocks");
    let mut counts = Vec::new();
    for scenario in SCENARIOS {
        let count = Count::of(&me, scenario, block);
        println!("{scenario:<10} {:>12.0} {:>14.0} {:>12.1}", count.all, count.outside_sha(), count.blocks);
        counts.push(count);
    }
    let [bare, new_key, replay, floor, http_floor] = [counts[0], counts[1], counts[2], counts[3], counts[4]];
    // The floor's loop builds its requests too: the floor's own work is without them.
    let floor_work = floor.less(Count::of(&me, "request", block));
    let new_key_adds = new_key.less(bare);
    let replay_adds = replay.less(bare);
    println!(
        "new key adds {:.0} ({:.0} outside SHA-256, {:.1} blocks); the floor's work is {:.0} ({:.0} outside, {:.1} blocks): {:.2}x the floor, {:.2}x outside SHA-256",
        new_key_adds.all,
        new_key_adds.outside_sha(),
        new_key_adds.blocks,
        floor_work.all,
        floor_work.outside_sha(),
        floor_work.blocks,
        new_key_adds.all / floor_work.all,
        new_key_adds.outside_sha() / floor_work.outside_sha(),
    );
    let http_floor_adds = http_floor.less(bare);
    println!(
        "the HTTP floor adds {:.0} ({:.0} outside SHA-256, {:.1} blocks): a new key through the layer is {:.2}x it, {:.2}x outside SHA-256",
        http_floor_adds.all,
        http_floor_adds.outside_sha(),
        http_floor_adds.blocks,
        new_key_adds.all / http_floor_adds.all,
        new_key_adds.outside_sha() / http_floor_adds.outside_sha(),
    );
    println!(
        "replay adds {:.0} ({:.0} outside SHA-256, {:.1} blocks)",
        replay_adds.all,
        replay_adds.outside_sha(),
        replay_adds.blocks
    );
    #[cfg(feature = "metrics")]
    metrics_share(&me, new_key.all, new_key_adds.all);
    #[cfg(feature = "grpc-example")]
    grpc::compare(&me, block);
}

/// The functions of a Prometheus recorder that the layer's metric calls run (a histogram's
/// sample with its timestamp, a counter's increment) and its upkeep, which drains the samples.
#[cfg(feature = "metrics")]
const EXPORTER: [&str; 3] = [
    "*HistogramFn>::record",
    "*CounterFn>::increment",
    "metrics_exporter_prometheus::recorder::PrometheusHandle::run_upkeep",
];

/// Drain the recorder's samples after this many requests.
#[cfg(feature = "metrics")]
const UPKEEP: u64 = 1_000;

/// The metrics' share of the layer's own instructions: a new key with a Prometheus recorder
/// installed (with buckets, then with summaries) against `new_key` (no recorder: every metric a
/// no-op), of which `overhead` is the layer's; and how much of the difference is the
/// recorder's own code.
#[cfg(feature = "metrics")]
fn metrics_share(me: &std::path::Path, new_key: f64, overhead: f64) {
    for (scenario, recorder) in [
        ("new_key_recorded", "the reference service's buckets"),
        ("new_key_summaries", "the exporter's default summaries"),
    ] {
        let recorded = per_request(me, scenario, &[]);
        let exporter = per_request(me, scenario, &EXPORTER);
        let metrics = recorded - new_key;
        println!(
            "metrics ({recorder}): a new key with a Prometheus recorder {recorded:.0}, without {new_key:.0}: +{metrics:.0} = {:.1}% of the layer's {overhead:.0}; of them the recorder's own calls and upkeep {exporter:.0} ({:.1}%), the rest {:.0} ({:.1}%)",
            100.0 * metrics / overhead,
            100.0 * exporter / overhead,
            metrics - exporter,
            100.0 * (metrics - exporter) / overhead,
        );
    }
}

/// One scenario's instructions per request.
#[derive(Clone, Copy)]
struct Count {
    all: f64,
    /// Of `all`, SHA-256's compression.
    sha: f64,
    /// SHA-256 blocks hashed.
    blocks: f64,
}

impl Count {
    /// `scenario`'s count, with SHA-256 blocks of `block` instructions.
    fn of(me: &std::path::Path, scenario: &str, block: f64) -> Self {
        let sha = per_request(me, scenario, &[SHA256]);
        Self { all: per_request(me, scenario, &[]), sha, blocks: sha / block }
    }

    fn outside_sha(self) -> f64 {
        self.all - self.sha
    }

    /// What `self` adds to `base`.
    fn less(self, base: Self) -> Self {
        Self { all: self.all - base.all, sha: self.sha - base.sha, blocks: self.blocks - base.blocks }
    }
}

/// Instructions per request of `scenario` (only inside the functions `only` names, if any;
/// none of them may call another).
fn per_request(me: &std::path::Path, scenario: &str, only: &[&str]) -> f64 {
    // A gRPC call costs a dozen times an in-process request: fewer of them.
    let (low, high) =
        if scenario.starts_with("grpc_") { (CALLS_LOW / 4, CALLS_HIGH / 4) } else { (CALLS_LOW, CALLS_HIGH) };
    let (low_count, high_count) = (collected(me, scenario, low, only), collected(me, scenario, high, only));
    (high_count as f64 - low_count as f64) / (high - low) as f64
}

/// The instructions callgrind collected over a child process running `calls` requests.
fn collected(me: &std::path::Path, scenario: &str, calls: u64, only: &[&str]) -> u64 {
    let mut command = Command::new("valgrind");
    command.args(["--tool=callgrind", "--callgrind-out-file=/dev/null", "--collect-atstart=no"]);
    // Everything the measured loop runs, or only what `only` names (whose warm-up share is the
    // same in both runs, and cancels out).
    let functions: &[&str] = if only.is_empty() { &[MEASURED] } else { only };
    command.args(functions.iter().map(|function| format!("--toggle-collect={function}")));
    let output = command.arg(me).env(CHILD, format!("{scenario}:{calls}")).output().expect("valgrind runs");
    assert!(output.status.success(), "{scenario} under callgrind: {}", String::from_utf8_lossy(&output.stderr));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr.lines().find(|line| line.contains("Collected :")).expect("callgrind's total");
    line.rsplit(' ').next().and_then(|n| n.trim().parse().ok()).expect("a count")
}

async fn drain<B: http_body::Body>(response: Response<B>) -> usize
where
    B::Error: std::fmt::Debug,
{
    response.into_body().collect().await.expect("body").to_bytes().len()
}

/// One request through `guarded` on `runtime`: answered 201, its body read to the end.
fn answered<S>(runtime: &tokio::runtime::Runtime, guarded: &S, request: http::Request<Full<Bytes>>)
where
    S: tower::Service<http::Request<Full<Bytes>>, Response = Response<IdempotencyBody<Full<Bytes>>>> + Clone,
    S::Error: std::fmt::Debug,
{
    let response = runtime.block_on(guarded.clone().oneshot(request)).expect("layer");
    assert_eq!(response.status(), StatusCode::CREATED);
    std::hint::black_box(runtime.block_on(drain(response)));
}

/// Requests each child runs before it counts: the runtime, the store's map and the lazily
/// set-up parts (the timing clock's calibration, which loops for a fixed time and so runs a
/// varying number of instructions) are past their first use.
const WARM_UP: u64 = 200;

/// What the child counts: `calls` runs of `step`. The parent has callgrind collect inside this
/// function only; it must keep its name.
#[inline(never)]
fn measured(step: &mut dyn FnMut(), calls: u64) {
    for _ in 0..calls {
        step();
    }
}

/// Runs `calls` requests of `scenario` (in a child process, under callgrind), after
/// [`WARM_UP`] that are not counted.
fn run(scenario: &str, calls: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let body = body();
    let mut keys = 0u64;
    let mut next_key = move || {
        keys += 1;
        format!("key-{keys}")
    };
    let guarded = || IdempotencyLayer::new(MemoryStore::new()).shared_scope("bench").layer(tower::service_fn(handler));
    let mut step: Box<dyn FnMut()> = match scenario {
        "bare" => {
            let bare = tower::service_fn(handler);
            Box::new(move || {
                let response = runtime.block_on(bare.oneshot(request(&next_key(), &body))).expect("bare");
                std::hint::black_box(runtime.block_on(drain(response)));
            })
        }
        "new_key" => {
            let guarded = guarded();
            Box::new(move || answered(&runtime, &guarded, request(&next_key(), &body)))
        }
        "replay" => {
            let guarded = guarded();
            Box::new(move || answered(&runtime, &guarded, request("replayed-key", &body)))
        }
        #[cfg(feature = "metrics")]
        recorded @ ("new_key_recorded" | "new_key_summaries") => {
            // A Prometheus recorder (the reference service's buckets, or the exporter's default
            // summaries), installed for the whole process; its samples drained every `UPKEEP`
            // requests, as a scrape or the exporter's upkeep would.
            let recorder =
                if recorded == "new_key_recorded" { prometheus::bucketed() } else { prometheus::summaries() };
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).expect("the only recorder");
            let guarded = guarded();
            let mut n = 0u64;
            Box::new(move || {
                answered(&runtime, &guarded, request(&next_key(), &body));
                n += 1;
                if n.is_multiple_of(UPKEEP) {
                    handle.run_upkeep();
                }
                if n == WARM_UP {
                    assert!(handle.render().contains("idempotency_requests_total"), "the recorder sees the layer");
                }
            })
        }
        "floor" => floor(body, next_key),
        "http_floor" => {
            let floor = http_floor::HttpFloor::new(tower::service_fn(handler));
            Box::new(move || {
                let response = runtime.block_on(floor.clone().oneshot(request(&next_key(), &body))).expect("floor");
                assert_eq!(response.status(), StatusCode::CREATED);
                std::hint::black_box(runtime.block_on(drain(response)));
            })
        }
        #[cfg(feature = "grpc-example")]
        grpc if grpc.starts_with("grpc_") => grpc::step(grpc, runtime),
        "sha256_block" => {
            let mut n = 0u8;
            // 55 bytes and the padding: one block.
            Box::new(move || {
                n = n.wrapping_add(1);
                std::hint::black_box(sha2::Sha256::digest([n; 55]));
            })
        }
        "request" => Box::new(move || {
            std::hint::black_box(request(&next_key(), &body));
        }),
        other => panic!("no scenario {other}"),
    };
    for _ in 0..WARM_UP {
        step();
    }
    measured(&mut step, calls);
}

/// The floor of `benches/layer.rs`: the fingerprint, the identity and one map insert, of a
/// request built in the step.
fn floor(body: Bytes, mut next_key: impl FnMut() -> String + 'static) -> Box<dyn FnMut()> {
    let (spec, scope) = (FingerprintSpec::new(), Scope::new("bench"));
    let answer = Bytes::from_static(b"{\"order_id\":\"0f8fad5b-d9cb-469f-a165-70867728950e\",\"bytes\":256}");
    let mut records: std::collections::HashMap<RecordId, (Fingerprint, Bytes)> = Default::default();
    Box::new(move || {
        let (parts, _) = request(&next_key(), &body).into_parts();
        let key = parts.headers["idempotency-key"].to_str().expect("key");
        let id = RecordId::new(&scope, "POST /orders", &IdempotencyKey::new(key).expect("key"));
        let print = fingerprint(&parts.method, &parts.uri, &parts.headers, &body, &spec);
        records.insert(id, (print, Bytes::copy_from_slice(&answer)));
    })
}

/// The gRPC scenarios (feature `grpc-example`).
#[cfg(feature = "grpc-example")]
mod grpc {
    use tonic::metadata::MetadataValue;
    use tonic::transport::Channel;

    use super::Count;
    use super::echo_things::proto::CreateThing;
    use super::echo_things::proto::things_client::ThingsClient;
    use super::echo_things::serve_in_memory;

    const METHOD: &str = "/conformance.v1.Things/Create";

    /// The scenarios, in the order of the table.
    const SCENARIOS: [&str; 4] = ["grpc_bare", "grpc_passthrough", "grpc_new_key", "grpc_replay"];

    /// Prints the gRPC table: each scenario's instructions per call, and its ratio to no layer.
    pub(super) fn compare(me: &std::path::Path, block: f64) {
        println!("gRPC unary call, instructions per call (client and server, one thread)");
        println!("{:<18} {:>12} {:>14} {:>12} {:>10}", "scenario", "all", "outside SHA", "SHA blocks", "bare/this");
        let mut bare = None;
        for scenario in SCENARIOS {
            let count = Count::of(me, scenario, block);
            let bare = *bare.get_or_insert(count.all);
            println!(
                "{scenario:<18} {:>12.0} {:>14.0} {:>12.1} {:>10.3}",
                count.all,
                count.outside_sha(),
                count.blocks,
                bare / count.all
            );
        }
    }

    /// One call of `scenario` per step, on `runtime` (which also runs the server).
    pub(super) fn step(scenario: &str, runtime: tokio::runtime::Runtime) -> Box<dyn FnMut()> {
        let guarded = match scenario {
            "grpc_bare" => None,
            "grpc_passthrough" => Some("/conformance.v1.Things/Unguarded"),
            "grpc_new_key" | "grpc_replay" => Some(METHOD),
            other => panic!("no scenario {other}"),
        };
        let replay = scenario == "grpc_replay";
        let client = runtime.block_on(async {
            let addr = serve_in_memory(guarded).await;
            let channel =
                Channel::from_shared(format!("http://{addr}")).expect("uri").connect().await.expect("connect");
            ThingsClient::new(channel)
        });
        let mut n = 0u64;
        Box::new(move || {
            n += 1;
            let key = if replay { "replayed-key".to_owned() } else { format!("key-{n}") };
            let mut request = tonic::Request::new(CreateThing { name: "book-42".to_owned(), amount: 129_900 });
            request.metadata_mut().insert("idempotency-key", MetadataValue::try_from(key).expect("key"));
            let mut client = client.clone();
            runtime.block_on(client.create(request)).expect("every call succeeds");
        })
    }
}
