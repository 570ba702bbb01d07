//! `keel review`: reads the files given (or found in the usual places),
//! runs keel-review's rule catalogue over them, and prints the report as
//! text, versioned JSON, SARIF 2.1.0, or the catalogue as Markdown.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, ValueEnum};
use keel_review::inputs::EnvVar;
use keel_review::slurm::FsLoader;
use keel_review::{Input, Kind, Location, ReviewOptions, Severity, Source, Suppressions};
use serde_json::json;

use crate::exit::{Code, DataError, UsageError};
use crate::output::Out;
use crate::Cli;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Text,
    Json,
    Sarif,
    Markdown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailOn {
    Low,
    Medium,
    High,
    Never,
}

#[derive(Debug, Args)]
pub struct ReviewArgs {
    /// Files to review: slurm.conf (its includes are followed), gres.conf,
    /// keel's gateway file, keel.toml, sbatch scripts, environment files
    /// (NAME=VALUE lines), NCCL's nccl.conf. The kind is told from the name
    /// and content; `KIND:PATH` forces it (slurm, gres, gateway, keel,
    /// sbatch, env, nccl). Without paths: $SLURM_CONF or
    /// /etc/slurm/slurm.conf (under --root), gres.conf beside it,
    /// /etc/nccl.conf (under --root), the keel config file and the gateway
    /// file it names.
    #[arg(value_name = "PATH")]
    paths: Vec<String>,
    /// Also review this process's environment, as a job's environment.
    #[arg(long)]
    env: bool,
    /// Also review this node: keel check's passive tier (with the keel
    /// config's [check] settings, no state written) and local NVMe scratch
    /// mounts, read under --root.
    #[arg(long)]
    node: bool,
    /// With --node: read the GPUs from a recorded snapshot instead of NVML.
    #[arg(long, value_name = "FILE", requires = "node")]
    gpu_snapshot: Option<PathBuf>,
    /// Output format (`--json` is `--format json`).
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Suppressions: a TOML file of `[[suppress]]` tables (rule, reason,
    /// optional file and expires).
    #[arg(long, value_name = "FILE")]
    suppressions: Option<PathBuf>,
    /// Exit 2 when an unsuppressed finding of this severity or worse is
    /// left.
    #[arg(long, value_enum, default_value = "high")]
    fail_on: FailOn,
    /// The storage account's ingress limit (`20Gbit/s`): checkpoint caps
    /// times writers must stay below it.
    #[arg(long, value_name = "BANDWIDTH")]
    storage_ingress: Option<String>,
    /// Print the rule catalogue instead of reviewing.
    #[arg(long)]
    list_rules: bool,
}

/// The files reviewed when none are given. The system's slurm.conf is
/// looked for under `root` (`--root`), like every other file of the
/// machine keel reads; `$SLURM_CONF` names a file as given.
fn default_paths(root: &Path) -> Vec<(Option<Kind>, PathBuf)> {
    let mut out = Vec::new();
    let slurm = std::env::var_os("SLURM_CONF")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("etc/slurm/slurm.conf"));
    if slurm.is_file() {
        let gres = slurm.with_file_name("gres.conf");
        out.push((Some(Kind::Slurm), slurm));
        if gres.is_file() {
            out.push((Some(Kind::Gres), gres));
        }
    }
    // Where Azure's HPC images write NCCL's settings (NCCL reads it in
    // every job on the node).
    let nccl = root.join("etc/nccl.conf");
    if nccl.is_file() {
        out.push((Some(Kind::Nccl), nccl));
    }
    let keel = std::env::var_os("KEEL_CONFIG")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/keel/keel.toml"))
        });
    if let Some(k) = keel.filter(|k| k.is_file()) {
        if let Ok(text) = keel_fs::read_regular_to_string(&k, keel_fs::MAX_CONFIG_BYTES) {
            if let Some(g) = toml::from_str::<toml::Table>(&text)
                .ok()
                .and_then(|t| t.get("serve")?.get("config")?.as_str().map(PathBuf::from))
            {
                let g = if g.is_relative() {
                    k.parent().unwrap_or(Path::new(".")).join(g)
                } else {
                    g
                };
                out.push((Some(Kind::Gateway), g));
            }
        }
        out.push((Some(Kind::Keel), k));
    }
    if let Some(g) = std::env::var_os("KEEL_SERVE_CONFIG") {
        out.push((Some(Kind::Gateway), PathBuf::from(g)));
    }
    out
}

fn split_kind(arg: &str) -> (Option<Kind>, PathBuf) {
    if let Some((k, p)) = arg.split_once(':') {
        if let Some(kind) = Kind::from_name(k) {
            return (Some(kind), PathBuf::from(p));
        }
    }
    (None, PathBuf::from(arg))
}

/// Today's date (UTC) as YYYY-MM-DD.
fn today() -> Option<String> {
    use keel_time::Clock as _;
    let secs = i64::try_from(keel_time::SystemClock.now_ms() / 1000).ok()?;
    Some(keel_time::date(secs))
}

