//! The layer's added cost with the in-memory store, against the bare service, in one run.
//!
//! A trivial handler answers 201 with a small JSON body to a POST with a 256-byte JSON body.
//! Three measurements of the same request shape:
//! - `bare`: the handler alone;
//! - `layer/new_key`: through the layer, a fresh key every time (claim, execute, store);
//! - `layer/replay`: through the layer, the same key every time (answered from the store);
//! - `floor`: only the work a new key cannot do without, with no layer around it: the
//!   request's fingerprint (its 256-byte JSON body canonicalised, SHA-256), the record's
//!   identity (a second SHA-256) and one map insert of the identity with the fingerprint and a
//!   copy of the answer. `(layer/new_key - bare) / floor` is the layer's cost against the least
//!   it could cost;
//! - `http_floor`: a new key through `HttpFloor` (`benches/support/http_floor.rs`), a
//!   middleware written straight that does the floor's work and what any HTTP middleware must
//!   do around it (the key from its header, the request body collected, a claim before the
//!   handler, the response body collected and a copy of the response kept), and nothing else
//!   the contract asks for. `(layer/new_key - bare) / (http_floor - bare)` is the layer against
//!   the least an HTTP middleware could cost;
//! - with the `metrics` feature, `layer/new_key/recorder` and `layer/replay/recorder`: the same,
//!   with a Prometheus recorder (`metrics-exporter-prometheus`, with the reference service's
//!   histogram buckets) installed, so every metric the layer emits is recorded.
//!   `(recorder - layer) / (layer - bare)` is the metrics' share of the layer's own overhead.
//!
//! Run with `cargo bench --bench layer` (and `--features metrics` for the recorder's cost);
//! the ratios are what matters on a shared machine.

#[path = "support/http_floor.rs"]
mod http_floor;
#[path = "support/json_order.rs"]
mod json_order;
#[cfg(feature = "metrics")]
#[path = "support/prometheus.rs"]
mod prometheus;

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use json_order::{body, handler, request};
use tower::{Layer, ServiceExt};
use tower_idempotency::fingerprint::{Fingerprint, FingerprintSpec, fingerprint};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore, RecordId, Scope};

async fn drain<B: http_body::Body>(response: Response<B>) -> usize
where
    B::Error: std::fmt::Debug,
{
    response.into_body().collect().await.expect("body").to_bytes().len()
}

fn layer_cost(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let body = body();
    let bare = tower::service_fn(handler);
    let guarded = guarded_fresh();
    let counter = AtomicU64::new(0);

    let mut group = c.benchmark_group("layer_256B_json");
    group.measurement_time(std::time::Duration::from_secs(4));
    group.bench_function("bare", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = format!("key-{}", counter.fetch_add(1, Ordering::Relaxed));
            drain(bare.oneshot(request(&key, &body)).await.expect("bare")).await
        })
    });
    // A fresh store every 50 000 requests, built and dropped outside the timed part: the cost
    // measured is the layer's with a store of realistic size, not the rehashing and freeing of
    // a map that grows to millions of records during the benchmark.
    group.bench_function("layer/new_key", |b| new_keys(b, &runtime, &body, &counter, guarded_fresh, || {}));
    #[cfg(feature = "metrics")]
    {
        let recorder = prometheus::bucketed();
        let handle = recorder.handle();
        let _local = metrics::set_default_local_recorder(&recorder);
        group.bench_function("layer/new_key/recorder", |b| {
            new_keys(b, &runtime, &body, &counter, guarded_fresh, || handle.run_upkeep())
        });
        let guarded = guarded_fresh();
        replays(&mut group, "layer/replay/recorder", &runtime, &guarded, &body);
        handle.run_upkeep();
        assert!(handle.render().contains("idempotency_requests_total"), "the recorder saw the layer's metrics");
    }
    replays(&mut group, "layer/replay", &runtime, &guarded, &body);
    group.bench_function("floor", |b| floor(b, &body, &counter));
    group.bench_function("http_floor", |b| {
        new_keys(b, &runtime, &body, &counter, || http_floor::HttpFloor::new(tower::service_fn(handler)), || {})
    });
    group.finish();
}

