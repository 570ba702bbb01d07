//! The request path: authenticate, parse, authorise, admit (limits), route
//! (weights, pin, mirror, fallback, retries, circuits), proxy (streams
//! chunk by chunk), settle, and record (metrics, audit, access log).

use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Map, Value};

use crate::access::{AccessInfo, AccessRecord, AccessSink, RequestId, X_REQUEST_ID};
use crate::answer::{oip_output_mean, summary_of_body, SseFilter, TokenUsage};
use crate::audit::AuditLog;
use crate::auth::{credential, looks_like_jwt, Identity, JwtVerifier, Rbac};
use crate::body::GwBody;
use crate::budget::{BodyBudget, BodyPermit};
use crate::clock::{rfc3339, Clock, Stamp};
use crate::config::{GatewayConfig, LimitsConfig, Protocol};
use crate::error::{reflect, truncated, ApiError, GatewayError, MESSAGE_BYTES};
use crate::keys::KeyRing;
use crate::limits::{
    reset_header_value, retry_after_s, Admission, Limiter, RateInfo, Refusal, Reservation, Scope,
    WINDOW_MS,
};
use crate::metrics::{Metrics, RequestLabels};
use crate::pool::UpstreamBody;
use crate::proxy::{retry_after, upstream_headers, Upstream};
use crate::request::{self, OipModel, Route, RouteError};
use crate::tls::ServerTls;
use crate::traffic::{Backend, ModelRoute, Permit, RetryBudget, Rng, Traffic};

mod admission;
mod deliver;
mod protocols;
mod upstream;

use admission::*;

/// Re-reads the configuration (the binary reads the file).
pub type ReloadFn = Arc<dyn Fn() -> Result<GatewayConfig, GatewayError> + Send + Sync>;

/// What the gateway is given besides its configuration.
#[derive(Clone)]
pub struct GatewayOptions {
    pub clock: Arc<dyn Clock>,
    /// Seeds weighted routing, mirroring and request ids.
    pub seed: u64,
    /// How `POST /admin/reload` and `Gateway::reload` get a new config.
    pub reload: Option<ReloadFn>,
    /// Where access-log records go (the sink makes lines of them with
    /// [`crate::access::access_line`], off the request path). Without one
    /// they are `tracing` events (target `keel::access`).
    pub access_sink: Option<AccessSink>,
    /// The machine's limits (open files, memory) the public listener's
    /// connection cap is chosen from when `server.max_connections` is not
    /// set (`keel serve` reads them at start); without them, 1024.
    pub machine: Option<keel_http::machine::Machine>,
}

impl std::fmt::Debug for GatewayOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayOptions")
            .field("clock", &self.clock)
            .field("seed", &self.seed)
            .field("machine", &self.machine)
            .finish()
    }
}

/// One configuration generation; swapped whole on reload, so a request
/// sees one consistent configuration from start to end.
#[derive(Debug)]
pub struct Generation {
    pub cfg: GatewayConfig,
    pub traffic: Traffic,
    keys: Option<KeyRing>,
    jwt: Option<Arc<JwtVerifier>>,
    rbac: Rbac,
    /// The certificates of the listeners that serve HTTPS, as read when
    /// this generation was built (indexed by `Listener`).
    listener_keys: [Option<Arc<rustls::sign::CertifiedKey>>; 3],
}

/// The gateway's three listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    Public = 0,
    Admin = 1,
    Metrics = 2,
}

impl Listener {
    pub const ALL: [Listener; 3] = [Listener::Public, Listener::Admin, Listener::Metrics];

    pub fn name(self) -> &'static str {
        match self {
            Listener::Public => "server",
            Listener::Admin => "admin",
            Listener::Metrics => "metrics",
        }
    }

    fn tls_files(self, cfg: &GatewayConfig) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
        match self {
            Listener::Public => cfg.server.tls(),
            Listener::Admin => cfg.admin.as_ref().and_then(|a| a.tls()),
            Listener::Metrics => cfg.metrics.as_ref().and_then(|m| m.tls()),
        }
    }
}

#[derive(Debug)]
struct Inner {
    generation: RwLock<Arc<Generation>>,
    limiter: Limiter,
    metrics: Metrics,
    audit: Option<AuditLog>,
    clock: Arc<dyn Clock>,
    rng: Rng,
    upstream: Upstream,
    /// TLS of the listeners that serve HTTPS, fixed at start; a reload
    /// swaps the certificates inside.
    listener_tls: [Option<ServerTls>; 3],
    budget: RetryBudget,
    reload: Option<ReloadFnBox>,
    access_sink: Option<AccessSinkBox>,
    machine: Option<keel_http::machine::Machine>,
    reload_lock: tokio::sync::Mutex<()>,
    /// Stream and mirror tasks still running.
    tasks: std::sync::atomic::AtomicUsize,
    /// Request and non-streamed response body bytes held now.
    bodies: BodyBudget,
    /// Per-request samples of the models a rollout watches.
    samples: crate::samples::SampleBook,
    /// The rollouts of the models that follow the registry.
    rollouts: std::sync::OnceLock<Arc<dyn crate::control::RolloutAdmin>>,
    /// Output drift of the registry-following models' versions.
    drift: crate::drift::DriftBook,
}

