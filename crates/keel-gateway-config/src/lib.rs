//! The gateway's configuration file (TOML, every key documented in
//! docs/serve.md) and its validated form. `FileConfig` is the file as
//! written, every key optional and unknown keys rejected; `GatewayConfig`
//! has every default filled in and every cross-reference checked.
//!
//! A leaf under the gateway's data plane (keel-gateway), its control
//! plane (keel-control) and `keel review`: it holds the configuration's
//! types and the values they are checked into (a backend's URL, a Redis
//! URL, the audit log's checkpoint key, a drift baseline), and it starts
//! nothing: no socket, no task, no clock.

pub mod backend_url;
mod checkpoints;
mod control;
pub mod drift_baseline;
pub mod drift_features;
mod error;
pub mod redis_url;

pub use backend_url::BackendUrl;
pub use checkpoints::Checkpoints;
pub use error::{error_kind, ConfigError};
pub use redis_url::{redact, RedisAddr};

use control::{drift_config, model_registry, registry_config, rollout_config};
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: FileServer,
    pub admin: Option<FileListener>,
    pub metrics: Option<FileListener>,
    #[serde(default)]
    pub auth: FileAuth,
    #[serde(default)]
    pub roles: BTreeMap<String, FileRole>,
    #[serde(default)]
    pub limits: FileLimits,
    #[serde(default)]
    pub traffic: FileTraffic,
    #[serde(default)]
    pub models: Vec<FileModel>,
    #[serde(default)]
    pub audit: FileAudit,
    #[serde(default)]
    pub upstream_tls: FileUpstreamTls,
    pub registry: Option<FileRegistry>,
}

/// The model registry that models with a `registry` key follow.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRegistry {
    pub url: String,
    pub key_file: PathBuf,
    pub ca_file: Option<PathBuf>,
    pub poll_ms: Option<u64>,
    pub public_key_file: Option<PathBuf>,
    pub write_key_file: Option<PathBuf>,
    pub rollout_state_file: Option<PathBuf>,
    pub rollout_store: Option<RolloutStore>,
    pub rollout_lease_ms: Option<u64>,
    pub drift_reference_requests: Option<usize>,
    pub drift_window_requests: Option<usize>,
}

/// A registry-following model's progressive rollouts.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRollout {
    pub steps: Option<Vec<u32>>,
    pub interval_s: Option<u64>,
    pub min_canary_samples: Option<u64>,
    pub max_intervals: Option<u32>,
    pub latency_min_increase_ms: Option<f64>,
}

/// A registry-following model's drift reference and action.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileModelDrift {
    pub baseline_file: Option<PathBuf>,
    pub action: Option<DriftAction>,
    pub fallback_version: Option<u64>,
    pub psi_threshold: Option<f64>,
    pub consecutive: Option<u32>,
    pub interval_s: Option<u64>,
}

/// Where a gateway keeps its rollouts (`registry.rollout_store`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RolloutStore {
    /// `registry.rollout_state_file`: one gateway's own rollouts.
    File,
    /// The Redis of `limits.redis_url`, shared by every replica: one
    /// rollout per model for the whole fleet, driven by the replica that
    /// holds its lease.
    Redis,
}

/// What the gateway does when a stable version's drift lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DriftAction {
    /// A log line, an audit event and a metric.
    Notify,
    /// As notify, and the stable alias moves to `fallback_version`.
    Fallback,
}

