//! The HTTP contract suite: the contract as a client sees it, through the real layer around a
//! reference application, [`TestApp`], that counts its executions.
//!
//! The layer under test must take its scope from the [`Scope`] request extension (the
//! default); [`Settings::apply`] sets that, the in-flight wait and the body limit.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tokio::sync::{Barrier, Semaphore};
use tower_layer::Layer;
use tower_service::Service;

use crate::IdempotencyLayer;
use crate::key::Scope;
use crate::outcome::OutcomeClass;
use crate::store::{Retention, Store};

/// The reference application. Routes (any method):
///
/// - `/create`: 201, JSON naming the execution, `Location`, `ETag`, and two headers that must
///   never be replayed (`Set-Cookie`, `X-Internal`);
/// - `/reject`: 402 marked [`OutcomeClass::Reject`] (a business rejection to store);
/// - `/fail`: 500 (released by the default rule);
/// - `/slow`: 201 once [`TestApp::open_gate`] lets it through;
/// - `/unknown`: 504 marked [`OutcomeClass::Unknown`] (a downstream call that timed out after it
///   was sent);
/// - `/large`: 201 with a 64 KiB body;
/// - `/sleep?ms=N`: 201 after sleeping `N` milliseconds.
#[derive(Clone, Default)]
pub struct TestApp {
    executions: Arc<Mutex<HashMap<String, usize>>>,
    total: Arc<AtomicUsize>,
    gate: Arc<GateInner>,
}

/// The `/slow` gate: permits to pass, and how many requests have reached it.
struct GateInner(Semaphore, AtomicUsize);

impl Default for GateInner {
    fn default() -> Self {
        Self(Semaphore::new(0), AtomicUsize::new(0))
    }
}

impl TestApp {
    /// A fresh application with no executions.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many times the handler ran for `path`.
    pub fn executions(&self, path: &str) -> usize {
        self.executions.lock().unwrap_or_else(|p| p.into_inner()).get(path).copied().unwrap_or(0)
    }

    /// How many times the handler ran in all.
    pub fn total_executions(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    /// Lets `n` waiting `/slow` requests finish.
    pub fn open_gate(&self, n: usize) {
        self.gate.0.add_permits(n);
    }

    /// Waits (up to a minute) until `n` requests have reached the `/slow` gate: the handler is
    /// running, so the request holds its claim.
    pub async fn wait_at_gate(&self, n: usize) {
        for _ in 0..6000 {
            if self.gate.1.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{n} request(s) never reached the /slow handler");
    }

    fn record(&self, path: &str) -> usize {
        self.total.fetch_add(1, Ordering::SeqCst);
        let mut executions = self.executions.lock().unwrap_or_else(|p| p.into_inner());
        let count = executions.entry(path.to_owned()).or_default();
        *count += 1;
        self.total.load(Ordering::SeqCst)
    }

    async fn handle(self, request: Request<Full<Bytes>>) -> Response<Full<Bytes>> {
        let path = request.uri().path().to_owned();
        if path == "/slow" {
            self.gate.1.fetch_add(1, Ordering::SeqCst);
            if let Ok(permit) = self.gate.0.acquire().await {
                permit.forget();
            }
        }
        if path == "/sleep" {
            let ms = request.uri().query().and_then(|q| q.strip_prefix("ms=")).and_then(|ms| ms.parse().ok());
            tokio::time::sleep(Duration::from_millis(ms.unwrap_or(0))).await;
        }
        let body = request.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let execution = self.record(&path);
        let json = format!("{{\"execution\":{execution},\"path\":\"{path}\",\"request_bytes\":{}}}", body.len());
        let mut response = Response::new(Full::new(Bytes::from(json)));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        match path.as_str() {
            "/reject" => {
                *response.status_mut() = StatusCode::PAYMENT_REQUIRED;
                response.extensions_mut().insert(OutcomeClass::Reject);
            }
            "/fail" => *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR,
            "/unknown" => {
                *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
                response.extensions_mut().insert(OutcomeClass::Unknown);
            }
            "/large" => {
                *response.status_mut() = StatusCode::CREATED;
                *response.body_mut() = Full::new(Bytes::from(vec![b'x'; 64 * 1024]));
            }
            _ => {
                *response.status_mut() = StatusCode::CREATED;
                let headers = response.headers_mut();
                headers.insert(
                    header::LOCATION,
                    HeaderValue::from_str(&format!("/things/{execution}")).expect("location"),
                );
                headers.insert(header::ETAG, HeaderValue::from_str(&format!("\"v{execution}\"")).expect("etag"));
                headers.insert(header::SET_COOKIE, HeaderValue::from_static("session=secret; HttpOnly"));
                headers.insert("x-internal", HeaderValue::from_static("not-for-replay"));
            }
        }
        response
    }
}

impl Service<Request<Full<Bytes>>> for TestApp {
    type Response = Response<Full<Bytes>>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let app = self.clone();
        Box::pin(async move { Ok(app.handle(request).await) })
    }
}

/// What a case asks of the layer under test.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The bounded wait for in-flight duplicates.
    pub in_flight_wait: Duration,
    /// The request body limit.
    pub max_request_body: usize,
    /// The retention, if the case needs its own.
    pub retention: Option<Retention>,
    /// The lease of a leased claim, if the case needs its own.
    pub lease: Option<Duration>,
    /// The stored response's limit, if the case needs its own.
    pub max_response_body: Option<usize>,
    /// The status of a reused key, if the case needs its own.
    pub mismatch_status: Option<StatusCode>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            in_flight_wait: Duration::from_secs(10),
            max_request_body: 64 * 1024,
            retention: None,
            lease: None,
            max_response_body: None,
            mismatch_status: None,
        }
    }
}