/// Counts a background task from spawn to end.
struct TaskGuard(Arc<Inner>);

impl TaskGuard {
    fn new(inner: &Arc<Inner>) -> Self {
        inner
            .tasks
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(inner.clone())
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0
            .tasks
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

struct ReloadFnBox(ReloadFn);
impl std::fmt::Debug for ReloadFnBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReloadFn")
    }
}

struct AccessSinkBox(AccessSink);
impl std::fmt::Debug for AccessSinkBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AccessSink")
    }
}

/// The gateway: cheap to clone, shared by every connection.
#[derive(Debug, Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

/// A handle on a gateway that does not keep it alive (for what the
/// gateway itself holds, such as its control plane's admin handler).
#[derive(Debug, Clone)]
pub struct WeakGateway(std::sync::Weak<Inner>);

impl WeakGateway {
    /// The gateway, while it is alive.
    pub fn upgrade(&self) -> Option<Gateway> {
        self.0.upgrade().map(|inner| Gateway { inner })
    }
}

const X_KEEL_MODEL: http::HeaderName = http::HeaderName::from_static("x-keel-model");
const X_KEEL_DEPLOYMENT: http::HeaderName = http::HeaderName::from_static("x-keel-deployment");

/// What [`Gateway::deliver`] reads of a whole answer for the metrics and
/// the canary analysis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Summary {
    /// An OpenAI answer: usage, finish reason, answer length.
    Answer,
    /// An OIP v2 inference answer: its first output's mean, while a
    /// rollout watches the model.
    OipOutput,
    Nothing,
}

/// What is known about a request as it goes.
#[derive(Debug, Clone, Default)]
struct Ctx {
    id: RequestId,
    route: &'static str,
    key: Option<Arc<str>>,
    team: Option<Arc<str>>,
    /// The model the client asked for, as it wrote it.
    model: Option<String>,
    /// `model` names a configured model: only then is it a metrics label
    /// (any other name the client sends would add series without bound).
    model_configured: bool,
    served_model: Option<Arc<str>>,
    deployment: Option<Arc<str>>,
    /// `served_model` and `deployment` as header values.
    served_headers: Option<(HeaderValue, HeaderValue)>,
    status: u16,
    usage: Option<TokenUsage>,
    /// `usage` is the gateway's estimate: the backend reported none.
    usage_estimated: bool,
    /// The first choice's finish reason and visible characters, for the
    /// canary analysis.
    finish_reason: Option<keel_canary::analysis::FinishReason>,
    answer_chars: Option<u32>,
    /// OIP v2: the mean of the first output tensor's values.
    output_mean: Option<f64>,
    /// A stream that ended without its end marker.
    stream_aborted: bool,
    /// Sampled numeric inputs of an OIP inference request of a model
    /// watched for drift.
    oip_inputs: Option<Box<crate::drift::InputValues>>,
    /// Prompt tokens as estimated from the request.
    prompt_estimate: u64,
    backend_time: Option<Duration>,
    denied: Option<&'static str>,
    error: Option<String>,
    rate: Option<RateInfo>,
    retries: u32,
    fallback: bool,
    stream: bool,
    request_body: Option<Bytes>,
    response_body: Option<Bytes>,
}

/// One audit line for a request or a refusal.
#[derive(serde::Serialize)]
struct RequestEvent<'a> {
    event: &'static str,
    ts: &'a str,
    request_id: &'a str,
    route: &'static str,
    key: Option<&'a str>,
    team: Option<&'a str>,
    model: Option<&'a str>,
    served_model: Option<&'a str>,
    deployment: Option<&'a str>,
    status: u16,
    duration_ms: f64,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    usage_estimated: bool,
    retries: u32,
    fallback: bool,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_body: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_body: Option<String>,
}

/// A finished request waiting for the audit writer.
struct Finished {
    ts_ms: u64,
    total: Duration,
    ctx: Ctx,
}

impl crate::audit::Event for Finished {
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        let ctx = &self.ctx;
        let content = |b: &Option<Bytes>| {
            b.as_ref()
                .map(|b| String::from_utf8_lossy(&b[..b.len().min(CONTENT_CAP)]).into_owned())
        };
        let stamp = Stamp::millis(self.ts_ms);
        // What the client sent is repeated only in part.
        let model = ctx.model.as_deref().map(reflect);
        let error = ctx.error.as_deref().map(|e| truncated(e, MESSAGE_BYTES));
        let e = RequestEvent {
            event: if ctx.denied.is_some() {
                "denied"
            } else {
                "request"
            },
            ts: stamp.as_str(),
            request_id: ctx.id.as_str(),
            route: ctx.route,
            key: ctx.key.as_deref(),
            team: ctx.team.as_deref(),
            model: model.as_deref(),
            served_model: ctx.served_model.as_deref(),
            deployment: ctx.deployment.as_deref(),
            status: ctx.status,
            duration_ms: (self.total.as_secs_f64() * 1e6).round() / 1e3,
            prompt_tokens: ctx.usage.map(|u| u.prompt),
            completion_tokens: ctx.usage.map(|u| u.completion),
            usage_estimated: ctx.usage_estimated,
            retries: ctx.retries,
            fallback: ctx.fallback,
            stream: ctx.stream,
            reason: ctx.denied,
            error: error.as_deref(),
            request_body: content(&ctx.request_body),
            response_body: content(&ctx.response_body),
        };
        serde_json::to_writer(out, &e)
    }
}

