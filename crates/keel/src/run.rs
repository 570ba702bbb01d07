//! `keel run`: supervise one attempt of a training job (single machine;
//! inside an sbatch script it supervises the batch step), and `keel run
//! report`. This file turns flags into a [`Plan`] for keel-run's
//! supervisor and renders its conclusion.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use keel_run::events::Imds;
use keel_run::supervisor::{supervise, Console, Ending, Plan, SlurmMode};
use keel_run::{account, HangConfig, History, RunPolicy, Timeout};
use keel_time::SystemClock;

use crate::exit::{Code, UsageError};

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct RunArgs {
    #[command(subcommand)]
    sub: Option<RunSub>,
    #[command(flatten)]
    opts: RunOpts,
    /// The trainer and its arguments, after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum RunSub {
    /// Goodput of a job across its attempts, from the state file.
    Report {
        /// The run state file.
        #[arg(long, env = "KEEL_RUN_STATE", value_name = "FILE")]
        state: PathBuf,
        /// The job (default: every job in the file).
        #[arg(long, value_name = "ID")]
        job: Option<String>,
    },
}

#[derive(Debug, Args)]
struct RunOpts {
    /// Checkpoint store (file://, az://, s3://).
    #[arg(long, env = "KEEL_RUN_STORE", value_name = "URL")]
    store: Option<String>,
    /// The run's name in the store.
    #[arg(long, env = "KEEL_RUN_NAME", value_name = "NAME")]
    run: Option<String>,
    /// Where the trainer writes checkpoint directories (watched and
    /// pushed as they complete); passed as KEEL_CKPT_DIR.
    #[arg(long, value_name = "DIR")]
    ckpt_dir: Option<PathBuf>,
    /// Where a checkpoint is restored (default: DIR/.keel-resume under
    /// --ckpt-dir).
    #[arg(long, value_name = "DIR")]
    restore_dir: Option<PathBuf>,
    /// The failure history state file (default: keel-run.json in
    /// --ckpt-dir). Put it on shared storage when attempts run on other
    /// machines.
    #[arg(long, env = "KEEL_RUN_STATE", value_name = "FILE")]
    state: Option<PathBuf>,
    /// A file that marks a checkpoint complete (default: the framework's
    /// own rule, e.g. DCP's .metadata).
    #[arg(long, value_name = "NAME")]
    marker: Option<String>,
    /// A file the trainer touches as a heartbeat; passed as
    /// KEEL_HEARTBEAT_FILE.
    #[arg(long, value_name = "FILE")]
    heartbeat_file: Option<PathBuf>,
    /// A directory where each node (or rank) touches a file of its own
    /// name as its heartbeat (KEEL_HEARTBEAT_DIR; e.g. $SLURMD_NODENAME):
    /// one that stops while others go on is a hang blamed on it.
    #[arg(long, value_name = "DIR")]
    heartbeat_dir: Option<PathBuf>,
    /// A line of the trainer's stdout containing this is a heartbeat.
    #[arg(long, value_name = "TEXT")]
    heartbeat_pattern: Option<String>,
    /// A fixed hang timeout in seconds (default: learned, the longest
    /// interval between heartbeats times --safety-factor).
    #[arg(long, value_name = "SECS")]
    hang_timeout: Option<f64>,
    /// The learned timeout's factor.
    #[arg(long, default_value_t = 5.0, value_name = "X")]
    safety_factor: f64,
    /// Allowance from start to the first heartbeat, and the timeout
    /// until one is learned.
    #[arg(long, default_value_t = 600.0, value_name = "SECS")]
    startup_timeout: f64,
    /// Added to the timeout while a checkpoint is being saved.
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    save_allowance: f64,
    /// From SIGTERM to SIGKILL when the trainer is stopped.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    grace: f64,
    /// A signal sent to the trainer's process group, besides the request
    /// file (KEEL_CKPT_REQUEST), to ask for a checkpoint now: `none` (the
    /// default: torchrun's agent dies of USR1/USR2 and turns TERM, INT,
    /// HUP and QUIT into a shutdown), USR1, USR2, TERM, INT, HUP or QUIT.
    #[arg(long, default_value = "none", value_name = "SIGNAL")]
    checkpoint_signal: String,
    /// How long to wait for that checkpoint's commit (less when Slurm's
    /// KillWait, the job's time left or an event's notice allow less).
    #[arg(long, default_value_t = 120.0, value_name = "SECS")]
    checkpoint_deadline: f64,
    /// Kept back from the time Slurm (or a notice) allows a stop, for
    /// recording the attempt and the requeue's scontrol calls.
    #[arg(long, default_value_t = 3.0, value_name = "SECS")]
    stop_reserve: f64,
    /// Seconds between passes of the checkpoint watcher.
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    watch_interval: f64,
    /// Poll Azure Scheduled Events at this IMDS address
    /// (http://169.254.169.254 on Azure); off when not given.
    #[arg(long, env = "KEEL_RUN_IMDS", value_name = "URL")]
    imds: Option<String>,
    /// Poll AWS EC2's Spot interruption notice at this IMDS address
    /// (http://169.254.169.254 on EC2) every 2 s; off when not given.
    #[arg(long, value_name = "URL")]
    aws_imds: Option<String>,
    /// Poll GCP's preemption flag at this metadata address
    /// (http://metadata.google.internal) every second; off when not given.
    #[arg(long, value_name = "URL")]
    gcp_metadata: Option<String>,
    /// This VM's name in Scheduled Events (default: asked from IMDS).
    #[arg(long, value_name = "NAME")]
    vm_name: Option<String>,
    /// The VM names of all the job's nodes, comma-separated, as Scheduled
    /// Events name them (default with --slurm: the allocation's node
    /// names, CycleCloud's nodes being named after their VMs). An event
    /// naming any of them, or this VM, ends training.
    #[arg(long, value_name = "LIST")]
    job_vms: Option<String>,
    /// Acknowledge an event (StartRequests) once its checkpoint is
    /// committed, and only an event that names no VM outside the job.
    /// Give it on one machine of a job only (the batch host).
    #[arg(long)]
    imds_ack: bool,
    /// The job the history is kept under (default: SLURM_JOB_ID, else
    /// `local`).
    #[arg(long, value_name = "ID")]
    job: Option<String>,
    /// Start-up failures in a row after which the job is not requeued.
    #[arg(long, default_value_t = 3, value_name = "N")]
    startup_retries: u32,
    /// Failures of this job on one node after which it is excluded.
    #[arg(long, default_value_t = 2, value_name = "N")]
    exclude_after: u32,
    /// Inside a Slurm batch job: check every node of the allocation
    /// before training and after a failure (one task per node), and
    /// requeue the job excluding suspect nodes.
    #[arg(long)]
    slurm: bool,
    /// The health check run on each node (default: this keel's `check
    /// --slurm`, which drains a failing node with a `keel:` reason).
    #[arg(long, value_name = "COMMAND")]
    check_command: Option<String>,
    /// Longest one Slurm command may take.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    slurm_timeout: f64,
    /// Serve Prometheus metrics at http://ADDR/metrics while supervising.
    #[arg(long, value_name = "HOST:PORT")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// SHA-256 (hex) of the bearer token scrapers of --metrics-listen must
    /// send (`keel serve token` makes a token and its hash); without it,
    /// anyone who can connect may read the metrics.
    #[arg(
        long,
        value_name = "HEX",
        env = "KEEL_RUN_METRICS_TOKEN_SHA256",
        hide_env_values = true
    )]
    metrics_token_sha256: Option<String>,
    /// Longest the checks on all nodes may take.
    #[arg(long, default_value_t = 120.0, value_name = "SECS")]
    check_timeout: f64,
}

