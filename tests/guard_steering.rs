//! A request that reaches a guarded route is guarded or refused, never passed through because
//! of something the client chose: its content type (gRPC or not, in any case, with
//! parameters), method-override headers, an empty or repeated key header. One test per way the
//! layer decides not to guard: the protocol (content type), the method, the optional key, and
//! the tonic adapter. (The rollout switch is the server's alone: nothing in a request reads it.)
#![cfg(feature = "axum")]

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, MemoryStore};

/// A handler that says whether the layer guarded it (as a handler written with
/// `Option<IdempotencyContext>` would run either way).
async fn handler(context: Option<IdempotencyContext>) -> String {
    format!("guarded={}", context.is_some())
}

fn app() -> Router {
    let layer = IdempotencyLayer::new(MemoryStore::new()).shared_scope("test");
    #[cfg(feature = "tonic")]
    let layer = layer.grpc_methods(["/pkg.Svc/Create"]);
    Router::new()
        .route("/orders", post(handler).layer(layer.clone()))
        .route("/optional", post(handler).layer(layer.key_required(false)))
}

/// Content types a client may send to a JSON route, hostile ones first.
const CONTENT_TYPES: &[Option<&str>] = &[
    Some("application/grpc"),
    Some("application/grpc+json"),
    Some("Application/GRPC+json; charset=utf-8"),
    Some("APPLICATION/GRPC;x=y"),
    Some("application/grpc+proto"),
    Some("application/grpc-web"),
    Some("application/grpc-web+proto"),
    Some("application/json"),
    Some("text/plain"),
    Some(""),
    None,
];

/// Headers some frameworks read to change the method; the layer must not.
const OVERRIDES: &[Option<(&str, &str)>] = &[
    None,
    Some(("x-http-method-override", "GET")),
    Some(("x-http-method", "GET")),
    Some(("x-method-override", "GET")),
    Some(("x-http-method-override", "OPTIONS")),
];

struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    body: String,
}

