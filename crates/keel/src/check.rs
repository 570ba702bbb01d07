//! `keel check`: node health checks, SKU profiles, GPU snapshots, fleet
//! merge, and Slurm drain/resume.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long `keel check` watches a GPU that holds its boost clock with no
/// process before calling its clocks locked: an H200 measured by
/// scripts/gpu-verify still ran at 1980 MHz right after a benchmark, and
/// an epilog runs right after the job.
const CLOCK_SETTLE: Duration = Duration::from_secs(10);

use anyhow::Context;
use clap::{Args, Subcommand};

use keel_check::fleet::{self, Fleet};
use keel_check::gather::{GatherOptions, State};
use keel_check::report::{describe, Report};
use keel_check::{profile, CheckResult, RunOptions, Status, SystemClock};
use keel_gpu::recorded::RecordedProbe;
use keel_gpu::GpuProbe;

use crate::config::{self, CheckConfig};
use crate::exit::{Code, UsageError};
use crate::output::Out;
use crate::table::Table;
use crate::Cli;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct CheckArgs {
    #[command(subcommand)]
    command: Option<CheckCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// SKU profile (`keel check profiles`); default: Azure IMDS vmSize, else
    /// the GPUs' model and count, else `generic`.
    #[arg(long)]
    sku: Option<String>,
    /// How many GPUs this node must have: overrides the profile's count
    /// (so `generic` stops trusting what PCI shows), and when the profile
    /// is guessed, the GPUs' model with this count picks it. A node with
    /// a GPU gone from the bus then fails instead of passing as `generic`.
    #[arg(long, value_name = "N")]
    gpus: Option<String>,
    /// TOML file whose values override the profile's.
    #[arg(long, value_name = "FILE")]
    profile_file: Option<PathBuf>,
    /// Read the GPUs from a recorded snapshot (`keel check record`) instead
    /// of NVML.
    #[arg(long, value_name = "FILE")]
    gpu_snapshot: Option<PathBuf>,
    /// Azure IMDS address (host:port), for tests and proxies.
    #[arg(long, value_name = "HOST:PORT")]
    imds_endpoint: Option<String>,
    /// Judge `keel bench ... --json` results (files or directories of
    /// *.json) against the profile: the active tier.
    #[arg(long, value_name = "PATH", num_args = 1..)]
    bench: Vec<PathBuf>,
    /// The node must have no GPU processes (prolog/epilog use).
    #[arg(long)]
    expect_idle: bool,
    /// Keep counters between runs here (PCIe replay growth).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Also write the results for node_exporter's textfile collector
    /// (atomically).
    #[arg(long, value_name = "PATH")]
    prometheus_textfile: Option<PathBuf>,
    /// Print only the one-line summary (`<host> | Healthy`).
    #[arg(long)]
    summary: bool,
    /// Show every result, not one line per passing check.
    #[arg(long, short)]
    verbose: bool,
    /// Drain this node through Slurm on a failure, resume it when healthy
    /// if keel drained it (HealthCheckProgram, prolog, epilog).
    #[arg(long)]
    slurm: bool,
    /// With --slurm: also drain when a check is unknown.
    #[arg(long, requires = "slurm")]
    fail_closed: bool,
    /// With --slurm: seconds each scontrol/sinfo call may take.
    #[arg(long, value_name = "SECS", requires = "slurm")]
    slurm_timeout: Option<f64>,
    /// With --slurm: the Slurm node name (default: SLURMD_NODENAME, then
    /// the short hostname).
    #[arg(long, value_name = "NAME", requires = "slurm", value_parser = slurm_node_arg)]
    node: Option<String>,
    /// Config file (default: KEEL_CONFIG, then ~/.config/keel/keel.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
}

#[derive(Debug, Subcommand)]
enum CheckCommand {
    /// List the built-in SKU profiles, or show one (with overrides applied).
    Profiles {
        name: Option<String>,
        #[arg(long, value_name = "FILE")]
        profile_file: Option<PathBuf>,
    },
    /// List the checks.
    List,
    /// Record this machine's NVML readings as a snapshot (a test fixture).
    Record {
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// What machine this is, stored in the snapshot.
        #[arg(long)]
        description: Option<String>,
    },
    /// Merge per-node JSON reports (files or directories) into a fleet view.
    Merge {
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
        /// Flag values more than this percentage below the median.
        #[arg(long, default_value_t = 10.0, value_name = "PCT")]
        outlier_pct: f64,
    },
}

