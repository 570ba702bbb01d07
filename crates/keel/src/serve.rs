//! `keel serve`: the inference gateway (keel-gateway), its API keys, its
//! audit log check, and bearer tokens for the admin and metrics listeners.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;

use keel_gateway::audit;
use keel_gateway::keys::{sha256_hex, KeyFile, NewKey};
use keel_gateway::{Clock, Gateway, GatewayConfig, GatewayError, GatewayOptions, Listeners};

use crate::config::{self, ServeConfig};
use crate::exit::{Code, PermissionError, UsageError};
use crate::output::Out;
use crate::table::Table;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ServeArgs {
    #[command(subcommand)]
    command: Option<ServeCommand>,
    /// The gateway configuration file (docs/serve.md); default:
    /// KEEL_SERVE_CONFIG, then `serve.config` in keel's config file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Listen here instead of the file's `server.listen`.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<std::net::SocketAddr>,
    /// Print the effective gateway configuration and exit.
    #[arg(long)]
    print_config: bool,
}

#[derive(Debug, Subcommand)]
enum ServeCommand {
    /// API keys: create (the secret is printed once), list, revoke.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
        #[command(flatten)]
        file: KeyFileArgs,
    },
    /// The audit log.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Make a random bearer token for the admin or metrics listener and
    /// print it with the SHA-256 that goes in the config file.
    Token,
    /// Progressive rollouts of a registry-following model's canary, through
    /// a running gateway's admin API.
    Rollout {
        #[command(subcommand)]
        command: RolloutCommand,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Output and input drift of a registry-following model's versions,
    /// and its recorded baselines.
    Drift {
        #[command(subcommand)]
        command: DriftCommand,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

#[derive(Debug, Subcommand)]
enum DriftCommand {
    /// Each version's features: windows, PSI, JS, breaches and actions.
    Status { model: String },
    /// Recorded baselines: a version's window kept in a file, the
    /// reference of `drift.baseline_file`.
    Baseline {
        #[command(subcommand)]
        command: BaselineCommand,
    },
}

#[derive(Debug, Subcommand)]
enum BaselineCommand {
    /// Record a window of MODEL's registry version to a file (mode 0600,
    /// replaced atomically).
    Save {
        model: String,
        /// The registry version whose window is recorded.
        #[arg(long, value_name = "N")]
        model_version: u64,
        /// `reference` (the version's first answers, or its baseline) or
        /// `current` (its last answers).
        #[arg(long, default_value = "reference", value_parser = ["reference", "current"])]
        window: String,
        /// The baseline file to write.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// Check a baseline file and show its features.
    Show {
        file: PathBuf,
        /// The gateway model it must be recorded for (default: the one it
        /// names).
        #[arg(long)]
        model: Option<String>,
    },
}

#[derive(Debug, Args)]
struct AdminArgs {
    /// The gateway's admin listener, `http://host:port`.
    #[arg(long, value_name = "URL", global = true)]
    admin: Option<String>,
    /// A file whose first line is the admin bearer token.
    #[arg(long, value_name = "FILE", global = true)]
    token_file: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum RolloutCommand {
    /// Start a rollout of MODEL's canary (or resume a paused one).
    Start { model: String },
    /// The rollout's phase, weight and each step's verdict with its numbers.
    Status { model: String },
    /// Hold the rollout at its weight; `start` resumes it.
    Pause { model: String },
    /// Canary weight 0 at once and the canary alias rolled back.
    Abort { model: String },
}

#[derive(Debug, Args)]
struct KeyFileArgs {
    /// The key file; default: KEEL_SERVE_KEYS_FILE, `serve.keys_file`, else
    /// `auth.keys_file` of the gateway file (--config).
    #[arg(long, value_name = "FILE", global = true)]
    keys_file: Option<PathBuf>,
    /// The gateway file whose `auth.keys_file` to use.
    #[arg(long, value_name = "FILE", global = true)]
    config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Create a key and print its secret (shown this once, stored hashed).
    Create {
        /// Who or what the key is for.
        #[arg(long)]
        name: String,
        /// A role the key has (repeatable).
        #[arg(long = "role", value_name = "ROLE")]
        roles: Vec<String>,
        /// The team whose limits the key shares.
        #[arg(long)]
        team: Option<String>,
    },
    /// List keys (never secrets).
    Ls,
    /// Revoke a key; a running gateway refuses it from its next request.
    Revoke { id: String },
}

#[derive(Debug, Subcommand)]
enum AuditCommand {
    /// Check that the hash chain of an audit log is intact.
    Verify {
        file: PathBuf,
        /// The log's HMAC key file (`audit.hmac_key_file`): also check every
        /// signed checkpoint, which detects a log rewritten or emptied by
        /// someone without the key.
        #[arg(long, value_name = "FILE")]
        key: Option<PathBuf>,
        /// The log's anchor (`audit.anchor_file`; default FILE.anchor when
        /// it exists), checked with --key: a log cut back to an earlier
        /// checkpoint no longer holds the checkpoint it records.
        #[arg(long, value_name = "FILE", requires = "key")]
        anchor: Option<PathBuf>,
    },
}

/// The wall clock, which the gateway library does not read itself.
use keel_time::SystemClock;

/// Log lines and access records are queued and written to stderr in
/// batches by a thread of their own (keel_gateway::Batcher), so no request
/// waits on a write or wakes a thread; access records become lines on
/// that thread too.
#[derive(Debug, Clone)]
struct LogQueue(Arc<keel_gateway::Batcher<LogItem>>);

#[derive(Debug)]
enum LogItem {
    /// A `tracing` event, formatted.
    Line(Vec<u8>),
    Access(keel_gateway::AccessRecord),
}

#[derive(Debug)]
struct LogLine {
    buf: Vec<u8>,
    q: LogQueue,
}

impl std::io::Write for LogLine {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            if let Err(item) = self.q.0.push(LogItem::Line(std::mem::take(&mut self.buf))) {
                write_now(item);
            }
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogQueue {
    type Writer = LogLine;
    fn make_writer(&'a self) -> LogLine {
        LogLine {
            buf: Vec::with_capacity(320),
            q: self.clone(),
        }
    }
}

impl LogQueue {
    fn start() -> anyhow::Result<Self> {
        use std::io::Write;
        let mut w = std::io::BufWriter::with_capacity(64 << 10, std::io::stderr());
        let mut line = Vec::with_capacity(512);
        let b = keel_gateway::Batcher::spawn("keel-log", move |items: Vec<LogItem>, _| {
            for item in &items {
                let _ = w.write_all(item.text(&mut line));
            }
            let _ = w.flush();
        })
        .context("cannot start the log writer")?;
        Ok(Self(Arc::new(b)))
    }
}

/// Writes an item straight to stderr: the log writer has stopped (the
/// process is ending) and the line must not be lost.
fn write_now(item: LogItem) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(item.text(&mut Vec::new()));
}

impl LogItem {
    /// The line's bytes (an access record is rendered into `buf`).
    fn text<'a>(&'a self, buf: &'a mut Vec<u8>) -> &'a [u8] {
        match self {
            LogItem::Line(l) => l,
            LogItem::Access(r) => {
                buf.clear();
                keel_gateway::access_line(r, buf);
                buf
            }
        }
    }
}

fn random<const N: usize>() -> anyhow::Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("no randomness from the OS: {e}"))?;
    Ok(b)
}

pub fn run(args: &ServeArgs, out: &mut Out) -> anyhow::Result<Code> {
    let env = |k: &str| std::env::var(k).ok();
    let mut sc = config::load_serve(&env)?;
    match &args.command {
        None => {
            if args.config.is_some() {
                sc.config = args.config.clone();
            }
            if args.listen.is_some() {
                sc.listen = args.listen;
            }
            gateway(&sc, args.print_config, out)
        }
        Some(ServeCommand::Keys { command, file }) => {
            if file.config.is_some() {
                sc.config = file.config.clone();
            }
            if file.keys_file.is_some() {
                sc.keys_file = file.keys_file.clone();
            }
            keys(&sc, command, out)
        }
        Some(ServeCommand::Audit {
            command: AuditCommand::Verify { file, key, anchor },
        }) => verify(file, key.as_deref(), anchor.as_deref(), out),
        Some(ServeCommand::Rollout { command, admin }) => rollout(command, admin, out),
        Some(ServeCommand::Drift { command, admin }) => drift(command, admin, out),
        Some(ServeCommand::Token) => {
            let token = format!("keel-admin-{}", keel_gateway::keys::hex(&random::<24>()?));
            let sha = sha256_hex(token.as_bytes());
            if out.json {
                out.json(
                    "serve token",
                    &serde_json::json!({"token": token, "token_sha256": sha}),
                )?;
            } else {
                out.text(&format!("token         {token}\ntoken_sha256  {sha}\n\nPut token_sha256 in [admin] or [metrics]; give the token to whoever calls it. It is not shown again.\n"))?;
            }
            Ok(Code::Ok)
        }
    }
}

/// The admin listener's URL and the token of `--token-file`.
fn admin_access(admin: &AdminArgs) -> anyhow::Result<(&str, String)> {
    let url = admin.admin.as_deref().ok_or_else(|| {
        UsageError("give the gateway's admin listener: --admin http://host:port".into())
    })?;
    let token_file = admin.token_file.as_deref().ok_or_else(|| {
        UsageError("give the admin token: --token-file FILE (its first line is the token)".into())
    })?;
    let token = keel_fs::read_regular_to_string(token_file, keel_fs::MAX_CONFIG_BYTES)
        .with_context(|| format!("cannot read the admin token file {}", token_file.display()))?;
    let token = token.lines().next().unwrap_or_default().trim().to_owned();
    if token.is_empty() {
        return Err(UsageError(format!(
            "the admin token file {} is empty",
            token_file.display()
        ))
        .into());
    }
    Ok((url, token))
}

/// A model name that goes into an admin path as it is.
fn check_model_name(model: &str) -> anyhow::Result<()> {
    if model.is_empty()
        || model.contains(['/', '?', '#', ' ', '&', '%'])
        || model.chars().any(char::is_control)
    {
        return Err(UsageError(format!(
            "{:?} is not a model name",
            model.chars().take(100).collect::<String>()
        ))
        .into());
    }
    Ok(())
}

/// An admin call's JSON answer, or the gateway's refusal as an error.
fn admin_json(
    url: &str,
    method: &str,
    path: &str,
    token: &str,
) -> anyhow::Result<serde_json::Value> {
    let (status, body) = admin_call(url, method, path, token)?;
    let doc: serde_json::Value = serde_json::from_slice(&body).map_err(|_| {
        anyhow::anyhow!(
            "the gateway at {url} answered {path} with HTTP {status} and no JSON: is it keel serve's admin listener?"
        )
    })?;
    if status != 200 {
        let msg = doc
            .pointer("/error/message")
            .and_then(|m| m.as_str())
            .unwrap_or("no message");
        let e = anyhow::anyhow!("the gateway refused: {msg} (HTTP {status})");
        return Err(match status {
            401 | 403 => e.context("the admin token was refused"),
            _ => e,
        });
    }
    Ok(doc)
}

fn drift(cmd: &DriftCommand, admin: &AdminArgs, out: &mut Out) -> anyhow::Result<Code> {
    use keel_gateway::drift_baseline::Baseline;
    if let DriftCommand::Baseline {
        command: BaselineCommand::Show { file, model },
    } = cmd
    {
        let b = match model {
            Some(m) => Baseline::read(file, m)?,
            None => {
                let bytes =
                    keel_fs::read_regular(file, keel_gateway::drift_baseline::MAX_BASELINE_BYTES)
                        .with_context(|| {
                        format!("cannot read the drift baseline {}", file.display())
                    })?;
                let name = serde_json::from_slice::<serde_json::Value>(&bytes)
                    .ok()
                    .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_owned))
                    .unwrap_or_default();
                Baseline::read(file, &name)?
            }
        };
        if out.json {
            out.json("serve drift baseline show", &serde_json::to_value(&b.file)?)?;
            return Ok(Code::Ok);
        }
        out.text(&baseline_text(&b))?;
        return Ok(Code::Ok);
    }
    let (url, token) = admin_access(admin)?;
    match cmd {
        DriftCommand::Status { model } => {
            check_model_name(model)?;
            let doc = admin_json(url, "GET", &format!("/admin/drift/{model}"), &token)?;
            if out.json {
                out.json("serve drift status", &doc)?;
            } else {
                out.text(&drift_text(&doc))?;
            }
        }
        DriftCommand::Baseline {
            command:
                BaselineCommand::Save {
                    model,
                    model_version: version,
                    window,
                    out: file,
                },
        } => {
            check_model_name(model)?;
            let doc = admin_json(
                url,
                "GET",
                &format!("/admin/drift/{model}/baseline?version={version}&window={window}"),
                &token,
            )?;
            // What is written is what a gateway will read.
            let f: keel_gateway::drift_baseline::BaselineFile = serde_json::from_value(doc)
                .context("the gateway's baseline is not a baseline file")?;
            let b = Baseline::check(f, model)
                .map_err(|m| anyhow::anyhow!("the gateway's baseline is not valid: {m}"))?;
            let mut bytes = serde_json::to_vec_pretty(&b.file)?;
            bytes.push(b'\n');
            keel_fs::write_atomic(file, &bytes, 0o600)
                .with_context(|| format!("cannot write the baseline {}", file.display()))?;
            if out.json {
                out.json(
                    "serve drift baseline save",
                    &serde_json::json!({"file": file, "baseline": b.file}),
                )?;
            } else {
                out.text(&format!("wrote {}\n{}", file.display(), baseline_text(&b)))?;
            }
        }
        DriftCommand::Baseline { .. } => {}
    }
    Ok(Code::Ok)
}

