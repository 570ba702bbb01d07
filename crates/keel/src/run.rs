//! `keel run`: supervise one attempt of a training job (single machine;
//! inside an sbatch script it supervises the batch step), and `keel run
//! report`. The decisions live in keel-run; this file starts the trainer,
//! watches it and signals it.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use keel_ckpt::watch::{WatchEvent, Watcher};
use keel_ckpt::{Ckpt, Selector};
use keel_run::decide::Next;
use keel_run::events::{Imds, Poller};
use keel_run::goodput::Ended;
use keel_run::{
    account, decide, AttemptTimes, Cause, HangConfig, HangDetector, HangStatus, History, Outcome,
    RunPolicy, Timeout,
};
use keel_store::TransferOptions;

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
    let plan = Plan::from_args(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(supervise(&plan, json))
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

/// Everything an attempt needs, validated.
#[derive(Debug)]
struct Plan {
    store: String,
    run: String,
    ckpt_dir: PathBuf,
    restore_dir: PathBuf,
    state: PathBuf,
    marker: Option<String>,
    heartbeat_file: Option<PathBuf>,
    heartbeat_dir: Option<PathBuf>,
    heartbeat_pattern: Option<String>,
    hang: HangConfig,
    grace: Duration,
    checkpoint_signal: Option<rustix::process::Signal>,
    /// Where a checkpoint request is written (KEEL_CKPT_REQUEST).
    request_file: PathBuf,
    checkpoint_deadline: Duration,
    stop_reserve: Duration,
    watch_interval: Duration,
    imds: Option<Imds>,
    aws_imds: Option<Imds>,
    gcp_metadata: Option<Imds>,
    vm_name: Option<String>,
    /// The other VMs of the job (beside this one).
    job_vms: Vec<String>,
    imds_ack: bool,
    job: String,
    policy: RunPolicy,
    command: Vec<String>,
    slurm: Option<SlurmMode>,
    metrics_listen: Option<std::net::SocketAddr>,
    metrics_token: Option<keel_http::TokenHash>,
}

/// What Slurm mode needs.
#[derive(Debug)]
struct SlurmMode {
    client: keel_slurm::Slurm,
    nodes: Vec<String>,
    check: Vec<String>,
    check_timeout: Duration,
}

impl Plan {
    fn from_args(args: &RunArgs) -> anyhow::Result<Self> {
        let o = &args.opts;
        let need = |v: &Option<String>, flag: &str| {
            v.clone()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| UsageError(format!("keel run needs {flag}")))
        };
        let store = need(&o.store, "--store URL")?;
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
        let job = o
            .job
            .clone()
            .or_else(|| std::env::var("SLURM_JOB_ID").ok())
            .filter(|j| !j.is_empty())
            .unwrap_or_else(|| "local".into());
        let request_file = ckpt_dir.join(REQUEST_FILE);
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
        Ok(Self {
            restore_dir: o
                .restore_dir
                .clone()
                .unwrap_or_else(|| ckpt_dir.join(".keel-resume")),
            state: o
                .state
                .clone()
                .unwrap_or_else(|| ckpt_dir.join("keel-run.json")),
            store,
            run,
            ckpt_dir,
            marker: o.marker.clone(),
            heartbeat_file: o.heartbeat_file.clone(),
            heartbeat_dir: o.heartbeat_dir.clone(),
            heartbeat_pattern: o.heartbeat_pattern.clone().filter(|p| !p.is_empty()),
            hang: HangConfig {
                startup,
                timeout,
                save: Duration::try_from_secs_f64(o.save_allowance).map_err(|_| {
                    UsageError("--save-allowance must be a number of seconds".into())
                })?,
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
        })
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "keel run: {msg}");
}

/// Something the supervisor reacts to, from its helper threads and tasks.
enum Note {
    Heartbeat,
    /// srun reported a task failing on this node.
    TaskFailed(String),
    /// Nothing: tells a helper thread whether the supervisor still listens.
    Tick,
    /// SIGTERM or SIGUSR1 to the supervisor.
    Signal(&'static str),
    /// A Scheduled Event that ends training on this VM.
    Evict {
        id: String,
        kind: String,
        /// The event's VMs, and the job's (for the acknowledgement);
        /// empty for AWS and GCP notices, which nobody acknowledges.
        resources: Vec<String>,
        job_vms: Vec<String>,
        /// Until the event may start (zero when it started or has no time).
        notice: Duration,
    },
}

fn pgid(child: &Child) -> Option<rustix::process::Pid> {
    i32::try_from(child.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw)
}

fn signal_group(child: &Child, sig: rustix::process::Signal) {
    if let Some(p) = pgid(child) {
        let _ = rustix::process::kill_process_group(p, sig);
    }
}

/// The checkpoint request file's name in the checkpoint directory.
const REQUEST_FILE: &str = ".keel-checkpoint-request";

/// Asks the trainer for a checkpoint now: writes a new request into the
/// request file (atomically: a trainer reads either the last request or
/// this one), then sends the checkpoint signal when one is configured.
/// The file reaches every rank under any launcher (torchrun's agent
/// forwards no signal without shutting its workers down); a trainer reads
/// it at a step boundary and saves when its content changed.
fn request_checkpoint(plan: &Plan, child: &Child, why: &str) {
    let body = format!("{} {why}\n", now_ms());
    if let Err(e) = keel_fs::write_atomic(&plan.request_file, body.as_bytes(), 0o644) {
        say(&format!(
            "cannot write the checkpoint request {}: {e}",
            plan.request_file.display()
        ));
    }
    if let Some(sig) = plan.checkpoint_signal {
        signal_group(child, sig);
    }
}

/// SIGTERM to the trainer's process group, SIGKILL after the grace.
fn stop(child: &mut Child, grace: Duration) -> Option<std::process::ExitStatus> {
    if let Ok(Some(s)) = child.try_wait() {
        return Some(s);
    }
    signal_group(child, rustix::process::Signal::TERM);
    let until = Instant::now() + grace;
    while Instant::now() < until {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    say("the trainer ignored SIGTERM; sending SIGKILL");
    signal_group(child, rustix::process::Signal::KILL);
    child.wait().ok()
}

/// A checkpoint asked for before stopping: until when its commit is
/// waited for, the stop's grace, the commits seen when asked, and the
/// Scheduled Event (id, its VMs, the job's VMs) to acknowledge.
struct Draining {
    deadline: Instant,
    grace: Duration,
    commits_then: u64,
    event: Option<(String, Vec<String>, Vec<String>)>,
}

/// What Slurm allows from a signal to its SIGKILL (see
/// [`keel_run::budget::until_kill`]): KillWait after SIGTERM, the job's
/// time left and KillWait after the warning signal. `None` outside Slurm
/// or when it cannot be read.
fn slurm_until_kill(plan: &Plan, sigterm: bool, kill_wait: Option<Duration>) -> Option<Duration> {
    let m = plan.slurm.as_ref()?;
    let time_left = if sigterm {
        None
    } else {
        let job = std::env::var("SLURM_JOB_ID").unwrap_or_else(|_| plan.job.clone());
        match m.client.time_left(&job) {
            Ok(t) => t,
            Err(e) => {
                say(&format!("cannot read the job's time left ({e})"));
                None
            }
        }
    };
    keel_run::budget::until_kill(sigterm, kill_wait, time_left)
}

/// The waits of a stop with `left` before the kill, saying so when they
/// had to be shortened.
fn stop_plan(plan: &Plan, left: Option<Duration>) -> keel_run::budget::StopPlan {
    let p = keel_run::budget::plan_stop(
        left,
        keel_run::budget::StopConfig {
            checkpoint_deadline: plan.checkpoint_deadline,
            grace: plan.grace,
            reserve: plan.stop_reserve,
        },
    );
    if p.shortened {
        say(&format!(
            "the stop must fit in {:.1} s: the checkpoint wait is {:.1} s (--checkpoint-deadline {:.0}) and the grace {:.1} s (--grace {:.0})",
            left.unwrap_or_default().as_secs_f64(),
            p.checkpoint_deadline.as_secs_f64(),
            plan.checkpoint_deadline.as_secs_f64(),
            p.grace.as_secs_f64(),
            plan.grace.as_secs_f64()
        ));
    }
    p
}

struct Attempt {
    times: AttemptTimes,
    commits: u64,
    last_step: Option<u64>,
}

/// Whether a checkpoint newer than the last commit is being written: a
/// step directory under `root` that is not complete yet.
fn saving_now(root: &Path, marker: Option<&str>, last: Option<u64>) -> bool {
    let Ok(done) = keel_ckpt::detect::completed(root, marker) else {
        return false;
    };
    let Ok(rd) = std::fs::read_dir(root) else {
        return false;
    };
    rd.flatten().any(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        !name.starts_with('.')
            && e.path().is_dir()
            && keel_ckpt::detect::step_of(&name).is_some_and(|step| {
                last.is_none_or(|l| step > l) && !done.iter().any(|c| c.step == step)
            })
    })
}

#[allow(clippy::too_many_arguments)]
async fn push_pass(
    watcher: &mut Watcher,
    watcher_root: &Path,
    marker: Option<&str>,
    topts: &TransferOptions,
    at: &mut Attempt,
    det: &mut HangDetector,
    origin: Instant,
) -> anyhow::Result<()> {
    let events = match watcher.pass(&crate::ckpt::context(), topts).await {
        Ok(e) => e,
        Err(e @ keel_ckpt::CkptError::Fenced { .. }) => return Err(e.into()),
        Err(e) => {
            say(&format!("checkpoint watcher: {e:#}; retrying"));
            return Ok(());
        }
    };
    let saving = saving_now(watcher_root, marker, at.last_step);
    if saving && det.phase() == keel_run::Phase::Training {
        det.save_started(origin.elapsed());
    }
    for ev in events {
        match ev {
            WatchEvent::Pushed { dir, report } => {
                at.commits += 1;
                at.last_step = Some(report.checkpoint.step);
                // Work is safe from when the trainer finished writing the
                // checkpoint (its directory's last change), not from when
                // the push got to it.
                let now = now_ms();
                let written = mtime(&dir)
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map_or(now, |d| u64::try_from(d.as_millis()).unwrap_or(now))
                    .min(now);
                at.times.last_commit_ms =
                    Some(at.times.last_commit_ms.map_or(written, |p| p.max(written)));
                det.save_committed(origin.elapsed());
                say(&format!(
                    "committed step {} from {}",
                    report.checkpoint.step,
                    dir.display()
                ));
            }
            WatchEvent::Skipped { .. } => {}
            WatchEvent::Failed { dir, step, error } => say(&format!(
                "push of {} (step {step}) failed, will retry: {error}",
                dir.display()
            )),
        }
    }
    Ok(())
}

/// A hang found by the supervision loop: what is said, whom it is
/// blamed on, what is recorded.
struct Hung {
    /// Said before the trainer is stopped.
    message: String,
    nodes: Vec<String>,
    detail: String,
    /// Whether a trainer that never sent a heartbeat failed during
    /// startup (the heartbeats are counted after the last push, whose
    /// commit counts as one).
    startup_if_no_beats: bool,
}

/// Stops a hung trainer, pushes the checkpoints it wrote, and gives the
/// attempt's outcome: failed by a hang.
#[allow(clippy::too_many_arguments)]
async fn stop_hung(
    hung: Hung,
    child: &mut Child,
    plan: &Plan,
    watcher: &mut Watcher,
    topts: &TransferOptions,
    at: &mut Attempt,
    det: &mut HangDetector,
    origin: Instant,
) -> anyhow::Result<Outcome> {
    say(&hung.message);
    stop(child, plan.grace);
    push_pass(
        watcher,
        &plan.ckpt_dir,
        plan.marker.as_deref(),
        topts,
        at,
        det,
        origin,
    )
    .await?;
    Ok(Outcome::Failed {
        cause: Cause::Hang,
        nodes: hung.nodes,
        during_startup: hung.startup_if_no_beats && det.beats() == 0,
        detail: hung.detail,
    })
}

async fn supervise(plan: &Plan, json: bool) -> anyhow::Result<Code> {
    let started = Instant::now();
    let mut at = Attempt {
        times: AttemptTimes {
            started_ms: now_ms(),
            ended_ms: 0,
            preflight_ms: 0,
            restore_ms: 0,
            stall_ms: 0,
            training_started_ms: None,
            last_commit_ms: None,
            ended: Ended::Failed,
        },
        commits: 0,
        last_step: None,
    };
    // A corrupt state file stops everything before training starts.
    let history = History::load(&plan.state)?.job(&plan.job);
    let metrics = Arc::new(Mutex::new(keel_run::metrics::Snapshot {
        job: plan.job.clone(),
        phase: "start-up",
        goodput: account(&history.attempts),
        ..Default::default()
    }));
    if let Some(addr) = plan.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| UsageError(format!("--metrics-listen {addr}: {e}")))?;
        say(&format!(
            "metrics on http://{}/metrics{}",
            listener.local_addr().map_or(addr, |a| a),
            if plan.metrics_token.is_some() {
                " (bearer token required)"
            } else {
                ""
            }
        ));
        tokio::spawn(serve_metrics(
            listener,
            metrics.clone(),
            plan.metrics_token.clone(),
        ));
    }
    std::fs::create_dir_all(&plan.ckpt_dir)
        .with_context(|| format!("cannot create {}", plan.ckpt_dir.display()))?;

    // Signals are taken from the start: a warning (`--signal=B:USR1@...`)
    // that Slurm sends during the pre-flight checks or the restore must
    // not kill keel (their default action); it is answered once the
    // trainer runs.
    let (tx, rx) = mpsc::channel::<Note>();
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        let mut usr1 = signal(SignalKind::user_defined1()).context("cannot handle SIGUSR1")?;
        let mut usr2 = signal(SignalKind::user_defined2()).context("cannot handle SIGUSR2")?;
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                let name = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = usr1.recv() => "SIGUSR1",
                    _ = usr2.recv() => "SIGUSR2",
                };
                if tx.send(Note::Signal(name)).is_err() {
                    break;
                }
            }
        });
    }

    if let Some(m) = &plan.slurm {
        mark_job(plan, m);
        let avoid = keel_run::placed_on_excluded(&history, &m.nodes, &plan.policy);
        if !avoid.is_empty() {
            // The last requeue's exclusions did not take: requeue again
            // before training there. Counted as a start-up failure, so a
            // list something keeps rewriting ends in the retry budget.
            say(&format!(
                "this attempt is on {}, which this job excludes: requeueing it again",
                avoid.join(",")
            ));
            let outcome = Outcome::Failed {
                cause: Cause::Check,
                nodes: Vec::new(),
                during_startup: true,
                detail: format!("placed on excluded node {}", avoid.join(",")),
            };
            let d = decide(&outcome, &history, &[], &plan.policy);
            return conclude(plan, &outcome, d, at, None, json);
        }
        let t = Instant::now();
        let reports = check_nodes(m);
        at.times.preflight_ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(0);
        let bad: Vec<String> = reports
            .iter()
            .filter(|r| matches!(r.verdict, keel_run::Verdict::Unhealthy { .. }))
            .map(|r| r.info.name.clone())
            .collect();
        if !bad.is_empty() {
            say(&format!(
                "pre-flight: the check failed on {}; not starting the trainer",
                bad.join(",")
            ));
            let outcome = Outcome::Failed {
                cause: Cause::Check,
                nodes: Vec::new(),
                during_startup: false,
                detail: format!("pre-flight check failed on {}", bad.join(",")),
            };
            let mut d = decide(&outcome, &history, &reports, &plan.policy);
            // A node failing its check is not the trainer failing to start.
            d.startup_failures = history.startup_failures;
            return conclude(plan, &outcome, d, at, None, json);
        }
        say(&format!("pre-flight: {} nodes passed", m.nodes.len()));
    }

    // Resume from the newest checkpoint that verifies.
    let store = crate::ckpt::open_for_writing(&plan.store)?;
    let ck = Ckpt::new(&store, &plan.run)?;
    let topts = TransferOptions::default();
    let restore_started = Instant::now();
    let latest = ck
        .latest()
        .await
        .with_context(|| format!("cannot read the checkpoints of {}", plan.run))?;
    let mut resume: Option<(PathBuf, u64)> = None;
    if latest.is_some() {
        remove_earlier_restores(&plan.restore_dir);
        let dir = plan
            .restore_dir
            .join(format!("attempt-{}", at.times.started_ms));
        let r = ck
            .pull(
                Selector::Latest,
                &dir,
                false,
                &crate::ckpt::context(),
                &topts,
            )
            .await
            .with_context(|| format!("cannot restore a checkpoint of {}", plan.run))?;
        for f in &r.fell_back_from {
            say(&format!(
                "WARNING: step {} failed verification and was not used: {}",
                f.checkpoint.step, f.error
            ));
        }
        say(&format!(
            "resuming from step {} ({})",
            r.checkpoint.step,
            r.dir.display()
        ));
        resume = Some((r.dir, r.checkpoint.step));
    } else {
        say("no checkpoint yet: starting fresh");
    }
    at.times.restore_ms = u64::try_from(restore_started.elapsed().as_millis()).unwrap_or(0);

    // Scheduled Events, on their own thread: a failure there is logged
    // and never ends training.
    if let Some(imds) = plan.imds.clone() {
        let tx = tx.clone();
        let vm = plan.vm_name.clone();
        let others = plan.job_vms.clone();
        std::thread::spawn(move || poll_imds(imds, vm, others, tx));
    }
    if let Some(imds) = plan.aws_imds.clone() {
        let tx = tx.clone();
        std::thread::spawn(move || poll_aws(&imds, &tx));
    }
    if let Some(md) = plan.gcp_metadata.clone() {
        let tx = tx.clone();
        std::thread::spawn(move || poll_gcp(&md, &tx));
    }

    // A request left by an earlier attempt is not this attempt's.
    match std::fs::remove_file(&plan.request_file) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "cannot remove the old checkpoint request {}",
                plan.request_file.display()
            )))
        }
    }
    let mut cmd = Command::new(&plan.command[0]);
    cmd.args(&plan.command[1..])
        .env("KEEL_CKPT_DIR", &plan.ckpt_dir)
        .env("KEEL_CKPT_REQUEST", &plan.request_file)
        .env_remove("KEEL_RESUME_DIR")
        .env_remove("KEEL_RESUME_STEP")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    if let Some((dir, step)) = &resume {
        cmd.env("KEEL_RESUME_DIR", dir)
            .env("KEEL_RESUME_STEP", step.to_string());
    }
    if let Some(f) = &plan.heartbeat_file {
        cmd.env("KEEL_HEARTBEAT_FILE", f);
    }
    if let Some(d) = &plan.heartbeat_dir {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
        cmd.env("KEEL_HEARTBEAT_DIR", d);
    }
    let mut child = cmd.spawn().map_err(|e| {
        let shown: String = plan.command[0].chars().take(200).collect();
        UsageError(format!("cannot start the trainer {shown:?}: {e}"))
    })?;
    at.times.training_started_ms = Some(now_ms());
    if let Some(out) = child.stdout.take() {
        let tx = tx.clone();
        let pattern = plan.heartbeat_pattern.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = Vec::new();
            while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                let _ = std::io::stdout().lock().write_all(&line);
                if let Some(p) = &pattern {
                    if keel_run::hang::line_is_heartbeat(&String::from_utf8_lossy(&line), p) {
                        let _ = tx.send(Note::Heartbeat);
                    }
                }
                line.clear();
            }
        });
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(err);
            let mut line = Vec::new();
            while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                let _ = std::io::stderr().lock().write_all(&line);
                if let Some(node) = srun_failed_node(&String::from_utf8_lossy(&line)) {
                    let _ = tx.send(Note::TaskFailed(node));
                }
                line.clear();
            }
        });
    }
    drop(tx);
    let mut failed_nodes: Vec<String> = Vec::new();

    let origin = started;
    let mut det = HangDetector::new(plan.hang, origin.elapsed());
    let mut watcher = Watcher::new(
        ck,
        &plan.ckpt_dir,
        plan.marker.clone(),
        format!("keel-run-{}", crate::ckpt::hostname()),
    );
    let mut heartbeat_mtime = plan.heartbeat_file.as_deref().and_then(mtime);
    // Per node (or rank) of --heartbeat-dir: its last mtime and detector.
    let mut per_name: std::collections::BTreeMap<String, (SystemTime, HangDetector)> =
        std::collections::BTreeMap::new();
    let mut commits_seen = 0u64;
    let mut last_commit: Option<Duration> = None;
    let mut next_pass = Instant::now();
    // Set when asked to checkpoint now: the deadline, the commits seen
    // when asked, and the event to acknowledge.
    let mut draining: Option<Draining> = None;
    // Slurm's KillWait, read once: what a SIGTERM leaves before SIGKILL.
    let kill_wait = plan
        .slurm
        .as_ref()
        .and_then(|m| match m.client.kill_wait() {
            Ok(k) => Some(k),
            Err(e) => {
                say(&format!(
                    "cannot read Slurm's KillWait ({e}); a stop waits what was configured"
                ));
                None
            }
        });
    let mut cancelled = false;
    let outcome;
    loop {
        if cancelled {
            // Slurm's SIGKILL follows its SIGTERM by KillWait.
            stop(&mut child, stop_plan(plan, kill_wait).grace);
            outcome = Outcome::Cancelled;
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            // A last pass pushes what the trainer wrote before it exited.
            push_pass(
                &mut watcher,
                &plan.ckpt_dir,
                plan.marker.as_deref(),
                &topts,
                &mut at,
                &mut det,
                origin,
            )
            .await?;
            // srun's last lines name the nodes whose tasks failed.
            std::thread::sleep(Duration::from_millis(200));
            while let Ok(note) = rx.try_recv() {
                if let Note::TaskFailed(node) = note {
                    if !failed_nodes.contains(&node) {
                        failed_nodes.push(node);
                    }
                }
            }
            outcome = if draining.is_some() {
                Outcome::Preempted
            } else if status.success() {
                Outcome::Completed
            } else {
                Outcome::Failed {
                    cause: Cause::Crash,
                    nodes: blame(plan, &failed_nodes),
                    during_startup: det.beats() == 0 && at.commits == 0,
                    detail: describe(status),
                }
            };
            break;
        }
        while let Ok(note) = rx.try_recv() {
            match note {
                Note::Heartbeat => det.beat(origin.elapsed()),
                Note::Tick => {}
                Note::TaskFailed(node) => {
                    if !failed_nodes.contains(&node) {
                        failed_nodes.push(node);
                    }
                }
                Note::Signal(name) => {
                    if cancelled_by_user(plan) {
                        say(&format!(
                            "{name}: the job was cancelled; stopping the trainer without a checkpoint"
                        ));
                        cancelled = true;
                    } else if draining.is_none() {
                        let left = slurm_until_kill(plan, name == "SIGTERM", kill_wait);
                        let waits = stop_plan(plan, left);
                        say(&format!(
                            "{name}: asking the trainer to checkpoint now (waiting up to {:.1} s for the commit, {:.1} s to stop{})",
                            waits.checkpoint_deadline.as_secs_f64(),
                            waits.grace.as_secs_f64(),
                            left.map_or(String::new(), |l| format!(
                                "; Slurm kills the job in {:.0} s",
                                l.as_secs_f64()
                            ))
                        ));
                        request_checkpoint(plan, &child, name);
                        draining = Some(Draining {
                            deadline: Instant::now() + waits.checkpoint_deadline,
                            grace: waits.grace,
                            commits_then: at.commits,
                            event: None,
                        });
                    }
                }
                Note::Evict {
                    id,
                    kind,
                    notice,
                    resources,
                    job_vms,
                } => {
                    if draining.is_none() {
                        // The event's NotBefore caps every wait (when it
                        // is in the future).
                        let waits = stop_plan(plan, (!notice.is_zero()).then_some(notice));
                        let on = if resources.is_empty() {
                            String::new()
                        } else {
                            format!(" for {}", resources.join(","))
                        };
                        say(&format!(
                            "scheduled event {kind} ({id}){on}, {:.0} s notice: asking the trainer to checkpoint now",
                            notice.as_secs_f64()
                        ));
                        request_checkpoint(plan, &child, &kind);
                        draining = Some(Draining {
                            deadline: Instant::now() + waits.checkpoint_deadline,
                            grace: waits.grace,
                            commits_then: at.commits,
                            event: Some((id, resources, job_vms)),
                        });
                    }
                }
            }
        }
        if let Some(f) = &plan.heartbeat_file {
            let m = mtime(f);
            if m.is_some() && m != heartbeat_mtime {
                heartbeat_mtime = m;
                det.beat(origin.elapsed());
            }
        }
        if let Some(d) = &plan.heartbeat_dir {
            let now = origin.elapsed();
            for (name, m) in heartbeat_files(d) {
                let room = per_name.len() < 4096;
                match per_name.get_mut(&name) {
                    Some((last, nd)) if *last != m => {
                        *last = m;
                        nd.beat(now);
                        det.beat(now);
                    }
                    Some(_) => {}
                    None if room => {
                        let mut nd = HangDetector::new(plan.hang, now);
                        nd.beat(now);
                        per_name.insert(name, (m, nd));
                        det.beat(now);
                    }
                    None => {}
                }
            }
            // The nodes' own detectors know nothing of saves: they are
            // not checked during one, nor for one timeout after a commit.
            if at.commits > commits_seen {
                last_commit = Some(now);
            }
            commits_seen = at.commits;
        }
        if Instant::now() >= next_pass {
            let before = Instant::now();
            push_pass(
                &mut watcher,
                &plan.ckpt_dir,
                plan.marker.as_deref(),
                &topts,
                &mut at,
                &mut det,
                origin,
            )
            .await?;
            if draining.is_some() {
                at.times.stall_ms += u64::try_from(before.elapsed().as_millis()).unwrap_or(0);
            }
            next_pass = Instant::now() + plan.watch_interval;
        }
        if let Some(Draining {
            deadline,
            grace,
            commits_then,
            event,
        }) = &draining
        {
            let committed = at.commits > *commits_then;
            if committed || Instant::now() >= *deadline {
                if committed {
                    say("the checkpoint is committed; stopping the trainer");
                } else {
                    say("WARNING: no checkpoint was committed before the deadline; stopping the trainer");
                }
                stop(&mut child, *grace);
                push_pass(
                    &mut watcher,
                    &plan.ckpt_dir,
                    plan.marker.as_deref(),
                    &topts,
                    &mut at,
                    &mut det,
                    origin,
                )
                .await?;
                if let (Some((id, resources, job_vms)), Some(imds)) = (event, &plan.imds) {
                    if plan.imds_ack {
                        let e = keel_run::events::Event {
                            id: id.clone(),
                            kind: keel_run::events::EventType::Other(String::new()),
                            resources: resources.clone(),
                            status: String::new(),
                            not_before: None,
                            duration: None,
                            source: String::new(),
                        };
                        match keel_run::events::ack(&e, job_vms, at.commits > *commits_then) {
                            keel_run::events::Ack::Yes => match imds.acknowledge(&[id]) {
                                Ok(()) => say(&format!("acknowledged scheduled event {id}")),
                                Err(e) => say(&format!("cannot acknowledge event {id}: {e}")),
                            },
                            keel_run::events::Ack::NotCommitted => say(&format!(
                                "scheduled event {id} not acknowledged: no checkpoint was committed"
                            )),
                            keel_run::events::Ack::Foreign(vms) => say(&format!(
                                "scheduled event {id} not acknowledged: it names {}, outside this job",
                                vms.join(",")
                            )),
                        }
                    }
                }
                outcome = Outcome::Preempted;
                break;
            }
        } else if let Some((names, silent_for, timeout)) = (det.phase()
            == keel_run::Phase::Training
            && last_commit.is_none_or(|c| origin.elapsed() > c + det.training_timeout()))
        .then(|| stopped_names(&per_name, origin.elapsed()))
        .flatten()
        {
            let hung = Hung {
                message: format!(
                    "no heartbeat from {} for {:.1} s (timeout {:.1} s) while others report: hung; stopping the trainer",
                    names.join(","),
                    silent_for.as_secs_f64(),
                    timeout.as_secs_f64()
                ),
                nodes: if plan.slurm.is_some() {
                    names.clone()
                } else {
                    blame(plan, &failed_nodes)
                },
                detail: format!(
                    "no heartbeat from {} for {:.0} s",
                    names.join(","),
                    silent_for.as_secs_f64()
                ),
                startup_if_no_beats: false,
            };
            outcome = stop_hung(
                hung,
                &mut child,
                plan,
                &mut watcher,
                &topts,
                &mut at,
                &mut det,
                origin,
            )
            .await?;
            break;
        } else if let HangStatus::Hung {
            phase,
            silent_for,
            timeout,
        } = det.check(origin.elapsed())
        {
            let hung = Hung {
                message: format!(
                    "no heartbeat for {:.1} s during {} (timeout {:.1} s): the trainer is hung; stopping it",
                    silent_for.as_secs_f64(),
                    phase.as_str(),
                    timeout.as_secs_f64()
                ),
                nodes: blame(plan, &failed_nodes),
                detail: format!("no heartbeat for {:.0} s", silent_for.as_secs_f64()),
                startup_if_no_beats: true,
            };
            outcome = stop_hung(
                hung,
                &mut child,
                plan,
                &mut watcher,
                &topts,
                &mut at,
                &mut det,
                origin,
            )
            .await?;
            break;
        }
        {
            let now = origin.elapsed();
            let mut m = metrics.lock().unwrap_or_else(|e| e.into_inner());
            m.phase = if draining.is_some() {
                "draining"
            } else {
                det.phase().as_str()
            };
            m.heartbeats = det.beats();
            m.commits = at.commits;
            m.last_commit_step = at.last_step;
            m.resumed_step = resume.as_ref().map(|r| r.1);
            m.hang_timeout_s = det.timeout().as_secs_f64();
            m.silent_s = now.saturating_sub(det.last()).as_secs_f64();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut outcome = outcome;
    let mut reports = Vec::new();
    if let Some(m) = &plan.slurm {
        // A user's scancel ends the steps (the trainer fails) and marks
        // the job cancelled: never requeued.
        let ended_early = matches!(outcome, Outcome::Failed { .. } | Outcome::Preempted);
        if ended_early && cancelled_by_user(plan) {
            say("the job was cancelled (Slurm is ending it); it is not requeued");
            outcome = Outcome::Cancelled;
        } else if matches!(outcome, Outcome::Failed { .. }) {
            reports = check_nodes(m);
            for r in reports.iter().filter(|r| r.unreachable()) {
                say(&format!(
                    "node {} is {} in Slurm: recorded as not responding and excluded; its state is left alone",
                    r.info.name,
                    slurm_state(&r.info)
                ));
            }
        }
    }
    let d = decide(&outcome, &history, &reports, &plan.policy);
    conclude(plan, &outcome, d, at, resume.map(|r| r.1), json)
}

/// Records the attempt, carries out the decision and picks the exit code.
fn conclude(
    plan: &Plan,
    outcome: &Outcome,
    d: keel_run::Decision,
    mut at: Attempt,
    resumed: Option<u64>,
    json: bool,
) -> anyhow::Result<Code> {
    at.times.ended_ms = now_ms();
    at.times.ended = match outcome {
        Outcome::Completed => Ended::Completed,
        Outcome::Cancelled => Ended::Cancelled,
        Outcome::Preempted => Ended::Preempted,
        Outcome::Failed { .. } => Ended::Failed,
    };
    let times = at.times.clone();
    let job = plan.job.clone();
    let record = d.record.clone();
    let startup_failures = d.startup_failures;
    History::update(&plan.state, move |h| {
        let j = h.jobs.entry(job).or_default();
        for (n, c) in &record {
            j.record_failure(n, *c);
        }
        j.startup_failures = startup_failures;
        j.attempts.push(times);
    })?;
    let (mut code, mut what) = match (outcome, &d.next) {
        (_, Next::Done) => (Code::Ok, "completed".to_owned()),
        (_, Next::Stop { reason }) => (Code::Stop, reason.clone()),
        (Outcome::Preempted, Next::Requeue) => (
            Code::Requeue,
            "preempted: requeue to resume from the committed checkpoint".to_owned(),
        ),
        (Outcome::Failed { detail, .. }, Next::Requeue) => (
            Code::Failed,
            format!("failed ({detail}); requeue to resume"),
        ),
        (_, Next::Requeue) => (Code::Requeue, "requeue".to_owned()),
    };
    if let Some(m) = &plan.slurm {
        for (node, reason) in &d.drain {
            match m.client.drain(node, reason) {
                Ok(()) => say(&format!("drained {node}: {reason}")),
                Err(e) => say(&format!("cannot drain {node}: {e}")),
            }
        }
        if d.next == Next::Requeue {
            let job = std::env::var("SLURM_JOB_ID").unwrap_or_else(|_| plan.job.clone());
            let shown = if d.exclude.is_empty() {
                "no node".to_owned()
            } else {
                d.exclude.join(",")
            };
            match m.client.requeue(&job, &d.exclude) {
                Ok(kept) => {
                    // What Slurm stored: the new exclusions and the
                    // user's own `--exclude`.
                    let stored = if kept.is_empty() {
                        "none".to_owned()
                    } else {
                        kept.join(",")
                    };
                    what = format!(
                        "{what}; requeued job {job} excluding {shown} (its ExcNodeList: {stored})"
                    );
                    code = Code::Requeue;
                }
                Err(e @ keel_slurm::SlurmError::NotExcluded { .. }) => {
                    // Requeued all the same: the next attempt finds itself
                    // on the node and requeues again (placed_on_excluded).
                    what = format!("{what}; WARNING: {e}");
                    code = Code::Requeue;
                }
                Err(e) => what = format!("{what}; cannot requeue job {job}: {e}"),
            }
        }
    }
    say(&what);
    if json {
        let body = serde_json::json!({
            "version": 1,
            "command": "run",
            "job": plan.job,
            "outcome": at.times.ended,
            "result": what,
            "exit_code": code as u8,
            "resumed_from_step": resumed,
            "commits": at.commits,
            "exclude": d.exclude,
            "drained": d.drain.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        });
        let _ = writeln!(std::io::stdout().lock(), "{body}");
    }
    Ok(code)
}

/// Runs the health check on every node of the allocation (one task per
/// node) and reads each node from Slurm afterwards: a node drained with
/// keel's prefix failed its check, and one Slurm reports down or not
/// responding is a suspect the check could not reach (decided in
/// [`keel_run::decide`]). A check that cannot run changes nothing (fail
/// open).
fn check_nodes(m: &SlurmMode) -> Vec<keel_run::NodeReport> {
    let n = m.nodes.len().to_string();
    let mut cmd = Command::new("srun");
    cmd.args(["--nodes", &n, "--ntasks", &n, "--ntasks-per-node=1"])
        .args(["--kill-on-bad-exit=0", "--job-name=keel-check"])
        .args(&m.check)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    match cmd.spawn() {
        Ok(mut c) => {
            let until = Instant::now() + m.check_timeout;
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    _ => {
                        say("the node checks did not finish in time; stopping them");
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
        Err(e) => say(&format!("cannot run the node checks with srun: {e}")),
    }
    let policy = keel_slurm::Policy::default();
    let mut reports = Vec::new();
    for node in &m.nodes {
        match m.client.node(node) {
            Ok(info) => {
                let verdict = match info.reason.as_deref() {
                    Some(r) if info.is_drained() && policy.owns(r) => {
                        keel_run::Verdict::Unhealthy {
                            reason: r.to_owned(),
                        }
                    }
                    _ => keel_run::Verdict::Healthy { passed: Vec::new() },
                };
                reports.push(keel_run::NodeReport { info, verdict });
            }
            Err(e) => say(&format!("cannot read node {node} from Slurm: {e}")),
        }
    }
    reports
}

/// A node's state as Slurm's long form writes it: `down`,
/// `allocated+not_responding`.
fn slurm_state(info: &keel_slurm::NodeInfo) -> String {
    if info.flags.not_responding {
        format!("{}+not_responding", info.state)
    } else {
        info.state.to_string()
    }
}

/// The files of a heartbeat directory (names of at most 64 characters)
/// with their mtimes.
fn heartbeat_files(dir: &Path) -> Vec<(String, SystemTime)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            if name.starts_with('.') || name.len() > 64 {
                return None;
            }
            let m = e.metadata().ok()?;
            (m.is_file()).then_some(())?;
            Some((name, m.modified().ok()?))
        })
        .collect()
}