/// The work a new key cannot do without (see the module docs), on the same request; a fresh
/// map every 50 000 keys, as `new_keys` gives the layer a fresh store.
fn floor(b: &mut criterion::Bencher<'_>, body: &Bytes, counter: &AtomicU64) {
    let (spec, scope) = (FingerprintSpec::new(), Scope::new("bench"));
    let answer = Bytes::from_static(b"{\"order_id\":\"0f8fad5b-d9cb-469f-a165-70867728950e\",\"bytes\":256}");
    b.iter_custom(|iters| {
        let mut elapsed = std::time::Duration::ZERO;
        let mut left = iters;
        while left > 0 {
            let chunk = left.min(50_000);
            left -= chunk;
            let mut records: std::collections::HashMap<RecordId, (Fingerprint, Bytes)> = Default::default();
            let requests: Vec<_> = (0..chunk)
                .map(|_| request(&format!("key-{}", counter.fetch_add(1, Ordering::Relaxed)), body))
                .collect();
            let started = std::time::Instant::now();
            for request in requests {
                let (parts, _) = request.into_parts();
                let key = parts.headers["idempotency-key"].to_str().expect("key");
                let id = RecordId::new(&scope, "POST /orders", &IdempotencyKey::new(key).expect("key"));
                let print = fingerprint(&parts.method, &parts.uri, &parts.headers, body, &spec);
                records.insert(id, (print, Bytes::copy_from_slice(&answer)));
            }
            elapsed += started.elapsed();
            std::hint::black_box(records);
        }
        elapsed
    })
}

/// The layer around the handler, over a fresh store.
fn guarded_fresh() -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<tower_idempotency::IdempotencyBody<Full<Bytes>>>,
    Error = std::convert::Infallible,
> + Clone {
    IdempotencyLayer::new(MemoryStore::new()).shared_scope("bench").layer(tower::service_fn(handler))
}

/// Fresh keys through a service made by `fresh` (a fresh one every 50 000 keys), `between`
/// run after each chunk, outside the timed part.
fn new_keys<S, B>(
    b: &mut criterion::Bencher<'_>,
    runtime: &tokio::runtime::Runtime,
    body: &Bytes,
    counter: &AtomicU64,
    fresh: impl Fn() -> S,
    between: impl Fn(),
) where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    b.to_async(runtime).iter_custom(|iters| {
        let (between, fresh) = (&between, &fresh);
        async move {
            let mut elapsed = std::time::Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let chunk = left.min(50_000);
                left -= chunk;
                let service = fresh();
                let started = std::time::Instant::now();
                for _ in 0..chunk {
                    let key = format!("key-{}", counter.fetch_add(1, Ordering::Relaxed));
                    let response = service.clone().oneshot(request(&key, body)).await.expect("new key");
                    std::hint::black_box(drain(response).await);
                }
                elapsed += started.elapsed();
                between();
            }
            elapsed
        }
    })
}

/// The same key every time through `guarded`: replays.
fn replays<S>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    runtime: &tokio::runtime::Runtime,
    guarded: &S,
    body: &Bytes,
) where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<tower_idempotency::IdempotencyBody<Full<Bytes>>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    runtime.block_on(async {
        let first = guarded.clone().oneshot(request("replayed-key", body)).await.expect("first");
        assert_eq!(first.status(), StatusCode::CREATED);
    });
    group.bench_function(name, |b| {
        b.to_async(runtime).iter(|| async {
            let response = guarded.clone().oneshot(request("replayed-key", body)).await.expect("replay");
            debug_assert_eq!(response.headers()["idempotent-replayed"], "true");
            drain(response).await
        })
    });
}

criterion_group!(benches, layer_cost);
criterion_main!(benches);