async fn send(
    app: &Router,
    path: &str,
    content_type: Option<&str>,
    header: Option<(&str, &str)>,
    keys: &[&str],
) -> Answer {
    let mut request = Request::post(path);
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    if let Some((name, value)) = header {
        request = request.header(name, value);
    }
    for key in keys {
        request = request.header("idempotency-key", *key);
    }
    let response = app.clone().oneshot(request.body(Body::from("{\"a\":1}")).unwrap()).await.unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        content_type: parts.headers.get("content-type").map(|v| v.to_str().unwrap().to_owned()),
        body: String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

fn assert_refused(answer: &Answer, status: StatusCode, code: &str, case: &str) {
    assert_eq!(answer.status, status, "{case}: {}", answer.body);
    assert_eq!(answer.content_type.as_deref(), Some("application/problem+json"), "{case}");
    assert!(answer.body.contains(&format!("\"code\":\"{code}\"")), "{case}: {}", answer.body);
}

#[tokio::test]
async fn no_content_type_or_override_header_takes_a_guarded_route_out_of_the_layer() {
    let app = app();
    for (n, content_type) in CONTENT_TYPES.iter().enumerate() {
        for (m, header) in OVERRIDES.iter().enumerate() {
            let case = format!("content type {content_type:?}, header {header:?}");
            let missing = send(&app, "/orders", *content_type, *header, &[]).await;
            assert_refused(&missing, StatusCode::BAD_REQUEST, "idempotency_key_missing", &case);

            let key = format!("k-{n}-{m}");
            let guarded = send(&app, "/orders", *content_type, *header, &[&key]).await;
            assert_eq!(guarded.status, StatusCode::OK, "{case}: {}", guarded.body);
            assert_eq!(guarded.body, "guarded=true", "{case}");
        }
    }
}

#[tokio::test]
async fn an_optional_key_is_optional_only_when_absent() {
    let app = app();
    for (n, content_type) in CONTENT_TYPES.iter().enumerate() {
        let case = format!("content type {content_type:?}");
        // No key at all: the route's documented choice, unguarded.
        let absent = send(&app, "/optional", *content_type, None, &[]).await;
        assert_eq!(absent.body, "guarded=false", "{case}");
        // A key header that is there but empty, blank, repeated or a list is refused, never
        // taken for "no key".
        for keys in [&[""][..], &["   "], &["a", "b"], &["a, b"]] {
            let answer = send(&app, "/optional", *content_type, None, keys).await;
            assert_refused(&answer, StatusCode::BAD_REQUEST, "idempotency_key_invalid", &format!("{case}, {keys:?}"));
        }
        let key = format!("opt-{n}");
        let guarded = send(&app, "/optional", *content_type, None, &[&key]).await;
        assert_eq!(guarded.body, "guarded=true", "{case}");
    }
}

#[tokio::test]
async fn a_guarded_route_takes_every_body_the_same_way_whatever_the_content_type() {
    // A duplicate under another content type is the same key with a different request: it is
    // refused, never executed as a fresh, unguarded request.
    let app = app();
    let first = send(&app, "/orders", Some("application/json"), None, &["same"]).await;
    assert_eq!(first.body, "guarded=true");
    let grpc = send(&app, "/orders", Some("application/grpc"), None, &["same"]).await;
    assert_refused(&grpc, StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused", "gRPC content type");
}

/// The tonic adapter: a named method is guarded whatever its content type; only a gRPC call to
/// an unnamed method passes through.
#[cfg(feature = "tonic")]
#[tokio::test]
async fn the_tonic_adapter_guards_a_named_method_whatever_its_content_type() {
    use bytes::Bytes;
    use http::Response;
    use http_body_util::Full;
    use tower_layer::Layer;

    let handler = tower::service_fn(|request: Request<tonic::body::Body>| async move {
        let guarded = request.extensions().get::<IdempotencyContext>().is_some();
        let mut response = Response::new(tonic::body::Body::new(Full::new(Bytes::new())));
        response.headers_mut().insert("grpc-status", "0".parse().unwrap());
        response.headers_mut().insert("x-guarded", guarded.to_string().parse().unwrap());
        Ok::<_, std::convert::Infallible>(response)
    });
    let service = IdempotencyLayer::new(MemoryStore::new())
        .shared_scope("test")
        .grpc_methods(["/pkg.Svc/Create"])
        .into_tonic()
        .layer(handler);
    let call = |path: &str, content_type: Option<&str>| {
        let mut request = Request::post(path);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request.body(tonic::body::Body::new(Full::new(Bytes::from_static(b"\0\0\0\0\0")))).unwrap()
    };
    for content_type in CONTENT_TYPES {
        let answer = service.clone().oneshot(call("/pkg.Svc/Create", *content_type)).await.unwrap();
        assert_eq!(answer.headers()["grpc-status"], "3", "{content_type:?}: refused, no key");
        assert_eq!(answer.headers()["idempotency-code"], "idempotency_key_missing", "{content_type:?}");
        assert!(answer.headers().get("x-guarded").is_none(), "{content_type:?}: the handler did not run");
    }
    let other = service.clone().oneshot(call("/pkg.Svc/Read", Some("application/grpc"))).await.unwrap();
    assert_eq!(other.headers()["x-guarded"], "false", "an unnamed gRPC method passes through");
}

/// A key with a control character never reaches the layer: hyper refuses the request with a
/// bare 400 (documented in the contract, §1). A tab, which HTTP allows, reaches the layer and
/// gets its problem+json.
#[tokio::test]
async fn a_control_character_in_the_key_gets_hypers_bare_400_before_the_layer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app()).await });
    let raw = |key: &[u8]| {
        let mut request = b"POST /orders HTTP/1.1\r\nhost: test\r\nconnection: close\r\n".to_vec();
        request.extend_from_slice(b"content-type: application/json\r\ncontent-length: 2\r\nidempotency-key: ");
        request.extend_from_slice(key);
        request.extend_from_slice(b"\r\n\r\n{}");
        request
    };
    for (key, layer_answers) in
        [(&b"a\x01b"[..], false), (b"a\x00b", false), (b"a\x7fb", false), (b"a\x1bb", false), (b"\"a\tb\"", true)]
    {
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream.write_all(&raw(key)).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{key:?}: {answer}");
        assert_eq!(answer.contains("idempotency_key_invalid"), layer_answers, "{key:?}: {answer}");
        if !layer_answers {
            assert!(!answer.contains("problem+json"), "{key:?}: hyper's own answer: {answer}");
        }
    }
    server.abort();
}
