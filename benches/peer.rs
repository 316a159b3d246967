//! This crate side by side with `axum-idempotent` (0.6), the crate Rust users find first, on the
//! same trivial axum handler (`POST /orders`, a 256-byte JSON body, 201 with a small JSON
//! answer), in one run, in process (`tower::ServiceExt::oneshot` on the router: no sockets, so
//! what is measured is the middleware and its store):
//!
//! - `no layer`: the handler alone (the baseline of every ratio);
//! - `peer`: `axum-idempotent` keyed by `Idempotency-Key` (its `use_idempotency_key_header`),
//!   with the session layer it requires: `ruts` on its in-memory `MokaStore` and
//!   `tower-cookies`. It keeps answers in the caller's session, so every request carries a
//!   session cookie (one of `SESSIONS`, made before the run, the way its own tests make one);
//! - `memory`: this crate on `MemoryStore`;
//! - `fast path`: this crate's Redis fast path (`FastPath`) in front of `MemoryStore`, on a
//!   `redis-server` the benchmark starts on a free loopback port (or `REDIS_URL`).
//!
//! Each is measured for new keys (every request a new key) and replays (retries of
//! `SESSIONS` keys completed before the window; the handler provably does not run: the run
//! counts its executions). `CONCURRENCY` callers on a one-thread runtime; `ROUNDS` rounds take
//! the scenarios in turn, each on fresh stores, and the ratios to `no layer` are given as the
//! median and range of the per-round ratios.
//!
//! Then a test-like run (printed, not asserted): 64 identical requests released together by a
//! barrier against a handler that takes 50 ms, and how many times each setup executes it; with
//! the peer both as designed (one shared session cookie) and on a bearer-token API (an
//! `Authorization` header, no cookie), and what a reuse of the key with another body gets.
//!
//! Run with `cargo bench --bench peer --features axum,redis` (`redis-server` must be installed).

#[path = "support/json_order.rs"]
mod json_order;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use ruts::store::Ttl;
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, Session, SessionLayer};
use tower::ServiceExt;
use tower_cookies::CookieManagerLayer;
use tower_idempotency::{FastPath, IdempotencyLayer, MemoryStore, Scope};

const CONCURRENCY: usize = 16;
const ROUNDS: usize = 5;
const WARM_UP: Duration = Duration::from_millis(200);
const WINDOW: Duration = Duration::from_millis(1000);
/// Sessions the peer's requests are spread over (and keys the replay scenarios retry).
const SESSIONS: usize = 256;
/// The barrier run: identical requests released together, and the handler's duration.
const STORM: usize = 64;
const STORM_WORK: Duration = Duration::from_millis(50);
const TOKEN: &str = "Bearer tok_live_4eC39HqLyjWDarjtT1zdp7dc";

/// What the handler counts, and how long it works.
#[derive(Clone)]
struct Handler {
    executions: Arc<AtomicU64>,
    work: Duration,
}

async fn create_order(
    State(handler): State<Handler>,
    body: Bytes,
) -> (StatusCode, [(&'static str, &'static str); 2], String) {
    let n = handler.executions.fetch_add(1, Ordering::Relaxed);
    if !handler.work.is_zero() {
        tokio::time::sleep(handler.work).await;
    }
    let json = format!("{{\"order_id\":\"ord_{n}\",\"bytes\":{}}}", body.len());
    (StatusCode::CREATED, [("content-type", "application/json"), ("location", "/orders/ord")], json)
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    NoLayer,
    Peer,
    Memory,
    FastPath,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::NoLayer => "no layer",
            Kind::Peer => "peer",
            Kind::Memory => "memory",
            Kind::FastPath => "fast path",
        }
    }

    /// The header that marks a replayed answer.
    fn replay_header(self) -> &'static str {
        match self {
            Kind::Peer => "idempotency-replayed",
            _ => "idempotent-replayed",
        }
    }
}

/// One setup: its router, its handler's counter, and the session cookies it knows (the peer's).
#[derive(Clone)]
struct App {
    kind: Kind,
    router: Router,
    executions: Arc<AtomicU64>,
    cookies: Arc<Vec<String>>,
}

/// This crate's layer over `store`: scoped by the bearer token, one named operation.
fn ours<St: tower_idempotency::Store>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store).scope_with(scope_of).operation("orders.create")
}