pub fn run(cli: &Cli, args: &CheckArgs, out: &mut Out) -> anyhow::Result<Code> {
    match &args.command {
        None => run_checks(cli, &args.run, out),
        Some(CheckCommand::Profiles { name, profile_file }) => {
            profiles(name.as_deref(), profile_file.as_deref(), out)
        }
        Some(CheckCommand::List) => {
            if out.json {
                let list: Vec<serde_json::Value> = keel_check::checks::DESCRIPTIONS
                    .iter()
                    .map(|(id, d)| serde_json::json!({"id": id, "tier": "passive", "description": d}))
                    .collect();
                out.json("check list", &serde_json::json!({ "checks": list }))?;
            } else {
                let mut t = Table::new(&["Check", "Tier", "What"]);
                for (id, d) in keel_check::checks::DESCRIPTIONS {
                    t.row(vec![id.to_string(), "passive".into(), d.to_string()]);
                }
                out.text(&t.render())?;
            }
            Ok(Code::Ok)
        }
        Some(CheckCommand::Record {
            out: file,
            description,
        }) => {
            let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
            let (cfg, _) = config::load(None, &env)?;
            let probe =
                crate::gpu::nvml_probe(cfg.nvml_library.as_deref(), Duration::from_secs(30));
            let snap = probe.snapshot().context("cannot read the GPUs")?;
            let snap = keel_gpu::GpuSnapshot {
                description: description.clone().or(snap.description),
                ..snap
            };
            write_atomic(file, keel_gpu::recorded::to_json(&snap).as_bytes())?;
            if out.json {
                out.json(
                    "check record",
                    &serde_json::json!({"out": file, "gpus": snap.gpus.len()}),
                )?;
            } else {
                out.text(&format!(
                    "recorded {} GPUs to {}\n",
                    snap.gpus.len(),
                    file.display()
                ))?;
            }
            Ok(Code::Ok)
        }
        Some(CheckCommand::Merge { paths, outlier_pct }) => merge(paths, *outlier_pct, out),
    }
}

fn effective_config(r: &RunArgs) -> anyhow::Result<(CheckConfig, Option<PathBuf>)> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (mut c, path) = config::load(r.config.as_deref(), &env)?;
    if let Some(v) = &r.sku {
        c.sku = Some(v.clone());
    }
    if let Some(v) = &r.gpus {
        c.gpus = Some(config::parse_gpus("--gpus", v)?);
    }
    if let Some(v) = &r.profile_file {
        c.profile_file = Some(v.clone());
    }
    if let Some(v) = &r.gpu_snapshot {
        c.gpu_snapshot = Some(v.clone());
    }
    if let Some(v) = &r.imds_endpoint {
        c.imds_endpoint = v.clone();
    }
    if let Some(v) = &r.state_dir {
        c.state_dir = Some(v.clone());
    }
    if let Some(v) = &r.prometheus_textfile {
        c.prometheus_textfile = Some(v.clone());
    }
    if let Some(v) = r.slurm_timeout {
        crate::config::check_seconds("--slurm-timeout", v)?;
        c.slurm_timeout_s = v;
    }
    if r.fail_closed {
        c.fail_closed = true;
    }
    Ok((c, path))
}

/// The outcome of a check run, for the Slurm step and exit code.
pub struct Outcome {
    pub report: Report,
    /// Writing the state file failed: reported after the Slurm step, so
    /// that a full disk (itself a failed check) still drains the node.
    pub state_error: Option<anyhow::Error>,
}

