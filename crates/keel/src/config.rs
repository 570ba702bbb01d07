//! keel's configuration: built-in defaults < config file < environment
//! (`KEEL_*`) < flags. The file is TOML (`--config FILE`, `KEEL_CONFIG`, or
//! `~/.config/keel/keel.toml` when it exists); every key is documented in
//! docs/config.md, which a test keeps in step with this file.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// The file as written: every key optional, unknown keys rejected.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub check: FileCheck,
    #[serde(default)]
    pub bench: FileBench,
    #[serde(default)]
    pub serve: FileServe,
    #[serde(default)]
    pub model: FileModel,
    #[serde(default)]
    pub exporter: FileExporter,
    /// Read by [`load_cost`] alone; here so that the other commands accept
    /// (and check) the section.
    #[serde(default)]
    #[allow(dead_code)]
    pub cost: FileCost,
}

/// `[cost]`: where `keel cost` reads idle GPU-hours (docs/config.md).
#[derive(Debug, Default, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileCost {
    /// A Prometheus server that scrapes keel exporters.
    pub prometheus: Option<String>,
    /// One keel exporter.
    pub exporter: Option<String>,
    /// The bearer token for `exporter`.
    pub exporter_token_file: Option<PathBuf>,
}

/// Loads `[cost]` from the config file (`KEEL_CONFIG`, else
/// `~/.config/keel/keel.toml`); flags are applied by the caller. Only
/// `[cost]` is read and checked: `keel cost` does not fail on another
/// section's keys (the commands those sections configure check them).
pub fn load_cost(
    explicit: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<FileCost> {
    let Some(path) = config_path(explicit, env) else {
        return Ok(FileCost::default());
    };
    let text = keel_fs::read_regular_to_string(&path, keel_fs::MAX_CONFIG_BYTES)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    let invalid =
        |e: String| crate::exit::UsageError(format!("invalid config file {}: {e}", path.display()));
    let mut table = toml::from_str::<toml::Table>(&text).map_err(|e| invalid(e.to_string()))?;
    match table.remove("cost") {
        None => Ok(FileCost::default()),
        Some(v) => FileCost::deserialize(v).map_err(|e| invalid(format!("[cost]: {e}")).into()),
    }
}

/// `[exporter]`: `keel exporter`'s settings (docs/monitoring.md).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileExporter {
    pub listen: Option<std::net::SocketAddr>,
    pub token_sha256: Option<String>,
    pub no_auth: Option<bool>,
    pub gpu_snapshots: Option<Vec<PathBuf>>,
    pub replay_step_s: Option<f64>,
    pub nvml_library: Option<PathBuf>,
    pub deadline_s: Option<f64>,
    pub check_textfile: Option<PathBuf>,
    pub job_mapping_dir: Option<PathBuf>,
    pub jobs_from_processes: Option<bool>,
    pub device_file_pattern: Option<String>,
    pub dcgm_names: Option<bool>,
    pub max_connections: Option<usize>,
    pub idle_threshold_percent: Option<f64>,
    pub idle_minutes: Option<f64>,
    pub sku: Option<String>,
    pub gpus: Option<u32>,
    pub slurm_gpu_ids: Option<String>,
    pub xid_window_s: Option<f64>,
}

/// The effective `keel exporter` settings.
#[derive(Debug, Clone, Serialize)]
pub struct ExporterConfig {
    /// Where `/metrics` is served.
    pub listen: std::net::SocketAddr,
    /// SHA-256 (hex) of the bearer token scrapers send.
    pub token_sha256: Option<String>,
    /// Serve without authentication (a trusted scrape network).
    pub no_auth: bool,
    /// Replay these recorded snapshots instead of reading NVML.
    pub gpu_snapshots: Vec<PathBuf>,
    /// Seconds each replayed snapshot is shown.
    pub replay_step_s: f64,
    pub nvml_library: Option<PathBuf>,
    /// How long a scrape waits for the GPUs before it shows the last good
    /// readings (marked stale).
    pub deadline_s: f64,
    /// keel check's Prometheus textfile, passed through.
    pub check_textfile: Option<PathBuf>,
    /// dcgm-exporter's job-mapping directory.
    pub job_mapping_dir: Option<PathBuf>,
    /// Find each GPU's Slurm job from its processes.
    pub jobs_from_processes: bool,
    /// Also find jobs from the processes holding a GPU's device file open
    /// (`{}` is the GPU index: `/dev/nvidia{}`).
    pub device_file_pattern: Option<String>,
    /// dcgm-exporter's metric names and labels.
    pub dcgm_names: bool,
    pub max_connections: usize,
    /// Idle accounting: a GPU below this utilisation is idle.
    pub idle_threshold_percent: f64,
    /// A job whose GPUs were all idle this long is marked idle.
    pub idle_minutes: f64,
    /// The node's SKU profile (`keel check profiles`): its GPU count is
    /// the count expected; unset: Azure IMDS's vmSize (on `/` only).
    pub sku: Option<String>,
    /// The GPUs the node must have; overrides the profile's count.
    pub gpus: Option<u32>,
    /// What Slurm's GPU ids (job-mapping file names) are: `minor` (gres.conf
    /// `File=/dev/nvidiaN`, CycleCloud) or `index` (`AutoDetect=nvml`).
    pub slurm_gpu_ids: String,
    /// Window of `DCGM_EXP_XID_ERRORS_COUNT` (dcgm-exporter's `-x`).
    pub xid_window_s: f64,
}