/// `s` for a terminal: control characters (escape sequences among them)
/// are written escaped (`\u{1b}`), never passed through.
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A baseline as text: where it comes from, then a row per feature.
fn baseline_text(b: &keel_gateway::drift_baseline::Baseline) -> String {
    let f = &b.file;
    let mut text = format!(
        "model     {}\nrecorded  {} window of {} at {}\n\n",
        printable(&f.model),
        printable(&f.window),
        printable(&f.recorded_from),
        printable(&f.recorded_at)
    );
    let mut t = Table::new(&["FEATURE", "BINS", "OBSERVATIONS"]);
    for (name, h) in &b.histograms {
        t.row(vec![
            printable(name),
            h.counts().len().to_string(),
            h.total().to_string(),
        ]);
    }
    text.push_str(&t.render());
    text
}

/// A model's drift as text: one row per version and feature.
fn drift_text(d: &serde_json::Value) -> String {
    let mut text = format!(
        "model     {}\nbaseline  {}\n\n",
        printable(d["model"].as_str().unwrap_or_default()),
        match &d["baseline"] {
            serde_json::Value::Null => "none (each version's first answers)".to_owned(),
            b => format!(
                "{} window of {}",
                printable(b["window"].as_str().unwrap_or_default()),
                printable(b["recorded_from"].as_str().unwrap_or_default())
            ),
        }
    );
    let mut t = Table::new(&[
        "VERSION",
        "FEATURE",
        "REFERENCE",
        "CURRENT",
        "PSI",
        "JS",
        "BREACHES",
    ]);
    let num = |v: &serde_json::Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.4}"));
    if let Some(vs) = d["versions"].as_object() {
        for (version, v) in vs {
            for f in v["features"].as_array().into_iter().flatten() {
                t.row(vec![
                    printable(version),
                    printable(f["name"].as_str().unwrap_or_default()),
                    f["reference"].to_string(),
                    f["current"].to_string(),
                    num(&f["psi"]),
                    num(&f["js"]),
                    v["streak"].to_string(),
                ]);
            }
        }
    }
    text.push_str(&t.render());
    text
}