fn run_checks(cli: &Cli, r: &RunArgs, out: &mut Out) -> anyhow::Result<Code> {
    let (cfg, cfg_path) = effective_config(r)?;
    if r.print_config {
        if out.json {
            out.json(
                "check config",
                &serde_json::json!({"config_file": cfg_path, "check": cfg}),
            )?;
        } else {
            let mut s = format!(
                "# config file: {}\n",
                cfg_path
                    .as_ref()
                    .map_or_else(|| "(none)".to_owned(), |p| p.display().to_string())
            );
            for (var, what) in config::ENV_VARS {
                if std::env::var_os(var).is_some() {
                    s.push_str(&format!("# {var} is set ({what})\n"));
                }
            }
            s.push_str("[check]\n");
            s.push_str(&toml::to_string(&cfg).context("cannot show the config")?);
            out.text(&s)?;
        }
        return Ok(Code::Ok);
    }
    // Under --slurm the node is read first: when check.gpus is not set,
    // its Gres GPU count is the count expected (unless a profile chosen
    // by --sku or Azure's metadata gives one).
    let slurm_node = r.slurm.then(|| slurm_node_name(cli, r)).flatten();
    let before = slurm_node
        .as_ref()
        .map(|node| crate::slurm::read_node(node, &cfg));
    let expected = match (cfg.gpus, &before) {
        (Some(n), _) => Some(ExpectedGpus {
            count: n,
            from: "check.gpus".to_owned(),
            over_profile: true,
        }),
        // `gpu:0` says nothing a node's GPUs could be checked against.
        (None, Some(Ok(info))) => info.gpus.filter(|&n| n > 0).map(|n| ExpectedGpus {
            count: n,
            from: format!("Slurm Gres of {}", info.name),
            over_profile: false,
        }),
        _ => None,
    };
    let outcome = check_node(cli, &cfg, expected, r.expect_idle, &r.bench)?;
    let report = &outcome.report;
    // Files the run writes beside its report. Their errors are reported
    // after the Slurm step and the report: a node whose disk is full fails
    // `host.disk` and must still be drained.
    let mut write_errors: Vec<anyhow::Error> = outcome.state_error.into_iter().collect();
    if let Some(path) = &cfg.prometheus_textfile {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        if let Err(e) = write_atomic(path, keel_check::report::prometheus(report, now).as_bytes())
            .with_context(|| format!("cannot write the Prometheus textfile {}", path.display()))
        {
            write_errors.push(e);
        }
    }
    let slurm = r
        .slurm
        .then(|| crate::slurm::apply(report, slurm_node, before.as_ref(), &cfg));
    if out.json {
        #[derive(serde::Serialize)]
        struct WithSlurm<'a> {
            #[serde(flatten)]
            report: &'a Report,
            #[serde(skip_serializing_if = "Option::is_none")]
            slurm: Option<&'a crate::slurm::SlurmOutcome>,
        }
        out.json(
            "check",
            &WithSlurm {
                report,
                slurm: slurm.as_ref(),
            },
        )?;
    } else if r.summary {
        out.text(&format!("{}\n", report.summary))?;
    } else {
        out.text(&render(report, r.verbose, colour_wanted()))?;
    }
    if let Some(s) = &slurm {
        if !out.json {
            out.text(&format!("slurm: {}\n", s.message))?;
        }
        if s.error.is_some() {
            eprintln!("keel: slurm: {}", s.message);
        }
    }
    let code = code_of(report.status);
    if write_errors.is_empty() {
        return Ok(code);
    }
    for e in &write_errors {
        eprintln!("keel: error: {e:#}");
    }
    // A failed node stays "failed" (2); otherwise the I/O error decides.
    Ok(if code == Code::Failed { code } else { Code::Io })
}

pub fn code_of(s: Status) -> Code {
    match s {
        Status::Pass | Status::Skip => Code::Ok,
        Status::Warn => Code::Warning,
        Status::Fail => Code::Failed,
        Status::Unknown => Code::Unknown,
    }
}

/// `--node`: one name Slurm reads as one node.
fn slurm_node_arg(s: &str) -> Result<String, String> {
    keel_slurm::check_node_name(s)
        .map(|()| s.to_owned())
        .map_err(|e| e.to_string())
}

/// The Slurm node name `--slurm` acts on: `--node`, then
/// `SLURMD_NODENAME`, then the short host name (under `--root`).
fn slurm_node_name(cli: &Cli, r: &RunArgs) -> Option<String> {
    let env_node = std::env::var("SLURMD_NODENAME")
        .ok()
        .filter(|v| !v.is_empty());
    r.node.clone().or(env_node).or_else(|| {
        std::fs::read_to_string(cli.root.join("proc/sys/kernel/hostname"))
            .ok()?
            .trim()
            .split('.')
            .next()
            .map(str::to_owned)
            .filter(|h| !h.is_empty())
    })
}

/// How many GPUs the node should have, and where that comes from.
#[derive(Debug, Clone)]
pub struct ExpectedGpus {
    pub count: u32,
    /// `check.gpus`, or `Slurm Gres of NODE`.
    pub from: String,
    /// Overrides the count of any profile (`check.gpus`); otherwise
    /// (Slurm's Gres) only of a profile guessed from the GPUs, or fills in
    /// one the profile lacks (`generic`): a profile chosen by `--sku` or
    /// Azure's metadata keeps its count.
    pub over_profile: bool,
}