/// The nodes (or ranks) that stopped while another still reports: each is
/// silent past its own timeout. When all are silent, nobody is singled
/// out (the job-wide detector reports that hang).
fn stopped_names(
    per_name: &std::collections::BTreeMap<String, (SystemTime, HangDetector)>,
    now: Duration,
) -> Option<(Vec<String>, Duration, Duration)> {
    let mut hung = Vec::new();
    let mut worst = (Duration::ZERO, Duration::ZERO);
    for (name, (_, d)) in per_name {
        if let HangStatus::Hung {
            silent_for,
            timeout,
            ..
        } = d.check(now)
        {
            hung.push(name.clone());
            if silent_for > worst.0 {
                worst = (silent_for, timeout);
            }
        }
    }
    (!hung.is_empty() && hung.len() < per_name.len()).then_some((hung, worst.0, worst.1))
}

/// Removes the checkpoints earlier attempts restored (`attempt-<ms>`
/// directories keel made under the restore directory, and their hidden
/// partial siblings); nothing else there is touched.
fn remove_earlier_restores(root: &Path) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let bare = name.trim_start_matches('.');
        let ours = bare.strip_prefix("attempt-").is_some_and(|rest| {
            rest.split('.')
                .next()
                .is_some_and(|ms| !ms.is_empty() && ms.bytes().all(|b| b.is_ascii_digit()))
        });
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if ours && is_dir {
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                say(&format!("cannot remove {}: {err}", e.path().display()));
            }
        }
    }
}