/// This crate's scope: the bearer token (what a real API would take from its authentication).
fn scope_of(parts: &http::request::Parts) -> Option<Scope> {
    parts.headers.get(http::header::AUTHORIZATION)?.to_str().ok().map(Scope::new)
}

async fn app(kind: Kind, work: Duration, redis_url: &str, sessions: usize) -> App {
    let executions = Arc::new(AtomicU64::new(0));
    let handler = Handler { executions: executions.clone(), work };
    let route = post(create_order);
    let router = match kind {
        Kind::NoLayer => Router::new().route("/orders", route),
        Kind::Memory => Router::new().route("/orders", route.layer(ours(MemoryStore::new()))),
        Kind::FastPath => {
            let prefix = format!("tidem_peer_{}", std::process::id());
            let fast =
                FastPath::connect(MemoryStore::new(), redis_url).expect("redis url").prefix(&prefix).expect("prefix");
            Router::new().route("/orders", route.layer(ours(fast)))
        }
        Kind::Peer => {
            let store = Arc::new(MokaStore::builder().max_capacity(100_000).build());
            let options = IdempotentOptions::default().use_idempotency_key_header(Some("idempotency-key"), true);
            let cookie = CookieOptions::build().name("session").max_age(3600).path("/");
            Router::new()
                .route("/orders", route)
                // Where a session gets its first field, as the peer's own tests do.
                .route(
                    "/session",
                    post(|session: Session<MokaStore>| async move {
                        session
                            .set("user", &String::from("bench"), Ttl::new(3600).expect("ttl"), None)
                            .await
                            .expect("session");
                        "session"
                    }),
                )
                .layer(IdempotentLayer::<MokaStore>::new(options))
                .layer(SessionLayer::new(store).with_cookie_options(cookie))
                .layer(CookieManagerLayer::new())
        }
    };
    let router = router.with_state(handler);
    let mut cookies = Vec::new();
    if kind == Kind::Peer {
        for n in 0..sessions {
            // The peer refuses a request without a key, even on the session route.
            let request =
                Request::post("/session").header("idempotency-key", format!("session-{n}")).body(Body::empty());
            let response = router.clone().oneshot(request.expect("request")).await.expect("session");
            let set_cookie = response.headers().get(http::header::SET_COOKIE).expect("the session layer sets a cookie");
            let pair = set_cookie.to_str().expect("cookie").split(';').next().expect("cookie pair");
            cookies.push(pair.to_owned());
        }
    }
    App { kind, router, executions, cookies: Arc::new(cookies) }
}

/// Request `key` of this app: the same headers for every setup (a bearer token, and for the
/// peer the session cookie of the key's session).
fn request(app: &App, key: u64, body: &Bytes) -> Request<Body> {
    let mut request = Request::post("/orders")
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .header("authorization", TOKEN)
        .header("idempotency-key", format!("key-{key}"));
    if !app.cookies.is_empty() {
        request = request.header("cookie", &app.cookies[key as usize % app.cookies.len()]);
    }
    request.body(Body::from(body.clone())).expect("request")
}

/// `CONCURRENCY` callers for `window`; request `n` (counted through `counter`) has key
/// `key_of(n)`. Returns the requests answered. Every answer must be 201, and a replay must
/// say it is one.
async fn drive(
    app: &App,
    body: &Bytes,
    counter: &Arc<AtomicU64>,
    key_of: fn(u64) -> u64,
    replay: bool,
    window: Duration,
) -> u64 {
    let deadline = Instant::now() + window;
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let (app, body, counter) = (app.clone(), body.clone(), counter.clone());
        workers.push(tokio::spawn(async move {
            let mut done = 0;
            while Instant::now() < deadline {
                let key = key_of(counter.fetch_add(1, Ordering::Relaxed));
                let response = app.router.clone().oneshot(request(&app, key, &body)).await.expect("call");
                assert_eq!(response.status(), StatusCode::CREATED, "{}: every request must succeed", app.kind.name());
                let replayed = response.headers().contains_key(app.kind.replay_header());
                assert_eq!(replayed, replay, "{}: replayed is {replayed}", app.kind.name());
                response.into_body().collect().await.expect("body");
                done += 1;
            }
            done
        }));
    }
    let mut done = 0;
    for worker in workers {
        done += worker.await.expect("worker");
    }
    done
}

