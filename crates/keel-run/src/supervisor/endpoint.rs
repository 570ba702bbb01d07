//! The supervisor's Prometheus endpoint, served through keel-http.

use super::*;

pub(super) type MetricsBody = http_body_util::Full<bytes::Bytes>;

/// The answer to one request to the metrics endpoint: `GET /metrics`
/// (with the bearer token when one is configured), else 401, 405 or 404.
pub(super) fn metrics_answer(
    req: &http::Request<hyper::body::Incoming>,
    m: &Mutex<crate::metrics::Snapshot>,
    token: Option<&keel_http::TokenHash>,
) -> http::Response<MetricsBody> {
    use http::{header, Method, StatusCode};
    let reply = |status: StatusCode, body: String| {
        let mut r = http::Response::new(MetricsBody::new(body.into()));
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        r
    };
    if req.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, "not found\n".into());
    }
    if req.method() != Method::GET {
        let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET"));
        return r;
    }
    if token.is_some_and(|t| !t.allows(req.headers())) {
        let mut r = reply(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is required\n".into(),
        );
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    let snap = m.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut r = reply(StatusCode::OK, crate::metrics::render(&snap));
    r.extensions_mut().insert(keel_http::Authenticated);
    r
}

/// Serves the metrics until the process ends, through keel-http's
/// hardened loop: 16 connections at once, 4 from one client (a quarter of
/// the places kept for scrapers with the token), a request head of at
/// most 8 KiB within 5 s, a write that makes no progress for 10 s and a
/// connection older than 30 s ended.
pub(super) async fn serve_metrics(
    sh: Shell,
    listener: tokio::net::TcpListener,
    m: Arc<Mutex<crate::metrics::Snapshot>>,
    token: Option<keel_http::TokenHash>,
) {
    type Answer = std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<http::Response<MetricsBody>, std::convert::Infallible>,
                > + Send,
        >,
    >;
    let reserved = if token.is_some() { 4 } else { 0 };
    let token = token.map(Arc::new);
    let app = tower::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let r = metrics_answer(&req, &m, token.as_deref());
        Box::pin(std::future::ready(Ok(r))) as Answer
    });
    let opts = keel_http::ServeOptions {
        limits: keel_http::Limits {
            max_connections: 16,
            max_per_client: 4,
            reserved,
            header_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
            lifetime: Duration::from_secs(30),
            drain: Duration::from_secs(1),
            max_head_bytes: 8 << 10,
        },
        busy: |why| keel_http::busy_answer("text/plain; charset=utf-8", why),
        bad_host: None,
    };
    if let Err(e) = keel_http::serve(listener, app, opts, std::future::pending()).await {
        sh.say(&format!("warning: the metrics endpoint stopped: {e}"));
    }
}