type MetricsBody = http_body_util::Full<bytes::Bytes>;

/// The answer to one request to the metrics endpoint: `GET /metrics`
/// (with the bearer token when one is configured), else 401, 405 or 404.
fn metrics_answer(
    req: &http::Request<hyper::body::Incoming>,
    m: &Mutex<keel_run::metrics::Snapshot>,
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
    let mut r = reply(StatusCode::OK, keel_run::metrics::render(&snap));
    r.extensions_mut().insert(keel_http::Authenticated);
    r
}

/// Serves the metrics until the process ends, through keel-http's
/// hardened loop: 16 connections at once, 4 from one client (a quarter of
/// the places kept for scrapers with the token), a request head of at
/// most 8 KiB within 5 s, a write that makes no progress for 10 s and a
/// connection older than 30 s ended.
async fn serve_metrics(
    listener: tokio::net::TcpListener,
    m: Arc<Mutex<keel_run::metrics::Snapshot>>,
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
        say(&format!("warning: the metrics endpoint stopped: {e}"));
    }
}

/// Adds keel run's marker to the job's Comment, so that Slurm accounting
/// (with `AccountingStoreFlags=job_comment`) records the job as run under
/// keel run: `keel cost` counts such jobs as requeue-safe. A job that
/// cannot be marked is still run; the warning says what keel cost will
/// miss.
fn mark_job(plan: &Plan, m: &SlurmMode) {
    let job = std::env::var("SLURM_JOB_ID").unwrap_or_else(|_| plan.job.clone());
    match m.client.mark_job(&job, keel_slurm::RUN_MARKER) {
        Ok(true) => say(&format!(
            "marked job {job} as run under keel run (`{}` in its Comment)",
            keel_slurm::RUN_MARKER
        )),
        // Marked before this attempt: a requeued job.
        Ok(false) => {}
        Err(e) => say(&format!(
            "warning: cannot add `{}` to job {job}'s Comment ({e}); keel cost will not know it ran under keel run",
            keel_slurm::RUN_MARKER
        )),
    }
}