/// Throughput of one setup in one round: new keys, then replays of `SESSIONS` keys completed
/// just before (the handler must not run during the replay window).
async fn round(kind: Kind, redis_url: &str, body: &Bytes, counter: &Arc<AtomicU64>) -> (f64, f64) {
    let app = app(kind, Duration::ZERO, redis_url, SESSIONS).await;
    // Keys are numbered so that key k uses session k % SESSIONS.
    let fresh: fn(u64) -> u64 = |n| SESSIONS as u64 + n;
    drive(&app, body, counter, fresh, false, WARM_UP).await;
    let started = Instant::now();
    let new_keys = drive(&app, body, counter, fresh, false, WINDOW).await as f64 / started.elapsed().as_secs_f64();
    if kind == Kind::NoLayer {
        return (new_keys, new_keys);
    }
    let replayed: fn(u64) -> u64 = |n| n % SESSIONS as u64;
    let first = Arc::new(AtomicU64::new(0));
    for _ in 0..SESSIONS {
        let key = replayed(first.fetch_add(1, Ordering::Relaxed));
        let response = app.router.clone().oneshot(request(&app, key, body)).await.expect("first");
        assert_eq!(response.status(), StatusCode::CREATED);
    }
    let before = app.executions.load(Ordering::Relaxed);
    drive(&app, body, counter, replayed, true, WARM_UP).await;
    let started = Instant::now();
    let replays = drive(&app, body, counter, replayed, true, WINDOW).await as f64 / started.elapsed().as_secs_f64();
    assert_eq!(app.executions.load(Ordering::Relaxed), before, "{}: a replay ran the handler", kind.name());
    (new_keys, replays)
}

/// What the barrier run saw for one setup.
struct Storm {
    executions: u64,
    statuses: Vec<(u16, bool, usize)>,
    retry_executed: bool,
    other_body: String,
}

/// `STORM` identical requests released together (with `cookie` if given, else the bearer token
/// alone), then one more retry, then the key reused with another body.
async fn storm(kind: Kind, redis_url: &str, body: &Bytes, with_cookie: bool) -> Storm {
    // The peer's session, when `with_cookie`; without, the requests carry only the bearer token.
    let app = app(kind, STORM_WORK, redis_url, usize::from(with_cookie)).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(STORM));
    let mut tasks = Vec::new();
    for _ in 0..STORM {
        let (app, body, barrier) = (app.clone(), body.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let request = request(&app, 7, &body);
            barrier.wait().await;
            let response = app.router.clone().oneshot(request).await.expect("call");
            (response.status().as_u16(), response.headers().contains_key(app.kind.replay_header()))
        }));
    }
    let mut statuses: Vec<(u16, bool, usize)> = Vec::new();
    for task in tasks {
        let answer = task.await.expect("storm task");
        match statuses.iter_mut().find(|(status, replayed, _)| (*status, *replayed) == answer) {
            Some(seen) => seen.2 += 1,
            None => statuses.push((answer.0, answer.1, 1)),
        }
    }
    statuses.sort();
    let executions = app.executions.load(Ordering::Relaxed);
    app.router.clone().oneshot(request(&app, 7, body)).await.expect("retry");
    let retry_executed = app.executions.load(Ordering::Relaxed) > executions;
    let mut other = request(&app, 7, &Bytes::from_static(b"{\"sku\":\"SKU-999999\",\"quantity\":200}"));
    other.headers_mut().remove(http::header::CONTENT_LENGTH);
    let before = app.executions.load(Ordering::Relaxed);
    let answer = app.router.clone().oneshot(other).await.expect("other body");
    let other_body = match (
        answer.headers().contains_key(app.kind.replay_header()),
        app.executions.load(Ordering::Relaxed) > before,
    ) {
        (true, _) => format!("{} replayed", answer.status().as_u16()),
        (false, true) => format!("{} executed", answer.status().as_u16()),
        (false, false) => format!("{} refused", answer.status().as_u16()),
    };
    Storm { executions, statuses, retry_executed, other_body }
}

