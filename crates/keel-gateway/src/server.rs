//! Serving: `serve(listener, app, shutdown)` for any tower service, over
//! plain TCP or TLS, the access-log layer, the admin and metrics listeners
//! (each with its own bearer token), and `run`, which starts all three and
//! shuts them down together: stop accepting, let requests and streams
//! finish within the grace period, then close the audit log.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tower::{Layer, Service, ServiceBuilder};

use keel_http::{ConnService, Deadlines, Guarded, Place, Places};

use crate::access::{emit_access, AccessInfo, AccessRecord, AccessSink};
use crate::body::GwBody;
use crate::clock::Clock;
use crate::error::ApiError;
use crate::gateway::{Gateway, Listener};
use crate::keys::sha256_hex;
use crate::tls::ServerTls;

/// How connections are served.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// A client must send its request head within this (slow clients),
    /// from the connection's start or a later request's first byte; with
    /// TLS, the handshake must finish within it too.
    pub header_timeout: Duration,
    /// How long a kept-alive connection waits for its next request.
    pub idle_timeout: Duration,
    /// A response write that makes no progress this long closes the
    /// connection (a client that does not read).
    pub write_timeout: Duration,
    /// Connections open at once; the next is answered 503 and closed
    /// (after the oldest connection without a key waiting for a request
    /// head, if there is one, has been closed to make room for it).
    pub max_connections: usize,
    /// Connections open at once from one client (an IPv4 address or an
    /// IPv6 /64); the next is answered 503 and closed.
    pub max_connections_per_client: usize,
    /// Places that connections without a key never hold.
    pub reserved_connections: usize,
    /// A connection's read and write buffer (hyper's `max_buf_size`): a
    /// longer request head is answered 431.
    pub max_header_bytes: usize,
    /// How long in-flight requests and streams may take after shutdown.
    pub grace: Duration,
    /// Serve HTTPS with this (the handshake runs in the connection's task).
    pub tls: Option<ServerTls>,
}

/// The connections the admin and metrics listeners serve at once unless
/// `server.max_connections` says otherwise.
pub const SIDE_LISTENER_CONNECTIONS: usize = 1024;

/// The most memory one connection of the public listener may hold: its
/// read and write buffers (`max_header_bytes` each), and for a stream the
/// backend connection's read buffer, one unfinished event and the piece
/// being written.
pub fn connection_worst_case_bytes(s: &crate::config::ServerConfig) -> u64 {
    (2 * s.max_header_bytes
        + crate::proxy::BACKEND_BUFFER
        + crate::answer::MAX_PENDING_EVENT
        + crate::body::HELD_PIECE) as u64
}

/// What a public connection costs, for choosing the cap from the machine:
/// its worst case in memory (beside the body budget and the process's own
/// 32 MiB), two descriptors (the client's and the backend's), and 1024
/// descriptors kept for the admin and metrics listeners, idle backend
/// connections and files.
pub fn connection_cost(s: &crate::config::ServerConfig) -> keel_http::machine::ConnectionCost {
    keel_http::machine::ConnectionCost {
        bytes: connection_worst_case_bytes(s),
        fixed_bytes: s.max_body_bytes_in_flight as u64 + (32 << 20),
        files: 2,
        reserved_files: 1024,
    }
}

/// The public listener's connection cap: `server.max_connections`, or
/// when it is not set, what `machine` allows (keel-http's
/// `connection_cap` over its open-file limit and memory), 1024 when the
/// machine is not known.
pub fn connection_cap(
    s: &crate::config::ServerConfig,
    machine: Option<&keel_http::machine::Machine>,
) -> usize {
    s.max_connections.unwrap_or_else(|| match machine {
        Some(m) => keel_http::machine::connection_cap(m, &connection_cost(s)),
        None => keel_http::machine::FALLBACK_CONNECTIONS,
    })
}

impl ServeOptions {
    /// The options `[server]` gives a listener.
    pub fn from_config(
        s: &crate::config::ServerConfig,
        listener: Listener,
        tls: Option<ServerTls>,
        machine: Option<&keel_http::machine::Machine>,
    ) -> Self {
        let max_connections = match listener {
            Listener::Public => connection_cap(s, machine),
            Listener::Admin | Listener::Metrics => {
                s.max_connections.unwrap_or(SIDE_LISTENER_CONNECTIONS)
            }
        };
        Self {
            header_timeout: Duration::from_millis(s.header_timeout_ms),
            idle_timeout: Duration::from_millis(s.idle_timeout_ms),
            write_timeout: Duration::from_millis(s.write_timeout_ms),
            max_connections,
            max_connections_per_client: s.max_connections_per_client,
            reserved_connections: max_connections / 8,
            max_header_bytes: s.max_header_bytes,
            grace: Duration::from_secs_f64(s.shutdown_grace_s),
            tls,
        }
    }