fn rollout(cmd: &RolloutCommand, admin: &AdminArgs, out: &mut Out) -> anyhow::Result<Code> {
    let (url, token) = admin_access(admin)?;
    let (method, model, action) = match cmd {
        RolloutCommand::Start { model } => ("POST", model, Some("start")),
        RolloutCommand::Status { model } => ("GET", model, None),
        RolloutCommand::Pause { model } => ("POST", model, Some("pause")),
        RolloutCommand::Abort { model } => ("POST", model, Some("abort")),
    };
    if model.is_empty()
        || model.contains(['/', '?', '#', ' '])
        || model.chars().any(char::is_control)
    {
        return Err(UsageError(format!(
            "{:?} is not a model name",
            model.chars().take(100).collect::<String>()
        ))
        .into());
    }
    let path = match action {
        Some(a) => format!("/admin/rollouts/{model}/{a}"),
        None => format!("/admin/rollouts/{model}"),
    };
    let (status, body) = admin_call(url, method, &path, &token)?;
    let doc: serde_json::Value = serde_json::from_slice(&body).map_err(|_| {
        anyhow::anyhow!(
            "the gateway at {url} answered {path} with HTTP {status} and no JSON: is it keel serve's admin listener?"
        )
    })?;
    if status != 200 {
        let msg = doc
            .pointer("/error/message")
            .and_then(|m| m.as_str())
            .unwrap_or("no message");
        let e = anyhow::anyhow!("the gateway refused: {msg} (HTTP {status})");
        let kind = doc.pointer("/error/type").and_then(|m| m.as_str());
        return Err(match (status, kind) {
            // The registry refused the gateway's write key: exit code 77.
            (_, Some("registry_write_refused")) => {
                PermissionError(format!("the gateway refused: {msg} (HTTP {status})")).into()
            }
            (401 | 403, _) => e.context("the admin token was refused"),
            _ => e,
        });
    }
    if out.json {
        out.json("serve rollout", &doc)?;
    } else {
        out.text(&rollout_text(&doc))?;
    }
    // An abort whose alias change failed: 3 while the gateway sends it
    // again (the registry could not be reached), 2 when the registry
    // refused it.
    let registry = doc.get("registry").filter(|r| !r.is_null());
    match (cmd, registry) {
        (RolloutCommand::Abort { .. }, Some(r))
            if r.get("ok").and_then(|v| v.as_bool()) != Some(true) =>
        {
            if r.get("pending").and_then(|v| v.as_bool()) == Some(true) {
                eprintln!("keel: error: the registry did not answer the alias change; the gateway sends it again until it does");
                Ok(Code::Unknown)
            } else {
                eprintln!("keel: error: the registry refused the alias change");
                Ok(Code::Failed)
            }
        }
        _ => Ok(Code::Ok),
    }
}