/// Gathers inputs, chooses the profile and runs the passive checks.
pub fn check_node(
    cli: &Cli,
    cfg: &CheckConfig,
    expected_gpus: Option<ExpectedGpus>,
    expect_idle: bool,
    bench: &[PathBuf],
) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let timeout = Duration::from_secs_f64(cfg.read_timeout_s.max(0.1));
    let probe: Box<dyn GpuProbe> = match &cfg.gpu_snapshot {
        Some(f) => Box::new(RecordedProbe::new(f)),
        // NVML sees the GPUs of this machine, not those of another root.
        None if cli.root != Path::new("/") => Box::new(crate::gpu::Unavailable(format!(
            "NVML reads this machine's GPUs, not those under --root {}; pass --gpu-snapshot FILE",
            cli.root.display()
        ))),
        None => crate::gpu::nvml_probe(cfg.nvml_library.as_deref(), timeout),
    };
    // The mounts to check come from the profile, which may depend on the
    // GPUs: read the profile's disks after choosing it, so gather twice only
    // for the (cheap) disk step.
    let state_file = cfg.state_dir.as_ref().map(|d| d.join("check-state.json"));
    let mut opts = GatherOptions {
        timeout,
        mounts: Vec::new(),
        state_file: state_file.clone(),
        // A recording does not change: judge it as it is.
        clock_settle: if cfg.gpu_snapshot.is_some() {
            Duration::ZERO
        } else {
            CLOCK_SETTLE
        },
        clock_poll: Duration::from_millis(500),
    };
    let mut inputs = keel_check::gather(&cli.root, probe.as_ref(), &opts);

    let (sku, source, guessed) = choose_sku(cfg, expected_gpus.as_ref(), &inputs)?;
    let mut profile =
        profile::load(&sku, cfg.profile_file.as_deref()).context("cannot load the SKU profile")?;
    if let Some(e) =
        expected_gpus.filter(|e| e.over_profile || guessed || profile.gpu.count.is_none())
    {
        profile.gpu.count = Some(e.count);
    }
    opts.mounts = profile.host.disks.iter().map(|d| d.mount.clone()).collect();
    inputs.host.disk_free = keel_check::gather::disk_free(&cli.root, &opts);

    let mut results: Vec<CheckResult> =
        keel_check::run(&profile, &inputs, RunOptions { expect_idle }, &SystemClock);
    for file in json_files(bench)? {
        let text = keel_fs::read_regular_to_string(&file, keel_fs::MAX_STATE_BYTES)
            .with_context(|| format!("cannot read {}", file.display()))?;
        let doc: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| crate::exit::DataError(format!("{} is not JSON: {e}", file.display())))?;
        let active = keel_check::active::from_bench(&profile, &file.display().to_string(), &doc)
            .map_err(|e| crate::exit::DataError(e.to_string()))?;
        results.extend(active);
    }
    let host = inputs
        .host
        .hostname
        .clone()
        .unwrap_or_else(|| "unknown-host".to_owned());
    let elapsed = started.elapsed().as_secs_f64() * 1000.0;
    let report = Report::new(host, sku, source, results, (elapsed * 10.0).round() / 10.0);

    let mut state_error = None;
    if let Some(f) = &state_file {
        let state = State::from_inputs(&inputs);
        if let Ok(text) = serde_json::to_string_pretty(&state) {
            state_error = write_atomic(f, text.as_bytes())
                .with_context(|| format!("cannot write the state file {}", f.display()))
                .err();
        }
    }
    Ok(Outcome {
        report,
        state_error,
    })
}