impl Settings {
    /// Applies these settings to a layer (and makes it read the scope from the extension).
    pub fn apply<St: Store>(&self, layer: IdempotencyLayer<St>) -> IdempotencyLayer<St> {
        let mut layer = layer
            .scope_with(|parts| parts.extensions.get::<Scope>().cloned())
            .in_flight_wait(self.in_flight_wait)
            .max_request_body(self.max_request_body);
        if let Some(retention) = self.retention {
            layer = layer.retention(retention);
        }
        if let Some(lease) = self.lease {
            layer = layer.lease(lease);
        }
        if let Some(limit) = self.max_response_body {
            layer = layer.max_response_body(limit);
        }
        if let Some(status) = self.mismatch_status {
            layer = layer.mismatch_status(status);
        }
        layer
    }
}

/// Wraps `app` in `layer` (what the suite macro calls).
pub fn wrap<St: Store>(layer: &IdempotencyLayer<St>, app: TestApp) -> crate::IdempotencyService<TestApp, St> {
    layer.layer(app)
}

/// An answer as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body bytes.
    pub body: Bytes,
}

impl Answer {
    /// Whether the answer carries `Idempotent-Replayed: true`.
    pub fn replayed(&self) -> bool {
        self.headers.get(crate::REPLAYED_HEADER).is_some_and(|v| v == "true")
    }

    /// The problem+json `code`, if the answer is a problem.
    pub fn problem_code(&self) -> Option<String> {
        if self.headers.get(header::CONTENT_TYPE)? != "application/problem+json" {
            return None;
        }
        let text = std::str::from_utf8(&self.body).ok()?;
        let start = text.find("\"code\":\"")? + 8;
        let end = text[start..].find('"')?;
        Some(text[start..start + end].to_owned())
    }
}

/// A request the suite sends.
#[derive(Debug, Clone)]
pub struct Call {
    method: Method,
    uri: String,
    scope: Option<&'static str>,
    keys: Vec<String>,
    body: Bytes,
    content_type: &'static str,
    declare_length: bool,
}

impl Call {
    /// A POST to `uri` by `tenant-a` with `key` and a small JSON body.
    pub fn post(uri: &str, key: &str) -> Self {
        Self {
            method: Method::POST,
            uri: uri.to_owned(),
            scope: Some("tenant-a"),
            keys: vec![key.to_owned()],
            body: Bytes::from_static(b"{\"sku\":\"A-1\",\"quantity\":2,\"amount_minor\":1999}"),
            content_type: "application/json",
            declare_length: true,
        }
    }