impl Default for ExporterConfig {
    fn default() -> Self {
        Self {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 9400)),
            token_sha256: None,
            no_auth: false,
            gpu_snapshots: Vec::new(),
            replay_step_s: 15.0,
            nvml_library: None,
            deadline_s: 2.0,
            check_textfile: None,
            job_mapping_dir: None,
            jobs_from_processes: true,
            device_file_pattern: None,
            dcgm_names: false,
            max_connections: 16,
            idle_threshold_percent: 5.0,
            idle_minutes: 30.0,
            sku: None,
            gpus: None,
            slurm_gpu_ids: "minor".into(),
            xid_window_s: 300.0,
        }
    }
}

/// Loads `[exporter]`: defaults < file < `KEEL_EXPORTER_*`; flags are
/// applied by the caller, which then calls [`validate_exporter`].
pub fn load_exporter(
    explicit: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<ExporterConfig> {
    let (file, _) = load_file(explicit, env)?;
    let f = file.exporter;
    let mut c = ExporterConfig::default();
    macro_rules! take {
        ($($field:ident),*) => { $( if let Some(v) = f.$field { c.$field = v; } )* };
    }
    take!(
        listen,
        no_auth,
        gpu_snapshots,
        replay_step_s,
        deadline_s,
        jobs_from_processes,
        dcgm_names,
        max_connections,
        idle_threshold_percent,
        idle_minutes,
        slurm_gpu_ids,
        xid_window_s
    );
    c.sku = f.sku;
    c.gpus = f.gpus;
    c.token_sha256 = f.token_sha256;
    c.nvml_library = f.nvml_library;
    c.check_textfile = f.check_textfile;
    c.job_mapping_dir = f.job_mapping_dir;
    c.device_file_pattern = f.device_file_pattern;
    if let Some(v) = env("KEEL_EXPORTER_LISTEN") {
        c.listen = v.parse().map_err(|_| {
            crate::exit::UsageError(format!(
                "KEEL_EXPORTER_LISTEN={v:?} is not an address (HOST:PORT)"
            ))
        })?;
    }
    if let Some(v) = env("KEEL_EXPORTER_TOKEN_SHA256") {
        c.token_sha256 = Some(v);
    }
    Ok(c)
}

/// Checks the effective exporter settings.
pub fn validate_exporter(c: &mut ExporterConfig) -> anyhow::Result<()> {
    let usage = |m: String| -> anyhow::Error { crate::exit::UsageError(m).into() };
    if let Some(t) = &mut c.token_sha256 {
        *t = t.to_ascii_lowercase();
        if t.len() != 64 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(usage(
                "exporter.token_sha256 must be 64 hex digits: the SHA-256 of the token (sha256sum)"
                    .into(),
            ));
        }
    }
    match (&c.token_sha256, c.no_auth) {
        (None, false) => return Err(usage("keel exporter needs exporter.token_sha256 (--token-sha256), or no_auth = true (--no-auth) on a trusted scrape network".into())),
        (Some(_), true) => return Err(usage("exporter.token_sha256 and no_auth exclude each other".into())),
        _ => {}
    }
    if let Some(p) = &c.device_file_pattern {
        if !p.contains("{}") || !p.starts_with('/') {
            return Err(usage("exporter.device_file_pattern must be an absolute path with {} for the GPU's device minor, e.g. /dev/nvidia{}".into()));
        }
    }
    c.slurm_gpu_ids
        .parse::<keel_topo::IdKind>()
        .map_err(|e| usage(format!("exporter.slurm_gpu_ids: {e}")))?;
    if let Some(s) = &c.sku {
        if !keel_check::profile::builtin_names().contains(&s.as_str()) {
            return Err(usage(format!(
                "exporter.sku = {:?} is not a SKU profile; known: {}",
                s.chars().take(64).collect::<String>(),
                keel_check::profile::builtin_names().join(", ")
            )));
        }
    }
    if c.gpus.is_some_and(|g| g > MAX_GPUS) {
        return Err(usage(format!(
            "exporter.gpus must be a whole number of GPUs from 0 to {MAX_GPUS}"
        )));
    }
    check_seconds("exporter.deadline_s", c.deadline_s)?;
    check_seconds("exporter.xid_window_s", c.xid_window_s)?;
    check_seconds("exporter.replay_step_s", c.replay_step_s)?;
    if !(1..=1024).contains(&c.max_connections) {
        return Err(usage(format!(
            "exporter.max_connections = {} must be from 1 to 1024",
            c.max_connections
        )));
    }
    if !(c.idle_threshold_percent > 0.0 && c.idle_threshold_percent <= 100.0) {
        return Err(usage(format!(
            "exporter.idle_threshold_percent = {} must be above 0 and at most 100",
            c.idle_threshold_percent
        )));
    }
    if !(c.idle_minutes > 0.0 && c.idle_minutes <= 10_080.0) {
        return Err(usage(format!(
            "exporter.idle_minutes = {} must be above 0 and at most 10080 (a week)",
            c.idle_minutes
        )));
    }
    Ok(())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileBench {
    pub cuda_lib_dir: Option<PathBuf>,
}

/// The effective `keel bench` settings.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BenchConfig {
    /// Directory searched first for libcuda, libcublas and libnccl.
    pub cuda_lib_dir: Option<PathBuf>,
}

/// `[serve]`: where `keel serve` finds its gateway file; the gateway's own
/// keys are in that file (docs/serve.md).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileServe {
    pub config: Option<PathBuf>,
    pub listen: Option<std::net::SocketAddr>,
    pub keys_file: Option<PathBuf>,
}