/// A rollout's status as text: the head, then one row per verdict with
/// the numbers of every check.
fn rollout_text(d: &serde_json::Value) -> String {
    let s = |p: &str| match d.pointer(p) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Null) | None => "-".into(),
        Some(v) => v.to_string(),
    };
    let mut text = format!(
        "rollout   {}\nmodel     {} (registry {}: {} v{} -> {} v{})\nphase     {}\nweight    {}%  steps {}  every {}s\n",
        s("/id"),
        s("/model"),
        s("/registry_model"),
        s("/stable/alias"),
        s("/stable/version"),
        s("/canary/alias"),
        s("/canary/version"),
        s("/phase"),
        s("/weight"),
        s("/steps"),
        s("/interval_s"),
    );
    // Shared by replicas: which one drives it (none while a lease lapses
    // after its driver died).
    if d.get("store").and_then(|v| v.as_str()) == Some("redis") {
        text.push_str(&format!(
            "driver    {} (shared in Redis)
",
            match d.get("driver").and_then(|v| v.as_str()) {
                Some(r) => r.to_owned(),
                None => "none: the next replica to take the lease drives it".into(),
            }
        ));
    }
    // A rollout that ended without an alias change (stopped after a
    // restart): why.
    if let (Some(reason), None) = (
        d.get("reason").and_then(|v| v.as_str()),
        d.get("registry").filter(|r| !r.is_null()),
    ) {
        text.push_str(&format!("ended     {reason}\n"));
    }
    if let Some(r) = d.get("registry").filter(|r| !r.is_null()) {
        let ok = r.get("ok").and_then(|v| v.as_bool()) == Some(true);
        let pending = r.get("pending").and_then(|v| v.as_bool()) == Some(true);
        text.push_str(&format!(
            "registry  {}: {}\n",
            if ok {
                "alias changed"
            } else if pending {
                "alias change FAILED, sent again until the registry answers"
            } else {
                "alias change FAILED"
            },
            r.get("error")
                .or_else(|| r.get("reason"))
                .and_then(|v| v.as_str())
                .unwrap_or("")
        ));
    }
    let verdicts = d
        .get("verdicts")
        .and_then(|v| v.as_array())
        .cloned()
        .unwrap_or_default();
    if verdicts.is_empty() {
        text.push_str("no verdict yet\n");
        return text;
    }
    let mut t = Table::new(&["STEP", "WEIGHT", "INTERVAL", "VERDICT", "CHECKS"]);
    for v in &verdicts {
        let checks: Vec<String> = v
            .get("summary")
            .and_then(|c| c.as_array())
            .map(|c| {
                c.iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let at = |k: &str| {
            v.get(k)
                .map(|x| x.to_string().trim_matches('"').to_owned())
                .unwrap_or_default()
        };
        t.row(vec![
            (v.get("step").and_then(|x| x.as_u64()).unwrap_or(0) + 1).to_string(),
            format!("{}%", at("weight")),
            at("interval"),
            at("decision"),
            checks.join("; "),
        ]);
    }
    text.push_str(&t.render());
    text
}

/// One request to the admin listener (plain HTTP/1.1): the status and the
/// body.
fn admin_call(url: &str, method: &str, path: &str, token: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    use std::io::{Read, Write};
    let authority = url
        .strip_prefix("http://")
        .map(|r| r.trim_end_matches('/'))
        .filter(|a| !a.is_empty() && !a.contains('/'))
        .ok_or_else(|| {
            UsageError(format!(
                "--admin {:?} must be http://host:port",
                url.chars().take(200).collect::<String>()
            ))
        })?;
    let mut conn = std::net::TcpStream::connect(authority)
        .with_context(|| format!("cannot reach the gateway's admin listener at {authority}"))?;
    let limit = Some(std::time::Duration::from_secs(30));
    conn.set_read_timeout(limit)?;
    conn.set_write_timeout(limit)?;
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    conn.take(16 << 20)
        .read_to_end(&mut raw)
        .with_context(|| format!("the gateway at {authority} did not answer"))?;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("the gateway at {authority} sent no HTTP answer"))?;
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("the gateway at {authority} sent no HTTP status"))?;
    let mut body = raw[end + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
            let size =
                usize::from_str_radix(String::from_utf8_lossy(&rest[..i]).trim(), 16).unwrap_or(0);
            if size == 0 || rest.len() < i + 2 + size {
                break;
            }
            out.extend_from_slice(&rest[i + 2..i + 2 + size]);
            rest = &rest[(i + 4 + size).min(rest.len())..];
        }
        body = out;
    }
    Ok((status, body))
}