pub fn run(cli: &Cli, args: &ReviewArgs, out: &mut Out) -> anyhow::Result<Code> {
    let format = if cli.json { Format::Json } else { args.format };
    let catalogue = keel_review::rules();
    if args.list_rules {
        match format {
            Format::Markdown => out.text(&keel_review::markdown(&catalogue))?,
            Format::Json => out.json("review rules", &json!({ "rules": catalogue }))?,
            Format::Sarif => {
                let empty =
                    keel_review::review(&catalogue, &[], Vec::new(), &ReviewOptions::default());
                out.text(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&empty.sarif(env!("CARGO_PKG_VERSION")))?
                ))?;
            }
            Format::Text => {
                let mut s = String::new();
                for r in &catalogue {
                    s.push_str(&format!(
                        "{:<14} {:<12} {:<7} {:<8} {}\n",
                        r.id,
                        r.pillar.name(),
                        r.severity.name(),
                        r.target.name(),
                        r.title
                    ));
                }
                out.text(&s)?;
            }
        }
        return Ok(Code::Ok);
    }

    let mut opts = ReviewOptions {
        today: today(),
        ..ReviewOptions::default()
    };
    if let Some(s) = &args.storage_ingress {
        opts.eval.storage_ingress = Some(
            keel_store::Bandwidth::parse(s)
                .map_err(|e| UsageError(format!("--storage-ingress: {e}")))?,
        );
    }
    if let Some(p) = &args.suppressions {
        let text = keel_fs::read_regular_to_string(p, keel_fs::MAX_CONFIG_BYTES)
            .with_context(|| format!("cannot read {}", p.display()))?;
        opts.suppressions = Suppressions::parse(&text, &catalogue)
            .map_err(|e| DataError(format!("{}: {e}", p.display())))?;
    }

    let targets: Vec<(Option<Kind>, PathBuf)> = if args.paths.is_empty() {
        default_paths(&cli.root)
    } else {
        args.paths.iter().map(|a| split_kind(a)).collect()
    };
    let mut texts = Vec::new();
    for (kind, path) in targets {
        // A regular file of at most 4 MiB, as the files it includes.
        let text = keel_fs::read_regular_to_string(&path, keel_review::slurm::MAX_LOADED_BYTES)
            .with_context(|| format!("cannot read {}", path.display()))?;
        texts.push((kind, path, text));
    }
    let mut diags = Vec::new();
    let mut sources = Vec::new();
    for (kind, path, text) in &texts {
        match kind.or_else(|| keel_review::detect(path, text)) {
            Some(kind) => sources.push(Source { path, text, kind }),
            None => diags.push(keel_review::Diagnostic::new(
                keel_review::DiagnosticKind::UnknownInput,
                Location {
                    file: path.display().to_string(),
                    line: 1,
                },
                "not reviewed: cannot tell what kind of file this is (name it KIND:PATH)".into(),
            )),
        }
    }
    let (mut inputs, mut parse_diags) = keel_review::parse_all(&sources, &FsLoader);
    diags.append(&mut parse_diags);
    if args.env {
        let vars = std::env::vars()
            .map(|(name, value)| EnvVar {
                name,
                value,
                location: Location {
                    file: "(environment)".into(),
                    line: 1,
                },
            })
            .collect();
        inputs.push(Input::Env(vars, "(environment)".into()));
    }
    if args.node {
        inputs.push(Input::Node(node_facts(cli, args)?));
    }
    if inputs.is_empty() {
        if !args.paths.is_empty() {
            let why: Vec<String> = diags
                .iter()
                .map(|d| format!("{}: {}", d.location.file, d.message))
                .take(5)
                .collect();
            return Err(DataError(format!(
                "none of the files given could be reviewed{}",
                if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", why.join("; "))
                }
            ))
            .into());
        }
        out.text("keel review: nothing to review (no slurm.conf, keel config or gateway file found; give paths)\n")?;
        return Ok(Code::Unknown);
    }

    let report = keel_review::review(&catalogue, &inputs, diags, &opts);
    match format {
        Format::Text => out.text(&report.text())?,
        Format::Json => out.json("review", &report)?,
        Format::Sarif => out.text(&format!(
            "{}\n",
            serde_json::to_string_pretty(&report.sarif(env!("CARGO_PKG_VERSION")))?
        ))?,
        Format::Markdown => {
            return Err(UsageError("--format markdown goes with --list-rules".into()).into())
        }
    }
    let threshold = match args.fail_on {
        FailOn::Low => Some(Severity::Low),
        FailOn::Medium => Some(Severity::Medium),
        FailOn::High => Some(Severity::High),
        FailOn::Never => None,
    };
    let failed = threshold.is_some_and(|t| report.fails(t));
    Ok(if failed { Code::Failed } else { Code::Ok })
}

/// Runs keel check's passive tier on this node (under --root) and reads
/// its scratch mounts.
fn node_facts(cli: &Cli, args: &ReviewArgs) -> anyhow::Result<keel_review::inputs::NodeFacts> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (mut cfg, _) = crate::config::load(None, &env)?;
    // A review reads; it leaves the check's state file alone.
    cfg.state_dir = None;
    if let Some(s) = &args.gpu_snapshot {
        cfg.gpu_snapshot = Some(s.clone());
    }
    let outcome = crate::check::check_node(cli, &cfg, None, false, &[])?;
    let report = outcome.report;
    let mounts = std::fs::read_to_string(cli.root.join("proc/mounts")).unwrap_or_default();
    Ok(keel_review::inputs::NodeFacts {
        version: 1,
        host: report.host.clone(),
        check_status: report.status.as_str().to_owned(),
        failed_checks: report
            .results
            .iter()
            .filter(|r| r.status == keel_check::Status::Fail)
            .map(|r| format!("{}: {}", r.id, r.detail))
            .collect(),
        scratch: keel_review::inputs::scratch_mounts(&mounts),
    })
}