    /// Another method.
    pub fn method(mut self, method: Method) -> Self {
        self.method = method;
        self
    }

    /// Another scope.
    pub fn scope(mut self, scope: &'static str) -> Self {
        self.scope = Some(scope);
        self
    }

    /// These raw `Idempotency-Key` field values (none, one, or several fields).
    pub fn keys(mut self, keys: &[&str]) -> Self {
        self.keys = keys.iter().map(|k| (*k).to_owned()).collect();
        self
    }

    /// Another body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// Another `Content-Type` value (default `application/json`).
    pub fn content_type(mut self, content_type: &'static str) -> Self {
        self.content_type = content_type;
        self
    }

    /// Leaves `Content-Length` out, so the limit must be enforced while reading.
    pub fn without_content_length(mut self) -> Self {
        self.declare_length = false;
        self
    }

    fn build(&self) -> Request<Full<Bytes>> {
        let mut request = Request::builder().method(self.method.clone()).uri(&self.uri);
        for key in &self.keys {
            request = request.header("idempotency-key", key.as_str());
        }
        request = request.header(header::CONTENT_TYPE, self.content_type);
        if self.declare_length {
            request = request.header(header::CONTENT_LENGTH, self.body.len());
        }
        let mut request = request.body(Full::new(self.body.clone())).expect("a valid request");
        if let Some(scope) = self.scope {
            request.extensions_mut().insert(Scope::new(scope));
        }
        request
    }
}

/// A service the suite can drive: any cloneable tower service over `Request<Full<Bytes>>`
/// whose answers can be read in full. Implemented for every such service.
pub trait ServiceUnderTest: Clone + Send + Sync + 'static {
    /// Sends one request and reads the whole answer.
    fn answer(&self, request: Request<Full<Bytes>>) -> impl Future<Output = Answer> + Send;
}

impl<Svc, B> ServiceUnderTest for Svc
where
    Svc: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + Sync + 'static,
    Svc::Future: Send,
    Svc::Error: Debug,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Debug,
{
    async fn answer(&self, request: Request<Full<Bytes>>) -> Answer {
        let mut service = self.clone();
        poll_fn(|cx| service.poll_ready(cx)).await.expect("service ready");
        let response = service.call(request).await.expect("the service answered");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("the response body").to_bytes();
        Answer { status: parts.status, headers: parts.headers, body }
    }
}

/// Builds the service under test for each case.
pub struct Harness<F> {
    wrap: F,
}

impl<F, Svc> Harness<F>
where
    F: Fn(TestApp, Settings) -> Svc,
    Svc: ServiceUnderTest,
{
    /// A harness from a function that wraps the reference application in the layer under test.
    pub fn new(wrap: F) -> Self {
        Self { wrap }
    }

    /// A fresh application and the service under test around it.
    pub fn build(&self, settings: Settings) -> (TestApp, Client<Svc>) {
        let app = TestApp::new();
        let service = (self.wrap)(app.clone(), settings);
        (app, Client { service })
    }
}

/// Sends [`Call`]s to the service under test.
#[derive(Clone)]
pub struct Client<Svc> {
    service: Svc,
}

impl<Svc: ServiceUnderTest> Client<Svc> {
    /// Sends one call and reads the whole answer.
    pub async fn send(&self, call: &Call) -> Answer {
        self.service.answer(call.build()).await
    }
}

fn unique_key(label: &str) -> String {
    crate::testkit::store::fresh_id(label).to_hex()
}

fn assert_problem(answer: &Answer, status: u16, code: &str) {
    assert_eq!(answer.status.as_u16(), status, "expected {status} {code}, got {answer:?}");
    assert_eq!(answer.problem_code().as_deref(), Some(code), "expected problem code {code}, got {answer:?}");
}