fn load_gateway_config(sc: &ServeConfig) -> anyhow::Result<(GatewayConfig, PathBuf)> {
    let path = sc.config.clone().ok_or_else(|| {
        UsageError("no gateway configuration: give --config FILE (or KEEL_SERVE_CONFIG, or serve.config in keel.toml)".into())
    })?;
    let mut cfg = GatewayConfig::load(&path)?;
    if let Some(l) = sc.listen {
        cfg.server.listen = l;
    }
    Ok((cfg, path))
}

fn gateway(sc: &ServeConfig, print_config: bool, out: &mut Out) -> anyhow::Result<Code> {
    let (cfg, path) = load_gateway_config(sc)?;
    // Every stream holds two descriptors: the soft limit (often 1024) is
    // raised to the hard one before the connection cap is chosen from it.
    let files = keel_http::machine::raise_open_files();
    let machine = keel_http::machine::Machine::read(std::path::Path::new("/"));
    if print_config {
        // The Redis URL may carry a password: never printed.
        let mut cfg = cfg;
        cfg.server.max_connections =
            Some(keel_gateway::connection_cap(&cfg.server, Some(&machine)));
        if let Some(u) = &mut cfg.limits.redis_url {
            *u = keel_gateway::redis::redact(u);
        }
        if out.json {
            out.json(
                "serve",
                &serde_json::json!({"config_file": path, "config": cfg}),
            )?;
        } else {
            out.text(&format!(
                "# from {}\n{}\n",
                path.display(),
                serde_json::to_string_pretty(&cfg)?
            ))?;
        }
        return Ok(Code::Ok);
    }
    let logs = LogQueue::start()?;
    tracing_subscriber::fmt()
        .json()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::INFO)
        .with_current_span(false)
        .init();
    let access = logs.clone();
    // One worker is an event loop on this thread, as nginx's one worker
    // process is: a multi-threaded runtime of one worker still pays for
    // waking and stealing between threads (about 1-3 µs of CPU a request
    // under load, docs/results/2026-11-22-serve-12.md).
    let mut rt = match cfg.server.workers {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = rt
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let cfg_connections = cfg.server.max_connections;
    let chosen_connections = keel_gateway::connection_cap(&cfg.server, Some(&machine));
    let result = rt.block_on(async move {
        let listen_override = sc.listen;
        let reload_path = path.clone();
        let (cfg, control) = keel_control::Control::prepare(cfg, |path| {
            let key = keel_registry::sign::PublicKey::read(path)?;
            Ok::<_, anyhow::Error>(Arc::new(TrustedKey(key)) as Arc<dyn keel_control::SignatureCheck>)
        })
        .await?;
        let reroute = control.as_ref().map(|c| c.reroute());
        let reload: keel_gateway::ReloadFn = Arc::new(move || {
            let mut c = GatewayConfig::load(&reload_path)?;
            if let Some(l) = listen_override {
                c.server.listen = l;
            }
            match &reroute {
                Some(r) => r.apply(c).map_err(|e| GatewayError::Config(format!("{:#}", anyhow::Error::new(e)))),
                None => Ok::<_, GatewayError>(c),
            }
        });
        let bind = |a: std::net::SocketAddr| async move {
            tokio::net::TcpListener::bind(a).await.with_context(|| format!("cannot listen on {a}"))
        };
        let public = bind(cfg.server.listen).await?;
        let admin = match &cfg.admin { Some(a) => Some(bind(a.listen).await?), None => None };
        let metrics = match &cfg.metrics { Some(m) => Some(bind(m.listen).await?), None => None };
        let seed = u64::from_le_bytes(random::<8>()?);
        let gw = Gateway::new(cfg, GatewayOptions {
            clock: Arc::new(SystemClock),
            seed,
            reload: Some(reload),
            access_sink: Some(Arc::new(move |r| {
                if let Err(item) = access.0.push(LogItem::Access(r)) {
                    write_now(item);
                }
            })),
            machine: Some(machine),
        }).await?;
        if let Some(control) = control {
            // This replica's name in shared rollouts' leases: its public
            // address and a random tag (two processes may share an address
            // one after the other).
            let replica = format!(
                "{}#{:08x}",
                public.local_addr()?,
                u32::from_le_bytes(random::<4>()?)
            );
            control.start(&gw, &replica)?;
        }
        let mut lines = vec![format!("public   {}", public.local_addr()?)];
        if let Some(a) = &admin {
            lines.push(format!("admin    {}", a.local_addr()?));
        }
        if let Some(m) = &metrics {
            lines.push(format!("metrics  {}", m.local_addr()?));
        }
        lines.push("ready".into());
        out.text(&format!("{}\n", lines.join("\n")))?;
        tracing::info!(config = %path.display(), "keel serve started");
        if cfg_connections.is_none() {
            tracing::info!(
                max_connections = chosen_connections,
                open_files = ?machine.open_files,
                open_files_before = ?files.0,
                memory_bytes = ?machine.memory_bytes,
                "server.max_connections chosen from the open-file limit and memory"
            );
        }

        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut hup = signal(SignalKind::hangup())?;
        let gw2 = gw.clone();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match gw2.reload().await {
                    Ok(()) => tracing::info!("configuration reloaded (SIGHUP)"),
                    Err(e) => tracing::error!(error = %e, "reload failed; the previous configuration stays"),
                }
            }
        });
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("shutting down: no new connections; finishing requests in flight");
        };
        keel_gateway::run(gw, Listeners { public, admin, metrics }, shutdown).await?;
        tracing::info!("keel serve stopped");
        Ok::<_, anyhow::Error>(())
    });
    logs.0.drain(std::time::Duration::from_secs(1));
    result?;
    Ok(Code::Ok)
}