pub fn run(args: &RunArgs, json: bool) -> anyhow::Result<Code> {
    if let Some(RunSub::Report { state, job }) = &args.sub {
        return report(state, job.as_deref(), json);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    // The store is opened inside the runtime, as everywhere else.
    let plan = {
        let _in = rt.enter();
        plan_from_args(args)?
    };
    let c = rt.block_on(supervise(&plan, Arc::new(Terminal), Arc::new(SystemClock)))?;
    let code = match c.ending {
        Ending::Done => Code::Ok,
        Ending::Requeue => Code::Requeue,
        Ending::Failed => Code::Failed,
        Ending::Stop => Code::Stop,
    };
    if json {
        let body = serde_json::json!({
            "version": 1,
            "command": "run",
            "job": c.job,
            "outcome": c.outcome,
            "result": c.result,
            "exit_code": code as u8,
            "resumed_from_step": c.resumed_from_step,
            "commits": c.commits,
            "exclude": c.exclude,
            "drained": c.drained,
        });
        let _ = writeln!(std::io::stdout().lock(), "{body}");
    }
    Ok(code)
}

/// The supervisor's words on standard error, prefixed `keel run: `; the
/// trainer's output passed through as it comes.
struct Terminal;

impl Console for Terminal {
    fn say(&self, msg: &str) {
        let _ = writeln!(std::io::stderr().lock(), "keel run: {msg}");
    }

    fn trainer_stdout(&self, line: &[u8]) {
        let _ = std::io::stdout().lock().write_all(line);
    }

    fn trainer_stderr(&self, line: &[u8]) {
        let _ = std::io::stderr().lock().write_all(line);
    }
}

fn secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| UsageError(format!("--{name} must be a positive number of seconds")).into())
}