/// A model's registry model and aliases.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileModelRegistry {
    pub model: String,
    pub stable: Option<String>,
    pub canary: Option<String>,
    pub require_signature: Option<bool>,
    pub allowed_backends: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileServer {
    pub listen: Option<SocketAddr>,
    pub max_body_bytes: Option<usize>,
    pub max_body_bytes_in_flight: Option<usize>,
    pub max_connections: Option<usize>,
    pub max_connections_per_client: Option<usize>,
    pub max_header_bytes: Option<usize>,
    pub header_timeout_ms: Option<u64>,
    pub body_timeout_ms: Option<u64>,
    pub write_timeout_ms: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
    pub shutdown_grace_s: Option<f64>,
    pub pin_header: Option<String>,
    pub access_log: Option<bool>,
    pub workers: Option<usize>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileListener {
    pub listen: SocketAddr,
    pub token_sha256: String,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

/// How the gateway connects to `https://` backends and JWKS URLs.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileUpstreamTls {
    pub system_roots: Option<bool>,
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileAuth {
    pub keys_file: Option<PathBuf>,
    pub jwt: Option<FileJwt>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileJwt {
    pub jwks_file: Option<PathBuf>,
    pub jwks_url: Option<String>,
    pub issuer: String,
    pub audience: String,
    pub roles_claim: Option<String>,
    pub team_claim: Option<String>,
    pub leeway_s: Option<u64>,
    pub refresh_s: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRole {
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub operations: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLimits {
    pub redis_url: Option<String>,
    pub default_max_tokens: Option<u64>,
    pub prompt_bytes_per_token: Option<u64>,
    pub prompt_tokens_per_message: Option<u64>,
    pub default: Option<LimitSet>,
    #[serde(default)]
    pub keys: BTreeMap<String, LimitSet>,
    #[serde(default)]
    pub teams: BTreeMap<String, LimitSet>,
}

/// Limits of one key or team; an absent limit is no limit.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSet {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub tokens_per_day: Option<u64>,
    pub tokens_per_month: Option<u64>,
}

impl LimitSet {
    pub fn is_empty(&self) -> bool {
        *self == LimitSet::default()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTraffic {
    pub connect_timeout_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub stream_idle_timeout_ms: Option<u64>,
    pub retries: Option<u32>,
    pub retry_budget_ratio: Option<f64>,
    pub retry_budget_min: Option<u32>,
    #[serde(default)]
    pub circuit: FileCircuit,
    #[serde(default)]
    pub health: FileHealth,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileCircuit {
    pub window_s: Option<u64>,
    pub min_requests: Option<u32>,
    pub failure_ratio: Option<f64>,
    pub trip_s: Option<f64>,
    pub failure_statuses: Option<Vec<u16>>,
    pub max_retry_after_s: Option<f64>,
    pub min_identities: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHealth {
    pub enabled: Option<bool>,
    pub interval_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub unhealthy_after: Option<u32>,
    pub healthy_after: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileModel {
    pub name: String,
    pub protocol: Option<Protocol>,
    #[serde(default)]
    pub fallback: Vec<String>,
    pub mirror: Option<FileMirror>,
    #[serde(default)]
    pub deployments: Vec<FileDeployment>,
    pub registry: Option<FileModelRegistry>,
    pub rollout: Option<FileRollout>,
    pub drift: Option<FileModelDrift>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileMirror {
    pub deployment: String,
    pub percent: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDeployment {
    pub name: String,
    pub url: String,
    pub weight: Option<u32>,
    pub model: Option<String>,
    pub health_path: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileAudit {
    pub path: Option<PathBuf>,
    pub include_content: Option<bool>,
    pub group: Option<String>,
    pub hmac_key_file: Option<PathBuf>,
    pub checkpoint_every: Option<u64>,
    pub anchor_file: Option<PathBuf>,
    pub sync: Option<bool>,
}

/// Which API a model's backends speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// OpenAI-compatible (vLLM, llama.cpp server, TGI).
    Openai,
    /// Open Inference Protocol v2 (KServe, Triton).
    Oip,
}

/// The effective configuration.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayConfig {
    pub server: ServerConfig,
    pub admin: Option<ListenerConfig>,
    pub metrics: Option<ListenerConfig>,
    pub auth: AuthConfig,
    pub roles: BTreeMap<String, RoleConfig>,
    pub limits: LimitsConfig,
    pub traffic: TrafficConfig,
    pub models: Vec<ModelConfig>,
    pub audit: AuditConfig,
    pub upstream_tls: UpstreamTlsConfig,
    /// The registry that models with `registry` follow.
    pub registry: Option<RegistryConfig>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    /// Request and non-streamed response bodies held at once, across the
    /// gateway; a body that would go over gets 503.
    pub max_body_bytes_in_flight: usize,
    /// Open connections per listener; more are answered 503 and closed.
    /// `None`: the public listener's cap is chosen at start from the
    /// machine's open-file limit and memory (`server::connection_cap`
    /// over `GatewayOptions::machine`, which `keel serve` reads; 1024
    /// without), the admin and metrics listeners' is 1024. Read at start
    /// only.
    pub max_connections: Option<usize>,
    /// Open connections per listener from one client (an IPv4 address or
    /// an IPv6 /64); more are answered 503 and closed.
    pub max_connections_per_client: usize,
    /// A connection's read (request head) and write buffer (hyper's
    /// `max_buf_size`); a longer head gets 431.
    pub max_header_bytes: usize,
    pub header_timeout_ms: u64,
    pub body_timeout_ms: u64,
    /// A response write that makes no progress this long closes the
    /// connection.
    pub write_timeout_ms: u64,
    /// A kept-alive connection waits this long for its next request.
    pub idle_timeout_ms: u64,
    pub shutdown_grace_s: f64,
    pub pin_header: String,
    pub access_log: bool,
    /// Runtime worker threads; `None`: one per CPU. Read at start only.
    pub workers: Option<usize>,
    /// PEM certificate chain and key: the listener serves HTTPS (both or
    /// neither; validation checks).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ListenerConfig {
    pub listen: SocketAddr,
    /// SHA-256 (hex) of the bearer token this listener accepts.
    pub token_sha256: String,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

/// Trust and identity for HTTPS to backends and JWKS URLs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UpstreamTlsConfig {
    /// Trust the system's roots (rustls-native-certs).
    pub system_roots: bool,
    /// Also trust the CAs in this PEM file.
    pub ca_file: Option<PathBuf>,
    /// Present this certificate chain and key (both or neither).
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

/// A listener's certificate and key, when it serves HTTPS.
pub fn listener_tls(cert: &Option<PathBuf>, key: &Option<PathBuf>) -> Option<(PathBuf, PathBuf)> {
    cert.clone().zip(key.clone())
}

impl ServerConfig {
    /// Certificate and key when the public listener serves HTTPS.
    pub fn tls(&self) -> Option<(PathBuf, PathBuf)> {
        listener_tls(&self.tls_cert, &self.tls_key)
    }
}

impl ListenerConfig {
    /// Certificate and key when this listener serves HTTPS.
    pub fn tls(&self) -> Option<(PathBuf, PathBuf)> {
        listener_tls(&self.tls_cert, &self.tls_key)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AuthConfig {
    pub keys_file: Option<PathBuf>,
    pub jwt: Option<JwtConfig>,
}

#[derive(Debug, Clone, Serialize)]
pub struct JwtConfig {
    pub jwks_file: Option<PathBuf>,
    pub jwks_url: Option<String>,
    pub issuer: String,
    pub audience: String,
    pub roles_claim: String,
    pub team_claim: String,
    pub leeway_s: u64,
    pub refresh_s: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoleConfig {
    pub models: Vec<String>,
    pub operations: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LimitsConfig {
    pub redis_url: Option<String>,
    pub default_max_tokens: u64,
    /// Bytes of prompt text counted as one token when reserving (1-16).
    pub prompt_bytes_per_token: u64,
    /// Tokens a chat template adds a message (and once for the reply's
    /// header), reserved on top of the text (0-1024).
    pub prompt_tokens_per_message: u64,
    pub default: LimitSet,
    pub keys: BTreeMap<String, LimitSet>,
    pub teams: BTreeMap<String, LimitSet>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TrafficConfig {
    pub connect_timeout_ms: u64,
    pub timeout_ms: u64,
    pub stream_idle_timeout_ms: u64,
    pub retries: u32,
    pub retry_budget_ratio: f64,
    pub retry_budget_min: u32,
    pub circuit: CircuitConfig,
    pub health: HealthConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CircuitConfig {
    pub window_s: u64,
    pub min_requests: u32,
    pub failure_ratio: f64,
    pub trip_s: f64,
    /// Backend answers that count as failures (besides connection errors
    /// and timeouts); any other answer shows the backend is up.
    pub failure_statuses: Vec<u16>,
    /// The longest a backend's `Retry-After` keeps the circuit open.
    pub max_retry_after_s: f64,
    /// Distinct callers whose requests failed in the window before the
    /// circuit may open: one caller's failing input cannot open it alone.
    pub min_identities: u32,
}

impl Default for CircuitConfig {
    fn default() -> Self {
        Self {
            window_s: 10,
            min_requests: 5,
            failure_ratio: 0.5,
            trip_s: 5.0,
            failure_statuses: vec![502, 503, 504],
            max_retry_after_s: 30.0,
            min_identities: 2,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct HealthConfig {
    pub enabled: bool,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct RegistryConfig {
    /// `http://host:port` or `https://host:port` of `keel model serve`.
    pub url: String,
    /// A file holding a registry API key with read rights.
    pub key_file: PathBuf,
    /// Also trust the CAs in this PEM file for an `https://` registry
    /// (besides the system's roots).
    pub ca_file: Option<PathBuf>,
    pub poll_ms: u64,
    /// The trusted key (PEM) signatures of versions are checked against,
    /// for models with `require_signature`.
    pub public_key_file: Option<PathBuf>,
    /// A file holding a registry API key with write rights: rollouts move
    /// and delete aliases with it.
    pub write_key_file: Option<PathBuf>,
    /// Where the rollouts' state is kept across restarts.
    pub rollout_state_file: PathBuf,
    /// `file` (the state file, one gateway) or `redis` (shared by the
    /// replicas through `limits.redis_url`).
    pub rollout_store: RolloutStore,
    /// With `redis`: how long a replica's lease on driving a rollout lasts
    /// unless renewed (it renews every third of it): the longest a rollout
    /// waits for another replica after its driver died.
    pub rollout_lease_ms: u64,
    /// Output drift of a registry version: the first this many answers
    /// it serves are the reference...
    pub drift_reference_requests: usize,
    /// ...and the last this many the current window.
    pub drift_window_requests: usize,
}

/// How a registry-following model's rollouts go (`[models.rollout]`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolloutConfig {
    /// Canary weights in percent, rising; 100 is the promotion.
    pub steps: Vec<u32>,
    /// Seconds between two analyses of a step.
    pub interval_s: u64,
    /// Canary requests a step needs to advance.
    pub min_canary_samples: u64,
    /// Intervals a step may lack its samples before the rollout pauses.
    pub max_intervals: u32,
    /// The least increase of the canary's median latency, in
    /// milliseconds, that fails the latency check (with its ratio).
    pub latency_min_increase_ms: f64,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            steps: vec![1, 5, 25, 50, 100],
            interval_s: 60,
            min_canary_samples: 100,
            max_intervals: 20,
            latency_min_increase_ms: keel_canary::analysis::Thresholds::default()
                .latency_min_increase_ms,
        }
    }
}

impl RolloutConfig {
    /// The analysis thresholds of this model's rollouts.
    pub fn thresholds(&self) -> keel_canary::analysis::Thresholds {
        keel_canary::analysis::Thresholds {
            latency_min_increase_ms: self.latency_min_increase_ms,
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelRegistryConfig {
    /// The model's name in the registry.
    pub model: String,
    /// The alias of the version taking the traffic.
    pub stable: String,
    /// The alias of a candidate version.
    pub canary: Option<String>,
    pub require_signature: bool,
    /// The backends the model's versions may name in their
    /// `keel.backend` tag (required with `require_signature`); empty: any.
    pub allowed_backends: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelConfig {
    pub name: String,
    pub protocol: Protocol,
    pub fallback: Vec<String>,
    pub mirror: Option<MirrorConfig>,
    /// For a model with `registry`, the template of the versions'
    /// deployments (see `registry_follow`): routed only after the registry
    /// has named the versions.
    pub deployments: Vec<DeploymentConfig>,
    pub registry: Option<ModelRegistryConfig>,
    /// Rollouts of a model that follows the registry.
    pub rollout: RolloutConfig,
    /// Drift reference and action of a model that follows the registry.
    pub drift: DriftConfig,
}

/// A registry-following model's drift reference and action
/// (`[models.drift]`).
#[derive(Debug, Clone, Serialize)]
pub struct DriftConfig {
    /// A recorded baseline: the reference of every version's drift.
    pub baseline_file: Option<PathBuf>,
    pub action: DriftAction,
    /// The registry version the stable alias moves to (`fallback`).
    pub fallback_version: Option<u64>,
    /// The largest PSI of a version's features above this is a breach.
    pub psi_threshold: f64,
    /// Consecutive conclusive breaches before the action.
    pub consecutive: u32,
    /// Seconds between two evaluations.
    pub interval_s: u64,
    /// The baseline read from `baseline_file`.
    #[serde(skip)]
    pub baseline: Option<std::sync::Arc<crate::drift_baseline::Baseline>>,
}

impl Default for DriftConfig {
    fn default() -> Self {
        DriftConfig {
            baseline_file: None,
            action: DriftAction::Notify,
            fallback_version: None,
            psi_threshold: 0.25,
            consecutive: 3,
            interval_s: 60,
            baseline: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct MirrorConfig {
    pub deployment: String,
    pub percent: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeploymentConfig {
    pub name: String,
    /// `http://` or `https://host:port` with an optional path prefix.
    pub url: String,
    pub weight: u32,
    /// The model name sent to the backend.
    pub model: String,
    pub health_path: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct AuditConfig {
    pub path: Option<PathBuf>,
    pub include_content: bool,
    /// The group that may read the log (file mode 0640); `None`: 0600.
    pub group: Option<u32>,
    pub hmac_key_file: Option<PathBuf>,
    pub checkpoint_every: u64,
    /// Where the latest checkpoint is kept outside the log (with
    /// checkpoints: `anchor_file`, else `<path>.anchor`).
    pub anchor_file: Option<PathBuf>,
    /// Sync a request's line to disk before its response is released.
    pub sync: bool,
    /// The key of the log's signed checkpoints (read from `hmac_key_file`),
    /// and how many lines apart.
    #[serde(skip)]
    pub checkpoints: Option<crate::Checkpoints>,
}

/// The audit log's HMAC key: a file its owner alone may read, of at least
/// 32 bytes (surrounding whitespace is not part of the key).
fn read_hmac_key(path: &Path) -> Result<Vec<u8>, ConfigError> {
    use std::os::unix::fs::PermissionsExt;
    let bad =
        |m: String| ConfigError::Config(format!("audit.hmac_key_file {}: {m}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(bad(
            "must be readable by its owner only (chmod 600): it is a secret".into(),
        ));
    }
    let bytes =
        keel_fs::read_regular(path, keel_fs::MAX_CONFIG_BYTES).map_err(|e| bad(e.to_string()))?;
    let key = bytes.trim_ascii().to_vec();
    if key.len() < 32 {
        return Err(bad(format!(
            "{} bytes; a key needs at least 32 (openssl rand -hex 32 > FILE)",
            key.len()
        )));
    }
    Ok(key)
}

/// A group's id from a number or a name in `/etc/group`.
fn group_id(name: &str, etc_group: &Path) -> Result<u32, String> {
    if let Ok(id) = name.parse::<u32>() {
        return Ok(id);
    }
    let text = keel_fs::read_regular_to_string(etc_group, keel_fs::MAX_CONFIG_BYTES)
        .map_err(|e| format!("cannot read {}: {e}", etc_group.display()))?;
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let n = f.next()?;
            let id = f.nth(1)?.parse::<u32>().ok()?;
            (n == name).then_some(id)
        })
        .next()
        .ok_or_else(|| format!("no group named {name:?} in {}", etc_group.display()))
}

/// The smallest `server.max_header_bytes` (hyper's smallest buffer).
pub const MIN_HEADER_BYTES: usize = 8192;
/// The largest `server.max_header_bytes`.
pub const MAX_HEADER_BYTES: usize = 1 << 20;

/// The operations a role may be granted.
pub const OPERATIONS: &[&str] = &[
    "chat",
    "completions",
    "embeddings",
    "models",
    "infer",
    "metadata",
    "pin",
];

impl TrafficConfig {
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// A TOML error as one line that says where: `line L, column C, key
/// K: message`. The key is the dotted path of the `key = value` line the
/// error points into (table header plus key); the value itself is never
/// repeated, since a config line may hold a secret such as a Redis URL's
/// password.
fn located(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return e.message().to_owned();
    };
    let start = span.start.min(text.len());
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = text[line_start..start].chars().count() + 1;
    let this = text[line_start..].lines().next().unwrap_or("");
    let key = this
        .split_once('=')
        .map(|(k, _)| k.trim())
        .filter(|k| !k.is_empty() && !k.starts_with('[') && !k.starts_with('#'))
        .map(|k| {
            let table = before[..line_start].lines().rev().find_map(|l| {
                let l = l.trim();
                let inner = l
                    .strip_prefix("[[")
                    .and_then(|r| r.split_once("]]"))
                    .or_else(|| l.strip_prefix('[').and_then(|r| r.split_once(']')));
                inner.map(|(t, _)| t.trim().to_owned())
            });
            match table {
                Some(t) if !t.is_empty() => format!(", key {t}.{k}"),
                _ => format!(", key {k}"),
            }
        })
        .unwrap_or_default();
    format!(
        "line {line}, column {column}{key}: {}",
        redact_values(e.message().trim_end())
    )
}

/// serde's messages quote the value they could not use (`invalid type:
/// string "..."`, `integer `5``, `unknown variant `x``); a config value may
/// be a secret, so the quoted value is dropped. Field names and the
/// expected ones stay.
fn redact_values(msg: &str) -> String {
    const BEFORE_VALUE: &[&str] = &[
        "string ",
        "integer ",
        "floating point ",
        "boolean ",
        "character ",
        "variant ",
    ];
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while !rest.is_empty() {
        let hit = BEFORE_VALUE
            .iter()
            .filter_map(|w| rest.find(w).map(|i| (i, w.len())))
            .filter(|&(i, n)| matches!(rest[i + n..].chars().next(), Some('"' | '`')))
            .min();
        let Some((i, n)) = hit else {
            out.push_str(rest);
            break;
        };
        out.push_str(rest[..i + n].trim_end());
        let quoted = &rest[i + n..];
        let q = quoted.chars().next().unwrap_or('"');
        // The closing quote; a string's inner quotes are escaped.
        let mut end = quoted.len();
        let mut escaped = false;
        for (j, c) in quoted.char_indices().skip(1) {
            if escaped {
                escaped = false;
            } else if c == '\\' && q == '"' {
                escaped = true;
            } else if c == q {
                end = j + c.len_utf8();
                break;
            }
        }
        out.push_str(" (value not shown)");
        rest = &quoted[end..];
    }
    out
}

impl GatewayConfig {
    /// Parses and validates a config file's text; relative paths are taken
    /// from `base` (the file's directory).
    pub fn from_toml(text: &str, base: &Path) -> Result<Self, ConfigError> {
        let file: FileConfig =
            toml::from_str(text).map_err(|e| ConfigError::Config(located(text, &e)))?;
        Self::validate(file, base)
    }

    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            keel_fs::read_regular_to_string(path, keel_fs::MAX_CONFIG_BYTES).map_err(|source| {
                ConfigError::Read {
                    path: path.to_owned(),
                    source,
                }
            })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_toml(&text, base).map_err(|e| match e {
            ConfigError::Config(m) => ConfigError::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    pub fn validate(f: FileConfig, base: &Path) -> Result<Self, ConfigError> {
        let bad = |m: String| Err(ConfigError::Config(m));
        let rel = |p: PathBuf| if p.is_absolute() { p } else { base.join(p) };
        let pair = |section: &str,
                    (a, b): (&str, &str),
                    x: Option<PathBuf>,
                    y: Option<PathBuf>|
         -> Result<(Option<PathBuf>, Option<PathBuf>), ConfigError> {
            if x.is_some() != y.is_some() {
                return Err(ConfigError::Config(format!(
                    "{section}.{a} and {section}.{b} go together: give both or neither"
                )));
            }
            Ok((x.map(rel), y.map(rel)))
        };
        let (tls_cert, tls_key) = pair(
            "server",
            ("tls_cert", "tls_key"),
            f.server.tls_cert,
            f.server.tls_key,
        )?;
        let server = ServerConfig {
            listen: f
                .server
                .listen
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080))),
            max_body_bytes: f.server.max_body_bytes.unwrap_or(4 << 20),
            max_body_bytes_in_flight: f.server.max_body_bytes_in_flight.unwrap_or(64 << 20),
            max_connections: f.server.max_connections,
            max_connections_per_client: f.server.max_connections_per_client.unwrap_or(256),
            max_header_bytes: f.server.max_header_bytes.unwrap_or(32 << 10),
            header_timeout_ms: f.server.header_timeout_ms.unwrap_or(10_000),
            body_timeout_ms: f.server.body_timeout_ms.unwrap_or(30_000),
            write_timeout_ms: f.server.write_timeout_ms.unwrap_or(30_000),
            idle_timeout_ms: f.server.idle_timeout_ms.unwrap_or(30_000),
            shutdown_grace_s: f.server.shutdown_grace_s.unwrap_or(30.0),
            pin_header: f
                .server
                .pin_header
                .unwrap_or_else(|| "x-keel-deployment".into())
                .to_ascii_lowercase(),
            access_log: f.server.access_log.unwrap_or(true),
            workers: f.server.workers,
            tls_cert,
            tls_key,
        };
        if server.workers.is_some_and(|w| !(1..=1024).contains(&w)) {
            return bad(
                "server.workers must be between 1 and 1024 (leave it out for one per CPU)".into(),
            );
        }
        if server.max_body_bytes == 0 {
            return bad("server.max_body_bytes must be at least 1".into());
        }
        if server.max_body_bytes_in_flight < server.max_body_bytes {
            return bad(format!(
                "server.max_body_bytes_in_flight ({}) must be at least server.max_body_bytes ({}): \
                 a body of the largest size allowed could never be read",
                server.max_body_bytes_in_flight, server.max_body_bytes
            ));
        }
        if server.max_connections == Some(0) {
            return bad("server.max_connections must be at least 1".into());
        }
        if server.max_connections_per_client == 0 {
            return bad("server.max_connections_per_client must be at least 1".into());
        }
        if !(MIN_HEADER_BYTES..=MAX_HEADER_BYTES).contains(&server.max_header_bytes) {
            return bad(format!(
                "server.max_header_bytes must be from {MIN_HEADER_BYTES} to {MAX_HEADER_BYTES}, not {}",
                server.max_header_bytes
            ));
        }
        for (key, ms) in [
            ("header_timeout_ms", server.header_timeout_ms),
            ("body_timeout_ms", server.body_timeout_ms),
            ("write_timeout_ms", server.write_timeout_ms),
            ("idle_timeout_ms", server.idle_timeout_ms),
        ] {
            if ms == 0 {
                return bad(format!(
                    "server.{key} must be at least 1 (a connection is never held without a limit)"
                ));
            }
        }
        if http::HeaderName::from_bytes(server.pin_header.as_bytes()).is_err() {
            return bad(format!(
                "server.pin_header {:?} is not a header name",
                server.pin_header
            ));
        }
        if !(server.shutdown_grace_s >= 0.0 && server.shutdown_grace_s.is_finite()) {
            return bad("server.shutdown_grace_s must be a number of seconds".into());
        }
        let listener = |name: &str, l: Option<FileListener>| -> Result<_, ConfigError> {
            let Some(l) = l else { return Ok(None) };
            let t = l.token_sha256.to_ascii_lowercase();
            if t.len() != 64 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ConfigError::Config(format!(
                    "{name}.token_sha256 must be 64 hex digits (the SHA-256 of the token)"
                )));
            }
            let (tls_cert, tls_key) = pair(name, ("tls_cert", "tls_key"), l.tls_cert, l.tls_key)?;
            Ok(Some(ListenerConfig {
                listen: l.listen,
                token_sha256: t,
                tls_cert,
                tls_key,
            }))
        };
        let admin = listener("admin", f.admin)?;
        let metrics = listener("metrics", f.metrics)?;

        let jwt = match f.auth.jwt {
            None => None,
            Some(j) => {
                if j.jwks_file.is_some() == j.jwks_url.is_some() {
                    return bad("auth.jwt needs exactly one of jwks_file and jwks_url".into());
                }
                if let Some(u) = &j.jwks_url {
                    if !u.starts_with("http://") && !u.starts_with("https://") {
                        return bad(format!(
                            "auth.jwt.jwks_url {u:?}: only http:// and https:// URLs are supported (use jwks_file for others)"
                        ));
                    }
                }
                Some(JwtConfig {
                    jwks_file: j.jwks_file.map(rel),
                    jwks_url: j.jwks_url,
                    issuer: j.issuer,
                    audience: j.audience,
                    roles_claim: j.roles_claim.unwrap_or_else(|| "roles".into()),
                    team_claim: j.team_claim.unwrap_or_else(|| "team".into()),
                    leeway_s: j.leeway_s.unwrap_or(30),
                    refresh_s: j.refresh_s.unwrap_or(300),
                })
            }
        };
        let auth = AuthConfig {
            keys_file: f.auth.keys_file.map(rel),
            jwt,
        };
        if auth.keys_file.is_none() && auth.jwt.is_none() {
            return bad("auth needs keys_file, jwt, or both: no endpoint is anonymous".into());
        }

        let mut roles = BTreeMap::new();
        for (name, r) in f.roles {
            for op in &r.operations {
                if op != "*" && !OPERATIONS.contains(&op.as_str()) {
                    return bad(format!(
                        "roles.{name}: unknown operation {op:?} (one of {}, or \"*\")",
                        OPERATIONS.join(", ")
                    ));
                }
            }
            roles.insert(
                name,
                RoleConfig {
                    models: r.models,
                    operations: r.operations,
                },
            );
        }

        let limits = LimitsConfig {
            redis_url: f.limits.redis_url,
            default_max_tokens: f.limits.default_max_tokens.unwrap_or(256),
            prompt_bytes_per_token: f.limits.prompt_bytes_per_token.unwrap_or(4),
            prompt_tokens_per_message: f.limits.prompt_tokens_per_message.unwrap_or(0),
            default: f.limits.default.unwrap_or_default(),
            keys: f.limits.keys,
            teams: f.limits.teams,
        };
        if let Some(u) = &limits.redis_url {
            crate::RedisAddr::parse(u)?;
        }
        if limits.default_max_tokens == 0 {
            return bad(
                "limits.default_max_tokens must be at least 1 (it is sent as max_tokens)".into(),
            );
        }
        if !(1..=16).contains(&limits.prompt_bytes_per_token) {
            return bad(format!(
                "limits.prompt_bytes_per_token must be from 1 to 16, not {} (4: an English \
                 tokenizer's average; 1: never under a byte-level BPE tokenizer's count)",
                limits.prompt_bytes_per_token
            ));
        }
        if limits.prompt_tokens_per_message > 1024 {
            return bad(format!(
                "limits.prompt_tokens_per_message must be from 0 to 1024, not {} (the tokens \
                 your model's chat template adds a message: 5 for ChatML or Llama 3)",
                limits.prompt_tokens_per_message
            ));
        }

        let c = f.traffic.circuit;
        let h = f.traffic.health;
        let cd = CircuitConfig::default();
        let traffic = TrafficConfig {
            connect_timeout_ms: f.traffic.connect_timeout_ms.unwrap_or(1000),
            timeout_ms: f.traffic.timeout_ms.unwrap_or(60_000),
            stream_idle_timeout_ms: f.traffic.stream_idle_timeout_ms.unwrap_or(60_000),
            retries: f.traffic.retries.unwrap_or(2),
            retry_budget_ratio: f.traffic.retry_budget_ratio.unwrap_or(0.2),
            retry_budget_min: f.traffic.retry_budget_min.unwrap_or(10),
            circuit: CircuitConfig {
                window_s: c.window_s.unwrap_or(cd.window_s).max(1),
                min_requests: c.min_requests.unwrap_or(cd.min_requests).max(1),
                failure_ratio: c.failure_ratio.unwrap_or(cd.failure_ratio),
                trip_s: c.trip_s.unwrap_or(cd.trip_s),
                failure_statuses: c.failure_statuses.unwrap_or(cd.failure_statuses),
                max_retry_after_s: c.max_retry_after_s.unwrap_or(cd.max_retry_after_s),
                min_identities: c.min_identities.unwrap_or(cd.min_identities),
            },
            health: HealthConfig {
                enabled: h.enabled.unwrap_or(true),
                interval_ms: h.interval_ms.unwrap_or(5000).max(10),
                timeout_ms: h.timeout_ms.unwrap_or(1000),
                unhealthy_after: h.unhealthy_after.unwrap_or(2).max(1),
                healthy_after: h.healthy_after.unwrap_or(1).max(1),
            },
        };
        if !(0.0..=1.0).contains(&traffic.circuit.failure_ratio) {
            return bad("traffic.circuit.failure_ratio must be within 0..1".into());
        }
        if !(traffic.circuit.trip_s >= 0.0 && traffic.circuit.trip_s.is_finite()) {
            return bad("traffic.circuit.trip_s must be a number of seconds".into());
        }
        let mr = traffic.circuit.max_retry_after_s;
        if !(0.0..=3600.0).contains(&mr) {
            return bad(format!(
                "traffic.circuit.max_retry_after_s must be from 0 to 3600 seconds, not {mr}"
            ));
        }
        if let Some(s) = traffic
            .circuit
            .failure_statuses
            .iter()
            .find(|s| !(400..=599).contains(*s))
        {
            return bad(format!(
                "traffic.circuit.failure_statuses: {s} is not an HTTP error status (400 to 599)"
            ));
        }
        if !(1..=16).contains(&traffic.circuit.min_identities) {
            return bad(format!(
                "traffic.circuit.min_identities must be from 1 to 16, not {} (1: any caller's \
                 failures may open a circuit)",
                traffic.circuit.min_identities
            ));
        }

        let mut models = Vec::new();
        let mut names = HashSet::new();
        for m in f.models {
            if !names.insert(m.name.clone()) {
                return bad(format!("model {:?} is configured twice", m.name));
            }
            let protocol = m.protocol.unwrap_or(Protocol::Openai);
            let mut deployments = Vec::new();
            let mut dnames = HashSet::new();
            for d in m.deployments {
                if !dnames.insert(d.name.clone()) {
                    return bad(format!("model {:?}: deployment {:?} twice", m.name, d.name));
                }
                crate::BackendUrl::parse(&d.url).map_err(|reason| {
                    ConfigError::Config(format!(
                        "model {:?} deployment {:?}: url {:?}: {reason}",
                        m.name, d.name, d.url
                    ))
                })?;
                deployments.push(DeploymentConfig {
                    weight: d.weight.unwrap_or(1),
                    model: d.model.unwrap_or_else(|| m.name.clone()),
                    health_path: d.health_path.unwrap_or_else(|| {
                        match protocol {
                            Protocol::Openai => "/health",
                            Protocol::Oip => "/v2/health/ready",
                        }
                        .into()
                    }),
                    name: d.name,
                    url: d.url,
                });
            }
            let registry = match m.registry {
                Some(r)
                    if r.require_signature == Some(true)
                        && f.registry
                            .as_ref()
                            .is_some_and(|g| g.public_key_file.is_none()) =>
                {
                    return bad(format!(
                        "model {:?}: registry.require_signature needs registry.public_key_file, the key signatures are checked against",
                        m.name
                    ));
                }
                Some(r) => Some(model_registry(
                    &m.name,
                    r,
                    f.registry.is_some(),
                    m.mirror.is_some(),
                    &mut deployments,
                    protocol,
                )?),
                None => None,
            };
            if deployments.is_empty() {
                return bad(format!("model {:?} has no deployments", m.name));
            }
            let rollout = match m.rollout {
                Some(_) if registry.is_none() => {
                    return bad(format!(
                        "model {:?}: [models.rollout] needs registry (a rollout moves registry aliases)",
                        m.name
                    ));
                }
                Some(r) => rollout_config(&m.name, r)?,
                None => RolloutConfig::default(),
            };
            let drift = match m.drift {
                Some(_) if registry.is_none() => {
                    return bad(format!(
                        "model {:?}: [models.drift] needs registry (drift is watched on registry versions)",
                        m.name
                    ));
                }
                Some(d) => drift_config(
                    &m.name,
                    d,
                    &rel,
                    f.registry
                        .as_ref()
                        .is_some_and(|r| r.write_key_file.is_some()),
                )?,
                None => DriftConfig::default(),
            };
            if let Some(mi) = &m.mirror {
                if !dnames.contains(&mi.deployment) {
                    return bad(format!(
                        "model {:?}: mirror deployment {:?} is not one of its deployments",
                        m.name, mi.deployment
                    ));
                }
                if !(0.0..=100.0).contains(&mi.percent) {
                    return bad(format!(
                        "model {:?}: mirror percent must be within 0..100",
                        m.name
                    ));
                }
            }
            let serving: u64 = deployments
                .iter()
                .filter(|d| m.mirror.as_ref().is_none_or(|mi| mi.deployment != d.name))
                .map(|d| d.weight as u64)
                .sum();
            if serving == 0 {
                return bad(format!(
                    "model {:?}: the weights of its serving deployments add up to 0",
                    m.name
                ));
            }
            models.push(ModelConfig {
                name: m.name,
                protocol,
                fallback: m.fallback,
                mirror: m.mirror.map(|mi| MirrorConfig {
                    deployment: mi.deployment,
                    percent: mi.percent,
                }),
                deployments,
                registry,
                rollout,
                drift,
            });
        }
        for m in &models {
            for fb in &m.fallback {
                if fb == &m.name || !names.contains(fb) {
                    return bad(format!(
                        "model {:?}: fallback {fb:?} is not another configured model",
                        m.name
                    ));
                }
            }
        }
        let group = match f.audit.group.as_deref() {
            Some(g) => Some(
                group_id(g, Path::new("/etc/group"))
                    .map_err(|e| ConfigError::Config(format!("audit.group: {e}")))?,
            ),
            None => None,
        };
        let every = f.audit.checkpoint_every.unwrap_or(1000);
        if every == 0 {
            return bad("audit.checkpoint_every must be at least 1 line".into());
        }
        let hmac_key_file = f.audit.hmac_key_file.map(rel);
        let audit_path = f.audit.path.clone().map(rel);
        let anchor_file = match (&hmac_key_file, f.audit.anchor_file.map(rel)) {
            (None, Some(_)) => return bad("audit.anchor_file needs audit.hmac_key_file".into()),
            (None, None) => None,
            (Some(_), Some(a)) => Some(a),
            (Some(_), None) => audit_path.as_ref().map(|p| {
                let mut s = p.clone().into_os_string();
                s.push(".anchor");
                PathBuf::from(s)
            }),
        };
        if anchor_file.is_some() && anchor_file == audit_path {
            return bad("audit.anchor_file must be another file than audit.path".into());
        }
        let checkpoints = match &hmac_key_file {
            Some(k) => Some(crate::Checkpoints {
                key: read_hmac_key(k)?,
                every,
                anchor: anchor_file.clone(),
            }),
            None if f.audit.checkpoint_every.is_some() => {
                return bad("audit.checkpoint_every needs audit.hmac_key_file".into());
            }
            None => None,
        };
        let audit = AuditConfig {
            path: f.audit.path.map(rel),
            include_content: f.audit.include_content.unwrap_or(false),
            group,
            hmac_key_file,
            checkpoint_every: every,
            anchor_file,
            sync: f.audit.sync.unwrap_or(false),
            checkpoints,
        };
        let u = f.upstream_tls;
        let (client_cert, client_key) = pair(
            "upstream_tls",
            ("client_cert", "client_key"),
            u.client_cert,
            u.client_key,
        )?;
        let upstream_tls = UpstreamTlsConfig {
            system_roots: u.system_roots.unwrap_or(true),
            ca_file: u.ca_file.map(rel),
            client_cert,
            client_key,
        };
        let registry = match f.registry {
            Some(r) => Some(registry_config(r, &rel)?),
            None => None,
        };
        if registry
            .as_ref()
            .is_some_and(|r| r.rollout_store == RolloutStore::Redis)
            && limits.redis_url.is_none()
        {
            return Err(ConfigError::Config(
                "registry.rollout_store = \"redis\" keeps the rollouts in the Redis the replicas share: set limits.redis_url".into(),
            ));
        }
        Ok(Self {
            server,
            admin,
            metrics,
            auth,
            roles,
            limits,
            traffic,
            models,
            audit,
            upstream_tls,
            registry,
        })
    }

    /// Whether any backend or the JWKS is reached over HTTPS.
    pub fn uses_https(&self) -> bool {
        let jwks = self
            .auth
            .jwt
            .as_ref()
            .and_then(|j| j.jwks_url.as_deref())
            .is_some_and(|u| u.starts_with("https://"));
        jwks || self
            .models
            .iter()
            .flat_map(|m| &m.deployments)
            .any(|d| d.url.starts_with("https://"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
[server]
listen = "127.0.0.1:8080"
[auth]
keys_file = "keys.json"
[roles.user]
models = ["chat"]
operations = ["chat", "models"]
[[models]]
name = "chat"
fallback = ["small"]
mirror = { deployment = "shadow", percent = 10 }
[[models.deployments]]
name = "blue"
url = "http://127.0.0.1:8001"
weight = 90
[[models.deployments]]
name = "shadow"
url = "http://127.0.0.1:8003"
weight = 0
[[models]]
name = "small"
[[models.deployments]]
name = "only"
url = "http://127.0.0.1:8002/prefix"
"#;

    #[test]
    fn a_toml_error_says_where_and_which_key_without_the_value() {
        let err = |text: &str| match GatewayConfig::from_toml(text, Path::new("/")) {
            Err(ConfigError::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        };
        let m = err(
            "[server]\nlisten = \"127.0.0.1:1\"\n[limits]\nprompt_bytes_per_token = \"four\"\n",
        );
        assert!(
            m.starts_with(
                "line 4, column 26, key limits.prompt_bytes_per_token: invalid type: string"
            ),
            "{m}"
        );
        assert!(m.contains("expected u64"), "{m}");
        assert!(!m.contains("four"), "the value is not repeated: {m}");
        let m = err("[limits]\ndefault_max_tokens = \"hunter2 \\\" more\"\n");
        assert!(!m.contains("hunter2") && !m.contains("more"), "{m}");
        assert!(m.contains("string (value not shown), expected"), "{m}");
        let m = err("[[models]]\nname = \"m\"\nprotocol = \"s3cret\"\n");
        assert!(!m.contains("s3cret"), "{m}");
        assert!(m.contains("unknown variant (value not shown)"), "{m}");
        assert!(!m.contains('\n'), "{m}");
        let m = err("[limits]\nredis_url = 5\n");
        assert!(
            m.starts_with("line 2, column 13, key limits.redis_url:"),
            "{m}"
        );
        let m = err("[server]\nlisten = \"127.0.0.1:1\"\n[[models]]\nname = 7\n");
        assert!(m.starts_with("line 4, column 8, key models.name:"), "{m}");
        let m = err("[limits]\nredis_url = \"redis://:hunter2@localhost\"\nnope = 1\n");
        assert!(m.contains("unknown field `nope`"), "{m}");
        assert!(!m.contains("hunter2"), "{m}");
        let m = err("[server\n");
        assert!(m.starts_with("line 1, column"), "{m}");
    }

    #[test]
    fn example_validates() {
        let c = GatewayConfig::from_toml(EXAMPLE, Path::new("/etc/keel")).expect("valid");
        assert_eq!(
            c.auth.keys_file.as_deref(),
            Some(Path::new("/etc/keel/keys.json"))
        );
        assert_eq!(c.models[0].deployments[0].model, "chat");
        assert_eq!(c.models[0].deployments[0].health_path, "/health");
        assert_eq!(c.traffic.retries, 2);
        assert!(c.server.tls().is_none());
        assert!(c.upstream_tls.system_roots);
        assert!(!c.uses_https());
    }

    #[test]
    fn tls_paths_are_taken_from_the_config_directory() {
        let text = EXAMPLE
            .replace(
                "[server]\n",
                "[server]\ntls_cert = \"tls/gw.pem\"\ntls_key = \"/secrets/gw.key\"\n",
            )
            .replace("http://127.0.0.1:8002/prefix", "https://llm.internal:8443");
        let text = format!(
            "{text}[upstream_tls]\nsystem_roots = false\nca_file = \"ca.pem\"\nclient_cert = \"client.pem\"\nclient_key = \"client.key\"\n"
        );
        let c = GatewayConfig::from_toml(&text, Path::new("/etc/keel")).expect("valid");
        assert_eq!(
            c.server.tls(),
            Some((
                PathBuf::from("/etc/keel/tls/gw.pem"),
                PathBuf::from("/secrets/gw.key")
            ))
        );
        let u = &c.upstream_tls;
        assert!(!u.system_roots);
        assert_eq!(u.ca_file.as_deref(), Some(Path::new("/etc/keel/ca.pem")));
        assert_eq!(
            u.client_key.as_deref(),
            Some(Path::new("/etc/keel/client.key"))
        );
        assert!(c.uses_https());
    }

    #[test]
    fn every_key_is_documented() {
        let doc = include_str!("../../../docs/serve.md");
        let text = format!(
            "{EXAMPLE}[admin]\nlisten = \"127.0.0.1:1\"\ntoken_sha256 = \"{}\"\n[auth.jwt]\njwks_file = \"j\"\nissuer = \"i\"\naudience = \"a\"\n",
            "0".repeat(64)
        );
        let c = GatewayConfig::from_toml(&text, Path::new("/")).expect("valid");
        let v = serde_json::to_value(&c).expect("json");
        fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
            if let serde_json::Value::Object(o) = v {
                for (k, x) in o {
                    let path = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    match x {
                        serde_json::Value::Object(_)
                            if !["roles", "keys", "teams", "default"].contains(&k.as_str()) =>
                        {
                            walk(&path, x, out)
                        }
                        _ => out.push(path),
                    }
                }
            }
        }
        let mut keys = Vec::new();
        walk("", &v, &mut keys);
        assert!(keys.len() > 30, "{keys:?}");
        for k in keys {
            if k == "models" || k == "roles" {
                continue;
            }
            assert!(
                doc.contains(&format!("`{k}`"))
                    || doc.contains(&format!("`{k},"))
                    || doc.contains(&format!(", `{k}`"))
                    || doc.contains(&format!("{k}`"))
                    || doc.contains(&format!("`{k}.")),
                "docs/serve.md does not document {k}"
            );
        }
        for k in [
            "name",
            "protocol",
            "fallback",
            "mirror",
            "weight",
            "url",
            "health_path",
            "drift.baseline_file",
            "drift.action",
            "drift.fallback_version",
            "drift.psi_threshold",
            "drift.consecutive",
            "drift.interval_s",
        ] {
            assert!(
                doc.contains(&format!(".{k}`")) || doc.contains(&format!("[].{k}")),
                "docs/serve.md does not document models[].{k}"
            );
        }
        for k in [
            "requests_per_minute",
            "tokens_per_minute",
            "tokens_per_day",
            "tokens_per_month",
        ] {
            assert!(doc.contains(k));
        }
    }

    #[test]
    fn drift_settings_are_checked() {
        let t = tempfile::tempdir().expect("tmp");
        let base = "[server]\nlisten = \"127.0.0.1:1\"\n[auth]\nkeys_file = \"k\"\n[registry]\nurl = \"http://127.0.0.1:5000\"\nkey_file = \"r.key\"\n[[models]]\nname = \"chat\"\nregistry = { model = \"chat\" }\n";
        let c = GatewayConfig::from_toml(base, t.path()).expect("valid");
        let d = &c.models[0].drift;
        assert_eq!(
            (d.action, d.psi_threshold, d.consecutive, d.interval_s),
            (DriftAction::Notify, 0.25, 3, 60)
        );
        let check = |base: &str, drift: &str| {
            GatewayConfig::from_toml(&format!("{base}[models.drift]\n{drift}\n"), t.path())
        };
        std::fs::write(
            t.path().join("b.json"),
            r#"{"version": 1, "model": "chat", "recorded_from": "v1", "window": "reference", "recorded_at": "x", "features": [{"name": "latency_ms", "edges": [10.0], "counts": [3, 1]}]}"#,
        )
        .expect("write");
        let c = check(base, "baseline_file = \"b.json\"\npsi_threshold = 0.5").expect("valid");
        let d = &c.models[0].drift;
        assert_eq!(d.psi_threshold, 0.5);
        assert_eq!(
            d.baseline
                .as_ref()
                .and_then(|b| b.get("latency_ms"))
                .map(|h| h.total()),
            Some(4)
        );
        for (drift, want) in [
            (
                "baseline_file = \"none.json\"",
                "drift.baseline_file: cannot read the drift baseline",
            ),
            ("action = \"fallback\"", "needs fallback_version"),
            (
                "fallback_version = 1",
                "fallback_version is used only with action = \"fallback\"",
            ),
            (
                "action = \"fallback\"\nfallback_version = 1",
                "needs registry.write_key_file",
            ),
            ("action = \"rollback\"", "unknown variant"),
            ("psi_threshold = 0.0", "psi_threshold 0 must be above 0"),
            ("consecutive = 0", "consecutive 0 must be within 1..1000"),
            ("interval_s = 0", "interval_s 0 must be within 1..86400"),
            ("colour = 1", "unknown field"),
        ] {
            let e = check(base, drift).expect_err(drift).to_string();
            assert!(e.contains(want), "{drift}: {e}");
        }
        let with_key = base.replace(
            "key_file = \"r.key\"",
            "key_file = \"r.key\"\nwrite_key_file = \"w.key\"",
        );
        let c = check(&with_key, "action = \"fallback\"\nfallback_version = 1").expect("valid");
        assert_eq!(c.models[0].drift.fallback_version, Some(1));
        let e = check(
            &base.replace(
                "registry = { model = \"chat\" }\n",
                "[[models.deployments]]\nname = \"a\"\nurl = \"http://127.0.0.1:2\"\n",
            ),
            "",
        )
        .expect_err("no registry")
        .to_string();
        assert!(e.contains("[models.drift] needs registry"), "{e}");
    }

    #[test]
    fn rollout_settings_are_checked() {
        let base = "[server]\nlisten = \"127.0.0.1:1\"\n[auth]\nkeys_file = \"k\"\n[registry]\nurl = \"http://127.0.0.1:5000\"\nkey_file = \"r.key\"\nwrite_key_file = \"w.key\"\n[[models]]\nname = \"chat\"\nregistry = { model = \"chat\", canary = \"canary\" }\n";
        let c = GatewayConfig::from_toml(base, Path::new("/etc/keel")).expect("valid");
        assert_eq!(c.models[0].rollout, RolloutConfig::default());
        assert_eq!(
            c.registry.as_ref().and_then(|r| r.write_key_file.clone()),
            Some(PathBuf::from("/etc/keel/w.key"))
        );
        let c = GatewayConfig::from_toml(
            &format!("{base}[models.rollout]\nsteps = [50, 100]\ninterval_s = 1\n"),
            Path::new("/"),
        )
        .expect("valid");
        assert_eq!(
            (
                c.models[0].rollout.steps.clone(),
                c.models[0].rollout.interval_s
            ),
            (vec![50, 100], 1)
        );
        for (extra, expect) in [
            ("steps = []", "rollout.steps [] must be weights"),
            ("steps = [5, 1]", "rising strictly"),
            ("steps = [0, 100]", "rising strictly"),
            ("steps = [50, 101]", "rising strictly"),
            (
                "interval_s = 0",
                "rollout.interval_s 0 must be within 1..86400",
            ),
            (
                "min_canary_samples = 0",
                "rollout.min_canary_samples 0 is below 50",
            ),
            (
                "min_canary_samples = 5",
                "rollout.min_canary_samples 5 is below 50, the sample size",
            ),
            (
                "min_canary_samples = 49",
                "min_canary_samples 49 is below 50",
            ),
            (
                "latency_min_increase_ms = -1.0",
                "rollout.latency_min_increase_ms -1 must be within 0..3600000",
            ),
            (
                "latency_min_increase_ms = nan",
                "latency_min_increase_ms NaN",
            ),
            ("bogus = 1", "bogus"),
        ] {
            let e = GatewayConfig::from_toml(
                &format!("{base}[models.rollout]\n{extra}\n"),
                Path::new("/"),
            )
            .expect_err(extra);
            assert!(e.to_string().contains(expect), "{e} lacks {expect}");
        }
        assert_eq!(
            c.registry
                .as_ref()
                .map(|r| (r.drift_reference_requests, r.drift_window_requests)),
            Some((1000, 1000))
        );
        let e = GatewayConfig::from_toml(
            &base.replace("[[models]]", "drift_window_requests = 5\n[[models]]"),
            Path::new("/"),
        )
        .expect_err("too small");
        assert!(
            e.to_string()
                .contains("registry.drift_window_requests 5 must be within 10..1000000"),
            "{e}"
        );
        let e = GatewayConfig::from_toml(
            &format!("{EXAMPLE}[models.rollout]\nsteps = [50, 100]\n"),
            Path::new("/"),
        )
        .expect_err("no registry");
        assert!(
            e.to_string().contains("[models.rollout] needs registry"),
            "{e}"
        );
    }

    #[test]
    fn rejections() {
        let check = |text: &str, expect: &str| {
            let e = GatewayConfig::from_toml(text, Path::new("/")).expect_err(text);
            assert!(e.to_string().contains(expect), "{e} lacks {expect}");
        };
        check(
            "[server]\nlisten = \"127.0.0.1:1\"\n",
            "no endpoint is anonymous",
        );
        check("[auth]\nkeys_file = \"k\"\nbogus = 1\n", "bogus");
        check(
            &format!("{EXAMPLE}[limits]\ndefault_max_tokens = 0\n"),
            "limits.default_max_tokens must be at least 1",
        );
        check(
            &format!("{EXAMPLE}[limits]\nprompt_bytes_per_token = 0\n"),
            "limits.prompt_bytes_per_token must be from 1 to 16, not 0",
        );
        check(
            &format!("{EXAMPLE}[limits]\nprompt_bytes_per_token = 17\n"),
            "limits.prompt_bytes_per_token must be from 1 to 16, not 17",
        );
        check(
            &format!("{EXAMPLE}[limits]\nprompt_tokens_per_message = 1025\n"),
            "limits.prompt_tokens_per_message must be from 0 to 1024, not 1025",
        );
        check(
            &EXAMPLE.replace("fallback = [\"small\"]", "fallback = [\"nope\"]"),
            "fallback",
        );
        check(
            &EXAMPLE.replace("http://127.0.0.1:8001", "ftp://x"),
            "only http:// and https://",
        );
        check(
            &EXAMPLE.replace("[server]\n", "[server]\ntls_cert = \"c.pem\"\n"),
            "server.tls_cert and server.tls_key go together",
        );
        check(
            &EXAMPLE.replace("[server]\n", "[server]\ntls_key = \"k.pem\"\n"),
            "server.tls_cert and server.tls_key go together",
        );
        check(
            &format!("{EXAMPLE}[admin]\nlisten = \"127.0.0.1:1\"\ntoken_sha256 = \"{}\"\ntls_cert = \"c.pem\"\n", "0".repeat(64)),
            "admin.tls_cert and admin.tls_key go together",
        );
        check(
            &format!("{EXAMPLE}[upstream_tls]\nclient_cert = \"c.pem\"\n"),
            "upstream_tls.client_cert and upstream_tls.client_key go together",
        );
        check(
            &format!("{EXAMPLE}[upstream_tls]\nverify = false\n"),
            "unknown field `verify`",
        );
        check(
            &EXAMPLE.replace(
                "operations = [\"chat\", \"models\"]",
                "operations = [\"fly\"]",
            ),
            "unknown operation",
        );
        check(
            &EXAMPLE.replace("[server]\n", "[server]\nworkers = 0\n"),
            "server.workers",
        );
        check(
            &format!("{EXAMPLE}[traffic.circuit]\nfailure_statuses = [200]\n"),
            "200 is not an HTTP error status",
        );
        check(
            &format!("{EXAMPLE}[traffic.circuit]\nmin_identities = 0\n"),
            "traffic.circuit.min_identities must be from 1 to 16, not 0",
        );
        check(
            &format!("{EXAMPLE}[traffic.circuit]\nmax_retry_after_s = -1\n"),
            "traffic.circuit.max_retry_after_s must be from 0 to 3600",
        );
        let c = GatewayConfig::from_toml(EXAMPLE, Path::new("/")).expect("valid");
        assert_eq!(c.traffic.circuit, CircuitConfig::default());
        assert_eq!(c.traffic.circuit.failure_statuses, [502, 503, 504]);
        for (line, expect) in [
            ("max_connections = 0", "server.max_connections must be at least 1"),
            (
                "max_connections_per_client = 0",
                "server.max_connections_per_client must be at least 1",
            ),
            (
                "max_header_bytes = 4096",
                "server.max_header_bytes must be from 8192 to 1048576, not 4096",
            ),
            (
                "max_body_bytes_in_flight = 1000",
                "server.max_body_bytes_in_flight (1000) must be at least server.max_body_bytes (4194304)",
            ),
            ("max_body_bytes = 0", "server.max_body_bytes must be at least 1"),
            ("write_timeout_ms = 0", "server.write_timeout_ms must be at least 1"),
            ("idle_timeout_ms = 0", "server.idle_timeout_ms must be at least 1"),
            ("header_timeout_ms = 0", "server.header_timeout_ms must be at least 1"),
            ("max_connections = -1", "key server.max_connections: invalid value"),
        ] {
            check(&EXAMPLE.replace("[server]\n", &format!("[server]\n{line}\n")), expect);
        }
        let c = GatewayConfig::from_toml(EXAMPLE, Path::new("/")).expect("valid");
        assert_eq!(
            (
                c.server.max_connections,
                c.server.max_header_bytes,
                c.server.max_body_bytes_in_flight,
                c.server.idle_timeout_ms,
                c.server.write_timeout_ms
            ),
            (None, 32 << 10, 64 << 20, 30_000, 30_000)
        );
        let c = GatewayConfig::from_toml(
            &EXAMPLE.replace("[server]\n", "[server]\nworkers = 2\n"),
            Path::new("/"),
        )
        .expect("valid");
        assert_eq!(c.server.workers, Some(2));
    }
}

#[cfg(test)]
mod registry_tests {
    use super::*;

    fn check(text: &str) -> Result<GatewayConfig, String> {
        let text = format!("[auth]\nkeys_file = \"keys.json\"\n{text}");
        GatewayConfig::from_toml(&text, Path::new("/etc/keel")).map_err(|e| e.to_string())
    }

    #[test]
    fn a_model_follows_the_registry() {
        let c = check(
            r#"
[registry]
url = "http://127.0.0.1:5000/"
key_file = "registry.key"
[[models]]
name = "chat"
registry = { model = "chat-llm", canary = "canary" }
"#,
        )
        .expect("valid");
        let r = c.registry.as_ref().expect("registry");
        assert_eq!(r.url, "http://127.0.0.1:5000");
        assert_eq!(r.key_file, Path::new("/etc/keel/registry.key"));
        assert_eq!(r.poll_ms, 1000);
        let m = &c.models[0];
        let mr = m.registry.as_ref().expect("model registry");
        assert_eq!(
            (mr.model.as_str(), mr.stable.as_str(), mr.canary.as_deref()),
            ("chat-llm", "production", Some("canary"))
        );
        // The template deployment.
        assert_eq!(m.deployments.len(), 1);
        assert_eq!(m.deployments[0].model, "chat");
        assert_eq!(m.deployments[0].health_path, "/health");
    }

    #[test]
    fn bad_registry_settings_are_refused() {
        let model = "[[models]]\nname = \"chat\"\nregistry = { model = \"chat\" }\n";
        let e = check(model).expect_err("no [registry]");
        assert_eq!(
            e,
            "invalid configuration: model \"chat\": it follows a registry model but there is no [registry] section"
        );
        let head = "[registry]\nurl = \"http://r:1\"\nkey_file = \"k\"\n";
        let e = check(&format!(
            "{head}[[models]]\nname = \"chat\"\nregistry = {{ model = \"chat\", canary = \"production\" }}\n"
        ))
        .expect_err("same aliases");
        assert!(e.contains("both \"production\""), "{e}");
        // https:// with a CA file is accepted; a CA file for http:// and
        // other schemes are not.
        check(&format!(
            "[registry]\nurl = \"https://r:1\"\nkey_file = \"k\"\nca_file = \"ca.pem\"\n{model}"
        ))
        .expect("https");
        let e = check(&format!(
            "[registry]\nurl = \"http://r:1\"\nkey_file = \"k\"\nca_file = \"ca.pem\"\n{model}"
        ))
        .expect_err("ca_file for http");
        assert!(e.contains("registry.ca_file is for an https://"), "{e}");
        let e = check(&format!(
            "[registry]\nurl = \"ftp://r:1\"\nkey_file = \"k\"\n{model}"
        ))
        .expect_err("ftp");
        assert!(
            e.contains("must be http://host:port or https://host:port"),
            "{e}"
        );
        // Signatures need the backends the versions may name.
        let signed = "[registry]\nurl = \"http://r:1\"\nkey_file = \"k\"\npublic_key_file = \"a.pub\"\n[[models]]\nname = \"chat\"\n";
        let e = check(&format!(
            "{signed}registry = {{ model = \"chat\", require_signature = true }}\n"
        ))
        .expect_err("no allowed_backends");
        assert!(
            e.contains("require_signature needs registry.allowed_backends"),
            "{e}"
        );
        let e = check(&format!(
            "{signed}registry = {{ model = \"chat\", require_signature = true, allowed_backends = [\"10.0.0.5:8000\"] }}\n"
        ))
        .expect_err("not a URL");
        assert!(e.contains("is not an http:// or https:// URL"), "{e}");
        let c = check(&format!(
            "{signed}registry = {{ model = \"chat\", require_signature = true, allowed_backends = [\"https://10.0.0.5:8000/\"] }}\n"
        ))
        .expect("valid");
        assert_eq!(
            c.models[0]
                .registry
                .as_ref()
                .expect("registry")
                .allowed_backends,
            vec!["https://10.0.0.5:8000".to_owned()]
        );
        let e = check(&format!(
            "[registry]\nurl = \"http://r:1\"\nkey_file = \"k\"\npoll_ms = 10\n{model}"
        ))
        .expect_err("poll");
        assert!(e.contains("poll_ms 10"), "{e}");
        let e = check(&format!(
            "{head}[[models]]\nname = \"chat\"\nregistry = {{ model = \"chat\", alias = \"x\" }}\n"
        ))
        .expect_err("unknown key");
        assert!(e.contains("unknown field `alias`"), "{e}");
    }
}