    fn deadlines(&self) -> Deadlines {
        Deadlines {
            header: self.header_timeout,
            idle: self.idle_timeout,
            write: self.write_timeout,
        }
    }
}

/// What a connection over the limit is told before it is closed.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 112\r\n\r\n\
{\"error\":{\"message\":\"too many connections to the gateway; retry later\",\
\"type\":\"service_unavailable\",\"code\":503}}";

/// What a connection over its client's share is told before it is closed.
const BUSY_CLIENT: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 130\r\n\r\n\
{\"error\":{\"message\":\"too many connections to the gateway from this address; retry later\",\
\"type\":\"service_unavailable\",\"code\":503}}";

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The answer to an HTTP/1.1 request without exactly one `Host`.
fn bad_host() -> Response<GwBody> {
    ApiError::bad_request("an HTTP/1.1 request needs exactly one Host header").into_response()
}

/// Serves one connection until it closes, a deadline passes, a graceful
/// shutdown ends it, or (not having authenticated) it is closed to make
/// room for a newer connection.
async fn connection<I, S>(io: I, app: S, opts: ConnOptions, watcher: Watcher, place: Place)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Response<GwBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + Unpin + 'static,
{
    let in_flight = place.in_flight().clone();
    let io = Guarded::new(io, opts.deadlines, in_flight.clone());
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        // The head's and the idle connection's deadlines are `Guarded`'s.
        // hyper's own, later than either, makes it read again as soon as
        // a response is done, which is when the wait for the next request
        // starts.
        .header_read_timeout(opts.deadlines.header + opts.deadlines.idle)
        .max_buf_size(opts.max_header_bytes)
        .serve_connection(
            TokioIo::new(io),
            TowerToHyperService::new(ConnService::new(app, in_flight, Some(bad_host))),
        );
    {
        let conn = watcher.watch(conn);
        let evicted = place.evicted();
        tokio::pin!(conn, evicted);
        // A connection that has sent a valid key keeps its place for good:
        // its eviction is not polled again (polling it takes a lock, at
        // every event a stream passes on).
        let was_evicted = std::future::poll_fn(|cx| {
            if conn.as_mut().poll(cx).is_ready() {
                return Poll::Ready(false);
            }
            if !place.in_flight().is_authenticated() && evicted.as_mut().poll(cx).is_ready() {
                return Poll::Ready(true);
            }
            Poll::Pending
        })
        .await;
        if was_evicted {
            tracing::debug!("a connection without a key waiting for a request closed to make room");
        }
    }
    drop(place);
}

/// What each connection's task is given.
#[derive(Debug, Clone, Copy)]
struct ConnOptions {
    deadlines: Deadlines,
    max_header_bytes: usize,
}

/// Serves HTTP/1.1 (over TLS when `opts.tls`) on an already-bound listener
/// until `shutdown` resolves, then stops accepting and waits up to the
/// grace period for open connections to finish. A TLS handshake that
/// fails or takes longer than the header timeout closes its connection.
/// A connection beyond `max_connections` or `max_connections_per_client`
/// is answered 503 (plain HTTP) or closed (TLS) at once, before anything
/// of it is read; when the places are full, the oldest connection that
/// has not sent a valid key and waits for a request head is closed to
/// make room first (keel-http's `Places`).
pub async fn serve<S>(
    listener: TcpListener,
    app: S,
    shutdown: impl Future<Output = ()>,
    opts: ServeOptions,
) -> std::io::Result<()>
where
    S: Service<Request<Incoming>, Response = Response<GwBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + Unpin + 'static,
{
    let graceful = GracefulShutdown::new();
    let places = Places::new(
        opts.max_connections,
        opts.max_connections_per_client,
        opts.reserved_connections,
    );
    let conn_opts = ConnOptions {
        deadlines: opts.deadlines(),
        max_header_bytes: opts.max_header_bytes,
    };
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            r = listener.accept() => {
                let (stream, peer) = match r {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let place = match places.admit(peer.ip()) {
                    Ok(p) => p,
                    Err(why) => {
                        if opts.tls.is_none() {
                            let _ = stream.try_write(match why {
                                keel_http::Refused::Full => BUSY,
                                keel_http::Refused::PerClient => BUSY_CLIENT,
                            });
                        }
                        tracing::debug!(reason = why.message(), "connection refused");
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let watcher = graceful.watcher();
                let app = app.clone();
                let header_timeout = opts.header_timeout;
                match &opts.tls {
                    None => {
                        tokio::spawn(connection(stream, app, conn_opts, watcher, place));
                    }
                    Some(tls) => {
                        let acceptor = tls.acceptor().clone();
                        tokio::spawn(async move {
                            // A handshake still running when its place is
                            // taken for a newer connection ends there, so
                            // no connection lives without a place.
                            let handshake = tokio::select! {
                                r = tokio::time::timeout(header_timeout, acceptor.accept(stream)) => r,
                                _ = place.evicted() => return,
                            };
                            match handshake {
                                Ok(Ok(s)) => connection(s, app, conn_opts, watcher, place).await,
                                Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                                Err(_) => tracing::debug!("TLS handshake timed out"),
                            }
                        });
                    }
                }
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(opts.grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_s = opts.grace.as_secs_f64(),
            "connections still open after the grace period; closing them"
        );
    }
    Ok(())
}

impl Service<Request<Incoming>> for Gateway {
    type Response = Response<GwBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<GwBody>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let g = self.clone();
        Box::pin(async move { Ok(g.handle(req).await) })
    }
}

/// Writes one structured access-log event per response (target
/// `keel::access`), with the route template, never the raw path.
#[derive(Clone)]
pub struct AccessLogLayer {
    pub enabled: bool,
    pub sink: Option<AccessSink>,
    /// Stamps each record (the gateway's injected clock).
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for AccessLogLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLogLayer")
            .field("enabled", &self.enabled)
            .field("sink", &self.sink.is_some())
            .finish()
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for AccessLog<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog")
            .field("inner", &self.inner)
            .field("enabled", &self.enabled)
            .finish()
    }
}

impl<S> Layer<S> for AccessLogLayer {
    type Service = AccessLog<S>;
    fn layer(&self, inner: S) -> AccessLog<S> {
        AccessLog {
            inner,
            enabled: self.enabled,
            sink: self.sink.clone(),
            clock: self.clock.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AccessLog<S> {
    inner: S,
    enabled: bool,
    sink: Option<AccessSink>,
    clock: Arc<dyn Clock>,
}

impl<S> Service<Request<Incoming>> for AccessLog<S>
where
    S: Service<Request<Incoming>, Response = Response<GwBody>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<GwBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<GwBody>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let enabled = self.enabled;
        let sink = self.sink.clone();
        let clock = self.clock.clone();
        let method = req.method().clone();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            if enabled {
                let info = resp
                    .extensions_mut()
                    .remove::<AccessInfo>()
                    .unwrap_or_default();
                emit_access(
                    sink.as_ref(),
                    AccessRecord {
                        at: std::time::UNIX_EPOCH + Duration::from_micros(clock.now_us()),
                        method,
                        status: resp.status().as_u16(),
                        duration_ms: start.elapsed().as_secs_f64() * 1e3,
                        info,
                    },
                );
            }
            Ok(resp)
        })
    }
}

fn bearer_ok(req: &Request<Incoming>, token_sha256: &str) -> bool {
    crate::auth::credential(req.headers())
        .is_some_and(|t| keel_http::same_digest(&sha256_hex(t.as_bytes()), token_sha256))
}

fn text(status: StatusCode, ct: &'static str, body: impl Into<Bytes>) -> Response<GwBody> {
    let mut r = Response::new(GwBody::full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
    r
}

fn json_ok(v: serde_json::Value) -> Response<GwBody> {
    text(StatusCode::OK, "application/json", v.to_string())
}

/// The admin API: `POST /admin/reload`, `GET /admin/status`,
/// `GET /admin/usage/{scope}` (`key:ID` or `team:NAME`), the rollouts
/// (`GET /admin/rollouts/MODEL`, `POST /admin/rollouts/MODEL/start|pause|abort`),
/// drift (`GET /admin/drift/MODEL`, `GET /admin/drift/MODEL/baseline?version=N&window=reference|current`).
#[derive(Debug, Clone)]
pub struct AdminService {
    pub gateway: Gateway,
    pub token_sha256: String,
}

impl Service<Request<Incoming>> for AdminService {
    type Response = Response<GwBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<GwBody>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let s = self.clone();
        Box::pin(async move {
            if !bearer_ok(&req, &s.token_sha256) {
                return Ok(ApiError::unauthorized().into_response());
            }
            let path = req.uri().path().to_owned();
            let mut r = match (req.method().clone(), path.as_str()) {
                (Method::POST, "/admin/reload") => match s.gateway.reload().await {
                    Ok(()) => json_ok(json!({"reloaded": true})),
                    Err(e) => {
                        tracing::error!(error = %e, "reload failed; the previous configuration stays");
                        text(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "application/json",
                            json!({"reloaded": false, "error": format!("{e}")}).to_string(),
                        )
                    }
                },
                (Method::GET, "/admin/status") => json_ok(s.gateway.status()),
                (method, p) if p.starts_with("/admin/rollouts/") => {
                    rollout_route(&s.gateway, method, &p["/admin/rollouts/".len()..]).await
                }
                (Method::GET, p) if p.starts_with("/admin/drift/") => drift_route(
                    &s.gateway,
                    &p["/admin/drift/".len()..],
                    req.uri().query().unwrap_or(""),
                ),
                (Method::GET, p) if p.starts_with("/admin/usage/") => {
                    let scope = &p["/admin/usage/".len()..];
                    match s.gateway.limiter().usage(scope).await {
                        Ok(u) => json_ok(json!({"version": 1, "scope": scope, "usage": u})),
                        Err(e) => ApiError::unavailable(e.to_string(), Some(1)).into_response(),
                    }
                }
                _ => ApiError::not_found("no such admin route").into_response(),
            };
            r.extensions_mut().insert(keel_http::Authenticated);
            Ok(r)
        })
    }
}

/// `POST /admin/rollouts/MODEL/start|pause|abort`, `GET
/// /admin/rollouts/MODEL`.
async fn rollout_route(gw: &Gateway, method: Method, rest: &str) -> Response<GwBody> {
    let (model, action) = match rest.rsplit_once('/') {
        Some((m, a)) if method == Method::POST => (m, Some(a)),
        _ => (rest, None),
    };
    // Percent-encoded names are not expected; what the caller sent is
    // repeated only in part.
    let model: String = model.chars().take(200).collect();
    let Some(r) = gw.rollouts() else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "no model follows the registry: there are no rollouts",
        )
        .into_response();
    };
    use crate::control::RolloutCall;
    let call = match (method, action) {
        (Method::GET, None) => RolloutCall::Status,
        (Method::POST, Some("start")) => RolloutCall::Start,
        (Method::POST, Some("pause")) => RolloutCall::Pause,
        (Method::POST, Some("abort")) => RolloutCall::Abort,
        _ => {
            return ApiError::not_found(
                "rollout routes: GET /admin/rollouts/MODEL, POST /admin/rollouts/MODEL/start|pause|abort",
            )
            .into_response()
        }
    };
    match r.call(call, &model).await {
        Ok(v) => json_ok(v),
        Err(e) => {
            let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::CONFLICT);
            text(
                status,
                "application/json",
                json!({"error": {"type": e.kind, "message": e.message}}).to_string(),
            )
        }
    }
}