/// Under Slurm, whether Slurm is already ending the job (`COMPLETING` or
/// `CANCELLED` while its batch script still runs): a user's `scancel`, or
/// a preemption Slurm carries out itself. keel neither checkpoints nor
/// requeues such a job; a preemption in `PreemptMode=REQUEUE` is requeued
/// by Slurm. (Slurm's warning signal, `--signal=B:USR1@...`, and
/// `scancel --batch --signal=TERM` leave the job running, and the time
/// limit's kill is `COMPLETING` with reason `TimeLimit`: those are
/// checkpointed and requeued.)
fn cancelled_by_user(plan: &Plan) -> bool {
    let Some(m) = &plan.slurm else {
        return false;
    };
    let job = std::env::var("SLURM_JOB_ID").unwrap_or_else(|_| plan.job.clone());
    matches!(m.client.job_state(&job), Ok(Some(s)) if s.cancelled())
}

/// The nodes a failure is recorded against: under Slurm those srun named
/// (`srun: error: n2: task 1: Exited with exit code 1`), else this host.
fn blame(plan: &Plan, failed: &[String]) -> Vec<String> {
    if plan.slurm.is_some() {
        failed.to_vec()
    } else {
        vec![crate::ckpt::hostname()]
    }
}

/// The node of a line where srun reports a failed task.
fn srun_failed_node(line: &str) -> Option<String> {
    let rest = line.trim().strip_prefix("srun: error: ")?;
    let (node, rest) = rest.split_once(": ")?;
    let failed = rest.starts_with("task")
        && (rest.contains("Exited with exit code")
            || rest.contains("Killed")
            || rest.contains("Terminated"));
    (failed && keel_slurm::check_node_name(node).is_ok()).then(|| node.to_owned())
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "ended".to_owned(),
    }
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Asks `notice` every `every` until it names an eviction or the
/// supervisor goes away; an error is logged once (`what`) and never ends
/// training.
fn poll_notice(
    what: &str,
    every: Duration,
    tx: &mpsc::Sender<Note>,
    mut notice: impl FnMut() -> Result<Option<Note>, keel_run::events::EventsError>,
) {
    let mut failing = false;
    loop {
        match notice() {
            Ok(Some(evict)) => {
                let _ = tx.send(evict);
                return;
            }
            Ok(None) => failing = false,
            Err(e) => {
                if !failing {
                    say(&format!("{what}: {e}; training continues"));
                    failing = true;
                }
            }
        }
        std::thread::sleep(every);
        if tx.send(Note::Tick).is_err() {
            return;
        }
    }
}

