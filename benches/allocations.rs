//! Heap allocations per request, the layer against the same work without it, in one run.
//!
//! On a multi-threaded server an allocation is more than its `malloc`: glibc's arenas are
//! locked, and a block freed on another worker thread than the one that made it takes that
//! arena's lock. Profiles of `grpc_unary` show the allocator, not the layer's own code, as the
//! largest part of what a guarded call adds. This benchmark counts, with `dhat`'s allocator
//! (exact counts; its own bookkeeping makes timings meaningless, so it prints none):
//!
//! - **HTTP**, through `tower::ServiceExt::oneshot` on a current-thread runtime: a POST with a
//!   256-byte JSON body and a trivial handler (the request shape of `benches/layer.rs`), bare,
//!   through the layer with a new key each time, and as a replay;
//! - **gRPC**, through a real tonic client and server on loopback (`Things/Create`, the handler
//!   of `benches/grpc_unary.rs`), one call at a time: without the layer, through the layer with
//!   the method not named (passthrough), with a new key each time, and as a replay.
//!
//! Each count is over `CALLS` requests after a warm-up, and is printed per request with the
//! bytes allocated, and as the layer's addition over the bare path. Counts move a little with
//! the store's map growing (an occasional rehash), never with the machine's load. Run with
//! `cargo bench --bench allocations --features grpc-example`.

#[path = "support/echo_things.rs"]
mod echo_things;
#[path = "support/json_order.rs"]
mod json_order;

use std::future::Future;
use std::net::SocketAddr;

use http::StatusCode;
use http_body_util::BodyExt;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tower::{Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

use echo_things::proto::CreateThing;
use echo_things::proto::things_client::ThingsClient;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Requests counted per scenario.
const CALLS: u64 = 2_000;
/// Requests before counting: connections, pools and maps at their working size.
const WARM_UP: u64 = 200;
const METHOD: &str = "/conformance.v1.Things/Create";

/// What one scenario allocated per request.
struct Count {
    name: &'static str,
    blocks: f64,
    bytes: f64,
}

/// Counts the allocations of `CALLS` calls of `call` (numbered from `WARM_UP`), after
/// `WARM_UP` uncounted ones.
async fn count<F, Fut>(name: &'static str, mut call: F) -> Count
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = ()>,
{
    for n in 0..WARM_UP {
        call(n).await;
    }
    let before = dhat::HeapStats::get();
    for n in WARM_UP..WARM_UP + CALLS {
        call(n).await;
    }
    let after = dhat::HeapStats::get();
    Count {
        name,
        blocks: (after.total_blocks - before.total_blocks) as f64 / CALLS as f64,
        bytes: (after.total_bytes - before.total_bytes) as f64 / CALLS as f64,
    }
}

/// The HTTP scenarios. The request is built before the count starts only in the sense that
/// every scenario builds it the same way; its allocations are in every count alike.
async fn http_counts() -> Vec<Count> {
    let body = json_order::body();
    let guarded =
        IdempotencyLayer::new(MemoryStore::new()).shared_scope("bench").layer(tower::service_fn(json_order::handler));
    let bare = count("http bare", |n| {
        let request = json_order::request(&format!("key-{n}"), &body);
        async move {
            let response = tower::service_fn(json_order::handler).oneshot(request).await.expect("bare");
            response.into_body().collect().await.expect("body");
        }
    })
    .await;
    let new_key = count("http new key", |n| {
        let (guarded, request) = (guarded.clone(), json_order::request(&format!("key-{n}"), &body));
        async move {
            let response = guarded.oneshot(request).await.expect("layer");
            assert_eq!(response.status(), StatusCode::CREATED);
            response.into_body().collect().await.expect("body");
        }
    })
    .await;
    let replay = count("http replay", |n| {
        // Keys of the new-key scenario's warm-up: every call replays one.
        let (guarded, request) = (guarded.clone(), json_order::request(&format!("key-{}", n % WARM_UP), &body));
        async move {
            let response = guarded.oneshot(request).await.expect("layer");
            assert_eq!(response.headers()["idempotent-replayed"], "true");
            response.into_body().collect().await.expect("body");
        }
    })
    .await;
    vec![bare, new_key, replay]
}

/// `count` for calls to `addr`, the key of call `n` made by `key_of`.
async fn grpc_count(name: &'static str, addr: SocketAddr, key_of: fn(u64) -> String) -> Count {
    let channel = Channel::from_shared(format!("http://{addr}")).expect("uri").connect().await.expect("connect");
    let client = ThingsClient::new(channel);
    count(name, |n| {
        let mut client = client.clone();
        async move {
            let mut request = tonic::Request::new(CreateThing { name: "book-42".to_owned(), amount: 129_900 });
            request.metadata_mut().insert("idempotency-key", MetadataValue::try_from(key_of(n)).expect("key"));
            client.create(request).await.expect("every call succeeds");
        }
    })
    .await
}

async fn grpc_counts() -> Vec<Count> {
    let bare = echo_things::serve_in_memory(None).await;
    let passthrough = echo_things::serve_in_memory(Some("/conformance.v1.Things/Unguarded")).await;
    let guarded = echo_things::serve_in_memory(Some(METHOD)).await;
    vec![
        grpc_count("grpc bare", bare, |n| format!("key-{n}")).await,
        grpc_count("grpc passthrough", passthrough, |n| format!("key-{n}")).await,
        grpc_count("grpc new key", guarded, |n| format!("key-{n}")).await,
        // Keys of the new-key scenario's warm-up: every call replays one.
        grpc_count("grpc replay", guarded, |n| format!("key-{}", n % WARM_UP)).await,
    ]
}

fn print(counts: &[Count]) {
    let bare = &counts[0];
    for c in counts {
        println!(
            "{:<18} {:>8.2} {:>10.0} {:>+9.2} {:>+10.0}",
            c.name,
            c.blocks,
            c.bytes,
            c.blocks - bare.blocks,
            c.bytes - bare.bytes
        );
    }
}

fn main() {
    // `ALLOCATIONS_PROFILE=1` also writes every allocation site to `dhat-heap.json`, for
    // `dh_view.html` (the sites under `tower_idempotency` frames are the layer's).
    let _profiler = if std::env::var_os("ALLOCATIONS_PROFILE").is_some() {
        dhat::Profiler::builder().build()
    } else {
        dhat::Profiler::builder().testing().build()
    };
    println!("\nheap allocations per request, {CALLS} requests after {WARM_UP} of warm-up");
    println!("{:<18} {:>8} {:>10} {:>9} {:>10}", "scenario", "allocs", "bytes", "vs bare", "bytes");
    let http = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    print(&http.block_on(http_counts()));
    // Client and server on one thread: the count is the same on more, and nothing else runs.
    let grpc = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    print(&grpc.block_on(grpc_counts()));
}
