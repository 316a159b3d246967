//! Serving HTTP/1.1, where a response marked [`DropConnection`] is not sent: the connection is
//! closed instead, as if the sink had crashed after processing.

use std::convert::Infallible;

use axum::Router;
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tower::ServiceExt;
use tower_idempotency::BoxError;

use super::app::DropConnection;

/// The error that makes hyper close a connection without answering.
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped on purpose (SINK_AMBIGUOUS_RATE)")
    }
}

impl std::error::Error for Dropped {}

/// Accepts connections until Ctrl-C or SIGTERM.
pub(crate) async fn serve(listener: TcpListener, router: Router) -> Result<(), BoxError> {
    let mut stop = std::pin::pin!(stop_signal());
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            () = &mut stop => return Ok(()),
        };
        let router = router.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let router = router.clone();
                async move {
                    let response =
                        router.oneshot(request.map(Body::new)).await.unwrap_or_else(|never: Infallible| match never {});
                    if response.extensions().get::<DropConnection>().is_some() { Err(Dropped) } else { Ok(response) }
                }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

async fn stop_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