/// What is sent upstream, rendered per deployment (the model name differs).
enum Payload {
    OpenAi {
        path: &'static str,
        body: request::OpenAiBody,
        /// Ask for the usage chunk of a stream.
        force_usage: bool,
        /// The completion tokens reserved a choice: every length limit
        /// the backend may read is bound to it.
        max_tokens: Option<u64>,
    },
    Oip {
        method: Method,
        version: Option<String>,
        action: &'static str,
        body: Bytes,
        content_type: Option<HeaderValue>,
    },
}

impl Payload {
    fn render(
        &self,
        backend_model: &str,
    ) -> (
        Method,
        std::borrow::Cow<'static, str>,
        Bytes,
        Option<HeaderValue>,
    ) {
        match self {
            Payload::OpenAi {
                path,
                body,
                force_usage,
                max_tokens,
            } => (
                Method::POST,
                std::borrow::Cow::Borrowed(*path),
                body.render(backend_model, *force_usage, *max_tokens),
                None,
            ),
            Payload::Oip {
                method,
                version,
                action,
                body,
                content_type,
            } => {
                let mut p = format!("/v2/models/{backend_model}");
                if let Some(v) = version {
                    p.push_str("/versions/");
                    p.push_str(v);
                }
                p.push_str(action);
                (method.clone(), p.into(), body.clone(), content_type.clone())
            }
        }
    }
}

/// A response from the deployment that served.
struct Served {
    resp: Response<UpstreamBody>,
    sent_at: Instant,
}

enum Fail {
    Api(ApiError),
    /// The last backend's own error response, passed on.
    Upstream(StatusCode, Option<HeaderValue>, Bytes, Option<Duration>),
}

impl From<ApiError> for Fail {
    fn from(e: ApiError) -> Self {
        Fail::Api(e)
    }
}

/// What the access log records of a request.
fn access_info(ctx: &Ctx, stream: bool) -> AccessInfo {
    AccessInfo {
        request_id: ctx.id,
        route: ctx.route,
        key: ctx.key.clone(),
        model: ctx
            .served_model
            .clone()
            .or_else(|| ctx.model.as_deref().map(|m| Arc::from(reflect(m).as_ref()))),
        deployment: ctx.deployment.clone(),
        stream,
    }
}

/// A request being answered. When the client goes away first, hyper drops
/// the request's future and with it this guard, which records the request
/// as status 499 in the metrics, the audit log and the access log. Its
/// token reservation stays charged as reserved: the backend may have done
/// the work.
struct Pending<'a> {
    gw: &'a Gateway,
    method: Method,
    access_log: bool,
    started: Instant,
    /// The request has not been answered yet.
    armed: bool,
    ctx: Ctx,
}

/// The status recorded for a request whose client went away (nginx's
/// "client closed request").
const CLIENT_CLOSED: u16 = 499;

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut ctx = std::mem::take(&mut self.ctx);
        ctx.status = CLIENT_CLOSED;
        ctx.error = Some("the client closed the connection before the response".into());
        let total = self.started.elapsed();
        if self.access_log {
            crate::access::emit_access(
                self.gw.inner.access_sink.as_ref().map(|s| &s.0),
                AccessRecord {
                    at: std::time::UNIX_EPOCH + Duration::from_micros(self.gw.inner.clock.now_us()),
                    method: self.method.clone(),
                    status: CLIENT_CLOSED,
                    duration_ms: total.as_secs_f64() * 1e3,
                    info: access_info(&ctx, ctx.stream),
                },
            );
        }
        self.gw.finish(ctx, total);
    }
}

/// One attempt's hold on a backend's circuit. If the attempt ends without
/// a result (the request was cancelled) and it was the half-open
/// circuit's trial, the trial is given back.
struct Lease<'a> {
    backend: &'a Backend,
    permit: Permit,
    /// The caller, whose failures alone may not open the circuit.
    who: &'a Arc<str>,
    done: bool,
}

impl Lease<'_> {
    fn done(mut self, ok: bool, retry_after: Option<Duration>) {
        self.done = true;
        self.backend
            .record(Instant::now(), ok, retry_after, self.permit, self.who);
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if !self.done && self.permit == Permit::Trial {
            self.backend.release_trial();
        }
    }
}

fn no_such_model(name: &str) -> ApiError {
    ApiError::not_found(format!("the model {:?} does not exist", reflect(name)))
}

async fn read_limited<B>(body: B, limit: usize, timeout: Duration) -> Result<Bytes, BodyError>
where
    B: http_body::Body<Data = Bytes>,
{
    tokio::time::timeout(timeout, collect_limited(body, limit, None))
        .await
        .unwrap_or(Err(BodyError::Timeout))
}