macro_rules! case {
    ($(#[$doc:meta])* $name:ident($harness:ident) $body:block) => {
        $(#[$doc])*
        pub async fn $name<F, Svc>($harness: Harness<F>)
        where
            F: Fn(TestApp, Settings) -> Svc,
            Svc: ServiceUnderTest,
        $body
    };
}

case! {
    /// The first request gets the handler's own answer, headers and all.
    first_request_gets_the_handler_response(harness) {
        let (app, client) = harness.build(Settings::default());
        let answer = client.send(&Call::post("/create", &unique_key("first"))).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed(), "a first execution is not a replay");
        assert!(answer.headers.contains_key(header::SET_COOKIE), "the first answer is the handler's own, cookies included");
        assert_eq!(app.executions("/create"), 1);
    }
}

case! {
    /// A retry with the same key and request replays status, stored headers and body byte for
    /// byte, marked `Idempotent-Replayed: true`, and the handler does not run again.
    retry_replays_byte_for_byte(harness) {
        let (app, client) = harness.build(Settings::default());
        let call = Call::post("/create", &unique_key("replay"));
        let first = client.send(&call).await;
        let retry = client.send(&call).await;
        assert!(retry.replayed(), "the retry must be marked as replayed: {retry:?}");
        assert_eq!(retry.status, first.status);
        assert_eq!(retry.body, first.body, "the replayed body must be byte for byte the first");
        for name in [header::LOCATION, header::ETAG, header::CONTENT_TYPE] {
            assert_eq!(retry.headers.get(&name), first.headers.get(&name), "header {name} must be replayed");
        }
        assert_eq!(app.executions("/create"), 1, "the handler must run once");
    }
}

case! {
    /// A replay carries only allow-listed headers: never cookies, nor unlisted ones.
    replay_keeps_only_allow_listed_headers(harness) {
        let (_app, client) = harness.build(Settings::default());
        let call = Call::post("/create", &unique_key("headers"));
        let first = client.send(&call).await;
        assert!(first.headers.contains_key("x-internal"));
        let retry = client.send(&call).await;
        assert!(retry.replayed());
        assert!(!retry.headers.contains_key(header::SET_COOKIE), "set-cookie must never be replayed");
        assert!(!retry.headers.contains_key("x-internal"), "unlisted headers must not be replayed");
    }
}

case! {
    /// The same key with a different body is refused, and the handler does not run again.
    key_reused_with_a_different_body_is_refused(harness) {
        let (app, client) = harness.build(Settings::default());
        let key = unique_key("mismatch");
        client.send(&Call::post("/create", &key)).await;
        let other = client.send(&Call::post("/create", &key).body(&b"{\"sku\":\"A-1\",\"quantity\":3,\"amount_minor\":1999}"[..])).await;
        assert_problem(&other, 422, "idempotency_key_reused");
        assert_eq!(app.executions("/create"), 1);
    }
}

case! {
    /// The same key with a different query string is a different request.
    key_reused_with_a_different_query_is_refused(harness) {
        let (app, client) = harness.build(Settings::default());
        let key = unique_key("query");
        client.send(&Call::post("/create?a=1&b=2", &key)).await;
        let same = client.send(&Call::post("/create?b=2&a=1", &key)).await;
        assert!(same.replayed(), "query pairs in another order are the same request");
        let other = client.send(&Call::post("/create?a=1&b=3", &key)).await;
        assert_problem(&other, 422, "idempotency_key_reused");
        assert_eq!(app.executions("/create"), 1);
    }
}

case! {
    /// JSON with members in another order, other whitespace and other number spellings is the
    /// same request, and replays.
    reordered_json_members_are_the_same_request(harness) {
        let (app, client) = harness.build(Settings::default());
        let key = unique_key("canonical");
        client.send(&Call::post("/create", &key)).await;
        let reordered = client
            .send(&Call::post("/create", &key).body(&b"{ \"amount_minor\": 1999.0, \"quantity\": 2e0, \"sku\": \"A-\\u0031\" }"[..]))
            .await;
        assert!(reordered.replayed(), "an equivalent JSON body must replay: {reordered:?}");
        assert_eq!(app.executions("/create"), 1);
    }
}

case! {
    /// A guarded request without a key is refused before the handler runs.
    missing_key_is_refused(harness) {
        let (app, client) = harness.build(Settings::default());
        let answer = client.send(&Call::post("/create", "unused").keys(&[])).await;
        assert_problem(&answer, 400, "idempotency_key_missing");
        assert_eq!(app.total_executions(), 0);
    }
}

case! {
    /// Malformed keys are refused before the handler runs: empty, too long, a list, two
    /// fields, non-visible characters, a parameterised or unterminated string.
    invalid_keys_are_refused(harness) {
        let (app, client) = harness.build(Settings::default());
        let long = "k".repeat(256);
        let cases: [&[&str]; 8] = [
            &[""], &["\"\""], &[long.as_str()], &["\"a\", \"b\""], &["a", "b"], &["\"a b\""], &["\"a\";p=1"], &["\"open"],
        ];
        for keys in cases {
            let answer = client.send(&Call::post("/create", "unused").keys(keys)).await;
            assert_problem(&answer, 400, "idempotency_key_invalid");
        }
        assert_eq!(app.total_executions(), 0, "no invalid key may reach the handler");
    }
}

case! {
    /// Methods the layer does not guard pass through untouched: no replay, every call runs.
    unguarded_methods_pass_through(harness) {
        let (app, client) = harness.build(Settings::default());
        let call = Call::post("/create", &unique_key("get")).method(Method::GET);
        let first = client.send(&call).await;
        let second = client.send(&call).await;
        assert!(!first.replayed() && !second.replayed());
        assert_eq!(app.executions("/create"), 2);
    }
}

case! {
    /// No content type takes a guarded request out of the layer: with a gRPC content type (in
    /// any case, with parameters) and no key, a guarded POST is refused, never run.
    content_type_never_skips_the_layer(harness) {
        let (app, client) = harness.build(Settings::default());
        for content_type in
            ["application/grpc", "application/grpc+json", "Application/GRPC+json; charset=utf-8", "application/grpc-web"]
        {
            let answer = client.send(&Call::post("/create", "unused").keys(&[]).content_type(content_type)).await;
            assert_problem(&answer, 400, "idempotency_key_missing");
        }
        assert_eq!(app.executions("/create"), 0);
    }
}

case! {
    /// JSON is UTF-8 and charset names are case-insensitive: a retry that adds
    /// `charset=utf-8`, in any case, is the same request and replays.
    json_charset_parameter_is_the_same_request(harness) {
        let (app, client) = harness.build(Settings::default());
        let key = unique_key("charset");
        let first = client.send(&Call::post("/create", &key)).await;
        for content_type in ["application/json; charset=utf-8", "application/json;charset=UTF-8"] {
            let retry = client.send(&Call::post("/create", &key).content_type(content_type)).await;
            assert!(retry.replayed(), "{content_type}: {retry:?}");
            assert_eq!(retry.body, first.body);
        }
        assert_eq!(app.executions("/create"), 1);
    }
}

case! {
    /// A duplicate of a request still in flight gets 409 with `Retry-After` after the bounded
    /// wait; once the first finishes, a retry replays it.
    in_flight_duplicate_gets_409_with_retry_after(harness) {
        let settings = Settings { in_flight_wait: Duration::from_millis(200), ..Settings::default() };
        let (app, client) = harness.build(settings);
        let call = Call::post("/slow", &unique_key("inflight"));
        let first = tokio::spawn({
            let (client, call) = (client.clone(), call.clone());
            async move { client.send(&call).await }
        });
        // The first request holds its claim once its handler is running.
        app.wait_at_gate(1).await;
        let duplicate = client.send(&call).await;
        assert_problem(&duplicate, 409, "idempotency_request_in_flight");
        assert!(duplicate.headers.contains_key(header::RETRY_AFTER), "409 in flight needs Retry-After");
        app.open_gate(1);
        let first = first.await.expect("first request");
        assert_eq!(first.status, StatusCode::CREATED);
        let retry = client.send(&call).await;
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        assert_eq!(app.executions("/slow"), 1);
    }
}

case! {
    /// A duplicate that arrives while the first request runs waits for it and gets the replay.
    waiting_duplicate_gets_the_replay(harness) {
        let (app, client) = harness.build(Settings::default());
        let call = Call::post("/slow", &unique_key("waiting"));
        let first = tokio::spawn({
            let (client, call) = (client.clone(), call.clone());
            async move { client.send(&call).await }
        });
        app.wait_at_gate(1).await;
        let duplicate = tokio::spawn({
            let (client, call) = (client.clone(), call.clone());
            async move { client.send(&call).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        app.open_gate(1);
        let first = first.await.expect("first");
        let duplicate = duplicate.await.expect("duplicate");
        assert!(duplicate.replayed(), "the waiting duplicate must get the replay: {duplicate:?}");
        assert_eq!(duplicate.body, first.body);
        assert_eq!(app.executions("/slow"), 1);
    }
}

case! {
    /// A failure released by the default rule (5xx) stores nothing: the retry executes afresh.
    released_failure_executes_again(harness) {
        let (app, client) = harness.build(Settings::default());
        let call = Call::post("/fail", &unique_key("release"));
        assert_eq!(client.send(&call).await.status, StatusCode::INTERNAL_SERVER_ERROR);
        let retry = client.send(&call).await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!retry.replayed());
        assert_eq!(app.executions("/fail"), 2);
    }
}

case! {
    /// A business rejection the handler marks as a stored failure is replayed, not re-run.
    stored_failure_is_replayed(harness) {
        let (app, client) = harness.build(Settings::default());
        let call = Call::post("/reject", &unique_key("failure"));
        let first = client.send(&call).await;
        assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED);
        let retry = client.send(&call).await;
        assert!(retry.replayed());
        assert_eq!((retry.status, retry.body), (first.status, first.body));
        assert_eq!(app.executions("/reject"), 1);
    }
}

case! {
    /// The same key in two scopes is two requests: one tenant never sees another's answer.
    scopes_are_isolated(harness) {
        let (app, client) = harness.build(Settings::default());
        let key = unique_key("scopes");
        let a = client.send(&Call::post("/create", &key).scope("tenant-a")).await;
        let b = client.send(&Call::post("/create", &key).scope("tenant-b")).await;
        assert!(!b.replayed(), "tenant-b must not get tenant-a's answer");
        assert_ne!(a.body, b.body);
        assert_eq!(app.executions("/create"), 2);
    }
}

case! {
    /// The same key on two operations is two requests.
    operations_are_isolated(harness) {
        let (app, client) = harness.build(Settings::default());
        let key = unique_key("operations");
        client.send(&Call::post("/create", &key)).await;
        let other = client.send(&Call::post("/reject", &key)).await;
        assert!(!other.replayed());
        assert_eq!(app.total_executions(), 2);
    }
}

case! {
    /// A body over the limit is refused with 413, whether or not `Content-Length` declares it.
    body_over_the_limit_is_refused(harness) {
        let settings = Settings { max_request_body: 1024, ..Settings::default() };
        let (app, client) = harness.build(settings);
        let big = vec![b' '; 4096];
        let declared = client.send(&Call::post("/create", &unique_key("big")).body(big.clone())).await;
        assert_problem(&declared, 413, "idempotency_body_too_large");
        let streamed = client.send(&Call::post("/create", &unique_key("big")).body(big).without_content_length()).await;
        assert_problem(&streamed, 413, "idempotency_body_too_large");
        assert_eq!(app.total_executions(), 0);
    }
}

case! {
    /// 64 identical requests released together run the handler once; every other answer is the
    /// identical replay or a 409.
    concurrent_duplicates_run_the_handler_once(harness) {
        const CONTENDERS: usize = 64;
        let (app, client) = harness.build(Settings::default());
        let call = Call::post("/create", &unique_key("storm"));
        let barrier = Arc::new(Barrier::new(CONTENDERS));
        let mut tasks = Vec::new();
        for _ in 0..CONTENDERS {
            let (client, call, barrier) = (client.clone(), call.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                client.send(&call).await
            }));
        }
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.expect("contender"));
        }
        assert_eq!(app.executions("/create"), 1, "the handler must run exactly once");
        let executed: Vec<_> = answers.iter().filter(|a| a.status == StatusCode::CREATED && !a.replayed()).collect();
        assert_eq!(executed.len(), 1, "exactly one answer is the execution");
        for answer in &answers {
            if answer.replayed() {
                assert_eq!(answer.body, executed[0].body, "every replay is identical");
            } else if answer.status != StatusCode::CREATED {
                assert_problem(answer, 409, "idempotency_request_in_flight");
            }
        }
    }
}

