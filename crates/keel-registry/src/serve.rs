//! Serving the HTTP API on a listener through keel-http's accept loop:
//! what one client may hold of the server is bounded in number
//! (connections at once, and from one client) and in time (a request head,
//! an idle connection, a write making no progress, a connection's whole
//! life), a connection over a limit is told so at once (503, in MLflow's
//! error shape) rather than left waiting unseen in the listen queue, and
//! connections without a valid key give way to those with one (the oldest
//! unauthenticated connection waiting for a request head is closed to make
//! room; a reserve of places is never held by them).

use std::future::Future;
use std::io;

use axum::Router;

/// What one client may hold of the server: keel-http's limits. The
/// registry's defaults: 512 connections, 64 from one client, 64 of them
/// kept for connections that have sent a valid key, 15 s for a request
/// head and for an idle connection's next request, 30 s for a write to
/// make progress, 10 minutes of life, 30 s of drain, 64 KiB heads.
pub type ConnectionLimits = keel_http::Limits;

/// Serves `app` on an already-bound listener with the default
/// [`ConnectionLimits`] until `shutdown` completes, then lets the requests
/// in flight finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    serve_with(listener, app, ConnectionLimits::default(), shutdown).await
}

/// The whole answer to a connection over a limit, in MLflow's error shape
/// (its client retries 503).
fn refusal(why: &'static str) -> Vec<u8> {
    keel_http::busy_answer(
        "application/json",
        &format!(r#"{{"error_code":"TEMPORARILY_UNAVAILABLE","message":"{why}"}}"#),
    )
}

/// [`serve`] with other limits.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let app = tower::util::BoxCloneService::new(app);
    let opts = keel_http::ServeOptions {
        limits,
        busy: refusal,
        bad_host: None,
    };
    keel_http::serve(listener, app, opts, shutdown).await
}