/// The effective `keel serve` settings.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServeConfig {
    /// The gateway configuration file (docs/serve.md).
    pub config: Option<PathBuf>,
    /// Overrides the gateway file's `server.listen`.
    pub listen: Option<std::net::SocketAddr>,
    /// Overrides the gateway file's `auth.keys_file` for `keel serve keys`.
    pub keys_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileModel {
    pub db: Option<PathBuf>,
    pub db_password_file: Option<PathBuf>,
    pub db_ca_file: Option<PathBuf>,
    pub db_pool_size: Option<usize>,
    pub db_timeout_ms: Option<u64>,
    pub artifact_store: Option<String>,
    pub actor: Option<String>,
    pub public_key: Option<PathBuf>,
    pub listen: Option<String>,
    pub serve_token_sha256: Option<String>,
    pub tracking_uri: Option<String>,
    pub serve_max_connections: Option<usize>,
    pub serve_max_connections_per_client: Option<usize>,
}

/// The effective `keel model` settings.
#[derive(Debug, Clone, Serialize)]
pub struct ModelConfig {
    /// The registry database: a SQLite file, or a PostgreSQL URL
    /// (`postgres://USER@HOST:PORT/DATABASE`, no password in it).
    pub db: PathBuf,
    /// PostgreSQL: a file (mode 0600) holding the password;
    /// KEEL_MODEL_DB_PASSWORD overrides it.
    pub db_password_file: Option<PathBuf>,
    /// PostgreSQL: the CA (PEM) of the server's certificate; TLS is then
    /// required and the server's name checked. KEEL_MODEL_DB_CA_FILE
    /// overrides it.
    pub db_ca_file: Option<PathBuf>,
    /// PostgreSQL: the most read connections one process opens (plus one
    /// for writes).
    pub db_pool_size: usize,
    /// PostgreSQL: the longest one wait lasts (a connection of the pool,
    /// connecting, the write lock, one statement), in milliseconds.
    pub db_timeout_ms: u64,
    /// Where `register --path` uploads files (a storage URL); default: the
    /// directory `<db stem>-artifacts` beside the database.
    pub artifact_store: String,
    /// Who the audit log names for changes made from this machine.
    pub actor: String,
    /// The trusted public key `verify` checks signatures with.
    pub public_key: Option<PathBuf>,
    /// `keel model serve`'s address.
    pub listen: String,
    /// SHA-256 (hex) of a bearer token `keel model serve` accepts for
    /// reading and writing, besides the registry's API keys.
    pub serve_token_sha256: Option<String>,
    pub tracking_uri: Option<String>,
    /// Connections `keel model serve` serves at once.
    pub serve_max_connections: usize,
    /// Connections `keel model serve` serves at once from one address.
    pub serve_max_connections_per_client: usize,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileCheck {
    pub sku: Option<String>,
    pub gpus: Option<u32>,
    pub profile_file: Option<PathBuf>,
    pub gpu_snapshot: Option<PathBuf>,
    pub nvml_library: Option<PathBuf>,
    pub imds_endpoint: Option<String>,
    pub imds_timeout_ms: Option<u64>,
    pub read_timeout_s: Option<f64>,
    pub state_dir: Option<PathBuf>,
    pub prometheus_textfile: Option<PathBuf>,
    pub slurm_timeout_s: Option<f64>,
    pub fail_closed: Option<bool>,
}

/// The effective `keel check` settings.
#[derive(Debug, Clone, Serialize)]
pub struct CheckConfig {
    /// SKU profile name; unset: from Azure IMDS, else from the GPUs.
    pub sku: Option<String>,
    /// How many GPUs this node must have (overrides the profile's count,
    /// and picks the profile by model with this count when guessing).
    pub gpus: Option<u32>,
    /// A TOML file whose values override the chosen profile's.
    pub profile_file: Option<PathBuf>,
    /// Read GPUs from a recorded snapshot instead of NVML.
    pub gpu_snapshot: Option<PathBuf>,
    /// The NVML library to load; unset: `libnvidia-ml.so.1` from the
    /// loader's search path.
    pub nvml_library: Option<PathBuf>,
    pub imds_endpoint: String,
    pub imds_timeout_ms: u64,
    /// Timeout of each read (sysfs tree, kernel log, file system, NVML).
    pub read_timeout_s: f64,
    /// Where counters are kept between runs (PCIe replay growth).
    pub state_dir: Option<PathBuf>,
    pub prometheus_textfile: Option<PathBuf>,
    pub slurm_timeout_s: f64,
    pub fail_closed: bool,
}

impl Default for CheckConfig {
    fn default() -> Self {
        Self {
            sku: None,
            gpus: None,
            profile_file: None,
            gpu_snapshot: None,
            nvml_library: None,
            imds_endpoint: keel_check::imds::DEFAULT_ENDPOINT.to_owned(),
            imds_timeout_ms: 1000,
            read_timeout_s: 10.0,
            state_dir: None,
            prometheus_textfile: None,
            slurm_timeout_s: 10.0,
            fail_closed: false,
        }
    }
}

/// Environment variables read, in the order they are documented.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("KEEL_CONFIG", "config file path"),
    (
        "KEEL_ROOT",
        "root directory for /sys, /proc and /dev (--root)",
    ),
    ("KEEL_SKU", "check.sku"),
    ("KEEL_GPUS", "check.gpus"),
    ("KEEL_PROFILE_FILE", "check.profile_file"),
    ("KEEL_GPU_SNAPSHOT", "check.gpu_snapshot"),
    ("KEEL_NVML_LIBRARY", "check.nvml_library"),
    ("KEEL_IMDS_ENDPOINT", "check.imds_endpoint"),
    ("KEEL_STATE_DIR", "check.state_dir"),
    ("KEEL_PROMETHEUS_TEXTFILE", "check.prometheus_textfile"),
    ("KEEL_SLURM_TIMEOUT_S", "check.slurm_timeout_s"),
    ("KEEL_FAIL_CLOSED", "check.fail_closed (true/false)"),
    ("KEEL_CUDA_LIB_DIR", "bench.cuda_lib_dir"),
    (
        "KEEL_RENDEZVOUS",
        "keel bench nccl --rendezvous (HOST:PORT of rank 0)",
    ),
    ("KEEL_SERVE_CONFIG", "serve.config"),
    ("KEEL_SERVE_LISTEN", "serve.listen"),
    ("KEEL_SERVE_KEYS_FILE", "serve.keys_file"),
    ("KEEL_MODEL_DB", "model.db"),
    (
        "KEEL_MODEL_DB_PASSWORD",
        "the PostgreSQL registry's password (else model.db_password_file)",
    ),
    ("KEEL_MODEL_DB_CA_FILE", "model.db_ca_file"),
    ("KEEL_ARTIFACT_STORE", "model.artifact_store"),
    ("KEEL_ACTOR", "model.actor"),
    ("KEEL_MODEL_PUBLIC_KEY", "model.public_key"),
    ("KEEL_MODEL_TOKEN_SHA256", "model.serve_token_sha256"),
    ("KEEL_MLFLOW_TRACKING_URI", "model.tracking_uri"),
    ("KEEL_EXPORTER_LISTEN", "exporter.listen"),
    ("KEEL_EXPORTER_TOKEN_SHA256", "exporter.token_sha256"),
    (
        "KEEL_EXPORTER_TOKEN",
        "keel cost [idle] --exporter: the bearer token (else --token-file, --exporter-token-file)",
    ),
    ("KEEL_RUN_STORE", "keel run --store"),
    ("KEEL_RUN_NAME", "keel run --run"),
    ("KEEL_RUN_STATE", "keel run --state"),
    ("KEEL_RUN_IMDS", "keel run --imds"),
];