fn signal_named(name: &str) -> anyhow::Result<Option<rustix::process::Signal>> {
    use rustix::process::Signal;
    let n = name.trim().to_ascii_uppercase();
    Ok(Some(match n.strip_prefix("SIG").unwrap_or(&n) {
        "NONE" => return Ok(None),
        "USR1" => Signal::USR1,
        "USR2" => Signal::USR2,
        "TERM" => Signal::TERM,
        "INT" => Signal::INT,
        "HUP" => Signal::HUP,
        "QUIT" => Signal::QUIT,
        _ => {
            let shown: String = name.chars().take(32).collect();
            return Err(UsageError(format!(
                "--checkpoint-signal {shown:?}: expected none, USR1, USR2, TERM, INT, HUP or QUIT"
            ))
            .into());
        }
    }))
}

fn plan_from_args(args: &RunArgs) -> anyhow::Result<Plan> {
    let o = &args.opts;
    let need = |v: &Option<String>, flag: &str| {
        v.clone()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| UsageError(format!("keel run needs {flag}")))
    };
    let store_url = need(&o.store, "--store URL")?;
    let run = need(&o.run, "--run NAME")?;
    keel_ckpt::layout::check_run(&run)?;
    let ckpt_dir = o
        .ckpt_dir
        .clone()
        .ok_or_else(|| UsageError("keel run needs --ckpt-dir DIR".into()))?;
    if args.command.is_empty() {
        return Err(UsageError("keel run needs a command after `--`".into()).into());
    }
    if !(o.safety_factor.is_finite() && o.safety_factor >= 1.0) {
        return Err(UsageError("--safety-factor must be at least 1".into()).into());
    }
    let startup = secs("startup-timeout", o.startup_timeout)?;
    let timeout = match o.hang_timeout {
        Some(t) => Timeout::Fixed(secs("hang-timeout", t)?),
        None => Timeout::Learned {
            safety_factor: o.safety_factor,
            min_samples: 3,
            floor: Duration::from_secs(1),
            before_learned: startup,
        },
    };
    let imds = o
        .imds
        .as_deref()
        .map(|u| Imds::new(u, Duration::from_secs(2)))
        .transpose()
        .map_err(|e| UsageError(format!("--imds: {e}")))?;
    let slurm = if o.slurm {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if var("SLURM_JOB_ID").is_none() && o.job.is_none() {
            return Err(UsageError(
                "--slurm runs inside a Slurm batch job (no SLURM_JOB_ID)".into(),
            )
            .into());
        }
        let list = var("SLURM_JOB_NODELIST")
            .or_else(|| var("SLURM_NODELIST"))
            .ok_or_else(|| UsageError("--slurm: no SLURM_JOB_NODELIST".into()))?;
        let nodes = keel_slurm::expand_hostlist(&list)
            .map_err(|e| UsageError(format!("SLURM_JOB_NODELIST: {e}")))?;
        let check = match &o.check_command {
            Some(c) => c.split_whitespace().map(str::to_owned).collect(),
            None => vec![
                std::env::current_exe()
                    .context("cannot find this keel")?
                    .display()
                    .to_string(),
                "check".into(),
                "--slurm".into(),
            ],
        };
        if check.is_empty() {
            return Err(UsageError("--check-command is empty".into()).into());
        }
        Some(SlurmMode {
            client: keel_slurm::Slurm::new(keel_slurm::SlurmConfig {
                timeout: secs("slurm-timeout", o.slurm_timeout)?,
                ..Default::default()
            }),
            nodes,
            check,
            check_timeout: secs("check-timeout", o.check_timeout)?,
        })
    } else {
        None
    };
    let aws_imds = o
        .aws_imds
        .as_deref()
        .map(|u| Imds::new(u, Duration::from_secs(2)))
        .transpose()
        .map_err(|e| UsageError(format!("--aws-imds: {e}")))?;
    let gcp_metadata = o
        .gcp_metadata
        .as_deref()
        .map(|u| Imds::new(u, Duration::from_secs(2)))
        .transpose()
        .map_err(|e| UsageError(format!("--gcp-metadata: {e}")))?;
    let slurm_job = std::env::var("SLURM_JOB_ID").ok().filter(|j| !j.is_empty());
    let job = o
        .job
        .clone()
        .or_else(|| slurm_job.clone())
        .filter(|j| !j.is_empty())
        .unwrap_or_else(|| "local".into());
    let request_file = ckpt_dir.join(keel_run::supervisor::REQUEST_FILE);
    let mut job_vms: Vec<String> = match &o.job_vms {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
            .collect(),
        None => slurm.as_ref().map(|m| m.nodes.clone()).unwrap_or_default(),
    };
    job_vms.sort();
    job_vms.dedup();
    Ok(Plan {
        restore_dir: o
            .restore_dir
            .clone()
            .unwrap_or_else(|| ckpt_dir.join(".keel-resume")),
        state: o
            .state
            .clone()
            .unwrap_or_else(|| ckpt_dir.join("keel-run.json")),
        run,
        ckpt_dir,
        marker: o.marker.clone(),
        heartbeat_file: o.heartbeat_file.clone(),
        heartbeat_dir: o.heartbeat_dir.clone(),
        heartbeat_pattern: o.heartbeat_pattern.clone().filter(|p| !p.is_empty()),
        hang: HangConfig {
            startup,
            timeout,
            save: Duration::try_from_secs_f64(o.save_allowance)
                .map_err(|_| UsageError("--save-allowance must be a number of seconds".into()))?,
        },
        grace: secs("grace", o.grace)?,
        checkpoint_signal: signal_named(&o.checkpoint_signal)?,
        request_file,
        checkpoint_deadline: secs("checkpoint-deadline", o.checkpoint_deadline)?,
        stop_reserve: Duration::try_from_secs_f64(o.stop_reserve)
            .map_err(|_| UsageError("--stop-reserve must be a number of seconds".into()))?,
        watch_interval: secs("watch-interval", o.watch_interval)?,
        imds,
        aws_imds,
        gcp_metadata,
        vm_name: o.vm_name.clone(),
        job_vms,
        imds_ack: o.imds_ack,
        job,
        slurm_job,
        host: crate::ckpt::hostname(),
        policy: RunPolicy {
            exclude_after: o.exclude_after.max(1),
            startup_retries: o.startup_retries.max(1),
            ..RunPolicy::default()
        },
        command: args.command.clone(),
        slurm,
        metrics_listen: o.metrics_listen,
        metrics_token: o
            .metrics_token_sha256
            .as_deref()
            .map(keel_http::TokenHash::parse)
            .transpose()
            .map_err(|e| UsageError(format!("--metrics-token-sha256: {e}")))?,
        // Last: every flag is checked before the store (a file:// root
        // is created) is opened.
        store: crate::ckpt::open_for_writing(&store_url)?,
    })
}