case! {
    /// A retry after the key's retention gets 422 `idempotency_key_expired` (the tombstone), not
    /// a second execution.
    key_past_its_retention_is_expired(harness) {
        let retention = Retention { response: Duration::from_millis(300), tombstone: Duration::from_secs(60), ..Retention::default() };
        let (app, client) = harness.build(Settings { retention: Some(retention), ..Settings::default() });
        let call = Call::post("/create", &unique_key("expired"));
        assert_eq!(client.send(&call).await.status, StatusCode::CREATED);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let late = client.send(&call).await;
        assert_problem(&late, 422, "idempotency_key_expired");
        assert_eq!(app.executions("/create"), 1, "an expired key never executes again");
    }
}

case! {
    /// A handler that marks its outcome unknown still answers its client; retries get 409
    /// `idempotency_outcome_unknown` with `Retry-After`, and the handler does not run again.
    unknown_outcome_is_answered_then_refused(harness) {
        let (app, client) = harness.build(Settings::default());
        let call = Call::post("/unknown", &unique_key("unknown"));
        let first = client.send(&call).await;
        assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT, "the handler's own answer reaches the client");
        assert!(!first.replayed());
        let retry = client.send(&call).await;
        assert_problem(&retry, 409, "idempotency_outcome_unknown");
        assert!(retry.headers.contains_key(header::RETRY_AFTER), "{retry:?}");
        assert_eq!(app.executions("/unknown"), 1);
    }
}