fn json_response(status: StatusCode, v: Value) -> Response<GwBody> {
    let mut r = Response::new(GwBody::full(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

const CONTENT_CAP: usize = 1 << 20;

/// Bodies longer than this, or of unknown length, are read only once the
/// caller is known to have requests left ([`Gateway::requests_left`]).
const PRECHECK_BODY_BYTES: u64 = 64 << 10;

impl Gateway {
    /// Builds the gateway: limit store, audit log, keys, JWKS, routing
    /// table and health probes. Must run inside a tokio runtime.
    /// The machine's limits it was given (`GatewayOptions::machine`).
    pub fn machine(&self) -> Option<&keel_http::machine::Machine> {
        self.inner.machine.as_ref()
    }

    pub async fn new(cfg: GatewayConfig, opts: GatewayOptions) -> Result<Self, GatewayError> {
        let limiter = match &cfg.limits.redis_url {
            Some(url) => {
                let l = Limiter::redis(url, opts.clock.clone())?;
                if let Limiter::Redis(r) = &l {
                    r.ping().await?;
                }
                l
            }
            None => Limiter::local(opts.clock.clone()),
        };
        let audit_opts = crate::audit::AuditOptions {
            group: cfg.audit.group,
            now_ms: opts.clock.now_ms(),
            checkpoints: cfg.audit.checkpoints.clone(),
            sync: cfg.audit.sync,
        };
        let audit = cfg
            .audit
            .path
            .as_deref()
            .map(|p| AuditLog::open(p, &audit_opts))
            .transpose()?;
        let upstream = Upstream::new(
            Duration::from_millis(cfg.traffic.connect_timeout_ms),
            &cfg.upstream_tls,
        )?;
        let drift = crate::drift::DriftBook::new(
            cfg.registry
                .as_ref()
                .map_or(1000, |r| r.drift_reference_requests),
            cfg.registry
                .as_ref()
                .map_or(1000, |r| r.drift_window_requests),
        );
        for m in cfg.models.iter().filter(|m| m.registry.is_some()) {
            drift.watch(&m.name, m.drift.baseline.clone());
        }
        let (generation, _) = build_generation(cfg.clone(), None, &upstream, &opts.clock).await?;
        let mut listener_tls = [None, None, None];
        for (slot, key) in listener_tls.iter_mut().zip(&generation.listener_keys) {
            *slot = key.clone().map(ServerTls::new).transpose()?;
        }
        let budget = RetryBudget::new(cfg.traffic.retry_budget_ratio, cfg.traffic.retry_budget_min);
        let gw = Self {
            inner: Arc::new(Inner {
                generation: RwLock::new(Arc::new(generation)),
                limiter,
                metrics: Metrics::new(),
                audit,
                clock: opts.clock,
                rng: Rng::new(opts.seed),
                upstream,
                listener_tls,
                budget,
                reload: opts.reload.map(ReloadFnBox),
                access_sink: opts.access_sink.map(AccessSinkBox),
                machine: opts.machine,
                reload_lock: tokio::sync::Mutex::new(()),
                tasks: std::sync::atomic::AtomicUsize::new(0),
                bodies: BodyBudget::default(),
                samples: crate::samples::SampleBook::default(),
                rollouts: std::sync::OnceLock::new(),
                drift,
            }),
        };
        gw.start_background();
        gw.audit_event("start", Map::new());
        Ok(gw)
    }

    /// Where access-log lines go (see [`GatewayOptions::access_sink`]).
    pub fn access_sink(&self) -> Option<AccessSink> {
        self.inner.access_sink.as_ref().map(|s| s.0.clone())
    }

    pub fn generation(&self) -> Arc<Generation> {
        self.inner
            .generation
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    pub fn limiter(&self) -> &Limiter {
        &self.inner.limiter
    }

    /// The TLS a listener serves, when its config names a certificate.
    pub fn listener_tls(&self, l: Listener) -> Option<ServerTls> {
        self.inner.listener_tls[l as usize].clone()
    }

    /// Reloads through the reload function given at construction.
    pub async fn reload(&self) -> Result<(), GatewayError> {
        let Some(f) = &self.inner.reload else {
            return Err(GatewayError::Config(
                "this gateway was started without a config file to reload".into(),
            ));
        };
        let cfg = (f.0)();
        match cfg {
            Ok(cfg) => self.apply(cfg).await,
            Err(e) => {
                let mut m = Map::new();
                m.insert("ok".into(), false.into());
                m.insert("error".into(), e.to_string().into());
                self.audit_event("reload", m);
                Err(e)
            }
        }
    }

    /// Swaps in a new configuration. Listeners (and whether they serve
    /// HTTPS), the limit store and the audit log path stay as they were
    /// started; listener certificates and `[upstream_tls]` files are read
    /// again; in-flight requests finish on the generation they started
    /// with; backends keep their state.
    pub async fn apply(&self, cfg: GatewayConfig) -> Result<(), GatewayError> {
        let _g = self.inner.reload_lock.lock().await;
        let old = self.generation();
        let (new, upstream) = build_generation(
            cfg,
            Some(&old.traffic),
            &self.inner.upstream,
            &self.inner.clock,
        )
        .await?;
        self.inner.upstream.adopt(&upstream);
        for l in Listener::ALL {
            let i = l as usize;
            match (&self.inner.listener_tls[i], &new.listener_keys[i]) {
                (Some(tls), Some(key)) => tls.set(key.clone()),
                (None, None) => {}
                (Some(_), None) => tracing::warn!(
                    listener = l.name(),
                    "the listener keeps serving HTTPS until the next start"
                ),
                (None, Some(_)) => tracing::warn!(
                    listener = l.name(),
                    "the listener serves HTTPS from the next start"
                ),
            }
        }
        *self
            .inner
            .generation
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Arc::new(new);
        self.start_background();
        let mut m = Map::new();
        m.insert("ok".into(), true.into());
        self.audit_event("reload", m);
        Ok(())
    }

    /// Streams being passed on and mirror requests still running.
    pub fn tasks_in_flight(&self) -> usize {
        self.inner.tasks.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stops the audit writer after writing what is queued.
    pub fn close(&self) {
        self.audit_event("stop", Map::new());
        if let Some(a) = &self.inner.audit {
            a.close();
        }
    }

    /// The drift windows of the registry-following models' versions.
    pub fn drift(&self) -> &crate::drift::DriftBook {
        &self.inner.drift
    }

    /// The per-request samples of the models a rollout watches.
    pub fn samples(&self) -> &crate::samples::SampleBook {
        &self.inner.samples
    }

    /// An attempt that a deployment failed (5xx or no answer), as a
    /// sample of that deployment: the request may still be served by a
    /// retry elsewhere.
    fn failed_sample(&self, model: &str, deployment: &str, sent_at: Instant) {
        self.inner.samples.record(
            model,
            deployment,
            keel_canary::analysis::Sample::failed(sent_at.elapsed().as_secs_f64() * 1e3),
        );
    }

    /// Records a rollout's event (weight change, verdict, promotion,
    /// rollback) in the audit log.
    pub fn audit_rollout(&self, event: &str, m: Map<String, Value>) {
        self.audit_event(event, m);
    }

    /// Records a drift alarm or action in the audit log.
    pub fn audit_drift(&self, event: &str, m: Map<String, Value>) {
        self.audit_event(event, m);
    }

    /// The injected clock's time.
    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// The injected clock (the access log stamps its records with it).
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.inner.clock.clone()
    }

    /// A handle that does not keep the gateway alive.
    pub fn downgrade(&self) -> WeakGateway {
        WeakGateway(Arc::downgrade(&self.inner))
    }

    /// Gives the admin API the control plane's rollouts (once; later
    /// calls are ignored).
    pub fn set_rollouts(&self, r: Arc<dyn crate::control::RolloutAdmin>) {
        let _ = self.inner.rollouts.set(r);
    }

    /// The control plane's rollouts, when models follow the registry.
    pub fn rollouts(&self) -> Option<&Arc<dyn crate::control::RolloutAdmin>> {
        self.inner.rollouts.get()
    }

    fn audit_event(&self, event: &str, mut m: Map<String, Value>) {
        if let Some(a) = &self.inner.audit {
            m.insert("event".into(), event.into());
            m.insert("ts".into(), rfc3339(self.inner.clock.now_ms()).into());
            a.record(m);
        }
    }

    /// Health probes for backends that have none, and the JWKS refresh.
    fn start_background(&self) {
        let gen = self.generation();
        let h = gen.cfg.traffic.health;
        if h.enabled {
            for m in gen.traffic.models.values() {
                for d in &m.all {
                    if !d.backend.start_probing() {
                        continue;
                    }
                    let weak = Arc::downgrade(&d.backend);
                    let upstream = self.inner.upstream.clone();
                    let path = d.health_path.clone();
                    tokio::spawn(probe_loop(weak, upstream, path, h));
                }
            }
        }
        if let Some(j) = &gen.jwt {
            if let Some(url) = j.config().jwks_url.clone() {
                let weak = Arc::downgrade(j);
                let upstream = self.inner.upstream.clone();
                let every = Duration::from_secs(j.config().refresh_s.max(1));
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(every).await;
                        let Some(j) = weak.upgrade() else { break };
                        match fetch_jwks(&upstream, &url).await {
                            Ok(k) => j.set_keys(k),
                            Err(e) => {
                                tracing::warn!(%e, "JWKS refresh failed; keeping the keys we have")
                            }
                        }
                    }
                });
            }
        }
    }

    /// Renders the metrics text with backend gauges.
    pub fn render_metrics(&self) -> String {
        let gen = self.generation();
        let now = Instant::now();
        let mut b: Vec<(String, bool, bool)> = gen
            .traffic
            .backends
            .values()
            .map(|b| {
                (
                    b.url.label(),
                    b.healthy.load(std::sync::atomic::Ordering::Relaxed),
                    b.open_until(now).is_some(),
                )
            })
            .collect();
        b.sort();
        let mut out = self.inner.metrics.render(&b);
        self.inner.drift.render(&mut out);
        out.push_str(
            "# HELP keel_body_bytes_in_flight Request and response body bytes the gateway holds.\n\
             # TYPE keel_body_bytes_in_flight gauge\n",
        );
        out.push_str(&format!(
            "keel_body_bytes_in_flight {}\n",
            self.inner.bodies.held()
        ));
        out
    }

    /// Models, deployments and backend states, for the admin API.
    pub fn status(&self) -> Value {
        let gen = self.generation();
        let now = Instant::now();
        let mut models: Vec<Value> = gen
            .traffic
            .models
            .values()
            .map(|m| {
                json!({
                    "name": &*m.name,
                    "protocol": m.protocol,
                    "fallback": m.fallback,
                    "mirror": m.mirror.as_ref().map(|(d, p)| json!({"deployment": &*d.name, "percent": p})),
                    "deployments": m.all.iter().map(|d| json!({
                        "name": &*d.name,
                        "url": d.backend.url.label(),
                        "weight": d.weight,
                        "healthy": d.backend.healthy.load(std::sync::atomic::Ordering::Relaxed),
                        "circuit": d.backend.state(now),
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        models.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
        json!({"version": 1, "models": models})
    }

    fn request_id(&self) -> RequestId {
        RequestId::new(self.inner.rng.next_u64())
    }

    /// Answers one request on the public listener.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<GwBody> {
        let started = Instant::now();
        let gen = self.generation();
        let mut pending = Pending {
            gw: self,
            method: req.method().clone(),
            access_log: gen.cfg.server.access_log,
            started,
            armed: true,
            ctx: Ctx {
                id: self.request_id(),
                route: "unmatched",
                ..Ctx::default()
            },
        };
        let result = self.dispatch(&gen, req, &mut pending.ctx, started).await;
        pending.armed = false;
        let mut ctx = std::mem::take(&mut pending.ctx);
        let (mut resp, streaming) = match result {
            Ok((r, s)) => (r, s),
            Err(Fail::Api(e)) => (e.into_response(), false),
            Err(Fail::Upstream(status, ct, body, ra)) => {
                let mut r = Response::new(GwBody::full(body));
                *r.status_mut() = status;
                if let Some(ct) = ct {
                    r.headers_mut().insert(http::header::CONTENT_TYPE, ct);
                }
                if let Some(ra) = ra {
                    r.headers_mut().insert(
                        http::header::RETRY_AFTER,
                        HeaderValue::from(ra.as_secs_f64().ceil() as u64),
                    );
                }
                (r, false)
            }
        };
        ctx.status = resp.status().as_u16();
        let h = resp.headers_mut();
        h.reserve(12);
        h.insert(X_REQUEST_ID, ctx.id.header_value());
        if let Some(info) = &ctx.rate {
            rate_headers(h, info);
        }
        if let Some((m, d)) = ctx.served_headers.take() {
            h.insert(X_KEEL_MODEL, m);
            h.insert(X_KEEL_DEPLOYMENT, d);
        }
        let info = access_info(&ctx, streaming);
        if !streaming {
            if let Some(synced) = self.finish(ctx, started.elapsed()) {
                // `audit.sync`: the response waits for its line on disk,
                // and is not released unrecorded.
                if !synced.await.unwrap_or(false) {
                    resp = ApiError::unavailable(
                        "the audit log could not be written; the response was withheld",
                        None,
                    )
                    .into_response();
                    resp.headers_mut()
                        .insert(X_REQUEST_ID, info.request_id.header_value());
                }
            }
        }
        if info.key.is_some() {
            // A client with a valid key keeps its connection's place
            // (keel-http: never closed to make room for another).
            resp.extensions_mut().insert(keel_http::Authenticated);
        }
        resp.extensions_mut().insert(info);
        resp
    }

    /// Metrics and audit for a finished request. The metrics are counted
    /// here; the audit event is queued as it is and serialised by the
    /// audit writer.
    fn finish(&self, ctx: Ctx, total: Duration) -> Option<tokio::sync::oneshot::Receiver<bool>> {
        let m = &self.inner.metrics;
        let model = match (&ctx.served_model, &ctx.model) {
            (Some(m), _) => m,
            (None, Some(m)) if ctx.model_configured => m.as_str(),
            (None, Some(_)) => "unknown",
            (None, None) => "",
        };
        let deployment = ctx.deployment.as_deref().unwrap_or("");
        let key = ctx.key.as_deref().unwrap_or("");
        m.request(
            RequestLabels {
                route: ctx.route,
                model,
                deployment,
                key,
                code: ctx.status,
            },
            total,
            ctx.backend_time,
        );
        if let Some(u) = ctx.usage {
            m.tokens(model, deployment, key, u.prompt, u.completion);
        }
        if !deployment.is_empty() {
            let sample = keel_canary::analysis::Sample {
                error: ctx.status >= 500,
                latency_ms: Some(total.as_secs_f64() * 1e3),
                completion_tokens: ctx
                    .usage
                    .filter(|_| !ctx.usage_estimated)
                    .map(|u| u.completion.try_into().unwrap_or(u32::MAX)),
                finish_reason: ctx.finish_reason,
                answer_chars: ctx.answer_chars,
                output_mean: ctx.output_mean,
                streamed: ctx.stream,
                stream_aborted: ctx.stream && ctx.stream_aborted,
            };
            self.inner.drift.record(
                model,
                deployment,
                &sample,
                ctx.usage.filter(|_| !ctx.usage_estimated).map(|u| u.prompt),
            );
            if let Some(inputs) = ctx.oip_inputs.as_deref().filter(|_| !sample.error) {
                self.inner.drift.record_inputs(model, deployment, inputs);
            }
            self.inner.samples.record(model, deployment, sample);
        }
        if let Some(kind) = ctx.denied {
            m.error(ctx.route, kind);
        } else if ctx.status >= 500 {
            m.error(ctx.route, "upstream");
        } else if ctx.status >= 400 {
            m.error(ctx.route, "client");
        }
        let audit = self.inner.audit.as_ref()?;
        if ctx.route == "/healthz" || ctx.route == "/readyz" {
            return None;
        }
        let event = Finished {
            ts_ms: self.inner.clock.now_ms(),
            total,
            ctx,
        };
        if audit.syncs() {
            Some(audit.record_synced(event))
        } else {
            audit.record(event);
            None
        }
    }

    fn authenticate(
        &self,
        gen: &Generation,
        headers: &HeaderMap,
        ctx: &mut Ctx,
    ) -> Result<Identity, ApiError> {
        let denied = |ctx: &mut Ctx, why: String| {
            ctx.denied = Some("unauthenticated");
            ctx.error = Some(why);
            ApiError::unauthorized()
        };
        let Some(token) = credential(headers) else {
            return Err(denied(ctx, "no credentials".into()));
        };
        if let (Some(j), true) = (&gen.jwt, looks_like_jwt(token)) {
            return j
                .verify(token)
                .map_err(|why| denied(ctx, format!("JWT: {why}")));
        }
        let Some(ring) = &gen.keys else {
            return Err(denied(ctx, "not a JWT, and no keys are configured".into()));
        };
        match ring.lookup(token) {
            Ok(Some(k)) => Ok(k),
            Ok(None) => Err(denied(ctx, "unknown or revoked key".into())),
            Err(e) => {
                tracing::error!(error = %e, "key file unreadable: refusing every key until it is fixed");
                Err(denied(ctx, format!("key file unreadable: {e}")))
            }
        }
    }

    async fn dispatch(
        &self,
        gen: &Arc<Generation>,
        req: Request<Incoming>,
        ctx: &mut Ctx,
        started: Instant,
    ) -> Result<(Response<GwBody>, bool), Fail> {
        let route = request::route(req.method(), req.uri().path());
        if let Ok(r) = &route {
            ctx.route = r.template();
            match r {
                Route::Live => {
                    return Ok((
                        json_response(StatusCode::OK, json!({"status": "live"})),
                        false,
                    ))
                }
                Route::Ready => return Ok((self.readiness(gen), false)),
                _ => {}
            }
        }
        let ident = self.authenticate(gen, req.headers(), ctx)?;
        ctx.key = Some(ident.id.clone());
        ctx.team = ident.team.clone();
        let route = match route {
            Ok(r) => r,
            Err(RouteError::NotFound) => {
                let e = ApiError::not_found("no such route");
                return Err(self.refuse(gen, &ident, ctx, e).await);
            }
            Err(RouteError::MethodNotAllowed) => {
                let e = ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "invalid_request_error",
                    "method not allowed on this route",
                );
                return Err(self.refuse(gen, &ident, ctx, e).await);
            }
        };
        let op = route.operation().unwrap_or("models");
        match route {
            Route::Models => {
                if !gen.rbac.allows(&ident.roles, op, None) {
                    ctx.denied = Some("forbidden");
                    let e = ApiError::forbidden("your roles do not allow listing models");
                    return Err(self.refuse(gen, &ident, ctx, e).await);
                }
                let mut names: Vec<&String> = gen
                    .traffic
                    .models
                    .keys()
                    .filter(|m| gen.rbac.allows(&ident.roles, "models", Some(m)))
                    .collect();
                names.sort();
                let data: Vec<Value> = names
                    .iter()
                    .map(|n| json!({"id": n, "object": "model", "created": 0, "owned_by": "keel"}))
                    .collect();
                Ok((
                    json_response(StatusCode::OK, json!({"object": "list", "data": data})),
                    false,
                ))
            }
            Route::ChatCompletions | Route::Completions | Route::Embeddings => {
                self.openai(gen, req, route, op, ident, ctx, started).await
            }
            Route::OipMetadata(m) => self
                .oip(gen, req, m, op, "", ident, ctx)
                .await
                .map(|r| (r, false)),
            Route::OipReady(m) => self
                .oip(gen, req, m, op, "/ready", ident, ctx)
                .await
                .map(|r| (r, false)),
            Route::OipInfer(m) => self
                .oip(gen, req, m, op, "/infer", ident, ctx)
                .await
                .map(|r| (r, false)),
            Route::Live | Route::Ready => Err(ApiError::not_found("no such route").into()),
        }
    }

    fn readiness(&self, gen: &Generation) -> Response<GwBody> {
        let now = Instant::now();
        let ready = gen.traffic.backends.values().any(|b| {
            b.healthy.load(std::sync::atomic::Ordering::Relaxed) && b.open_until(now).is_none()
        });
        if ready {
            json_response(StatusCode::OK, json!({"status": "ready"}))
        } else {
            json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "not ready", "error": "no backend can serve"}),
            )
        }
    }

    fn model_route(
        &self,
        gen: &Generation,
        name: &str,
        protocol: Protocol,
    ) -> Option<Arc<ModelRoute>> {
        gen.traffic
            .models
            .get(name)
            .filter(|m| m.protocol == protocol)
            .cloned()
    }
}

/// Reads and checks everything a configuration names (keys, JWKS,
/// certificates) and builds its routing table; returns it with the client
/// for `[upstream_tls]` (`upstream` itself when nothing changed), which the
/// JWKS was fetched with.
async fn build_generation(
    cfg: GatewayConfig,
    previous: Option<&Traffic>,
    upstream: &Upstream,
    clock: &Arc<dyn Clock>,
) -> Result<(Generation, Upstream), GatewayError> {
    let upstream = upstream.prepare(&cfg.upstream_tls)?;
    if cfg.uses_https() && upstream.trusted_roots() == 0 {
        tracing::warn!(
            "no trusted CA certificates (no system roots found and no upstream_tls.ca_file): HTTPS to backends and JWKS URLs will fail"
        );
    }
    let mut listener_keys = [None, None, None];
    for l in Listener::ALL {
        if let Some((cert, key)) = l.tls_files(&cfg) {
            listener_keys[l as usize] = Some(crate::tls::certified_key(&cert, &key)?);
        }
    }
    let keys = cfg
        .auth
        .keys_file
        .as_deref()
        .map(KeyRing::open)
        .transpose()?;
    let jwt = match &cfg.auth.jwt {
        None => None,
        Some(j) => {
            let set = match (&j.jwks_file, &j.jwks_url) {
                (Some(f), _) => JwtVerifier::load_file(f)?,
                (None, Some(u)) => fetch_jwks(&upstream, u).await?,
                (None, None) => {
                    return Err(GatewayError::Config("auth.jwt has no key source".into()))
                }
            };
            Some(Arc::new(JwtVerifier::new(j.clone(), set, clock.clone())))
        }
    };
    let traffic = Traffic::build(&cfg, previous);
    let rbac = Rbac::new(cfg.roles.clone());
    Ok((
        Generation {
            cfg,
            traffic,
            keys,
            jwt,
            rbac,
            listener_keys,
        },
        upstream,
    ))
}

async fn fetch_jwks(
    upstream: &Upstream,
    url: &str,
) -> Result<jsonwebtoken::jwk::JwkSet, GatewayError> {
    let err = |reason: String| GatewayError::Jwks {
        url: url.to_owned(),
        reason,
    };
    let mut h = HeaderMap::new();
    h.insert(
        http::header::ACCEPT,
        HeaderValue::from_static("application/json"),
    );
    let uri = url.parse::<http::Uri>().map_err(|e| err(e.to_string()))?;
    let r = upstream
        .send(Method::GET, uri, h, Bytes::new(), Duration::from_secs(5))
        .await
        .map_err(err)?;
    if !r.status().is_success() {
        return Err(err(format!("status {}", r.status())));
    }
    let b = read_limited(r.into_body(), 1 << 20, Duration::from_secs(5))
        .await
        .map_err(|_| err("body failed".into()))?;
    crate::auth::parse_jwks(&String::from_utf8_lossy(&b), url)
}

async fn probe_loop(
    backend: Weak<Backend>,
    upstream: Upstream,
    path: Arc<str>,
    h: crate::config::HealthConfig,
) {
    let every = Duration::from_millis(h.interval_ms);
    let timeout = Duration::from_millis(h.timeout_ms);
    loop {
        tokio::time::sleep(every).await;
        let Some(b) = backend.upgrade() else { break };
        let sent = async {
            let uri = b.url.request_uri(&path)?;
            upstream
                .send(Method::GET, uri, HeaderMap::new(), Bytes::new(), timeout)
                .await
        };
        let ok = match sent.await {
            Ok(r) => {
                let ok = r.status().is_success();
                let _ = read_limited(r.into_body(), 64 << 10, timeout).await;
                ok
            }
            Err(_) => false,
        };
        b.probe_result(ok, h.unhealthy_after, h.healthy_after);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A body of the given pieces; `None` is a broken connection.
    struct Pieces(VecDeque<Option<&'static [u8]>>);

    impl http_body::Body for Pieces {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
            Poll::Ready(self.0.pop_front().map(|p| match p {
                Some(b) => Ok(http_body::Frame::data(Bytes::from_static(b))),
                None => Err(std::io::Error::other("reset")),
            }))
        }
    }

    fn pieces(p: &[Option<&'static [u8]>]) -> Pieces {
        Pieces(p.iter().copied().collect())
    }

    #[tokio::test]
    async fn bodies_are_collected_within_their_limit() {
        let t = Duration::from_secs(5);
        let one: &'static [u8] = b"{\"usage\":{}}";
        let b = read_limited(pieces(&[Some(one)]), 100, t)
            .await
            .ok()
            .expect("one piece");
        assert_eq!(
            b.as_ptr(),
            one.as_ptr(),
            "one piece is passed on without a copy"
        );
        let b = read_limited(
            pieces(&[Some(b"ab"), Some(b""), Some(b"cd"), Some(b"ef")]),
            6,
            t,
        )
        .await
        .ok()
        .expect("pieces");
        assert_eq!(&b[..], b"abcdef");
        assert!(matches!(
            read_limited(pieces(&[Some(b"abc"), Some(b"def")]), 5, t).await,
            Err(BodyError::TooLarge)
        ));
        assert!(matches!(
            read_limited(pieces(&[Some(b"abc"), None]), 50, t).await,
            Err(BodyError::Broken)
        ));
        assert_eq!(
            read_limited(pieces(&[]), 0, t).await.ok().map(|b| b.len()),
            Some(0)
        );
        let full = http_body_util::Full::new(Bytes::from_static(b"0123456789"));
        assert!(matches!(
            read_limited(full, 9, t).await,
            Err(BodyError::TooLarge)
        ));
    }
}