/// Checks registry versions' signatures against `registry.public_key_file`:
/// the bundle must open with that key and sign this model and version
/// (the statement's subject, `MODEL:VERSION` as `keel model sign` names
/// it: another version's signature over the same files does not do) and
/// the version's digest.
struct TrustedKey(keel_registry::sign::PublicKey);

impl keel_control::SignatureCheck for TrustedKey {
    fn check(
        &self,
        model: &str,
        version: u64,
        digest: Option<&str>,
        bundle: &str,
        _recorded: &str,
    ) -> Result<(), String> {
        let payload = self
            .0
            .open_bundle(bundle.as_bytes())
            .map_err(|e| format!("{:#}", anyhow::Error::new(e)))?;
        let st = keel_registry::sign::parse_statement(&payload)
            .map_err(|e| format!("{:#}", anyhow::Error::new(e)))?;
        let subject = format!("{model}:{version}");
        if st.name != subject {
            return Err(format!(
                "it signs {:?}, not {subject:?}: a signature of another model or version",
                st.name.chars().take(200).collect::<String>()
            ));
        }
        match digest {
            Some(d) if d == st.digest => Ok(()),
            Some(d) => Err(format!(
                "it signs digest {} but the version's digest is {d}",
                st.digest
            )),
            None => Err("the version records no digest to check it against".into()),
        }
    }
}

