//! The metrics' cost on the layer's own overhead, interleaved in one run (feature `metrics`).
//!
//! Three services answer the same 256-byte JSON `POST` with a fresh key each time (claim,
//! execute, store, over `MemoryStore`): the handler alone (`bare`), the layer whose metric handles
//! were resolved with no recorder installed (`layer`: every metric a no-op), and the layer whose
//! handles were resolved under a Prometheus recorder (`recorded`: every metric recorded).
//!
//! Time is the thread's own CPU time (`CLOCK_THREAD_CPUTIME_ID`; the runtime is
//! single-threaded, so every request runs on this thread), which other processes on a shared
//! machine do not inflate, as they do wall time. Each round runs `SLICES` slices of `SLICE`
//! requests of each service, rotating which goes first, so the three share whatever the machine
//! does meanwhile. The share `(recorded - layer) / (layer - bare)` is printed per step (the three
//! adjacent slices of one step: median and quartiles over all steps, the least disturbed by
//! the machine's drift), per round (median and range), and of the whole run's sums.
//!
//! The recorder has the reference service's histogram buckets (`examples/orders`);
//! `METRICS_COST_SUMMARIES=1` measures the exporter's default, histograms as summaries.
//!
//! Run with `cargo bench --features metrics --bench metrics_cost` (`METRICS_COST_ROUNDS`, default 15).

#[path = "support/prometheus.rs"]
mod prometheus;

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// Requests per slice.
const SLICE: u64 = 500;
/// Slices of each service per round.
const SLICES: u64 = 40;

/// This thread's CPU time so far, in nanoseconds: `CLOCK_THREAD_CPUTIME_ID`, which the kernel
/// brings up to date when it is read (`/proc/thread-self/schedstat` lags the running thread by
/// up to a scheduler tick, several milliseconds, longer than a slice takes).
fn cpu_now() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

async fn handler(request: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = request.into_body().collect().await?.to_bytes();
    let json = format!("{{\"order_id\":\"0f8fad5b-d9cb-469f-a165-70867728950e\",\"bytes\":{}}}", body.len());
    Ok(Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(json)))
        .expect("response"))
}

fn request(key: u64, body: &Bytes) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("key-{key}"))
        .header("content-length", body.len())
        .body(Full::new(body.clone()))
        .expect("request")
}

/// One slice of fresh keys through `service`: the CPU time it took, in nanoseconds.
async fn slice<S, B>(service: &S, body: &Bytes, next: &mut u64) -> u64
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let started = cpu_now();
    for _ in 0..SLICE {
        *next += 1;
        let response = service.clone().oneshot(request(*next, body)).await.expect("answer");
        std::hint::black_box(response.into_body().collect().await.expect("body"));
    }
    cpu_now() - started
}