/// Loads the file (if any) and applies the environment. `env` is the
/// process environment, injected for tests.
pub fn load(
    explicit: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<(CheckConfig, Option<PathBuf>)> {
    let (file, path) = load_file(explicit, env)?;
    Ok((check_config(file, env)?, path))
}

/// The `keel bench` settings: file < `KEEL_CUDA_LIB_DIR` (the flag is
/// applied by the caller).
pub fn load_bench(
    explicit: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<(BenchConfig, Option<PathBuf>)> {
    let (file, path) = load_file(explicit, env)?;
    let mut c = BenchConfig {
        cuda_lib_dir: file.bench.cuda_lib_dir,
    };
    if let Some(v) = env("KEEL_CUDA_LIB_DIR") {
        c.cuda_lib_dir = Some(v.into());
    }
    Ok((c, path))
}

/// Loads `[serve]` from keel's config file (KEEL_CONFIG, else
/// ~/.config/keel/keel.toml) and applies the environment; flags are
/// applied by the caller.
pub fn load_serve(env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<ServeConfig> {
    let (file, _) = load_file(None, env)?;
    let f = file.serve;
    let mut c = ServeConfig {
        config: f.config,
        listen: f.listen,
        keys_file: f.keys_file,
    };
    if let Some(v) = env("KEEL_SERVE_CONFIG") {
        c.config = Some(v.into());
    }
    if let Some(v) = env("KEEL_SERVE_LISTEN") {
        c.listen = Some(v.parse().map_err(|_| {
            crate::exit::UsageError(format!(
                "KEEL_SERVE_LISTEN={v:?} is not an address (HOST:PORT)"
            ))
        })?);
    }
    if let Some(v) = env("KEEL_SERVE_KEYS_FILE") {
        c.keys_file = Some(v.into());
    }
    Ok(c)
}

/// The registry database's default place: `$XDG_DATA_HOME/keel/registry.db`,
/// else `~/.local/share/keel/registry.db`.
fn default_db(env: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    match env("XDG_DATA_HOME").filter(|d| Path::new(d).is_absolute()) {
        Some(d) => PathBuf::from(d).join("keel/registry.db"),
        None => PathBuf::from(env("HOME").unwrap_or_else(|| ".".into()))
            .join(".local/share/keel/registry.db"),
    }
}

/// The artifact store used when none is configured: the directory
/// `<db stem>-artifacts` beside the database (`registry.db` ->
/// `registry-artifacts`), as a `file://` URL of its absolute path.
pub fn default_artifact_store(db: &Path) -> String {
    let db = std::path::absolute(db).unwrap_or_else(|_| db.to_owned());
    let stem = db
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "registry".into());
    let dir = db
        .parent()
        .unwrap_or_else(|| Path::new("/"))
        .join(format!("{stem}-artifacts"));
    format!("file://{}", dir.display())
}

/// Whether the registry database setting names PostgreSQL rather than a
/// SQLite file.
pub fn is_postgres_db(db: &Path) -> bool {
    db.to_str().is_some_and(keel_registry::is_postgres_url)
}

/// Loads the `[model]` settings: defaults < file < environment < the
/// `--db` flag (`db_flag`, which also moves the default artifact store).
/// Other flags are applied by the caller.
pub fn load_model(
    explicit: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
    db_flag: Option<&Path>,
) -> anyhow::Result<(ModelConfig, Option<PathBuf>)> {
    let (file, path) = load_file(explicit, env)?;
    let f = file.model;
    let mut artifact_store = f.artifact_store;
    let mut c = ModelConfig {
        db: f.db.unwrap_or_else(|| default_db(env)),
        db_password_file: f.db_password_file,
        db_ca_file: f.db_ca_file,
        db_pool_size: f.db_pool_size.unwrap_or(8),
        db_timeout_ms: f.db_timeout_ms.unwrap_or(5000),
        artifact_store: String::new(),
        actor: f
            .actor
            .or_else(|| env("USER"))
            .or_else(|| env("LOGNAME"))
            .unwrap_or_else(|| "unknown".into()),
        public_key: f.public_key,
        listen: f.listen.unwrap_or_else(|| "127.0.0.1:8470".into()),
        serve_token_sha256: f.serve_token_sha256,
        tracking_uri: f.tracking_uri,
        serve_max_connections: f.serve_max_connections.unwrap_or(512),
        serve_max_connections_per_client: f.serve_max_connections_per_client.unwrap_or(64),
    };
    for (key, v) in [
        ("model.db_pool_size", c.db_pool_size),
        (
            "model.db_timeout_ms",
            usize::try_from(c.db_timeout_ms).unwrap_or(usize::MAX),
        ),
        ("model.serve_max_connections", c.serve_max_connections),
        (
            "model.serve_max_connections_per_client",
            c.serve_max_connections_per_client,
        ),
    ] {
        if v == 0 {
            return Err(crate::exit::UsageError(format!("{key} must be at least 1")).into());
        }
    }
    if let Some(v) = env("KEEL_MODEL_DB") {
        c.db = v.into();
    }
    if let Some(v) = env("KEEL_MODEL_DB_CA_FILE") {
        c.db_ca_file = Some(v.into());
    }
    if let Some(v) = env("KEEL_ARTIFACT_STORE") {
        artifact_store = Some(v);
    }
    if let Some(db) = db_flag {
        c.db = db.to_owned();
    }
    // A PostgreSQL registry has no directory beside it: its artifact store
    // is configured (every replica and client must upload to the same
    // one), and `register --path` says so when it is not.
    c.artifact_store = match artifact_store {
        Some(a) => a,
        None if is_postgres_db(&c.db) => String::new(),
        None => default_artifact_store(&c.db),
    };
    if let Some(v) = env("KEEL_ACTOR") {
        c.actor = v;
    }
    if let Some(v) = env("KEEL_MODEL_PUBLIC_KEY") {
        c.public_key = Some(v.into());
    }
    if let Some(v) = env("KEEL_MODEL_TOKEN_SHA256") {
        c.serve_token_sha256 = Some(v);
    }
    if let Some(v) = env("KEEL_MLFLOW_TRACKING_URI") {
        c.tracking_uri = Some(v);
    }
    c.tracking_uri = c.tracking_uri.filter(|u| !u.is_empty());
    if let Some(u) = &c.tracking_uri {
        check_tracking_uri(u)?;
    }
    if let Some(t) = &c.serve_token_sha256 {
        if t.len() != 64 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(crate::exit::UsageError(
                "model.serve_token_sha256 must be 64 hex digits: the SHA-256 of the token (sha256sum)".into(),
            )
            .into());
        }
    }
    Ok((c, path))
}

/// An MLflow tracking server's URL: `http://` or `https://`.
pub fn check_tracking_uri(u: &str) -> anyhow::Result<()> {
    if !(u.starts_with("http://") || u.starts_with("https://")) {
        let shown: String = u.chars().take(100).collect();
        return Err(crate::exit::UsageError(format!(
            "model.tracking_uri {shown:?} must be an MLflow tracking server's http:// or https:// URL"
        ))
        .into());
    }
    Ok(())
}

/// The config file: `explicit`, else `KEEL_CONFIG`, else
/// `~/.config/keel/keel.toml` where it exists.
fn config_path(explicit: Option<&Path>, env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| env("KEEL_CONFIG").map(PathBuf::from))
        .or_else(|| {
            let p = PathBuf::from(env("HOME")?).join(".config/keel/keel.toml");
            p.exists().then_some(p)
        })
}

