//! Serving: HTTP/1.1 and HTTP/2 (prior knowledge, h2c) on one listener, with limits on what one
//! connection can hold, until the shutdown signal; then in-flight requests finish.
//!
//! HTTP/2 limits (hyper's defaults are generous; a client can open many streams on one
//! connection and make each hold a buffered body):
//!
//! | setting | value |
//! |---|---|
//! | concurrent streams per connection | 32 |
//! | header list size | 16 KiB |
//! | streams reset by the client before they are answered | 20 |
//! | streams reset by the server for the client's errors | 100 |
//! | flow-control window: per stream / per connection | 256 KiB / 1 MiB |
//! | send buffer per stream | 256 KiB |
//! | keep-alive ping | every 20 s, closed when not answered within 20 s |
//!
//! HTTP/1.1: the request head must arrive within 30 s, and is at most 64 KiB.
//!
//! Request bodies are bounded by the idempotency layer (`limits.rs`): a deadline per body and
//! one budget for the bytes buffered at once.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower_idempotency::BoxError;

/// The connection builder with the limits above.
fn builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(30)).max_buf_size(64 * 1024);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(32)
        .max_header_list_size(16 * 1024)
        .max_pending_accept_reset_streams(20)
        .max_local_error_reset_streams(100)
        .initial_stream_window_size(256 * 1024)
        .initial_connection_window_size(1024 * 1024)
        .max_send_buf_size(256 * 1024)
        .keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(20));
    builder
}

/// Serves `router` on `listener` until `shutdown` resolves, then stops accepting and waits
/// for the open connections to finish their requests.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()>,
) -> Result<(), BoxError> {
    let builder = builder();
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait a little rather than spin.
                    eprintln!("orders: accept failed: {error}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(router.clone());
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service).into_owned());
        tokio::spawn(async move {
            // A connection that fails (a client that goes away) concerns that client only.
            let _ = connection.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