fn keys_path(sc: &ServeConfig) -> anyhow::Result<PathBuf> {
    if let Some(k) = &sc.keys_file {
        return Ok(k.clone());
    }
    if sc.config.is_none() {
        return Err(
            UsageError("no key file: give --keys-file FILE or --config FILE".into()).into(),
        );
    }
    // A configuration that does not load is reported as it is, not as a
    // missing key file.
    let (cfg, path) = load_gateway_config(sc)?;
    cfg.auth
        .keys_file
        .ok_or_else(|| UsageError(format!("{} sets no auth.keys_file", path.display())).into())
}

#[derive(Debug, Serialize)]
struct KeyView<'a> {
    id: &'a str,
    name: &'a str,
    roles: &'a [String],
    team: Option<&'a str>,
    created: String,
    revoked: Option<String>,
}

fn keys(sc: &ServeConfig, cmd: &KeysCommand, out: &mut Out) -> anyhow::Result<Code> {
    let path = keys_path(sc)?;
    let now = SystemClock.now_ms();
    let view = |k: &keel_gateway::keys::KeyRecord| -> (String, String, String) {
        (
            keel_gateway::rfc3339(k.created_ms),
            k.revoked_ms
                .map(keel_gateway::rfc3339)
                .unwrap_or_else(|| "-".into()),
            if k.roles.is_empty() {
                "-".into()
            } else {
                k.roles.join(",")
            },
        )
    };
    match cmd {
        KeysCommand::Create { name, roles, team } => {
            let random = random::<32>()?;
            let (rec, secret) = KeyFile::update(&path, |f| {
                Ok(f.create(
                    NewKey {
                        name: name.clone(),
                        roles: roles.clone(),
                        team: team.clone(),
                    },
                    random,
                    now,
                ))
            })?;
            if out.json {
                out.json("serve keys create", &serde_json::json!({"id": rec.id, "name": rec.name, "roles": rec.roles, "team": rec.team, "secret": secret}))?;
            } else {
                out.text(&format!("id      {}\nsecret  {secret}\n\nThe secret is shown only now; keel keeps its SHA-256 in {}.\n", rec.id, path.display()))?;
            }
        }
        KeysCommand::Ls => {
            let f = KeyFile::load(&path)?;
            if out.json {
                let keys: Vec<KeyView> = f
                    .keys
                    .iter()
                    .map(|k| KeyView {
                        id: &k.id,
                        name: &k.name,
                        roles: &k.roles,
                        team: k.team.as_deref(),
                        created: keel_gateway::rfc3339(k.created_ms),
                        revoked: k.revoked_ms.map(keel_gateway::rfc3339),
                    })
                    .collect();
                out.json("serve keys ls", &serde_json::json!({"keys": keys}))?;
            } else {
                let mut t = Table::new(&["Id", "Name", "Roles", "Team", "Created", "Revoked"]);
                for k in &f.keys {
                    let (c, r, roles) = view(k);
                    t.row(vec![
                        k.id.clone(),
                        k.name.clone(),
                        roles,
                        k.team.clone().unwrap_or_else(|| "-".into()),
                        c,
                        r,
                    ]);
                }
                out.text(&t.render())?;
            }
        }
        KeysCommand::Revoke { id } => {
            let rec = KeyFile::update(&path, |f| Ok(f.revoke(id, now)?.clone()))?;
            if out.json {
                out.json("serve keys revoke", &serde_json::json!({"id": rec.id, "revoked": rec.revoked_ms.map(keel_gateway::rfc3339)}))?;
            } else {
                out.text(&format!("revoked {} ({})\n", rec.id, rec.name))?;
            }
        }
    }
    Ok(Code::Ok)
}