/// Reads the config file, if there is one.
fn load_file(
    explicit: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<(FileConfig, Option<PathBuf>)> {
    let path = config_path(explicit, env);
    let file = match &path {
        Some(p) => {
            let text = keel_fs::read_regular_to_string(p, keel_fs::MAX_CONFIG_BYTES)
                .with_context(|| format!("cannot read the config file {}", p.display()))?;
            toml::from_str::<FileConfig>(&text).map_err(|e| {
                crate::exit::UsageError(format!("invalid config file {}: {e}", p.display()))
            })?
        }
        None => FileConfig::default(),
    };
    Ok((file, path))
}

/// The most GPUs `check.gpus` accepts.
pub const MAX_GPUS: u32 = 1024;

/// A GPU count from the environment or a flag: 0 to [`MAX_GPUS`].
pub fn parse_gpus(what: &str, v: &str) -> anyhow::Result<u32> {
    v.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| *n <= MAX_GPUS)
        .ok_or_else(|| {
            crate::exit::UsageError(format!(
                "{what} = {v:?} must be a whole number of GPUs from 0 to {MAX_GPUS}"
            ))
            .into()
        })
}

fn check_config(
    file: FileConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<CheckConfig> {
    let mut c = CheckConfig::default();
    let f = file.check;
    macro_rules! take {
        ($($field:ident),*) => { $( if let Some(v) = f.$field { c.$field = v.into(); } )* };
    }
    take!(
        imds_endpoint,
        imds_timeout_ms,
        read_timeout_s,
        slurm_timeout_s,
        fail_closed
    );
    c.sku = f.sku.or(c.sku);
    c.gpus = f.gpus.or(c.gpus);
    c.profile_file = f.profile_file.or(c.profile_file);
    c.gpu_snapshot = f.gpu_snapshot.or(c.gpu_snapshot);
    c.nvml_library = f.nvml_library.or(c.nvml_library);
    c.state_dir = f.state_dir.or(c.state_dir);
    c.prometheus_textfile = f.prometheus_textfile.or(c.prometheus_textfile);

    if let Some(v) = env("KEEL_SKU") {
        c.sku = Some(v);
    }
    if let Some(v) = env("KEEL_GPUS") {
        c.gpus = Some(parse_gpus("KEEL_GPUS", &v)?);
    }
    if let Some(v) = env("KEEL_PROFILE_FILE") {
        c.profile_file = Some(v.into());
    }
    if let Some(v) = env("KEEL_GPU_SNAPSHOT") {
        c.gpu_snapshot = Some(v.into());
    }
    if let Some(v) = env("KEEL_NVML_LIBRARY") {
        c.nvml_library = Some(v.into());
    }
    if let Some(v) = env("KEEL_IMDS_ENDPOINT") {
        c.imds_endpoint = v;
    }
    if let Some(v) = env("KEEL_STATE_DIR") {
        c.state_dir = Some(v.into());
    }
    if let Some(v) = env("KEEL_PROMETHEUS_TEXTFILE") {
        c.prometheus_textfile = Some(v.into());
    }
    if let Some(v) = env("KEEL_SLURM_TIMEOUT_S") {
        c.slurm_timeout_s = v.parse().map_err(|_| {
            crate::exit::UsageError(format!(
                "KEEL_SLURM_TIMEOUT_S={v:?} is not a number of seconds"
            ))
        })?;
    }
    if let Some(v) = env("KEEL_FAIL_CLOSED") {
        c.fail_closed = match v.as_str() {
            "1" | "true" | "yes" => true,
            "0" | "false" | "no" => false,
            _ => {
                return Err(crate::exit::UsageError(format!(
                    "KEEL_FAIL_CLOSED={v:?} is not true or false"
                ))
                .into())
            }
        };
    }
    for (what, v) in [
        ("read_timeout_s (check)", c.read_timeout_s),
        (
            "slurm_timeout_s (check) / KEEL_SLURM_TIMEOUT_S",
            c.slurm_timeout_s,
        ),
    ] {
        check_seconds(what, v)?;
    }
    if let Some(n) = c.gpus.filter(|n| *n > MAX_GPUS) {
        return Err(crate::exit::UsageError(format!(
            "gpus (check) = {n} must be a whole number of GPUs from 0 to {MAX_GPUS}"
        ))
        .into());
    }
    if !(1..=MAX_TIMEOUT_S as u64 * 1000).contains(&c.imds_timeout_ms) {
        return Err(crate::exit::UsageError(format!(
            "imds_timeout_ms (check) = {} must be between 1 and {} milliseconds",
            c.imds_timeout_ms,
            MAX_TIMEOUT_S as u64 * 1000
        ))
        .into());
    }
    Ok(c)
}

/// The longest timeout keel accepts anywhere: a day.
pub const MAX_TIMEOUT_S: f64 = 86_400.0;

/// A timeout in seconds: positive, finite, at most a day.
pub fn check_seconds(what: &str, v: f64) -> anyhow::Result<()> {
    if v > 0.0 && v <= MAX_TIMEOUT_S {
        Ok(())
    } else {
        Err(crate::exit::UsageError(format!(
            "{what} = {v} must be a positive number of seconds, at most {MAX_TIMEOUT_S}"
        ))
        .into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keel_cost_reads_only_the_cost_section() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        let none = |_: &str| None;
        // Another section's unknown key is not keel cost's to refuse.
        std::fs::write(
            &f,
            "[check]\nno_such_key = 1\n[cost]\nprometheus = \"http://p:9090\"\n",
        )
        .expect("write");
        let c = load_cost(Some(&f), &none).expect("loads");
        assert_eq!(c.prometheus.as_deref(), Some("http://p:9090"));
        std::fs::write(&f, "[serve]\nbogus = true\n").expect("write");
        assert!(load_cost(Some(&f), &none)
            .expect("loads")
            .prometheus
            .is_none());
        // Its own are.
        std::fs::write(&f, "[cost]\nprometeus = \"http://p\"\n").expect("write");
        let e = format!("{:#}", load_cost(Some(&f), &none).expect_err("refused"));
        assert!(e.contains("[cost]") && e.contains("prometeus"), "{e}");
        std::fs::write(&f, "[cost\n").expect("write");
        assert!(load_cost(Some(&f), &none).is_err());
        assert!(load_cost(None, &none)
            .expect("no file")
            .prometheus
            .is_none());
    }

    #[test]
    fn timeouts_out_of_range_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        let none = |_: &str| None;
        for body in [
            "[check]\nread_timeout_s = 1e30\n",
            "[check]\nread_timeout_s = -1.0\n",
            "[check]\nslurm_timeout_s = inf\n",
            "[check]\nslurm_timeout_s = nan\n",
            "[check]\nimds_timeout_ms = 0\n",
            "[check]\nimds_timeout_ms = 100000000000\n",
        ] {
            std::fs::write(&f, body).expect("write");
            let e = load(Some(&f), &none).expect_err(body);
            assert!(e.to_string().contains("must be"), "{body}: {e}");
        }
        std::fs::write(&f, "").expect("write");
        for v in ["-1", "inf", "NaN", "1e19", "0"] {
            let env = |k: &str| (k == "KEEL_SLURM_TIMEOUT_S").then(|| v.to_owned());
            let e = load(Some(&f), &env).expect_err(v);
            assert!(e.to_string().contains("KEEL_SLURM_TIMEOUT_S"), "{v}: {e}");
        }
    }

    #[test]
    fn precedence_file_then_env() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        std::fs::write(&f, "[check]\nsku = \"nd96asr_v4\"\nslurm_timeout_s = 3.0\n")
            .expect("write");
        let env = |k: &str| (k == "KEEL_SKU").then(|| "nd96isr_h100_v5".to_owned());
        let (c, path) = load(Some(&f), &env).expect("config");
        assert_eq!(path.as_deref(), Some(f.as_path()));
        assert_eq!(c.sku.as_deref(), Some("nd96isr_h100_v5"));
        assert_eq!(c.slurm_timeout_s, 3.0);
        assert_eq!(c.imds_timeout_ms, 1000);

        std::fs::write(
            &f,
            "[serve]\nconfig = \"/etc/keel/serve.toml\"\nlisten = \"127.0.0.1:1\"\n",
        )
        .expect("write");
        let env = |k: &str| match k {
            "KEEL_CONFIG" => Some(f.display().to_string()),
            "KEEL_SERVE_LISTEN" => Some("127.0.0.1:2".to_owned()),
            _ => None,
        };
        let s = load_serve(&env).expect("serve config");
        assert_eq!(s.config.as_deref(), Some(Path::new("/etc/keel/serve.toml")));
        assert_eq!(s.listen, Some("127.0.0.1:2".parse().expect("addr")));

        std::fs::write(&f, "[check]\nskus = \"x\"\n").expect("write");
        let err = load(Some(&f), &|_| None).expect_err("unknown key");
        assert!(format!("{err:#}").contains("skus"), "{err:#}");
    }

    #[test]
    fn model_defaults_and_precedence() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        std::fs::write(
            &f,
            "[model]\nartifact_store = \"file:///a\"\nactor = \"ci\"\n",
        )
        .expect("write");
        let env = |k: &str| match k {
            "HOME" => Some("/home/u".to_owned()),
            "KEEL_ACTOR" => Some("alice".to_owned()),
            _ => None,
        };
        let (c, _) = load_model(Some(&f), &env, None).expect("config");
        assert_eq!(c.db, PathBuf::from("/home/u/.local/share/keel/registry.db"));
        assert_eq!(c.artifact_store, "file:///a");
        assert_eq!(c.actor, "alice");
        let env = |k: &str| (k == "XDG_DATA_HOME").then(|| "/data".to_owned());
        let (c, _) = load_model(None, &env, None).expect("config");
        assert_eq!(c.db, PathBuf::from("/data/keel/registry.db"));
        assert_eq!(c.artifact_store, "file:///data/keel/registry-artifacts");
        // --db moves the default store with the database.
        let (c, _) = load_model(None, &env, Some(Path::new("/srv/m.db"))).expect("config");
        assert_eq!(c.artifact_store, "file:///srv/m-artifacts");
        let env = |k: &str| (k == "KEEL_MODEL_TOKEN_SHA256").then(|| "xyz".to_owned());
        assert!(load_model(None, &env, None).is_err());
    }

    #[test]
    fn model_tracking_uri_file_then_env() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        std::fs::write(&f, "[model]\ntracking_uri = \"http://mlflow:5000\"\n").expect("write");
        let (c, _) = load_model(Some(&f), &|_| None, None).expect("config");
        assert_eq!(c.tracking_uri.as_deref(), Some("http://mlflow:5000"));
        let env = |k: &str| (k == "KEEL_MLFLOW_TRACKING_URI").then(|| "https://t".to_owned());
        let (c, _) = load_model(Some(&f), &env, None).expect("config");
        assert_eq!(c.tracking_uri.as_deref(), Some("https://t"));
        let (c, _) = load_model(None, &|_| None, None).expect("config");
        assert_eq!(c.tracking_uri, None);
        let env = |k: &str| (k == "KEEL_MLFLOW_TRACKING_URI").then(|| "file:///mlruns".to_owned());
        let err = load_model(None, &env, None).expect_err("not http");
        assert!(format!("{err:#}").contains("http://"), "{err:#}");
    }

    #[test]
    fn model_serve_connection_limits_default_read_and_refuse_zero() {
        let (c, _) = load_model(None, &|_| None, None).expect("config");
        assert_eq!(
            (c.serve_max_connections, c.serve_max_connections_per_client),
            (512, 64)
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        std::fs::write(
            &f,
            "[model]\nserve_max_connections = 2000\nserve_max_connections_per_client = 500\n",
        )
        .expect("write");
        let (c, _) = load_model(Some(&f), &|_| None, None).expect("config");
        assert_eq!(
            (c.serve_max_connections, c.serve_max_connections_per_client),
            (2000, 500)
        );
        std::fs::write(&f, "[model]\nserve_max_connections_per_client = 0\n").expect("write");
        let err = load_model(Some(&f), &|_| None, None).expect_err("zero");
        assert!(
            format!("{err:#}")
                .contains("model.serve_max_connections_per_client must be at least 1"),
            "{err:#}"
        );
    }

    #[test]
    fn model_postgres_settings_default_read_and_refuse_zero() {
        let (c, _) = load_model(None, &|_| None, None).expect("config");
        assert_eq!((c.db_pool_size, c.db_timeout_ms), (8, 5000));
        assert_eq!((c.db_password_file, c.db_ca_file), (None, None));
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        std::fs::write(
            &f,
            "[model]
db = \"postgres://keel@db:5432/reg\"\ndb_password_file = \"/etc/keel/pw\"\ndb_ca_file = \"/etc/keel/ca.pem\"\ndb_pool_size = 3\ndb_timeout_ms = 250\n",
        )
        .expect("write");
        let (c, _) = load_model(Some(&f), &|_| None, None).expect("config");
        assert_eq!(c.db, PathBuf::from("postgres://keel@db:5432/reg"));
        assert!(is_postgres_db(&c.db));
        assert_eq!(c.db_password_file, Some(PathBuf::from("/etc/keel/pw")));
        assert_eq!((c.db_pool_size, c.db_timeout_ms), (3, 250));
        // No artifact directory is guessed beside a PostgreSQL database.
        assert_eq!(c.artifact_store, "");
        let env = |k: &str| (k == "KEEL_MODEL_DB_CA_FILE").then(|| "/run/ca.pem".to_owned());
        let (c, _) = load_model(Some(&f), &env, None).expect("config");
        assert_eq!(c.db_ca_file, Some(PathBuf::from("/run/ca.pem")));
        std::fs::write(&f, "[model]\ndb_pool_size = 0\n").expect("write");
        let err = load_model(Some(&f), &|_| None, None).expect_err("zero");
        assert!(
            format!("{err:#}").contains("model.db_pool_size must be at least 1"),
            "{err:#}"
        );
    }

    #[test]
    fn every_key_is_documented() {
        let doc = include_str!("../../../docs/config.md");
        // Every field of the effective config, read from the struct itself.
        let value = serde_json::to_value(CheckConfig::default()).expect("serialises");
        let keys: Vec<String> = value.as_object().expect("object").keys().cloned().collect();
        assert_eq!(keys.len(), 12);
        let keys: Vec<String> = keys;
        for k in keys {
            assert!(
                doc.contains(&format!("`{k}`")),
                "docs/config.md does not document check.{k}"
            );
        }
        for (var, _) in ENV_VARS {
            assert!(doc.contains(var), "docs/config.md does not document {var}");
        }
        let cost = serde_json::to_value(FileCost::default()).expect("serialises");
        for k in cost.as_object().expect("object").keys() {
            assert!(
                doc.contains(&format!("`{k}`")),
                "docs/config.md does not document cost.{k}"
            );
        }
        let serve = serde_json::to_value(ServeConfig::default()).expect("serialises");
        for k in serve.as_object().expect("object").keys() {
            assert!(
                doc.contains(&format!("`{k}`")),
                "docs/config.md does not document serve.{k}"
            );
        }
        let model = serde_json::to_value(
            load_model(None, &|k| (k == "HOME").then(|| "/h".to_owned()), None)
                .expect("model config")
                .0,
        )
        .expect("serialises");
        let keys: Vec<String> = model.as_object().expect("object").keys().cloned().collect();
        assert_eq!(keys.len(), 13);
        for k in keys {
            assert!(
                doc.contains(&format!("`{k}`")),
                "docs/config.md does not document model.{k}"
            );
        }
        let exporter = serde_json::to_value(ExporterConfig::default()).expect("serialises");
        let keys: Vec<String> = exporter
            .as_object()
            .expect("object")
            .keys()
            .cloned()
            .collect();
        assert_eq!(keys.len(), 19);
        for k in keys {
            assert!(
                doc.contains(&format!("`{k}`")),
                "docs/config.md does not document exporter.{k}"
            );
        }
        let bench = serde_json::to_value(BenchConfig::default()).expect("serialises");
        for k in bench.as_object().expect("object").keys() {
            assert!(
                doc.contains(&format!("`{k}`")),
                "docs/config.md does not document bench.{k}"
            );
        }
    }

    #[test]
    fn exporter_needs_a_token_or_an_explicit_opt_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        let hex = "A".repeat(64);
        for (body, ok) in [
            ("", false),
            ("[exporter]\nno_auth = true\n", true),
            (
                &format!("[exporter]\ntoken_sha256 = \"{hex}\"\n") as &str,
                true,
            ),
            (
                &format!("[exporter]\ntoken_sha256 = \"{hex}\"\nno_auth = true\n"),
                false,
            ),
            ("[exporter]\ntoken_sha256 = \"abc\"\n", false),
            ("[exporter]\nno_auth = true\nmax_connections = 0\n", false),
            ("[exporter]\nno_auth = true\ndeadline_s = -1.0\n", false),
            (
                "[exporter]\nno_auth = true\nidle_threshold_percent = 101.0\n",
                false,
            ),
        ] {
            std::fs::write(&f, body).expect("write");
            let mut c = load_exporter(Some(&f), &|_| None).expect(body);
            assert_eq!(validate_exporter(&mut c).is_ok(), ok, "{body}");
            if ok {
                assert_eq!(c.listen, "127.0.0.1:9400".parse().expect("addr"));
                assert!(c
                    .token_sha256
                    .as_deref()
                    .is_none_or(|t| t == "a".repeat(64)));
            }
        }
        std::fs::write(&f, "[exporter]\nlisten = \"0.0.0.0:1\"\n").expect("write");
        let env = |k: &str| (k == "KEEL_EXPORTER_LISTEN").then(|| "127.0.0.1:2".to_owned());
        let c = load_exporter(Some(&f), &env).expect("config");
        assert_eq!(c.listen, "127.0.0.1:2".parse().expect("addr"));
        std::fs::write(&f, "[exporter]\ntoken = \"x\"\n").expect("write");
        assert!(
            load_exporter(Some(&f), &|_| None).is_err(),
            "unknown keys are refused"
        );
    }

    #[test]
    fn bench_settings_file_then_env() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("keel.toml");
        std::fs::write(&f, "[bench]\ncuda_lib_dir = \"/opt/a\"\n").expect("write");
        let (c, _) = load_bench(Some(&f), &|_| None).expect("config");
        assert_eq!(c.cuda_lib_dir.as_deref(), Some(Path::new("/opt/a")));
        let env = |k: &str| (k == "KEEL_CUDA_LIB_DIR").then(|| "/opt/b".to_owned());
        let (c, _) = load_bench(Some(&f), &env).expect("config");
        assert_eq!(c.cuda_lib_dir.as_deref(), Some(Path::new("/opt/b")));
        // The check settings still load from a file with a [bench] table.
        assert!(load(Some(&f), &|_| None).is_ok());
    }
}