/// `GET /admin/drift/MODEL`: the drift windows, measures and alarms of
/// the model's versions; `GET /admin/drift/MODEL/baseline?version=N
/// [&window=reference|current]`: a window of version N as a baseline file
/// (`keel serve drift baseline save`).
fn drift_route(gw: &Gateway, rest: &str, query: &str) -> Response<GwBody> {
    use crate::drift::WindowKind;
    let err = |status: StatusCode, msg: String| {
        text(
            status,
            "application/json",
            json!({"error": {"type": "drift_error", "message": msg}}).to_string(),
        )
    };
    let reflect = |s: &str| s.chars().take(100).collect::<String>();
    let (model, baseline) = match rest.strip_suffix("/baseline") {
        Some(m) => (m, true),
        None => (rest, false),
    };
    if !baseline {
        return match gw.drift().status(model) {
            Some(v) => json_ok(v),
            None => err(
                StatusCode::NOT_FOUND,
                format!(
                    "model {:?} is not watched for drift (only models that follow the registry are)",
                    reflect(model)
                ),
            ),
        };
    }
    let mut version = None;
    let mut window = WindowKind::Reference;
    for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        match (k, v) {
            ("version", v) => version = Some(v.trim_start_matches('v')),
            ("window", "reference") => window = WindowKind::Reference,
            ("window", "current") => window = WindowKind::Current,
            ("window", w) => {
                return err(
                    StatusCode::BAD_REQUEST,
                    format!("window {:?}: give reference or current", reflect(w)),
                )
            }
            _ => {}
        }
    }
    let Some(version) = version.filter(|v| v.parse::<u64>().is_ok()) else {
        return err(
            StatusCode::BAD_REQUEST,
            "give the registry version: ?version=N".into(),
        );
    };
    match gw.drift().snapshot(
        model,
        &format!("v{version}"),
        window,
        crate::clock::rfc3339(gw.now_ms()),
    ) {
        Ok(f) => json_ok(serde_json::to_value(f).unwrap_or_default()),
        Err(e @ crate::drift::SnapshotError::NotFull { .. }) => {
            err(StatusCode::CONFLICT, e.to_string())
        }
        Err(e) => err(StatusCode::NOT_FOUND, e.to_string()),
    }
}