case! {
    /// A response too large to store is refused with 500 `idempotency_response_too_large`;
    /// nothing was kept, so the retry executes again (and is refused the same way).
    response_too_large_to_store_is_500(harness) {
        let (app, client) = harness.build(Settings { max_response_body: Some(1024), ..Settings::default() });
        let call = Call::post("/large", &unique_key("large"));
        assert_problem(&client.send(&call).await, 500, "idempotency_response_too_large");
        assert_problem(&client.send(&call).await, 500, "idempotency_response_too_large");
        assert_eq!(app.executions("/large"), 2, "nothing was stored: the retry executed afresh");
    }
}

case! {
    /// `mismatch_status(409)` answers a reused key with 409 instead of 422.
    mismatch_status_409_is_honoured(harness) {
        let (app, client) = harness.build(Settings { mismatch_status: Some(StatusCode::CONFLICT), ..Settings::default() });
        let key = unique_key("mismatch-409");
        client.send(&Call::post("/create", &key)).await;
        let other = client.send(&Call::post("/create", &key).body(&b"{\"sku\":\"B-2\"}"[..])).await;
        assert_problem(&other, 409, "idempotency_key_reused");
        assert_eq!(app.executions("/create"), 1);
    }
}

case! {
    /// A leased handler that runs three lease lengths keeps its claim (the heartbeat renews
    /// it): a duplicate sent after two lease lengths waits for it instead of finding a dead
    /// lease, the first request completes, and the duplicate replays its answer.
    long_handler_keeps_its_lease_and_replays(harness) {
        let lease = Duration::from_millis(300);
        let (app, client) = harness.build(Settings { lease: Some(lease), ..Settings::default() });
        let call = Call::post("/sleep?ms=900", &unique_key("heartbeat"));
        let first = tokio::spawn({
            let (client, call) = (client.clone(), call.clone());
            async move { client.send(&call).await }
        });
        tokio::time::sleep(lease * 2).await;
        let duplicate = client.send(&call).await;
        let first = first.await.expect("the first request");
        assert_eq!(first.status, StatusCode::CREATED, "the handler's claim was never lost: {first:?}");
        assert!(!first.replayed());
        assert_eq!(duplicate.status, StatusCode::CREATED, "the duplicate replays: {duplicate:?}");
        assert!(duplicate.replayed());
        assert_eq!(duplicate.body, first.body);
        assert_eq!(app.executions("/sleep"), 1);
    }
}