fn report(state: &Path, job: Option<&str>, json: bool) -> anyhow::Result<Code> {
    if !state.exists() {
        return Err(UsageError(format!("no run state file at {}", state.display())).into());
    }
    let h = History::load(state)?;
    let jobs: Vec<(&String, &keel_run::JobHistory)> = h
        .jobs
        .iter()
        .filter(|(k, _)| job.is_none_or(|j| j == k.as_str()))
        .collect();
    if jobs.is_empty() {
        return Err(UsageError(format!(
            "{} has no job {}",
            state.display(),
            job.unwrap_or("")
        ))
        .into());
    }
    let mut out = std::io::stdout().lock();
    if json {
        let body: Vec<_> = jobs
            .iter()
            .map(|(k, j)| {
                serde_json::json!({"job": k, "goodput": account(&j.attempts),
                    "failures": j.failures.iter().map(|f| serde_json::json!({"node": f.node, "cause": f.cause, "count": f.count})).collect::<Vec<_>>(),
                    "startup_failures": j.startup_failures})
            })
            .collect();
        writeln!(
            out,
            "{}",
            serde_json::json!({"version": 1, "command": "run report", "jobs": body})
        )?;
        return Ok(Code::Ok);
    }
    for (k, j) in jobs {
        let g = account(&j.attempts);
        let pct = |ms: u64| {
            if g.wall_ms == 0 {
                "-".to_owned()
            } else {
                #[allow(clippy::cast_precision_loss)]
                let p = ms as f64 * 100.0 / g.wall_ms as f64;
                format!("{p:.1}%")
            }
        };
        writeln!(out, "job {k}: {} attempts", g.attempts)?;
        writeln!(out, "  {:<20} {:>12} {:>7}", "bucket", "seconds", "share")?;
        for (name, ms) in [
            ("queue", g.queue_ms),
            ("pre-flight", g.preflight_ms),
            ("restore", g.restore_ms),
            ("checkpoint stalls", g.stall_ms),
            ("lost work", g.lost_ms),
            ("productive", g.productive_ms),
            ("wall", g.wall_ms),
        ] {
            #[allow(clippy::cast_precision_loss)]
            let s = ms as f64 / 1000.0;
            writeln!(out, "  {name:<20} {s:>12.1} {:>7}", pct(ms))?;
        }
        writeln!(
            out,
            "  effective training time ratio: {}",
            g.ettr.map_or("-".to_owned(), |r| format!("{r:.3}"))
        )?;
        for f in &j.failures {
            writeln!(
                out,
                "  failure: node {} {} x{}",
                f.node,
                f.cause.as_str(),
                f.count
            )?;
        }
    }
    Ok(Code::Ok)
}
