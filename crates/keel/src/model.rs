//! `keel model`: the model registry (keel-registry) from the command line:
//! register, ls, show, alias, rollback, history, pull, verify, sign,
//! keygen, keys, backup, restore, audit, serve.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use serde_json::json;

use keel_registry::artifacts;
use keel_registry::register as registration;
use keel_registry::sign::{self, DirOptions, PrivateKey, PublicKey, SignError};
use keel_registry::{
    rfc3339, version_manifest, BackupReport, Clock, Dataset, Lineage, NewVersion, Registry, Role,
    Tag, Version, VersionRef,
};
use keel_store::{FileEntry, Store, StoreOptions, StoreUrl, TransferOptions};

use crate::config::{self, ModelConfig};
use crate::exit::{Code, UsageError};
use crate::output::Out;
use crate::table::Table;

#[derive(Debug, Args)]
pub struct ModelArgs {
    /// The registry database: a SQLite file or postgres://USER@HOST:PORT/DB
    /// (default: model.db, KEEL_MODEL_DB, else
    /// $XDG_DATA_HOME/keel/registry.db or ~/.local/share/keel/registry.db).
    #[arg(long, global = true, value_name = "PATH|URL")]
    db: Option<PathBuf>,
    /// Who the audit log names (default: model.actor, KEEL_ACTOR, $USER).
    #[arg(long, global = true, value_name = "NAME")]
    actor: Option<String>,
    /// Config file (default: KEEL_CONFIG, then ~/.config/keel/keel.toml).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
    #[command(subcommand)]
    command: Option<ModelCommand>,
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Register a new version: from a local directory (uploaded to the
    /// artifact store), from files already in storage with a manifest, or
    /// from a committed keel checkpoint (which gets pinned).
    Register(Box<RegisterArgs>),
    /// List models.
    Ls,
    /// Show a model (NAME) or a version (NAME@ALIAS, NAME:VERSION).
    Show { reference: String },
    /// Point an alias at a version, or remove it.
    Alias {
        #[command(subcommand)]
        command: AliasCommand,
    },
    /// Move an alias back to the version it held before its last change.
    Rollback {
        name: String,
        alias: String,
        #[arg(long, default_value = "rollback")]
        reason: String,
    },
    /// Alias history of a model (or of one alias), oldest first.
    History { name: String, alias: Option<String> },
    /// Download a version's files, verified against their digests; writes
    /// the version's signature as model.sig beside them when it has one.
    Pull {
        reference: String,
        #[arg(long, value_name = "DIR")]
        to: PathBuf,
    },
    /// Verify a version (stored files and signature) or, with --path, any
    /// local directory against any OpenSSF model-signing bundle.
    Verify(VerifyArgs),
    /// Sign a version with an ECDSA P-256 key (OpenSSF model signing v1.0).
    Sign {
        /// NAME:VERSION (or NAME@ALIAS).
        reference: String,
        /// Private key: SEC1 (`openssl ecparam -name prime256v1 -genkey`)
        /// or PKCS#8 PEM, without a password.
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
    },
    /// Make an ECDSA P-256 key pair for signing.
    Keygen {
        #[arg(long, value_name = "FILE", default_value = "key.pem")]
        private_key: PathBuf,
        #[arg(long, value_name = "FILE", default_value = "key.pub")]
        public_key: PathBuf,
    },
    /// API keys for `keel model serve` (stored as SHA-256 hashes).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Copy the registry to object storage as a SQLite registry file (from
    /// SQLite, its online backup; from PostgreSQL, a checked copy of one
    /// snapshot).
    Backup {
        /// The backup object: file:///backups/registry.db, az://c/p/registry.db...
        url: String,
    },
    /// Replace the registry database with a backup, after checking its
    /// integrity and hash chains (on PostgreSQL: into an empty database).
    Restore {
        url: String,
        /// Replace a registry that already holds data (SQLite only).
        #[arg(long)]
        force: bool,
    },
    /// The audit log and its verification.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Serve the registry's HTTP API (keel's read API and an MLflow-
    /// compatible subset) with API-key authentication.
    Serve {
        /// Address to listen on (default: model.listen, 127.0.0.1:8470).
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
        /// MLflow tracking server asked for the run of a version that
        /// MLflow's `log_model` registers without one (default:
        /// model.tracking_uri).
        #[arg(long, value_name = "URL")]
        tracking_uri: Option<String>,
    },
    /// Copy a whole registry into an empty database (SQLite to PostgreSQL,
    /// or back): one transaction on the target, committed only after both
    /// hash chains and every signature check out there. A copy that
    /// stopped committed nothing: run it again.
    Migrate {
        /// The registry to copy: sqlite:PATH (or a path), or
        /// postgres://USER@HOST:PORT/DB.
        #[arg(long, value_name = "SOURCE")]
        from: String,
        /// The empty database to copy into: postgres://... or sqlite:PATH.
        #[arg(long, value_name = "TARGET")]
        to: String,
    },
}

#[derive(Debug, Args)]
struct RegisterArgs {
    name: String,
    /// A local directory: its files are uploaded to the artifact store.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["from", "from_ckpt"])]
    path: Option<PathBuf>,
    /// A storage URL holding files and their manifest.json.
    #[arg(long, value_name = "URL", conflicts_with = "from_ckpt")]
    from: Option<String>,
    /// A keel checkpoint store (`keel ckpt ... URL`); needs --run and --step.
    #[arg(long, value_name = "URL", requires_all = ["run", "step"])]
    from_ckpt: Option<String>,
    /// The checkpoint's run (with --from-ckpt).
    #[arg(long, requires = "from_ckpt")]
    run: Option<String>,
    /// The checkpoint's step (with --from-ckpt).
    #[arg(long, requires = "from_ckpt")]
    step: Option<u64>,
    /// With --from or --from-ckpt: only check that every file exists with
    /// its size, instead of reading every byte against its SHA-256.
    #[arg(long, conflicts_with = "path")]
    sizes_only: bool,
    /// Where --path uploads (default: model.artifact_store,
    /// KEEL_ARTIFACT_STORE, else the directory `<db stem>-artifacts` beside
    /// the registry database).
    #[arg(long, value_name = "URL")]
    artifact_store: Option<String>,
    #[arg(long, default_value = "")]
    description: String,
    /// A version tag (repeatable).
    #[arg(long = "tag", value_name = "KEY=VALUE")]
    tags: Vec<String>,
    /// The training run's id (default with --from-ckpt: the checkpoint run).
    #[arg(long, value_name = "ID")]
    run_id: Option<String>,
    /// A data set: URI or URI#DIGEST (repeatable).
    #[arg(long = "dataset", value_name = "URI[#DIGEST]")]
    datasets: Vec<String>,
    /// The code revision that trained it.
    #[arg(long, value_name = "COMMIT")]
    code_commit: Option<String>,
    /// The version of this model it derives from.
    #[arg(long, value_name = "VERSION")]
    parent: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum AliasCommand {
    /// Point ALIAS at VERSION.
    Set {
        name: String,
        alias: String,
        #[arg(value_name = "VERSION")]
        target: String,
        #[arg(long)]
        reason: String,
    },
    /// Remove an alias.
    Rm {
        name: String,
        alias: String,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Args)]
struct VerifyArgs {
    /// NAME@ALIAS, NAME:VERSION or NAME (without --path).
    #[arg(required_unless_present = "path", conflicts_with = "path")]
    reference: Option<String>,
    /// A local model directory to verify against --signature.
    #[arg(long, value_name = "DIR", requires_all = ["signature", "public_key"])]
    path: Option<PathBuf>,
    /// A model-signing bundle (model.sig).
    #[arg(long, value_name = "FILE", requires = "path")]
    signature: Option<PathBuf>,
    /// The trusted public key (SPKI PEM). Default for versions:
    /// model.public_key, else the key recorded at signing.
    #[arg(long, value_name = "FILE")]
    public_key: Option<PathBuf>,
    /// Paths to leave out of --path, relative to it (repeatable).
    #[arg(long = "ignore-paths", value_name = "PATH", num_args = 1.., requires = "path")]
    ignore_paths: Vec<String>,
    /// Hash .git, .gitattributes, .github and .gitignore too.
    #[arg(long, requires = "path")]
    no_ignore_git_paths: bool,
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Create a key; its secret is printed once.
    Create {
        name: String,
        #[arg(long, default_value = "read", value_parser = ["read", "write"])]
        role: String,
    },
    Ls,
    /// Revoke a key; it stops working at once.
    Revoke {
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum AuditCommand {
    /// Check the alias history and audit log hash chains, and the current
    /// state against them; names the first broken link.
    Verify,
    /// Print the audit log.
    Log,
}

use keel_time::SystemClock;

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn store_options(create_root: bool) -> StoreOptions {
    StoreOptions {
        create_root,
        env: std::env::vars()
            .filter(|(k, _)| k.starts_with("AZURE_") || k.starts_with("AWS_"))
            .collect(),
        ..Default::default()
    }
}

fn open_store(url: &str, create_root: bool) -> anyhow::Result<Store> {
    let u = StoreUrl::parse(url)?;
    Ok(Store::open(&u, &store_options(create_root))?)
}

/// Opens the configured registry: a SQLite file, or a PostgreSQL database
/// (its password from `model.db_password_file` or KEEL_MODEL_DB_PASSWORD,
/// never the command line).
pub fn open_registry(cfg: &ModelConfig, clock: Arc<dyn Clock>) -> anyhow::Result<Registry> {
    match cfg
        .db
        .to_str()
        .filter(|s| keel_registry::is_postgres_url(s))
    {
        Some(url) => Ok(Registry::open_postgres(&pg_options(cfg, url)?, clock)?),
        None => Ok(Registry::open(&cfg.db, clock)?),
    }
}

/// The PostgreSQL settings of `cfg`, for the database at `url`.
pub fn pg_options(cfg: &ModelConfig, url: &str) -> anyhow::Result<keel_registry::PgOptions> {
    let mut o = keel_registry::PgOptions::new(url);
    o.password = match (
        std::env::var("KEEL_MODEL_DB_PASSWORD")
            .ok()
            .filter(|p| !p.is_empty()),
        &cfg.db_password_file,
    ) {
        (Some(p), _) => Some(p),
        (None, Some(f)) => Some(read_password_file(f)?),
        (None, None) => None,
    };
    o.ca_file = cfg.db_ca_file.clone();
    o.pool_size = cfg.db_pool_size;
    o.timeout = std::time::Duration::from_millis(cfg.db_timeout_ms);
    Ok(o)
}

/// A password file: its owner's alone (mode 0600), one line.
fn read_password_file(path: &Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |m: String| UsageError(format!("model.db_password_file {}: {m}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(bad(
            "must be readable by its owner only (chmod 600): it holds a password".into(),
        )
        .into());
    }
    let bytes =
        keel_fs::read_regular(path, keel_fs::MAX_CONFIG_BYTES).map_err(|e| bad(e.to_string()))?;
    let text = String::from_utf8(bytes).map_err(|_| bad("not UTF-8 text".into()))?;
    let pw = text.trim_end_matches(['\n', '\r']);
    if pw.is_empty() || pw.contains('\n') {
        return Err(bad("must hold the password alone, on one line".into()).into());
    }
    Ok(pw.to_owned())
}

/// A registry named on the command line: `sqlite:PATH` or a path (which
/// must exist when `existing`), or a PostgreSQL URL (with the configured
/// password and CA).
fn open_named(
    cfg: &ModelConfig,
    name: &str,
    existing: bool,
    clock: Arc<dyn Clock>,
) -> anyhow::Result<Registry> {
    if keel_registry::is_postgres_url(name) {
        return Ok(Registry::open_postgres(&pg_options(cfg, name)?, clock)?);
    }
    let path = Path::new(name.strip_prefix("sqlite:").unwrap_or(name));
    if path.as_os_str().is_empty() {
        return Err(UsageError(format!(
            "{name:?}: name a SQLite file (sqlite:PATH) or a postgres:// URL"
        ))
        .into());
    }
    if existing && !path.is_file() {
        return Err(UsageError(format!(
            "{}: no registry database there (name a SQLite file, as PATH or sqlite:PATH, or a postgres://USER@HOST:PORT/DB URL)",
            path.display()
        ))
        .into());
    }
    Ok(Registry::open(path, clock)?)
}

/// `keel model migrate --from SOURCE --to TARGET`.
fn migrate(
    cfg: &ModelConfig,
    from: &str,
    to: &str,
    clock: Arc<dyn Clock>,
    out: &mut Out,
) -> anyhow::Result<Code> {
    let source = open_named(cfg, from, true, clock.clone())?;
    let target = open_named(cfg, to, false, clock)?;
    let report = keel_registry::migrate::copy(&source, &target)?;
    if out.json {
        out.json(
            "model migrate",
            &json!({"from": source.path(), "to": target.path(), "report": report}),
        )?;
    } else {
        let tables: Vec<String> = report
            .tables
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect();
        out.text(&format!(
            "copied {} -> {}\nrows:          {}\nalias history: {} events, head {}\naudit log:     {} events, head {}\nsignatures:    {} checked, all hold\nok\n",
            source.path().display(),
            target.path().display(),
            tables.join(", "),
            report.chains.alias_events,
            report.chains.alias_head,
            report.chains.audit_events,
            report.chains.audit_head,
            report.signatures.checked,
        ))?;
    }
    Ok(Code::Ok)
}

fn parse_ref(s: &str) -> anyhow::Result<VersionRef> {
    Ok(s.parse::<VersionRef>()?)
}

fn effective(args: &ModelArgs) -> anyhow::Result<(ModelConfig, Option<PathBuf>)> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (mut c, path) = config::load_model(args.config.as_deref(), &env, args.db.as_deref())?;
    if let Some(a) = &args.actor {
        c.actor = a.clone();
    }
    Ok((c, path))
}

pub fn run(args: &ModelArgs, out: &mut Out) -> anyhow::Result<Code> {
    let (mut cfg, cfg_path) = effective(args)?;
    let Some(command) = &args.command else {
        if args.print_config {
            if out.json {
                out.json(
                    "model config",
                    &json!({"config_file": cfg_path, "model": cfg}),
                )?;
            } else {
                // A struct, not JSON: TOML has no null, and unset keys are
                // left out.
                #[derive(serde::Serialize)]
                struct File<'a> {
                    model: &'a ModelConfig,
                }
                let text = toml::to_string(&File { model: &cfg }).unwrap_or_default();
                let from = cfg_path
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "none".into());
                out.text(&format!("# config file: {from}\n{text}"))?;
            }
            return Ok(Code::Ok);
        }
        return Err(UsageError("a subcommand is needed: keel model --help".into()).into());
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    // Commands that do not need the database.
    match command {
        ModelCommand::Keygen {
            private_key,
            public_key,
        } => return keygen(private_key, public_key, out),
        ModelCommand::Verify(v) if v.path.is_some() => return verify_path(v, out),
        ModelCommand::Migrate { from, to } => return migrate(&cfg, from, to, clock, out),
        _ => {}
    }
    let mut reg = open_registry(&cfg, clock)?;
    let actor = cfg.actor.clone();
    match command {
        ModelCommand::Register(r) => register(&mut reg, &cfg, r, out),
        ModelCommand::Ls => ls(&reg, out),
        ModelCommand::Show { reference } => show(&reg, reference, out),
        ModelCommand::Alias { command } => match command {
            AliasCommand::Set {
                name,
                alias,
                target,
                reason,
            } => {
                let v = keel_registry::parse_version(target)?;
                let ev = reg.set_alias(&actor, name, alias, v, reason)?;
                alias_result("model alias set", &ev, out)
            }
            AliasCommand::Rm {
                name,
                alias,
                reason,
            } => {
                let ev = reg.delete_alias(&actor, name, alias, reason)?;
                alias_result("model alias rm", &ev, out)
            }
        },
        ModelCommand::Rollback {
            name,
            alias,
            reason,
        } => {
            let ev = reg.rollback(&actor, name, alias, reason)?;
            alias_result("model rollback", &ev, out)
        }
        ModelCommand::History { name, alias } => history(&reg, name, alias.as_deref(), out),
        ModelCommand::Pull { reference, to } => pull(&reg, reference, to, out),
        ModelCommand::Verify(v) => {
            if v.public_key.is_some() {
                cfg.public_key = v.public_key.clone();
            }
            verify_version(&reg, &cfg, v.reference.as_deref().unwrap_or_default(), out)
        }
        ModelCommand::Sign { reference, key } => {
            sign_version(&mut reg, &actor, reference, key, out)
        }
        ModelCommand::Keygen { .. } | ModelCommand::Migrate { .. } => Ok(Code::Ok),
        ModelCommand::Keys { command } => keys(&mut reg, &actor, command, out),
        ModelCommand::Backup { url } => backup(&reg, url, out),
        ModelCommand::Restore { url, force } => restore(&mut reg, &actor, url, *force, out),
        ModelCommand::Audit { command } => match command {
            AuditCommand::Verify => audit_verify(&reg, out),
            AuditCommand::Log => audit_log(&reg, out),
        },
        ModelCommand::Serve {
            listen,
            tracking_uri,
        } => {
            let addr = listen.clone().unwrap_or_else(|| cfg.listen.clone());
            if let Some(u) = tracking_uri {
                crate::config::check_tracking_uri(u)?;
                cfg.tracking_uri = Some(u.clone()).filter(|u| !u.is_empty());
            }
            serve(reg, &cfg, &addr)
        }
    }
}

// ----- register -------------------------------------------------------------

fn register(
    reg: &mut Registry,
    cfg: &ModelConfig,
    r: &RegisterArgs,
    out: &mut Out,
) -> anyhow::Result<Code> {
    // A new model's name is checked before anything is uploaded (a model
    // that already exists keeps the name it has).
    if reg.model(&r.name).is_err() {
        keel_registry::check_model_name(&r.name)?;
    }
    let mut tags = Vec::new();
    for t in &r.tags {
        let (k, v) = t
            .split_once('=')
            .ok_or_else(|| UsageError(format!("--tag {t:?}: expected KEY=VALUE")))?;
        tags.push(Tag {
            key: k.to_owned(),
            value: v.to_owned(),
        });
    }
    let datasets = r
        .datasets
        .iter()
        .map(|d| d.parse::<Dataset>())
        .collect::<Result<Vec<_>, _>>()?;
    let new = NewVersion {
        model: r.name.clone(),
        source: String::new(),
        description: r.description.clone(),
        lineage: Lineage {
            run_id: r.run_id.clone(),
            checkpoint: None,
            datasets,
            code_commit: r.code_commit.clone(),
            parent_version: r.parent,
            run_link: None,
            mlflow_model_id: None,
        },
        tags,
        create_model: true,
    };
    let store_url;
    let files = if let Some(dir) = &r.path {
        store_url = r
            .artifact_store
            .clone()
            .unwrap_or_else(|| cfg.artifact_store.clone());
        if store_url.is_empty() {
            return Err(UsageError(
                "a registry on PostgreSQL has no artifact store beside it: set model.artifact_store (or KEEL_ARTIFACT_STORE, --artifact-store) to the store every replica and client uploads to".into(),
            )
            .into());
        }
        registration::Files::Dir {
            dir,
            store_url: &store_url,
        }
    } else if let Some(url) = &r.from {
        registration::Files::Stored {
            url,
            sizes_only: r.sizes_only,
        }
    } else if let Some(url) = &r.from_ckpt {
        registration::Files::Checkpoint {
            url,
            run: r.run.as_deref().unwrap_or_default(),
            step: r.step.unwrap_or_default(),
            sizes_only: r.sizes_only,
        }
    } else {
        return Err(UsageError(
            "register needs --path DIR, --from URL or --from-ckpt URL --run RUN --step N".into(),
        )
        .into());
    };
    let who = registration::Registrant {
        actor: cfg.actor.clone(),
        host: crate::ckpt::hostname(),
        pid: std::process::id(),
        now: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default(),
    };
    let v = runtime()?.block_on(registration::register(
        reg,
        new,
        files,
        &store_options(false),
        &who,
    ))?;
    if out.json {
        out.json("model register", &json!({ "model_version": v }))?;
    } else {
        out.text(&format!(
            "registered {}:{} ({}, {} files, {}), manifest digest {}\n",
            v.model,
            v.version,
            v.status,
            v.files.len(),
            human_bytes(v.total_bytes()),
            v.manifest_digest.as_deref().unwrap_or("-"),
        ))?;
    }
    Ok(Code::Ok)
}

// ----- reading ----------------------------------------------------------------

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Rows the listing commands read from the registry at a time: a page
/// is read, rendered (a table row each, or JSON) and dropped before the
/// next, so no listing holds a whole registry's versions.
const PAGE: usize = 500;

/// Calls `page(after)` until it returns fewer than [`PAGE`] items, handing
/// each item to `each`; `key` gives the position after an item.
fn for_each_page<T, K>(
    mut page: impl FnMut(Option<&K>) -> Result<Vec<T>, keel_registry::RegistryError>,
    key: impl Fn(&T) -> K,
    mut each: impl FnMut(T) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut after: Option<K> = None;
    loop {
        let items = page(after.as_ref())?;
        let full = items.len() >= PAGE;
        if let Some(last) = items.last() {
            after = Some(key(last));
        }
        for i in items {
            each(i)?;
        }
        if !full {
            return Ok(());
        }
    }
}

fn ls(reg: &Registry, out: &mut Out) -> anyhow::Result<Code> {
    let mut models = Vec::new();
    for_each_page(
        |after: Option<&String>| reg.models_after(after.map(String::as_str), PAGE),
        |m| m.name.clone(),
        |m| {
            models.push(m);
            Ok(())
        },
    )?;
    if out.json {
        out.json("model ls", &json!({ "models": models }))?;
        return Ok(Code::Ok);
    }
    let mut t = Table::new(&["Model", "Versions", "Latest", "Aliases", "Updated"]);
    for m in &models {
        t.row(vec![
            m.name.clone(),
            m.versions.to_string(),
            m.latest_version.map_or("-".into(), |v| v.to_string()),
            if m.aliases.is_empty() {
                "-".into()
            } else {
                m.aliases
                    .iter()
                    .map(|a| format!("{}={}", a.alias, a.version))
                    .collect::<Vec<_>>()
                    .join(",")
            },
            rfc3339(m.updated_ms),
        ]);
    }
    out.text(&t.render())?;
    Ok(Code::Ok)
}

fn show(reg: &Registry, reference: &str, out: &mut Out) -> anyhow::Result<Code> {
    match parse_ref(reference)? {
        VersionRef::Latest(name) => {
            let m = reg.model(&name)?;
            if out.json {
                let mut versions = Vec::new();
                for_each_page(
                    |after: Option<&u64>| {
                        reg.versions_after(&name, after.copied().unwrap_or(0), PAGE)
                    },
                    |v| v.version,
                    |v| {
                        versions.push(serde_json::to_value(v)?);
                        Ok(())
                    },
                )?;
                out.json("model show", &json!({ "model": m, "versions": versions }))?;
                return Ok(Code::Ok);
            }
            let mut s = format!(
                "{} | {} version(s) | created {} by {}\n",
                m.name,
                m.versions,
                rfc3339(m.created_ms),
                m.created_by
            );
            if !m.description.is_empty() {
                s.push_str(&format!("{}\n", m.description));
            }
            s.push('\n');
            let mut t = Table::new(&[
                "Version", "Status", "Files", "Size", "Digest", "Aliases", "Signed", "Created",
            ]);
            // A row each, a page of versions (with their file lists) at a
            // time.
            for_each_page(
                |after: Option<&u64>| reg.versions_after(&name, after.copied().unwrap_or(0), PAGE),
                |v| v.version,
                |v| {
                    t.row(vec![
                        v.version.to_string(),
                        v.status.to_string(),
                        v.files.len().to_string(),
                        human_bytes(v.total_bytes()),
                        v.manifest_digest
                            .as_deref()
                            .map_or("-".into(), |d| head(d, 12).to_owned()),
                        if v.aliases.is_empty() {
                            "-".into()
                        } else {
                            v.aliases.join(",")
                        },
                        if v.signed { "yes" } else { "no" }.into(),
                        rfc3339(v.created_ms),
                    ]);
                    Ok(())
                },
            )?;
            s.push_str(&t.render());
            out.text(&s)?;
        }
        r => {
            let v = reg.resolve(&r)?;
            let sig = reg.signature(&v.model, v.version)?;
            if out.json {
                out.json(
                    "model show",
                    &json!({ "model_version": v, "signature_key_hint": sig.map(|s| s.key_hint) }),
                )?;
                return Ok(Code::Ok);
            }
            out.text(&render_version(
                &v,
                sig.as_ref().map(|s| s.key_hint.as_str()),
            ))?;
        }
    }
    Ok(Code::Ok)
}

/// The first `n` characters of `s` (all of it when shorter): digests and
/// key hints shortened for display.
fn head(s: &str, n: usize) -> &str {
    s.char_indices().nth(n).map_or(s, |(i, _)| &s[..i])
}

fn render_version(v: &Version, key_hint: Option<&str>) -> String {
    let mut s = format!("{}:{} | {}", v.model, v.version, v.status);
    if !v.aliases.is_empty() {
        s.push_str(&format!(" | aliases {}", v.aliases.join(", ")));
    }
    s.push('\n');
    let dash = |o: Option<&str>| o.unwrap_or("-").to_owned();
    let mut kv = vec![
        ("source", v.source.clone()),
        ("artifacts", dash(v.artifact_url.as_deref())),
        ("manifest digest", dash(v.manifest_digest.as_deref())),
        (
            "created",
            format!("{} by {}", rfc3339(v.created_ms), v.created_by),
        ),
        (
            "signed",
            key_hint.map_or("no".into(), |h| format!("yes (key {})", head(h, 16))),
        ),
        ("run", dash(v.lineage.run_id.as_deref())),
    ];
    if !v.status_message.is_empty() {
        kv.push(("status message", v.status_message.clone()));
    }
    if !v.description.is_empty() {
        kv.push(("description", v.description.clone()));
    }
    if let Some(c) = &v.lineage.checkpoint {
        kv.push((
            "checkpoint",
            format!(
                "{} run {} step {} (digest {})",
                c.url, c.run, c.step, c.manifest_digest
            ),
        ));
    }
    for d in &v.lineage.datasets {
        kv.push((
            "dataset",
            match &d.digest {
                Some(x) => format!("{} ({x})", d.uri),
                None => d.uri.clone(),
            },
        ));
    }
    if let Some(c) = &v.lineage.code_commit {
        kv.push(("code commit", c.clone()));
    }
    if let Some(p) = v.lineage.parent_version {
        kv.push(("parent", format!("{}:{p}", v.model)));
    }
    for t in &v.tags {
        kv.push(("tag", format!("{}={}", t.key, t.value)));
    }
    for (k, val) in kv {
        s.push_str(&format!("  {k:<16} {val}\n"));
    }
    if !v.files.is_empty() {
        s.push('\n');
        let mut t = Table::new(&["File", "Size", "SHA-256"]);
        for f in &v.files {
            t.row(vec![f.name.clone(), f.size.to_string(), f.sha256.clone()]);
        }
        s.push_str(&t.render());
    }
    s
}

fn alias_result(
    command: &str,
    ev: &keel_registry::AliasEvent,
    out: &mut Out,
) -> anyhow::Result<Code> {
    if out.json {
        out.json(command, &json!({ "event": ev }))?;
    } else {
        let show = |v: Option<u64>| v.map_or("none".to_owned(), |v| v.to_string());
        out.text(&format!(
            "{}@{}: {} -> {} ({}, event #{})\n",
            ev.model,
            ev.alias,
            show(ev.old_version),
            show(ev.new_version),
            ev.action.as_str(),
            ev.seq
        ))?;
    }
    Ok(Code::Ok)
}

fn history(reg: &Registry, name: &str, alias: Option<&str>, out: &mut Out) -> anyhow::Result<Code> {
    let mut events = Vec::new();
    for_each_page(
        |after: Option<&i64>| reg.history_after(name, alias, after.copied().unwrap_or(0), PAGE),
        |e| e.seq,
        |e| {
            events.push(e);
            Ok(())
        },
    )?;
    if out.json {
        out.json("model history", &json!({ "model": name, "events": events }))?;
        return Ok(Code::Ok);
    }
    let mut t = Table::new(&[
        "#", "Time", "Alias", "Action", "From", "To", "Actor", "Reason",
    ]);
    let show = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
    for e in &events {
        t.row(vec![
            e.seq.to_string(),
            rfc3339(e.time_ms),
            e.alias.clone(),
            e.action.as_str().into(),
            show(e.old_version),
            show(e.new_version),
            e.actor.clone(),
            e.reason.clone(),
        ]);
    }
    out.text(&t.render())?;
    Ok(Code::Ok)
}

fn version_files(v: &Version) -> anyhow::Result<Vec<FileEntry>> {
    Ok(version_manifest(v)?.files().to_vec())
}

fn stored_version(reg: &Registry, reference: &str) -> anyhow::Result<(Version, String)> {
    let v = reg.resolve(&parse_ref(reference)?)?;
    if v.status != keel_registry::Status::Ready {
        return Err(UsageError(format!(
            "{}:{} is {}, not READY",
            v.model, v.version, v.status
        ))
        .into());
    }
    let url = v.artifact_url.clone().ok_or_else(|| {
        UsageError(format!(
            "{}:{} records only a source ({}), no stored files",
            v.model, v.version, v.source
        ))
    })?;
    Ok((v, url))
}

fn pull(reg: &Registry, reference: &str, to: &Path, out: &mut Out) -> anyhow::Result<Code> {
    let (v, url) = stored_version(reg, reference)?;
    let files = version_files(&v)?;
    let sig = reg.signature(&v.model, v.version)?;
    let extra: Vec<(&str, &[u8])> = sig
        .as_ref()
        .map(|s| vec![("model.sig", s.bundle.as_bytes())])
        .unwrap_or_default();
    runtime()?.block_on(async {
        let store = open_store(&url, false)?;
        artifacts::pull(&store, &files, to, &extra, &TransferOptions::default()).await?;
        Ok::<_, anyhow::Error>(())
    })?;
    if out.json {
        out.json(
            "model pull",
            &json!({"model": v.model, "version": v.version, "to": to, "files": files.len(), "bytes": v.total_bytes(), "signature": sig.is_some()}),
        )?;
    } else {
        out.text(&format!(
            "pulled {}:{} to {}: {} files, {}, every file verified{}\n",
            v.model,
            v.version,
            to.display(),
            files.len(),
            human_bytes(v.total_bytes()),
            if sig.is_some() {
                "; signature in model.sig"
            } else {
                ""
            }
        ))?;
    }
    Ok(Code::Ok)
}

// ----- verify and sign ----------------------------------------------------------

fn verify_version(
    reg: &Registry,
    cfg: &ModelConfig,
    reference: &str,
    out: &mut Out,
) -> anyhow::Result<Code> {
    let (v, url) = stored_version(reg, reference)?;
    // A bad key file is an error whether or not the version is signed.
    let trusted_key = cfg.public_key.as_deref().map(PublicKey::read).transpose()?;
    let files = version_files(&v)?;
    let bad = runtime()?.block_on(async {
        let store = open_store(&url, false)?;
        Ok::<_, anyhow::Error>(
            artifacts::check_stored(&store, &files, &TransferOptions::default()).await?,
        )
    })?;
    let sig = reg.signature(&v.model, v.version)?;
    let mut problems: Vec<String> = bad.iter().map(|b| format!("stored file {b}")).collect();
    let mut signature = json!(null);
    match (&sig, &cfg.public_key) {
        (None, Some(_)) => problems.push(format!("{}:{} is not signed", v.model, v.version)),
        (None, None) => {}
        (Some(s), trusted) => {
            let (key, trust) = match trusted.as_ref().and(trusted_key.clone()) {
                Some(k) => (k, "trusted key"),
                None => (
                    PublicKey::from_pem(&s.public_key_pem, Path::new("<recorded key>"))?,
                    "the key recorded at signing (pass --public-key to check who signed)",
                ),
            };
            match key
                .open_bundle(s.bundle.as_bytes())
                .and_then(|p| sign::parse_statement(&p))
            {
                Err(e) => problems.push(format!("signature: {e}")),
                Ok(st) => {
                    let want: Vec<(String, String)> = files
                        .iter()
                        .map(|f| (f.name.clone(), f.sha256.hex()))
                        .collect();
                    for p in sign::compare(&st.resources, &want) {
                        problems.push(format!("signature: {p}"));
                    }
                    signature =
                        json!({"key_hint": key.hint(), "checked_with": trust, "digest": st.digest});
                }
            }
        }
    }
    let ok = problems.is_empty();
    if out.json {
        out.json(
            "model verify",
            &json!({"model": v.model, "version": v.version, "ok": ok, "files": files.len(), "signed": sig.is_some(), "signature": signature, "problems": problems}),
        )?;
    } else if ok {
        let how = match &signature {
            serde_json::Value::Null => "not signed".to_owned(),
            s => format!(
                "signature valid ({})",
                s["checked_with"].as_str().unwrap_or("")
            ),
        };
        out.text(&format!(
            "{}:{}: {} files match their digests; {how}\n",
            v.model,
            v.version,
            files.len()
        ))?;
    } else {
        let mut s = format!("{}:{}: FAILED\n", v.model, v.version);
        for p in &problems {
            s.push_str(&format!("  {p}\n"));
        }
        out.text(&s)?;
    }
    if ok {
        Ok(Code::Ok)
    } else {
        let _ = writeln!(
            std::io::stderr(),
            "keel: error: {}:{} does not verify: {}",
            v.model,
            v.version,
            problems.join("; ")
        );
        Ok(Code::Failed)
    }
}

fn verify_path(a: &VerifyArgs, out: &mut Out) -> anyhow::Result<Code> {
    let (Some(dir), Some(sig_path), Some(key_path)) = (&a.path, &a.signature, &a.public_key) else {
        return Err(UsageError("verify --path needs --signature and --public-key".into()).into());
    };
    if !dir.is_dir() {
        return Err(UsageError(format!("{} is not a directory", dir.display())).into());
    }
    let key = PublicKey::read(key_path)?;
    let bundle = keel_fs::read_regular(sig_path, keel_fs::MAX_CONFIG_BYTES)
        .with_context(|| format!("cannot read {}", sig_path.display()))?;
    let mut ignore = a.ignore_paths.clone();
    // The signature file itself, when it lies inside the directory.
    if let (Ok(d), Ok(s)) = (std::fs::canonicalize(dir), std::fs::canonicalize(sig_path)) {
        if let Ok(rel) = s.strip_prefix(&d) {
            ignore.push(rel.display().to_string());
        }
    }
    // --ignore-paths may be given relative to the directory or as paths
    // under it.
    let ignore = ignore
        .into_iter()
        .map(|p| {
            let pb = PathBuf::from(&p);
            match (std::fs::canonicalize(dir), std::fs::canonicalize(&pb)) {
                (Ok(d), Ok(full)) if pb.components().count() > 1 || pb.is_absolute() => full
                    .strip_prefix(&d)
                    .map(|r| r.display().to_string())
                    .unwrap_or(p),
                _ => p,
            }
        })
        .collect();
    let opts = DirOptions {
        ignore_paths: ignore,
        ignore_git_paths: !a.no_ignore_git_paths,
    };
    match sign::verify_dir(dir, &bundle, &key, &opts) {
        Ok(r) => {
            if out.json {
                out.json(
                    "model verify",
                    &json!({"path": dir, "ok": true, "resources": r.resources, "digest": r.statement.digest, "name": r.statement.name, "serialization": r.statement.serialization, "key_hint": r.key_hint}),
                )?;
            } else {
                out.text(&format!(
                    "{}: signature valid; {} resources match ({} serialization), model digest {}\n",
                    dir.display(),
                    r.resources,
                    r.statement.serialization.method,
                    r.statement.digest
                ))?;
            }
            Ok(Code::Ok)
        }
        Err(e) => {
            if out.json {
                let problems = match &e {
                    SignError::Mismatch { problems } => json!(problems),
                    _ => json!([]),
                };
                out.json(
                    "model verify",
                    &json!({"path": dir, "ok": false, "error": e.to_string(), "problems": problems}),
                )?;
            }
            Err(e.into())
        }
    }
}

fn sign_version(
    reg: &mut Registry,
    actor: &str,
    reference: &str,
    key: &Path,
    out: &mut Out,
) -> anyhow::Result<Code> {
    let key = PrivateKey::read(key)?;
    let v = reg.resolve(&parse_ref(reference)?)?;
    if v.status != keel_registry::Status::Ready || v.manifest_digest.is_none() {
        return Err(UsageError(format!(
            "{}:{} has no registered files to sign ({})",
            v.model, v.version, v.status
        ))
        .into());
    }
    let manifest = version_manifest(&v)?;
    let bundle = key.sign_statement(&sign::statement_for(&manifest));
    // Check what was made before storing it.
    let st = sign::parse_statement(&key.public_key().open_bundle(bundle.as_bytes())?)?;
    if Some(st.digest.as_str()) != v.manifest_digest.as_deref() {
        return Err(anyhow::anyhow!(
            "internal error: the signed digest differs from the version's"
        ));
    }
    let pem = key.public_key().to_pem();
    let rec = reg.attach_signature(
        actor,
        &v.model,
        v.version,
        &bundle,
        &pem,
        &key.public_key().hint(),
    )?;
    if out.json {
        out.json(
            "model sign",
            &json!({"model": v.model, "version": v.version, "key_hint": rec.key_hint, "digest": st.digest}),
        )?;
    } else {
        out.text(&format!(
            "signed {}:{} (digest {}) with key {}\n",
            v.model, v.version, st.digest, rec.key_hint
        ))?;
    }
    Ok(Code::Ok)
}

fn write_new(path: &Path, data: &str, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                anyhow::Error::new(UsageError(format!(
                    "{} exists; keel does not overwrite keys",
                    path.display()
                )))
            } else {
                anyhow::Error::new(e).context(format!("cannot write {}", path.display()))
            }
        })?;
    f.write_all(data.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

fn keygen(private_key: &Path, public_key: &Path, out: &mut Out) -> anyhow::Result<Code> {
    if public_key.exists() {
        return Err(UsageError(format!(
            "{} exists; keel does not overwrite keys",
            public_key.display()
        ))
        .into());
    }
    let k = PrivateKey::generate();
    write_new(private_key, &k.to_sec1_pem(), 0o600)?;
    write_new(public_key, &k.public_key().to_pem(), 0o644)?;
    if out.json {
        out.json(
            "model keygen",
            &json!({"private_key": private_key, "public_key": public_key, "key_hint": k.public_key().hint()}),
        )?;
    } else {
        out.text(&format!(
            "wrote {} (ECDSA P-256, SEC1 PEM, mode 0600) and {} (SPKI PEM); key {}\n",
            private_key.display(),
            public_key.display(),
            k.public_key().hint()
        ))?;
    }
    Ok(Code::Ok)
}

// ----- keys, backup, audit, serve ---------------------------------------------

fn keys(reg: &mut Registry, actor: &str, cmd: &KeysCommand, out: &mut Out) -> anyhow::Result<Code> {
    match cmd {
        KeysCommand::Create { name, role } => {
            let role: Role = role.parse()?;
            let secret = keel_registry::auth::new_secret();
            let k = reg.create_api_key(actor, name, role, &secret)?;
            if out.json {
                out.json("model keys create", &json!({"key": k, "secret": secret}))?;
            } else {
                out.text(&format!(
                    "created API key {} ({}, id {}); its secret, shown only now:\n{secret}\n",
                    k.name,
                    k.role.as_str(),
                    k.id
                ))?;
            }
        }
        KeysCommand::Ls => {
            let ks = reg.api_keys()?;
            if out.json {
                out.json("model keys ls", &json!({ "keys": ks }))?;
            } else {
                let mut t = Table::new(&["Name", "Role", "Id", "Created", "By", "Revoked"]);
                for k in &ks {
                    t.row(vec![
                        k.name.clone(),
                        k.role.as_str().into(),
                        k.id.clone(),
                        rfc3339(k.created_ms),
                        k.created_by.clone(),
                        k.revoked_ms.map_or("-".into(), rfc3339),
                    ]);
                }
                out.text(&t.render())?;
            }
        }
        KeysCommand::Revoke { name } => {
            let k = reg.revoke_api_key(actor, name)?;
            if out.json {
                out.json("model keys revoke", &json!({ "key": k }))?;
            } else {
                out.text(&format!("revoked API key {}\n", k.name))?;
            }
        }
    }
    Ok(Code::Ok)
}

/// `scheme://a/b/name.db` -> (`scheme://a/b`, `name.db`).
fn split_object_url(url: &str) -> anyhow::Result<(String, String)> {
    let u = StoreUrl::parse(url)?;
    let s = u.to_string();
    let (parent, name) = s
        .rsplit_once('/')
        .filter(|(p, n)| !n.is_empty() && !p.ends_with('/') && p.contains("://"))
        .ok_or_else(|| {
            UsageError(format!(
                "{url}: name the backup object, e.g. {url}/registry.db"
            ))
        })?;
    if matches!(u, StoreUrl::Azure { ref prefix, .. } | StoreUrl::S3 { ref prefix, .. } if prefix.is_empty())
    {
        return Err(UsageError(format!(
            "{url}: name the backup object inside the container or bucket"
        ))
        .into());
    }
    Ok((parent.to_owned(), name.to_owned()))
}

fn backup(reg: &Registry, url: &str, out: &mut Out) -> anyhow::Result<Code> {
    let (parent, name) = split_object_url(url)?;
    let rt = runtime()?;
    let store = {
        let _in = rt.enter();
        open_store(&parent, true)?
    };
    let BackupReport {
        bytes: size,
        chains: report,
    } = rt.block_on(reg.backup_to_object(&store, &name))?;
    if out.json {
        out.json(
            "model backup",
            &json!({"url": url, "bytes": size, "audit_events": report.audit_events, "audit_head": report.audit_head}),
        )?;
    } else {
        out.text(&format!(
            "backed up {} to {url}: {}, {} audit events, audit head {}\n",
            reg.path().display(),
            human_bytes(size),
            report.audit_events,
            report.audit_head
        ))?;
    }
    Ok(Code::Ok)
}

fn restore(
    reg: &mut Registry,
    actor: &str,
    url: &str,
    force: bool,
    out: &mut Out,
) -> anyhow::Result<Code> {
    let (parent, name) = split_object_url(url)?;
    let rt = runtime()?;
    let store = {
        let _in = rt.enter();
        open_store(&parent, false)?
    };
    let report = rt.block_on(reg.restore_from_object(actor, &store, &name, url, force))?;
    if out.json {
        out.json(
            "model restore",
            &json!({"url": url, "db": reg.path(), "audit_events": report.audit_events, "alias_events": report.alias_events}),
        )?;
    } else {
        out.text(&format!(
            "restored {} from {url}: {} audit events and {} alias events verified\n",
            reg.path().display(),
            report.audit_events,
            report.alias_events
        ))?;
    }
    Ok(Code::Ok)
}

fn audit_verify(reg: &Registry, out: &mut Out) -> anyhow::Result<Code> {
    let r = reg.verify_chains()?;
    if out.json {
        out.json("model audit verify", &json!({ "ok": r.ok(), "report": r }))?;
    } else {
        let mut s = format!(
            "alias history: {} events, head {}\naudit log:     {} events, head {}\nversions:      {} READY versions checked against their digests\n",
            r.alias_events, r.alias_head, r.audit_events, r.audit_head, r.versions_checked
        );
        if r.ok() {
            s.push_str("ok\n");
        } else {
            for b in &r.breaks {
                if b.seq > 0 {
                    s.push_str(&format!(
                        "BROKEN {} at event #{}: {}\n",
                        b.chain.as_str(),
                        b.seq,
                        b.what
                    ));
                } else {
                    s.push_str(&format!("BROKEN {}: {}\n", b.chain.as_str(), b.what));
                }
            }
        }
        out.text(&s)?;
    }
    Ok(if r.ok() { Code::Ok } else { Code::Failed })
}

fn audit_log(reg: &Registry, out: &mut Out) -> anyhow::Result<Code> {
    let mut events = Vec::new();
    for_each_page(
        |after: Option<&i64>| reg.audit_log_after(after.copied().unwrap_or(0), PAGE),
        |e| e.seq,
        |e| {
            events.push(e);
            Ok(())
        },
    )?;
    if out.json {
        out.json("model audit log", &json!({ "events": events }))?;
        return Ok(Code::Ok);
    }
    let mut t = Table::new(&["#", "Time", "Actor", "Action", "Target", "Detail"]);
    for e in &events {
        t.row(vec![
            e.seq.to_string(),
            rfc3339(e.time_ms),
            e.actor.clone(),
            e.action.clone(),
            e.target.clone(),
            e.detail.clone(),
        ]);
    }
    out.text(&t.render())?;
    Ok(Code::Ok)
}

fn serve(reg: Registry, cfg: &ModelConfig, addr: &str) -> anyhow::Result<Code> {
    // Warnings (a version registered without its run) go to stderr.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::WARN)
        .with_target(false)
        .try_init();
    let tracking = cfg
        .tracking_uri
        .as_deref()
        .map(keel_registry::tracking::TrackingServer::new)
        .transpose()
        .map_err(|e| UsageError(format!("model.tracking_uri: {e}")))?;
    let rt = runtime()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| UsageError(format!("cannot listen on {addr}: {e}")))?;
        let local = listener.local_addr()?;
        let app = keel_registry::http::router(
            reg,
            keel_registry::http::ServeOptions {
                token_sha256: cfg.serve_token_sha256.clone(),
                max_body_bytes: 1 << 20,
                max_response_bytes: keel_registry::http::MAX_RESPONSE_BYTES,
                // The account keel-store reads az:// URLs from.
                azure_account: std::env::var("AZURE_STORAGE_ACCOUNT_NAME")
                    .ok()
                    .filter(|a| !a.is_empty()),
                tracking,
            },
        );
        // The address goes to stdout first (tests bind port 0 and read it).
        let mut stdout = std::io::stdout();
        writeln!(stdout, "keel model serve: listening on http://{local}")?;
        stdout.flush()?;
        let shutdown = async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
            }
        };
        let limits = keel_registry::http::ConnectionLimits {
            max_connections: cfg.serve_max_connections,
            max_per_client: cfg.serve_max_connections_per_client,
            // An eighth of the places is kept for clients with a key.
            reserved: cfg.serve_max_connections / 8,
            ..Default::default()
        };
        keel_registry::http::serve_with(listener, app, limits, shutdown).await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(Code::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_registry::Status;

    /// A password file is its owner's alone and holds one line; its
    /// trailing newline is not part of the password.
    #[test]
    fn password_files_are_private_and_one_line() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("pw");
        std::fs::write(&f, "s3cret\n").expect("write");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = read_password_file(&f).expect_err("readable by others");
        assert!(format!("{e:#}").contains("chmod 600"), "{e:#}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(read_password_file(&f).expect("read"), "s3cret");
        std::fs::write(&f, "a\nb\n").expect("write");
        let e = read_password_file(&f).expect_err("two lines");
        assert!(format!("{e:#}").contains("one line"), "{e:#}");
    }

    #[test]
    fn digests_and_key_hints_shorten_by_character() {
        assert_eq!(head("0123456789abcdef0123", 12), "0123456789ab");
        assert_eq!(head("abc", 12), "abc");
        assert_eq!(head("", 12), "");
        assert_eq!(head(&"\u{20ac}".repeat(20), 12), "\u{20ac}".repeat(12));
        let v = Version {
            model: "m".into(),
            version: 1,
            status: Status::Ready,
            status_message: String::new(),
            source: "/src".into(),
            artifact_url: None,
            manifest_digest: Some("\u{20ac}\u{20ac}".into()),
            description: String::new(),
            lineage: Lineage::default(),
            created_ms: 0,
            created_by: "alice".into(),
            updated_ms: 0,
            files: Vec::new(),
            tags: Vec::new(),
            aliases: Vec::new(),
            signed: true,
        };
        let hint = "\u{20ac}".repeat(6);
        let text = render_version(&v, Some(&hint));
        assert!(
            text.contains(&format!("yes (key {})", "\u{20ac}".repeat(6))),
            "{text}"
        );
    }
}
