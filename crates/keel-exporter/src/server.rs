//! `/metrics` over HTTP/1.1: `serve(listener, exporter, opts, shutdown)`,
//! through keel-http's accept loop. A bearer token (its SHA-256
//! configured, as keel serve's metrics listener) or, only when asked for,
//! no authentication for a trusted scrape network. At most
//! `max_connections` connections at once and `max_per_client` from one
//! client (an IPv4 address or an IPv6 /64); one more is answered 503 at
//! once. A connection without the token gives way to a newer one when the
//! places are full (the oldest waiting for its request head is closed),
//! and a quarter of the places is kept for scrapers with the token. Each
//! connection must send its request head within `header_timeout`, waits
//! as long for its next one, must let its answer be written (10 s without
//! progress ends it), and lives at most `connection_lifetime`; heads are
//! at most 16 KiB.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::net::TcpListener;

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
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections served at once from one client.
    pub max_per_client: usize,
    pub header_timeout: Duration,
    pub connection_lifetime: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            auth: Auth::None,
            max_connections: 16,
            max_per_client: 4,
            header_timeout: Duration::from_secs(5),
            connection_lifetime: Duration::from_secs(120),
        }
    }
}

pub use keel_http::sha256_hex;

fn authorized(auth: &Auth, req: &Request<Incoming>) -> bool {
    match auth {
        Auth::None => true,
        Auth::Token { sha256 } => keel_http::bearer_token(req.headers())
            .is_some_and(|t| keel_http::same_digest(&sha256_hex(t.as_bytes()), sha256)),
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
            let mut r = if openmetrics {
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
            };
            // A scraper (with the token, or anyone without one) keeps its
            // connection's place.
            r.extensions_mut().insert(keel_http::Authenticated);
            r
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

/// The answer to a connection that gets no place.
fn busy(why: &'static str) -> Vec<u8> {
    keel_http::busy_answer(
        "text/plain; charset=utf-8",
        &format!("{why}; retry later\n"),
    )
}

/// Serves on an already-bound listener until `shutdown` resolves; then
/// stops accepting and lets open scrapes finish for up to a second.
pub async fn serve(
    listener: TcpListener,
    exporter: Exporter,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let auth = Arc::new(opts.auth.clone());
    let app = tower::service_fn(move |req| {
        let exporter = exporter.clone();
        let auth = auth.clone();
        Box::pin(async move { Ok::<_, Infallible>(handle(exporter, auth, req).await) })
            as std::pin::Pin<
                Box<dyn Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send>,
            >
    });
    let reserved = match opts.auth {
        Auth::Token { .. } => opts.max_connections / 4,
        Auth::None => 0,
    };
    let limits = keel_http::Limits {
        max_connections: opts.max_connections,
        max_per_client: opts.max_per_client,
        reserved,
        header_timeout: opts.header_timeout,
        idle_timeout: opts.header_timeout,
        write_timeout: Duration::from_secs(10),
        lifetime: opts.connection_lifetime,
        drain: Duration::from_secs(1),
        max_head_bytes: 16 << 10,
    };
    let opts = keel_http::ServeOptions {
        limits,
        busy,
        bad_host: None,
    };
    keel_http::serve(listener, app, opts, shutdown).await
}