fn choose_sku(
    cfg: &CheckConfig,
    expected_gpus: Option<&ExpectedGpus>,
    inputs: &keel_check::Inputs,
) -> anyhow::Result<(String, String, bool)> {
    if let Some(s) = &cfg.sku {
        if !profile::builtin_names().contains(&s.as_str()) {
            return Err(UsageError(format!(
                "unknown SKU {s:?}; known: {}",
                profile::builtin_names().join(", ")
            ))
            .into());
        }
        return Ok((s.clone(), "flag".into(), false));
    }
    if let Some(size) = keel_check::imds::vm_size(
        &cfg.imds_endpoint,
        Duration::from_millis(cfg.imds_timeout_ms),
    ) {
        if let Some(p) = profile::for_vm_size(&size) {
            return Ok((p.to_owned(), format!("imds ({size})"), false));
        }
    }
    let from_gpus = match (&inputs.gpu, &inputs.machine) {
        (Ok(s), _) if !s.gpus.is_empty() => s.gpus[0].name.clone().map(|n| (n, s.gpus.len())),
        (_, Ok(m)) if !m.gpus.is_empty() => m.gpus[0].model.clone().map(|n| (n, m.gpus.len())),
        _ => None,
    };
    let found = from_gpus.as_ref().map_or(0, |(_, n)| *n);
    let note = |e: &ExpectedGpus| format!("{found} found, {} = {}", e.from, e.count);
    if let Some((model, _)) = &from_gpus {
        // The expected count, not the count found: a node that lost a GPU
        // is still judged by its SKU's profile.
        let (count, note) = match expected_gpus {
            Some(e) => (e.count as usize, format!(", {}", note(e))),
            None => (found, String::new()),
        };
        if let Some(p) = profile::for_gpus(model, count) {
            return Ok((p.to_owned(), format!("gpus ({count}x {model}{note})"), true));
        }
    }
    let source = match expected_gpus {
        Some(e) => format!("generic ({})", note(e)),
        None => "generic".into(),
    };
    Ok(("generic".into(), source, true))
}

fn profiles(name: Option<&str>, file: Option<&Path>, out: &mut Out) -> anyhow::Result<Code> {
    match name {
        None => {
            let mut list = Vec::new();
            for n in profile::builtin_names() {
                let p = profile::load(n, None)?;
                list.push((n, p.description, p.vm_sizes));
            }
            if out.json {
                let v: Vec<serde_json::Value> = list
                    .iter()
                    .map(
                        |(n, d, v)| serde_json::json!({"name": n, "description": d, "vm_sizes": v}),
                    )
                    .collect();
                out.json("check profiles", &serde_json::json!({ "profiles": v }))?;
            } else {
                let mut t = Table::new(&["Profile", "Azure VM size", "Description"]);
                for (n, d, v) in list {
                    t.row(vec![
                        n.to_owned(),
                        if v.is_empty() {
                            "-".into()
                        } else {
                            v.join(",")
                        },
                        d,
                    ]);
                }
                out.text(&t.render())?;
            }
        }
        Some(n) => {
            let p = profile::load(n, file).map_err(|e| match e {
                profile::ProfileError::Unknown { .. } => {
                    anyhow::Error::new(UsageError(e.to_string()))
                }
                other => anyhow::Error::new(other),
            })?;
            if out.json {
                out.json("check profile", &p)?;
            } else {
                out.text(&format!(
                    "# profile {n}\n{}",
                    toml::to_string(&p).context("cannot show the profile")?
                ))?;
            }
        }
    }
    Ok(Code::Ok)
}

fn colour_wanted() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

fn paint(s: Status, colour: bool) -> String {
    let word = s.as_str();
    if !colour {
        return word.to_owned();
    }
    let code = match s {
        Status::Pass => "32",
        Status::Warn => "33",
        Status::Fail => "31;1",
        Status::Unknown => "35",
        Status::Skip => "2",
    };
    format!("\x1b[{code}m{word}\x1b[0m")
}

/// The human report: one line per check when all its devices pass, one
/// line per device otherwise (all lines with `--verbose`).
pub fn render(report: &Report, verbose: bool, colour: bool) -> String {
    let mut s = format!(
        "{} | profile {} ({}) | {} results in {:.0} ms\n\n",
        report.host,
        report.sku,
        report.sku_source,
        report.results.len(),
        report.duration_ms
    );
    let mut t = Table::new(&["Check", "Status", "Device", "Detail"]);
    let mut ids: Vec<&str> = Vec::new();
    for r in &report.results {
        if !ids.contains(&r.id.as_str()) {
            ids.push(&r.id);
        }
    }
    for id in ids {
        let rs: Vec<&CheckResult> = report.results.iter().filter(|r| r.id == id).collect();
        let all_pass = rs.iter().all(|r| r.status == Status::Pass);
        if all_pass && rs.len() > 1 && !verbose {
            let details: std::collections::BTreeSet<&str> =
                rs.iter().map(|r| r.detail.as_str()).collect();
            let detail = if details.len() == 1 {
                rs[0].detail.clone()
            } else {
                "all pass".to_owned()
            };
            t.row(vec![
                id.to_owned(),
                paint(Status::Pass, colour),
                format!("{} devices", rs.len()),
                detail,
            ]);
            continue;
        }
        for r in rs {
            let device = r.device.as_ref().map(|d| d.label()).unwrap_or_default();
            let mut detail = r.detail.clone();
            if let Some(c) = &r.code {
                if r.status != Status::Pass {
                    detail = format!("{detail} [{c}]");
                }
            }
            t.row(vec![
                r.id.clone(),
                paint(r.status, colour),
                if device.is_empty() {
                    "-".into()
                } else {
                    device
                },
                detail,
            ]);
        }
    }
    s.push_str(&t.render());
    s.push('\n');
    for r in report
        .results
        .iter()
        .filter(|r| matches!(r.status, Status::Fail | Status::Warn) && !r.evidence.is_empty())
    {
        s.push_str(&format!("evidence for {} {}:\n", r.id, describe(r)));
        for e in &r.evidence {
            s.push_str(&format!("  {e}\n"));
        }
    }
    s.push_str(&format!("{}\n", report.summary));
    s
}