/// AWS's Spot interruption notice, asked every 2 s.
fn poll_aws(imds: &Imds, tx: &mpsc::Sender<Note>) {
    poll_notice("AWS Spot notice", Duration::from_secs(2), tx, || {
        Ok(imds.aws_instance_action()?.map(|n| Note::Evict {
            resources: Vec::new(),
            job_vms: Vec::new(),
            id: format!("aws-spot-{}", n.action),
            kind: format!("AWS Spot {}", n.action),
            notice: n
                .time
                .and_then(|t| t.duration_since(SystemTime::now()).ok())
                .unwrap_or(Duration::ZERO),
        }))
    });
}

/// GCP's preemption flag, asked every second. GCP powers the VM off 30 s
/// after it is set.
fn poll_gcp(md: &Imds, tx: &mpsc::Sender<Note>) {
    poll_notice("GCP preemption flag", Duration::from_secs(1), tx, || {
        Ok(md.gcp_preempted()?.then(|| Note::Evict {
            resources: Vec::new(),
            job_vms: Vec::new(),
            id: "gcp-preempted".to_owned(),
            kind: "GCP preemption".to_owned(),
            notice: Duration::from_secs(30),
        }))
    });
}

/// Polls Scheduled Events once a second until the supervisor goes away.
fn poll_imds(imds: Imds, vm: Option<String>, others: Vec<String>, tx: mpsc::Sender<Note>) {
    let mut warned = false;
    let vm = loop {
        match vm.clone().map(Ok).unwrap_or_else(|| imds.vm_name()) {
            Ok(v) => break v,
            Err(e) => {
                if !warned {
                    say(&format!(
                        "Scheduled Events: cannot learn this VM's name: {e}; retrying"
                    ));
                    warned = true;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    };
    let mut job_vms = others;
    if !job_vms.iter().any(|v| v.eq_ignore_ascii_case(&vm)) {
        job_vms.push(vm.clone());
    }
    let mut poller = Poller::new(imds, &job_vms);
    let mut failing = false;
    loop {
        match poller.poll() {
            Ok(events) => {
                if failing {
                    say("Scheduled Events: IMDS answers again");
                    failing = false;
                }
                for e in events {
                    if e.kind.ends_training() {
                        let note = Note::Evict {
                            resources: e.resources.clone(),
                            job_vms: job_vms.clone(),
                            id: e.id.clone(),
                            kind: e.kind.as_str().to_owned(),
                            notice: e.notice(SystemTime::now()),
                        };
                        if tx.send(note).is_err() {
                            return;
                        }
                    } else {
                        say(&format!(
                            "scheduled event {} ({}) for this VM: training continues",
                            e.kind.as_str(),
                            e.id
                        ));
                    }
                }
            }
            Err(e) => {
                if !failing {
                    say(&format!("Scheduled Events: {e}; training continues"));
                    failing = true;
                }
            }
        }
        std::thread::sleep(Duration::from_secs(1));
        // The supervisor is gone when nobody listens.
        if tx.send(Note::Tick).is_err() {
            return;
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn srun_failure_lines_name_the_node() {
        assert_eq!(
            srun_failed_node("srun: error: n2: task 1: Exited with exit code 1\n"),
            Some("n2".to_owned())
        );
        assert_eq!(
            srun_failed_node("srun: error: gpu-07: tasks 8-15: Killed"),
            Some("gpu-07".to_owned())
        );
        assert_eq!(
            srun_failed_node("srun: error: Timed out waiting for job step"),
            None
        );
        assert_eq!(srun_failed_node("step 3 loss 0.1"), None);
    }
}