fn verify(
    file: &Path,
    key: Option<&Path>,
    anchor: Option<&Path>,
    out: &mut Out,
) -> anyhow::Result<Code> {
    let f = keel_fs::open_regular(file)
        .with_context(|| format!("cannot read the audit log {}", file.display()))?;
    let key = key
        .map(|k| {
            keel_fs::read_regular(k, keel_fs::MAX_CONFIG_BYTES)
                .map(|b| b.trim_ascii().to_vec())
                .with_context(|| format!("cannot read the key {}", k.display()))
        })
        .transpose()?;
    // An anchor named must be there; the default one only when it is.
    let anchor_path = match anchor {
        Some(a) => Some(a.to_owned()),
        None => {
            let mut s = file.as_os_str().to_owned();
            s.push(".anchor");
            key.as_ref().map(|_| PathBuf::from(s))
        }
    };
    let anchor_doc = match &anchor_path {
        Some(p) => match audit::Anchor::read(p)? {
            Some(a) => Some(a),
            None if anchor.is_some() => {
                return Err(crate::exit::DataError(format!(
                    "the anchor {} does not exist",
                    p.display()
                ))
                .into())
            }
            None => None,
        },
        None => None,
    };
    let result = match &key {
        Some(k) => audit::verify_with_key(BufReader::new(f), k, anchor_doc.as_ref())
            .map(|r| (r.chain.clone(), Some(r))),
        None => audit::verify(BufReader::new(f)).map(|r| (r, None)),
    };
    match &result {
        Ok((r, keyed)) => {
            // With a key, a log must carry at least one good checkpoint:
            // an emptied or re-chained one has none.
            let unsigned = keyed.as_ref().filter(|k| k.checkpoints == 0).is_some();
            if out.json {
                let mut v = serde_json::json!({"file": file, "ok": !unsigned, "entries": r.entries, "last_hash": r.last_hash, "recoveries": r.recoveries});
                if let Some(k) = keyed {
                    v["checkpoints"] = k.checkpoints.into();
                    v["signed_through"] = k.signed_through.into();
                    v["anchor"] = anchor_doc
                        .as_ref()
                        .and(anchor_path.as_ref())
                        .map(|p| p.display().to_string())
                        .into();
                    v["anchored_checkpoint"] = k.anchored.into();
                }
                out.json("serve audit verify", &v)?;
            } else {
                let recovered = match r.recoveries {
                    0 => String::new(),
                    n => format!(
                        " ({n} recovered event(s): an incomplete line set aside after a crash)"
                    ),
                };
                let signed = match keyed {
                    Some(k) if k.checkpoints == 0 => " but NO signed checkpoint: a log rewritten or emptied without the key looks like this".to_owned(),
                    Some(k) => format!(
                        "; {} signed checkpoint(s), lines 1-{} vouched for by the key, {} after the last; {}",
                        k.checkpoints,
                        k.signed_through,
                        r.entries - k.signed_through,
                        match (k.anchored, &anchor_path) {
                            (Some(n), Some(p)) => format!("the checkpoint at line {n} that the anchor {} records is there", p.display()),
                            _ => "no anchor file: a log cut back to an earlier checkpoint would verify too".to_owned(),
                        }
                    ),
                    None => String::new(),
                };
                out.text(&format!(
                    "{}: intact, {} entries, last hash {}{recovered}{signed}\n",
                    file.display(),
                    r.entries,
                    r.last_hash
                ))?;
            }
            Ok(if unsigned { Code::Failed } else { Code::Ok })
        }
        Err(audit::VerifyError::IncompleteTail { intact, bytes }) => {
            if out.json {
                out.json("serve audit verify", &serde_json::json!({"file": file, "ok": false, "incomplete_tail": true, "entries": intact.entries, "last_hash": intact.last_hash, "incomplete_bytes": bytes, "reason": "incomplete final line (crash)"}))?;
            } else {
                out.text(&format!(
                    "{}: incomplete final line (crash): {bytes} bytes after line {}; the first {} lines are intact, last hash {}. keel serve sets the incomplete line aside when it next opens the log.\n",
                    file.display(),
                    intact.entries,
                    intact.entries,
                    intact.last_hash
                ))?;
            }
            Ok(Code::Warning)
        }
        Err(audit::VerifyError::Broken(b)) => {
            if out.json {
                out.json("serve audit verify", &serde_json::json!({"file": file, "ok": false, "line": b.line, "reason": b.reason}))?;
            } else {
                out.text(&format!(
                    "{}: broken at line {}: {}\n",
                    file.display(),
                    b.line,
                    b.reason
                ))?;
            }
            Ok(Code::Failed)
        }
    }
}
