//! `/metrics` over HTTP/1.1: `serve(listener, exporter, opts, shutdown)`.
//! A bearer token (its SHA-256 configured, as keel serve's metrics
//! listener) or, only when asked for, no authentication for a trusted
//! scrape network. At most `max_connections` connections at once (further
//! ones wait in the kernel's accept queue), each must send its request head
//! within `header_timeout` and lives at most `connection_lifetime`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::Exporter;

/// Who may read `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    /// A bearer token whose SHA-256 (lowercase hex) is this.
    Token { sha256: String },
    /// Anyone who can connect (a trusted scrape network).
    None,
}

/// How the listener behaves.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub auth: Auth,
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub connection_lifetime: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            auth: Auth::None,
            max_connections: 16,
            header_timeout: Duration::from_secs(5),
            connection_lifetime: Duration::from_secs(120),
        }
    }
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Compares two hex digests without an early exit.
fn same_digest(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn authorized(auth: &Auth, req: &Request<Incoming>) -> bool {
    match auth {
        Auth::None => true,
        Auth::Token { sha256 } => req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer "))
            .is_some_and(|v| same_digest(&sha256_hex(v[7..].trim().as_bytes()), sha256)),
    }
}

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

const LANDING: &str = "<html><head><title>keel exporter</title></head><body><h1>keel exporter</h1><p><a href=\"/metrics\">/metrics</a></p></body></html>\n";

async fn handle(
    exporter: Exporter,
    auth: Arc<Auth>,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::GET, "/metrics") => {
            if !authorized(&auth, &req) {
                let mut r = reply(
                    StatusCode::UNAUTHORIZED,
                    "text/plain; charset=utf-8",
                    "a valid bearer token is required\n",
                );
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return r;
            }
            let openmetrics = req
                .headers()
                .get_all(header::ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains("application/openmetrics-text"));
            let text = exporter.scrape().await;
            if openmetrics {
                reply(
                    StatusCode::OK,
                    crate::text::OPENMETRICS_CONTENT_TYPE,
                    crate::text::to_openmetrics(&text),
                )
            } else {
                reply(
                    StatusCode::OK,
                    crate::text::CONTENT_TYPE,
                    Bytes::from(text.as_bytes().to_vec()),
                )
            }
        }
        (&Method::GET, "/health") => reply(StatusCode::OK, "text/plain; charset=utf-8", "ok\n"),
        (&Method::GET, "/") => reply(StatusCode::OK, "text/html; charset=utf-8", LANDING),
        (_, "/metrics" | "/health" | "/") => {
            let mut r = reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain; charset=utf-8",
                "only GET\n",
            );
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET"));
            r
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found\n",
        ),
    }
}

/// Serves on an already-bound listener until `shutdown` resolves; then
/// stops accepting and lets open scrapes finish for up to a second.
pub async fn serve(
    listener: TcpListener,
    exporter: Exporter,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(opts.max_connections.max(1)));
    let auth = Arc::new(opts.auth.clone());
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let exporter = exporter.clone();
        let auth = auth.clone();
        let header_timeout = opts.header_timeout;
        let lifetime = opts.connection_lifetime;
        tasks.spawn(async move {
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req| {
                let exporter = exporter.clone();
                let auth = auth.clone();
                async move { Ok::<_, Infallible>(handle(exporter, auth, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), svc);
            let _ = tokio::time::timeout(lifetime, conn).await;
        });
        while tasks.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    Ok(())
}
