//! The floor of an HTTP idempotency middleware: the least any Tower middleware must do for a
//! new key, written straight, with none of the contract's other work.
//!
//! `floor` in `benches/layer.rs` is the fingerprint, the identity and one map insert, with no
//! HTTP around them. A middleware cannot stop there: it has to take the key out of the
//! request's headers, collect the request body (to fingerprint it, then hand it on), claim the
//! identity before the handler runs, call the handler, collect the response body and keep a
//! copy of the response's status, headers and body. [`HttpFloor`] does exactly that, in one
//! boxed future, against a `Mutex<HashMap>`; a key it has seen is answered from the map. It
//! has no key syntax beyond [`IdempotencyKey::new`], no scope source, no operation naming, no
//! context or handle for the handler, no deadlines, leases, retention, response classes,
//! problem answers, metrics or tracing: what the layer adds on top of it is what those cost.

#![allow(dead_code)] // Each benchmark takes the parts it needs.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower_idempotency::fingerprint::{Fingerprint, FingerprintSpec, fingerprint};
use tower_idempotency::{IdempotencyKey, RecordId, Scope};

/// What the map keeps of an identity: claimed, or answered.
enum Slot {
    Claimed(Fingerprint),
    Answered { fingerprint: Fingerprint, status: StatusCode, headers: HeaderMap, body: Bytes },
}

/// The straight-written middleware around `S`.
#[derive(Clone)]
pub struct HttpFloor<S> {
    inner: S,
    records: Arc<Mutex<HashMap<RecordId, Slot>>>,
    scope: Scope,
    spec: Arc<FingerprintSpec>,
}

impl<S> HttpFloor<S> {
    /// `inner` behind an empty map.
    pub fn new(inner: S) -> Self {
        let scope = Scope::new("bench");
        // The layer's shared scope is hashed once too.
        scope.digest();
        Self { inner, records: Arc::default(), scope, spec: Arc::new(FingerprintSpec::new()) }
    }
}

type Answer = Result<Response<Full<Bytes>>, Infallible>;

impl<S> tower::Service<Request<Full<Bytes>>> for HttpFloor<S>
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Answer> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (records, scope, spec) = (self.records.clone(), self.scope.clone(), self.spec.clone());
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let key = parts.headers.get("idempotency-key").and_then(|value| value.to_str().ok());
            let Some(key) = key.and_then(|key| IdempotencyKey::new(key).ok()) else {
                return Ok(status_only(StatusCode::BAD_REQUEST));
            };
            let id = RecordId::new(&scope, "POST /orders", &key);
            let body = body.collect().await?.to_bytes();
            let print = fingerprint(&parts.method, &parts.uri, &parts.headers, &body, &spec);
            {
                let mut records = records.lock().expect("records");
                match records.entry(id) {
                    std::collections::hash_map::Entry::Vacant(vacant) => {
                        vacant.insert(Slot::Claimed(print));
                    }
                    std::collections::hash_map::Entry::Occupied(occupied) => {
                        return Ok(existing(occupied.get(), &print));
                    }
                }
            }
            let response = inner.call(Request::from_parts(parts, Full::new(body))).await?;
            let (head, body) = response.into_parts();
            let body = body.collect().await?.to_bytes();
            let answered = Slot::Answered {
                fingerprint: print,
                status: head.status,
                headers: head.headers.clone(),
                body: Bytes::copy_from_slice(&body),
            };
            records.lock().expect("records").insert(id, answered);
            Ok(Response::from_parts(head, Full::new(body)))
        })
    }
}

/// The answer to a key the map has: its stored response, or a refusal.
fn existing(slot: &Slot, print: &Fingerprint) -> Response<Full<Bytes>> {
    match slot {
        Slot::Answered { fingerprint, status, headers, body } if fingerprint == print => {
            let mut response = Response::new(Full::new(body.clone()));
            *response.status_mut() = *status;
            *response.headers_mut() = headers.clone();
            response
        }
        Slot::Answered { .. } => status_only(StatusCode::UNPROCESSABLE_ENTITY),
        Slot::Claimed(_) => status_only(StatusCode::CONFLICT),
    }
}

fn status_only(status: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = status;
    response
}