/// `GET /metrics` in the Prometheus text format, behind a bearer token.
#[derive(Debug, Clone)]
pub struct MetricsService {
    pub gateway: Gateway,
    pub token_sha256: String,
}

impl Service<Request<Incoming>> for MetricsService {
    type Response = Response<GwBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<GwBody>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let s = self.clone();
        Box::pin(async move {
            if !bearer_ok(&req, &s.token_sha256) {
                return Ok(ApiError::unauthorized().into_response());
            }
            let mut r = match (req.method(), req.uri().path()) {
                (&Method::GET, "/metrics") => text(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    s.gateway.render_metrics(),
                ),
                _ => ApiError::not_found("no such route").into_response(),
            };
            r.extensions_mut().insert(keel_http::Authenticated);
            Ok(r)
        })
    }
}

/// The listeners `run` serves; admin and metrics are optional.
#[derive(Debug)]
pub struct Listeners {
    pub public: TcpListener,
    pub admin: Option<TcpListener>,
    pub metrics: Option<TcpListener>,
}

/// Serves the public, admin and metrics listeners until `shutdown`, then
/// drains them within the configured grace period and closes the audit log.
pub async fn run(
    gateway: Gateway,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let gen = gateway.generation();
    let cfg = &gen.cfg;
    let opts = |l: Listener| {
        ServeOptions::from_config(&cfg.server, l, gateway.listener_tls(l), gateway.machine())
    };
    let grace = Duration::from_secs_f64(cfg.server.shutdown_grace_s);
    let (tx, rx) = tokio::sync::watch::channel(false);
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let public = ServiceBuilder::new()
        .layer(AccessLogLayer {
            enabled: cfg.server.access_log,
            sink: gateway.access_sink(),
            clock: gateway.clock(),
        })
        .service(gateway.clone());
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(serve(
        listeners.public,
        public,
        wait(rx.clone()),
        opts(Listener::Public),
    )));
    if let (Some(l), Some(a)) = (listeners.admin, &cfg.admin) {
        let svc = AdminService {
            gateway: gateway.clone(),
            token_sha256: a.token_sha256.clone(),
        };
        tasks.push(tokio::spawn(serve(
            l,
            svc,
            wait(rx.clone()),
            opts(Listener::Admin),
        )));
    }
    if let (Some(l), Some(m)) = (listeners.metrics, &cfg.metrics) {
        let svc = MetricsService {
            gateway: gateway.clone(),
            token_sha256: m.token_sha256.clone(),
        };
        tasks.push(tokio::spawn(serve(
            l,
            svc,
            wait(rx.clone()),
            opts(Listener::Metrics),
        )));
    }
    drop(gen);
    shutdown.await;
    let _ = tx.send(true);
    let mut result = Ok(());
    for t in tasks {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => result = Err(e),
            Err(e) => result = Err(std::io::Error::other(e.to_string())),
        }
    }
    // Streams finish in their own tasks; give them the same grace.
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && gateway.tasks_in_flight() > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gateway.close();
    result
}

#[cfg(test)]
mod access_tests {
    use super::*;

    #[test]
    fn the_busy_answers_are_whole() {
        for busy in [BUSY, BUSY_CLIENT] {
            busy_answer_is_whole(busy);
        }
    }

    fn busy_answer_is_whole(busy: &[u8]) {
        let text = std::str::from_utf8(busy).expect("ascii");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|v| v.parse().ok())
            .expect("content-length");
        assert_eq!(len, body.len());
        let v: serde_json::Value = serde_json::from_str(body).expect("JSON");
        assert_eq!(v["error"]["code"], 503);
    }
}