/// `REDIS_URL`, or a `redis-server` of our own on a free loopback port (killed at the end).
fn redis() -> (String, Option<Child>) {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return (url, None);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
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

fn median_and_range(mut ratios: Vec<f64>) -> String {
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let median = (ratios[(n - 1) / 2] + ratios[n / 2]) / 2.0;
    format!("{median:.2}x ({:.2}..{:.2})", ratios[0], ratios[n - 1])
}

fn main() {
    let (redis_url, mut redis_server) = redis();
    // One thread: the time per request is then this process's CPU per request (and Redis's
    // round trips, which the callers overlap), free of cross-thread wake-ups.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let body = json_order::body();
        let kinds = [Kind::NoLayer, Kind::Peer, Kind::Memory, Kind::FastPath];
        let counter = Arc::new(AtomicU64::new(0));
        let mut results: Vec<Vec<(f64, f64)>> = vec![Vec::new(); kinds.len()];
        for r in 0..ROUNDS {
            // Rotated, so that drift of a shared machine weighs on every setup alike.
            for i in 0..kinds.len() {
                let k = (i + r) % kinds.len();
                results[k].push(round(kinds[k], &redis_url, &body, &counter).await);
            }
        }

        println!(
            "\nPOST /orders, 256-byte JSON, in process, {CONCURRENCY} callers on 1 thread, {ROUNDS} rotated rounds of \
             {WINDOW:?} per scenario; ratios: median of the per-round ratios to `no layer` (range)"
        );
        println!(
            "{:<10} {:>12} {:>24} {:>10} {:>12} {:>24} {:>10}",
            "setup", "new keys/s", "vs no layer", "+µs/req", "replays/s", "vs no layer", "+µs/req"
        );
        let mean = |values: &[(f64, f64)], pick: fn(&(f64, f64)) -> f64| {
            values.iter().map(pick).sum::<f64>() / values.len() as f64
        };
        for (k, kind) in kinds.iter().enumerate() {
            let new_ratios = (0..ROUNDS).map(|r| results[k][r].0 / results[0][r].0).collect();
            let replay_ratios = (0..ROUNDS).map(|r| results[k][r].1 / results[0][r].0).collect();
            // The time one request adds to the handler's alone (one thread: its CPU time, but
            // for Redis's round trips), from the medians of the per-round differences.
            let added = |pick: fn(&(f64, f64)) -> f64| {
                let mut added: Vec<f64> =
                    (0..ROUNDS).map(|r| (1.0 / pick(&results[k][r]) - 1.0 / results[0][r].0) * 1e6).collect();
                added.sort_by(f64::total_cmp);
                format!("{:+.2}", (added[(ROUNDS - 1) / 2] + added[ROUNDS / 2]) / 2.0)
            };
            let (replay, replay_ratio, replay_added) = match kind {
                Kind::NoLayer => ("-".to_owned(), "-".to_owned(), "-".to_owned()),
                _ => (format!("{:.0}", mean(&results[k], |m| m.1)), median_and_range(replay_ratios), added(|m| m.1)),
            };
            println!(
                "{:<10} {:>12.0} {:>24} {:>10} {:>12} {:>24} {:>10}",
                kind.name(),
                mean(&results[k], |m| m.0),
                median_and_range(new_ratios),
                added(|m| m.0),
                replay,
                replay_ratio,
                replay_added
            );
        }

        println!(
            "\n{STORM} identical requests (same key, same body, same bearer token) released by a barrier; the handler \
             takes {STORM_WORK:?}"
        );
        println!(
            "{:<34} {:>10}  {:<44} {:>14} {:>16}",
            "setup", "executions", "answers (status, replayed: count)", "later retry", "other body"
        );
        let storms = [
            ("no layer", Kind::NoLayer, false),
            ("peer, one session cookie", Kind::Peer, true),
            ("peer, bearer token, no cookie", Kind::Peer, false),
            ("memory", Kind::Memory, false),
            ("fast path", Kind::FastPath, false),
        ];
        for (name, kind, with_cookie) in storms {
            let seen = storm(kind, &redis_url, &body, with_cookie).await;
            let answers: Vec<String> = seen
                .statuses
                .iter()
                .map(|(status, replayed, count)| {
                    format!("{status}{}: {count}", if *replayed { " replayed" } else { "" })
                })
                .collect();
            println!(
                "{name:<34} {:>10}  {:<44} {:>14} {:>16}",
                seen.executions,
                answers.join(", "),
                if seen.retry_executed { "executed" } else { "replayed" },
                seen.other_body
            );
        }
    });
    if let Some(server) = redis_server.as_mut() {
        let _ = server.kill();
        let _ = server.wait();
    }
}