/// The files named, with directories replaced by the *.json files in them.
fn json_files(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut inside: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("cannot list {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.extension().is_some_and(|x| x == "json"))
                .collect();
            inside.sort();
            files.extend(inside);
        } else {
            files.push(p.clone());
        }
    }
    Ok(files)
}

fn merge(paths: &[PathBuf], pct: f64, out: &mut Out) -> anyhow::Result<Code> {
    if !(0.0..100.0).contains(&pct) {
        return Err(UsageError(format!("--outlier-pct {pct} must be between 0 and 100")).into());
    }
    let files = json_files(paths)?;
    if files.is_empty() {
        return Err(
            UsageError("no report to merge (directories are searched for *.json)".into()).into(),
        );
    }
    let mut reports = Vec::new();
    for f in &files {
        let text = keel_fs::read_regular_to_string(f, keel_fs::MAX_STATE_BYTES)
            .with_context(|| format!("cannot read {}", f.display()))?;
        let r: Report = serde_json::from_str(&text).map_err(|e| {
            crate::exit::DataError(format!(
                "{} is not a keel check --json report: {e}",
                f.display()
            ))
        })?;
        reports.push(r);
    }
    let fleet = fleet::merge(&reports, pct / 100.0);
    if out.json {
        out.json("check merge", &fleet)?;
    } else {
        out.text(&render_fleet(&fleet))?;
    }
    let worst = reports
        .iter()
        .map(|r| r.status)
        .max()
        .unwrap_or(Status::Pass);
    let code = code_of(worst);
    Ok(if code == Code::Ok && !fleet.outliers.is_empty() {
        Code::Warning
    } else {
        code
    })
}

fn render_fleet(f: &Fleet) -> String {
    let counts: Vec<String> = f
        .by_status
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect();
    let mut s = format!("{} nodes: {}\n", f.nodes, counts.join(", "));
    if !f.unhealthy.is_empty() {
        s.push_str("\nunhealthy nodes:\n");
        for n in &f.unhealthy {
            s.push_str(&format!("  {}\n", n.summary));
        }
    }
    if f.outliers.is_empty() {
        s.push_str(&format!(
            "\nno outlier more than {:.0}% below the median\n",
            f.outlier_fraction * 100.0
        ));
    } else {
        s.push_str(&format!(
            "\noutliers (more than {:.0}% below the median):\n",
            f.outlier_fraction * 100.0
        ));
        let mut t = Table::new(&[
            "Host", "SKU", "Check", "Device", "Value", "Median", "Below", "Against",
        ]);
        for o in &f.outliers {
            t.row(vec![
                o.host.clone(),
                o.sku.clone(),
                o.check.clone(),
                o.device.clone().unwrap_or_else(|| "-".into()),
                format!("{} {}", o.value, o.unit.clone().unwrap_or_default()),
                format!("{:.2}", o.median),
                format!("{:.1}%", o.below * 100.0),
                o.against.to_owned(),
            ]);
        }
        s.push_str(&t.render());
    }
    s
}

/// Writes `bytes` to `path` atomically (`keel_fs::write_atomic`: a unique
/// temporary file beside it, synced and renamed, the directory synced), so
/// readers (node_exporter, the next `keel check`) never see a partial
/// file. Mode 0644: the node_exporter textfile collector reads it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    keel_fs::write_atomic(path, bytes, 0o644)?;
    Ok(())
}
