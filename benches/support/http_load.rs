//! The load generator the HTTP benchmarks share: keep-alive clients posting orders to a server
//! for a fixed window, each request's latency recorded.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Names the idempotency key of request number `n`.
pub type KeyOf = Arc<dyn Fn(u64) -> String + Send + Sync>;

/// `concurrency` keep-alive clients posting `body` to `http://{addr}/orders` until `window`
/// ends. Request `n` (counted across calls through `counter`) carries the key `key_of(n)`.
/// Every answer must be 201. Returns the latencies, sorted.
pub async fn post_orders(
    name: &str,
    addr: std::net::SocketAddr,
    concurrency: usize,
    body: &'static str,
    counter: Arc<AtomicU64>,
    key_of: KeyOf,
    window: Duration,
) -> Vec<Duration> {
    let client: Client<_, String> = Client::builder(TokioExecutor::new()).build_http();
    let deadline = Instant::now() + window;
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, counter, key_of, name) = (client.clone(), counter.clone(), key_of.clone(), name.to_owned());
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while Instant::now() < deadline {
                let key = key_of(counter.fetch_add(1, Ordering::Relaxed));
                let request = Request::post(format!("http://{addr}/orders"))
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .body(body.to_owned())
                    .expect("request");
                let started = Instant::now();
                let response = client.request(request).await.expect("request");
                let status = response.status();
                response.into_body().collect().await.expect("body");
                assert_eq!(status, StatusCode::CREATED, "{name}: every request must succeed");
                latencies.push(started.elapsed());
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for worker in workers {
        all.extend(worker.await.expect("load worker"));
    }
    all.sort();
    all
}

/// The `q` quantile of sorted latencies.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}