fn main() {
    let rounds = std::env::var("METRICS_COST_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(15);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let body = Bytes::from(format!("{{\"sku\":\"SKU-1\",\"note\":\"{}\"}}", "x".repeat(230)));
    // The reference service's recorder (histogram buckets); `METRICS_COST_SUMMARIES=1`: the
    // exporter's default (summaries).
    let summaries = std::env::var_os("METRICS_COST_SUMMARIES").is_some();
    let recorder = if summaries { prometheus::summaries() } else { prometheus::bucketed() };
    println!(
        "recorder: {}",
        if summaries { "the exporter's default summaries" } else { "the reference service's buckets" }
    );
    let handle = recorder.handle();
    runtime.block_on(async {
        let mut next = 0;
        let mut shares = Vec::new();
        let mut slice_shares = Vec::new();
        let mut sums = [Duration::ZERO; 3];
        for round in 0..rounds {
            // Fresh stores each round, so the map never grows past a few batches.
            let bare = tower::service_fn(handler);
            let layer =
                IdempotencyLayer::new(MemoryStore::new()).shared_scope("bench").layer(tower::service_fn(handler));
            let recorded =
                IdempotencyLayer::new(MemoryStore::new()).shared_scope("bench").layer(tower::service_fn(handler));
            // Resolve the `recorded` layer's handles under the recorder (its first request).
            {
                let _local = metrics::set_default_local_recorder(&recorder);
                recorded.clone().oneshot(request(u64::MAX - round as u64, &body)).await.expect("first");
            }
            let mut times = [0u64; 3];
            for slice_index in 0..SLICES {
                let mut slices = [0u64; 3];
                for step in 0..3 {
                    let which = (step + slice_index as usize + round) % 3;
                    slices[which] = match which {
                        0 => slice(&bare, &body, &mut next).await,
                        1 => slice(&layer, &body, &mut next).await,
                        _ => slice(&recorded, &body, &mut next).await,
                    };
                }
                for (time, slice) in times.iter_mut().zip(slices) {
                    *time += slice;
                }
                // The three slices of one step ran back to back: their share is the least
                // disturbed by what the machine does over a whole round.
                let [bare, layer, recorded] = slices.map(|t| t as f64);
                slice_shares.push((recorded - layer) / (layer - bare));
                handle.run_upkeep();
            }
            let per_request = |ns: u64| Duration::from_nanos(ns / (SLICE * SLICES));
            for (sum, time) in sums.iter_mut().zip(times) {
                *sum += per_request(time);
            }
            let [bare, layer, recorded] = times.map(|t| t as f64);
            shares.push((recorded - layer) / (layer - bare));
        }
        assert!(handle.render().contains("idempotency_requests_total"), "the recorder saw the layer's metrics");
        shares.sort_by(f64::total_cmp);
        slice_shares.sort_by(f64::total_cmp);
        let quartile = |q: usize| slice_shares[(slice_shares.len() - 1) * q / 4] * 100.0;
        println!(
            "metrics' share per step of three adjacent slices ({} steps): median {:.1}%, quartiles {:.1}% to {:.1}%",
            slice_shares.len(),
            quartile(2),
            quartile(1),
            quartile(3),
        );
        let mean = |sum: Duration| sum.as_secs_f64() * 1e6 / rounds as f64;
        let [bare, layer, recorded] = sums.map(|sum| sum.as_secs_f64());
        println!(
            "CPU per request: bare {:.2} µs, layer {:.2} µs, layer with a recorder {:.2} µs (means); metrics' share \
             of the layer's overhead: {:.1}% of the run's sums, per round median {:.1}% (range {:.1}% to {:.1}%, \
             {rounds} rounds)",
            mean(sums[0]),
            mean(sums[1]),
            mean(sums[2]),
            (recorded - layer) / (layer - bare) * 100.0,
            shares[shares.len() / 2] * 100.0,
            shares[0] * 100.0,
            shares[shares.len() - 1] * 100.0,
        );
        // The same calls alone, without the noise of whole requests around them.
        let calls = metric_calls(&recorder, 2_000_000);
        handle.run_upkeep();
        let clocks = clock_reads(2_000_000, true);
        let std_clocks = clock_reads(2_000_000, false);
        let overhead_ns = (mean(sums[1]) - mean(sums[0])) * 1000.0;
        println!(
            "alone, per new-key request: the metric calls (1 counter, 4 histogram samples) {calls:.0} ns = {:.1}% of \
             the layer's overhead ({overhead_ns:.0} ns, above); with the timings the feature adds (8 clock reads, 4 \
             lengths: {clocks:.0} ns on the layer's clock, {std_clocks:.0} ns on std's Instant) {:.0} ns = {:.1}% \
             (on std's Instant it would be {:.1}%)",
            calls / overhead_ns * 100.0,
            calls + clocks,
            (calls + clocks) / overhead_ns * 100.0,
            (calls + std_clocks) / overhead_ns * 100.0,
        );
        let stamps = exporter_timestamps(2_000_000);
        println!(
            "of the metric calls, the exporter's own timestamps (it reads quanta's Instant once per histogram sample, \
             4 per request): {stamps:.0} ns = {:.1}% of the layer's overhead; the rest of the calls {:.0} ns = {:.1}%",
            stamps / overhead_ns * 100.0,
            calls - stamps,
            (calls - stamps) / overhead_ns * 100.0,
        );
    });
}

/// CPU nanoseconds of the timings the layer takes per new-key request: 8 clock reads (start,
/// before and after the claim, the inner service and the finish, and the end) and the 4 lengths
/// taken from them, on the layer's clock (`quanta`'s raw counter) when `layer_clock`, else on
/// `std::time::Instant`, for comparison; the median of 5 runs of `requests`.
fn clock_reads(requests: u64, layer_clock: bool) -> f64 {
    let clock = quanta::Clock::new();
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let started = cpu_now();
            for _ in 0..requests {
                if layer_clock {
                    let start = clock.raw();
                    for _ in 0..3 {
                        let step = clock.raw();
                        std::hint::black_box(clock.delta(step, clock.raw()));
                    }
                    std::hint::black_box(clock.delta(start, clock.raw()));
                } else {
                    let start = Instant::now();
                    for _ in 0..3 {
                        std::hint::black_box(Instant::now().elapsed());
                    }
                    std::hint::black_box(start.elapsed());
                }
            }
            (cpu_now() - started) as f64 / requests as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

/// CPU nanoseconds per request of what the Prometheus exporter does first in every histogram
/// sample, whoever records it: reading `quanta::Instant::now()` (it keeps each sample with its
/// time, on `quanta`'s global clock), 4 times; the median of 5 runs of `requests`.
fn exporter_timestamps(requests: u64) -> f64 {
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let started = cpu_now();
            for _ in 0..requests {
                for _ in 0..4 {
                    std::hint::black_box(quanta::Instant::now());
                }
            }
            (cpu_now() - started) as f64 / requests as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

/// CPU nanoseconds per request of the calls the layer makes on its metric handles for a new
/// key (`idempotency_requests_total`, and samples of `idempotency_overhead_seconds`,
/// `idempotency_store_seconds` for `begin` and `finish`, `idempotency_stored_bytes`), on handles
/// resolved under `recorder`, `requests` times; the median of 5 runs.
fn metric_calls(recorder: &metrics_exporter_prometheus::PrometheusRecorder, requests: u64) -> f64 {
    use tower_idempotency::telemetry::{OVERHEAD, REQUESTS, STORE, STORED_BYTES};
    let (counter, overhead, begin, finish, bytes) = metrics::with_local_recorder(recorder, || {
        (
            metrics::counter!(REQUESTS, "operation" => "bench.calls", "result" => "executed"),
            metrics::histogram!(OVERHEAD, "operation" => "bench.calls"),
            metrics::histogram!(STORE, "operation" => "bench.calls", "step" => "begin"),
            metrics::histogram!(STORE, "operation" => "bench.calls", "step" => "finish"),
            metrics::histogram!(STORED_BYTES, "operation" => "bench.calls"),
        )
    });
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let started = cpu_now();
            for i in 0..requests {
                let sample = std::hint::black_box(Duration::from_nanos(1_000 + (i & 1023)));
                counter.increment(1);
                overhead.record(sample);
                begin.record(sample);
                finish.record(sample);
                bytes.record(std::hint::black_box(64.0));
            }
            (cpu_now() - started) as f64 / requests as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}
