//! The supervisor of one attempt of a training job (`keel run`): starts
//! the trainer in a process group of its own, watches its heartbeats,
//! pushes the checkpoints it writes, asks it to checkpoint on a signal or
//! an eviction notice and stops it, and afterwards records the attempt and
//! carries out the decision ([`crate::decide`]): drain, requeue with
//! exclusions, stop.
//!
//! This is the I/O shell around the pure modules of this crate: it
//! launches processes, sends signals, runs the pre-flight checks with
//! srun, talks to Slurm, to the checkpoint store and to the metadata
//! services, and serves the metrics endpoint. What it says goes through a
//! [`Console`] and wall-clock time comes from a [`Clock`], both given by
//! the caller; it reads no environment variable (the caller puts the Slurm
//! job's id and the host name in the [`Plan`]).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel_ckpt::watch::{WatchEvent, Watcher};
use keel_ckpt::{Ckpt, Selector};
use keel_store::TransferOptions;
use keel_time::{Clock, Monotonic};
pub use rustix::process::Signal;

mod endpoint;
mod launch;
mod notices;
mod slurm;

impl keel_error::HasKind for SuperviseError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Usage(_) => K::Usage,
            Self::State(h) => keel_error::HasKind::kind(h),
            Self::Ckpt(c) | Self::Checkpoints { source: c, .. } => keel_error::HasKind::kind(&**c),
            Self::Io { .. } | Self::Signal(_) => K::Io,
        }
    }
}

#[cfg(test)]
mod tests;

pub use launch::{Launch, Launcher, ProcessLauncher, Trainer};

use endpoint::serve_metrics;
use notices::{poll_aws, poll_gcp, poll_imds};
use slurm::{
    cancelled_by_user, check_nodes, mark_job, slurm_state, slurm_until_kill, srun_failed_node,
};

use crate::decide::Next;
use crate::events::{Imds, Poller};
use crate::goodput::Ended;
use crate::{
    account, decide, AttemptTimes, Cause, HangConfig, HangDetector, HangStatus, History,
    HistoryError, Outcome, RunPolicy,
};

/// Everything an attempt needs, validated.
pub struct Plan {
    /// The checkpoint store (opened by the caller, with its credentials).
    pub store: keel_store::Store,
    pub run: String,
    pub ckpt_dir: PathBuf,
    pub restore_dir: PathBuf,
    pub state: PathBuf,
    pub marker: Option<String>,
    pub heartbeat_file: Option<PathBuf>,
    pub heartbeat_dir: Option<PathBuf>,
    pub heartbeat_pattern: Option<String>,
    pub hang: HangConfig,
    pub grace: Duration,
    pub checkpoint_signal: Option<Signal>,
    /// Where a checkpoint request is written (KEEL_CKPT_REQUEST).
    pub request_file: PathBuf,
    pub checkpoint_deadline: Duration,
    pub stop_reserve: Duration,
    pub watch_interval: Duration,
    pub imds: Option<Imds>,
    pub aws_imds: Option<Imds>,
    pub gcp_metadata: Option<Imds>,
    pub vm_name: Option<String>,
    /// The other VMs of the job (beside this one).
    pub job_vms: Vec<String>,
    pub imds_ack: bool,
    pub job: String,
    /// The Slurm job's id (`SLURM_JOB_ID`), when running inside one: what
    /// Slurm is asked about and requeues (`job` may be named otherwise).
    pub slurm_job: Option<String>,
    /// This machine's name: the checkpoint writer's host, and whom a
    /// failure is recorded against outside Slurm.
    pub host: String,
    pub policy: RunPolicy,
    pub command: Vec<String>,
    pub slurm: Option<SlurmMode>,
    pub metrics_listen: Option<std::net::SocketAddr>,
    pub metrics_token: Option<keel_http::TokenHash>,
}

/// What Slurm mode needs.
#[derive(Debug)]
pub struct SlurmMode {
    pub client: keel_slurm::Slurm,
    pub nodes: Vec<String>,
    pub check: Vec<String>,
    pub check_timeout: Duration,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("run", &self.run)
            .field("job", &self.job)
            .field("ckpt_dir", &self.ckpt_dir)
            .field("command", &self.command)
            .finish_non_exhaustive()
    }
}

impl Plan {
    /// The job Slurm is asked about: `SLURM_JOB_ID`, else the job's name.
    fn slurm_job_id(&self) -> String {
        self.slurm_job.clone().unwrap_or_else(|| self.job.clone())
    }
}

/// Where the supervisor's words and the trainer's output go.
pub trait Console: Send + Sync {
    /// One line about what the supervisor sees or does.
    fn say(&self, msg: &str);
    /// A line the trainer wrote to its standard output (with its newline).
    fn trainer_stdout(&self, line: &[u8]);
    /// A line the trainer wrote to its standard error (with its newline).
    fn trainer_stderr(&self, line: &[u8]);
}

/// How an attempt ended for the job: what its batch script should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The trainer completed.
    Done,
    /// Requeue the job (it was requeued under Slurm, or should be).
    Requeue,
    /// The attempt failed; another attempt may get past it, but the job
    /// could not be requeued here.
    Failed,
    /// Do not requeue (the start-up retry budget is spent).
    Stop,
}

/// What an attempt came to, and what was done about it.
#[derive(Debug, Clone)]
pub struct Conclusion {
    pub job: String,
    pub outcome: Ended,
    /// In words: what happened and what was done.
    pub result: String,
    pub ending: Ending,
    pub resumed_from_step: Option<u64>,
    /// Checkpoints committed during the attempt.
    pub commits: u64,
    /// Nodes the requeued job excludes.
    pub exclude: Vec<String>,
    /// Nodes drained.
    pub drained: Vec<String>,
}

/// Why an attempt could not be supervised to its end.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// Something the user gave cannot be used (a listen address, a
    /// command that does not start).
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    State(#[from] HistoryError),
    #[error("cannot {what} {run}")]
    Checkpoints {
        what: &'static str,
        run: String,
        #[source]
        source: Box<keel_ckpt::CkptError>,
    },
    #[error(transparent)]
    Ckpt(Box<keel_ckpt::CkptError>),
    #[error("cannot {op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot handle signals")]
    Signal(#[source] std::io::Error),
}

impl From<keel_ckpt::CkptError> for SuperviseError {
    fn from(e: keel_ckpt::CkptError) -> Self {
        SuperviseError::Ckpt(Box::new(e))
    }
}

impl SuperviseError {
    fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |source| SuperviseError::Io {
            op,
            path: path.to_owned(),
            source,
        }
    }
}

/// The supervisor's console and clock, handed to its helpers and threads.
#[derive(Clone)]
struct Shell {
    out: Arc<dyn Console>,
    clock: Arc<dyn Clock>,
    /// Durations, deadlines and every wait.
    mono: Arc<dyn Monotonic>,
}

impl Shell {
    /// The monotonic clock's now.
    fn instant(&self) -> Instant {
        self.mono.now()
    }

    /// Since `t` on the monotonic clock.
    fn since(&self, t: Instant) -> Duration {
        self.mono.now().saturating_duration_since(t)
    }

    /// Waits `d` on the monotonic clock (a blocking sleep).
    fn sleep(&self, d: Duration) {
        std::thread::sleep(self.mono.wait(d));
    }

    fn say(&self, msg: &str) {
        self.out.say(msg);
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    fn now(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.clock.now_ms())
    }

    /// Who writes a checkpoint push, and when.
    fn ckpt_context(&self, host: &str) -> keel_ckpt::Context {
        use std::hash::{BuildHasher, Hasher};
        let now = self.clock.now_us();
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(now);
        h.write_u32(std::process::id());
        keel_ckpt::Context {
            now_unix: i64::try_from(now / 1_000_000).unwrap_or(i64::MAX),
            host: host.to_owned(),
            nonce: h.finish(),
        }
    }
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

/// The checkpoint request file's name in the checkpoint directory.
pub const REQUEST_FILE: &str = ".keel-checkpoint-request";

/// Asks the trainer for a checkpoint now: writes a new request into the
/// request file (atomically: a trainer reads either the last request or
/// this one), then sends the checkpoint signal when one is configured.
/// The file reaches every rank under any launcher (torchrun's agent
/// forwards no signal without shutting its workers down); a trainer reads
/// it at a step boundary and saves when its content changed.
fn request_checkpoint(sh: &Shell, plan: &Plan, child: &dyn Trainer, why: &str) {
    let body = format!("{} {why}\n", sh.now_ms());
    if let Err(e) = keel_fs::write_atomic(&plan.request_file, body.as_bytes(), 0o644) {
        sh.say(&format!(
            "cannot write the checkpoint request {}: {e}",
            plan.request_file.display()
        ));
    }
    if let Some(sig) = plan.checkpoint_signal {
        child.signal(sig);
    }
}

/// SIGTERM to the trainer's process group, SIGKILL after the grace.
fn stop(sh: &Shell, child: &mut dyn Trainer, grace: Duration) -> Option<std::process::ExitStatus> {
    if let Some(s) = child.try_wait() {
        return Some(s);
    }
    child.signal(Signal::TERM);
    let until = sh.instant() + grace;
    while sh.instant() < until {
        if let Some(s) = child.try_wait() {
            return Some(s);
        }
        sh.sleep(Duration::from_millis(50));
    }
    sh.say("the trainer ignored SIGTERM; sending SIGKILL");
    child.signal(Signal::KILL);
    child.wait()
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

/// The waits of a stop with `left` before the kill, saying so when they
/// had to be shortened.
fn stop_plan(sh: &Shell, plan: &Plan, left: Option<Duration>) -> crate::budget::StopPlan {
    let p = crate::budget::plan_stop(
        left,
        crate::budget::StopConfig {
            checkpoint_deadline: plan.checkpoint_deadline,
            grace: plan.grace,
            reserve: plan.stop_reserve,
        },
    );
    if p.shortened {
        sh.say(&format!(
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
    sh: &Shell,
    host: &str,
    watcher: &mut Watcher,
    watcher_root: &Path,
    marker: Option<&str>,
    topts: &TransferOptions,
    at: &mut Attempt,
    det: &mut HangDetector,
    origin: Instant,
) -> Result<(), SuperviseError> {
    let events = match watcher.pass(&sh.ckpt_context(host), topts).await {
        Ok(e) => e,
        Err(e @ keel_ckpt::CkptError::Fenced { .. }) => {
            return Err(SuperviseError::Ckpt(Box::new(e)))
        }
        Err(e) => {
            sh.say(&format!("checkpoint watcher: {e:#}; retrying"));
            return Ok(());
        }
    };
    let saving = saving_now(watcher_root, marker, at.last_step);
    if saving && det.phase() == crate::Phase::Training {
        det.save_started(sh.since(origin));
    }
    for ev in events {
        match ev {
            WatchEvent::Pushed { dir, report } => {
                at.commits += 1;
                at.last_step = Some(report.checkpoint.step);
                // Work is safe from when the trainer finished writing the
                // checkpoint (its directory's last change), not from when
                // the push got to it.
                let now = sh.now_ms();
                let written = mtime(&dir)
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map_or(now, |d| u64::try_from(d.as_millis()).unwrap_or(now))
                    .min(now);
                at.times.last_commit_ms =
                    Some(at.times.last_commit_ms.map_or(written, |p| p.max(written)));
                det.save_committed(sh.since(origin));
                sh.say(&format!(
                    "committed step {} from {}",
                    report.checkpoint.step,
                    dir.display()
                ));
            }
            WatchEvent::Skipped { .. } => {}
            WatchEvent::Failed { dir, step, error } => sh.say(&format!(
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
    sh: &Shell,
    hung: Hung,
    child: &mut dyn Trainer,
    plan: &Plan,
    watcher: &mut Watcher,
    topts: &TransferOptions,
    at: &mut Attempt,
    det: &mut HangDetector,
    origin: Instant,
) -> Result<Outcome, SuperviseError> {
    sh.say(&hung.message);
    stop(sh, child, plan.grace);
    push_pass(
        sh,
        &plan.host,
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

/// Runs one attempt of `plan`'s trainer to its end (completed, failed,
/// preempted, cancelled), records it in the state file, carries out the
/// decision (drain, requeue) under Slurm and says what it did through
/// `out`; wall-clock times come from `clock`. The trainer is a process and
/// the signals are the process's: [`Supervisor`] replaces either.
pub async fn supervise(
    plan: &Plan,
    out: Arc<dyn Console>,
    clock: Arc<dyn Clock>,
) -> Result<Conclusion, SuperviseError> {
    Supervisor::new(out, clock).run(plan).await
}

/// A signal that asks the supervisor to checkpoint and stop (Slurm's
/// SIGTERM, its `--signal` warning, an operator's USR2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    Term,
    Usr1,
    Usr2,
}

impl StopSignal {
    fn name(self) -> &'static str {
        match self {
            StopSignal::Term => "SIGTERM",
            StopSignal::Usr1 => "SIGUSR1",
            StopSignal::Usr2 => "SIGUSR2",
        }
    }
}

/// The supervisor with its seams: where it speaks, its wall clock, its
/// monotonic clock (durations, deadlines and every wait), how it
/// starts the trainer, and where its stop signals come from (by default
/// the process's SIGTERM, SIGUSR1 and SIGUSR2, taken from the start).
pub struct Supervisor {
    out: Arc<dyn Console>,
    clock: Arc<dyn Clock>,
    mono: Arc<dyn Monotonic>,
    launcher: Box<dyn Launcher>,
    signals: Mutex<Option<mpsc::Receiver<StopSignal>>>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor").finish_non_exhaustive()
    }
}

impl Supervisor {
    /// Trainers started as processes; the process's own signals.
    pub fn new(out: Arc<dyn Console>, clock: Arc<dyn Clock>) -> Self {
        Supervisor {
            out,
            clock,
            mono: Arc::new(keel_time::SystemClock),
            launcher: Box::new(ProcessLauncher),
            signals: Mutex::new(None),
        }
    }

    /// Starts trainers with `launcher`.
    pub fn with_launcher(mut self, launcher: Box<dyn Launcher>) -> Self {
        self.launcher = launcher;
        self
    }

    /// Measures durations and deadlines, and takes its waits, on `mono`
    /// (by default the system's monotonic clock).
    pub fn with_monotonic(mut self, mono: Arc<dyn Monotonic>) -> Self {
        self.mono = mono;
        self
    }

    /// Takes its stop signals from `signals` instead of the process's.
    pub fn with_signals(self, signals: mpsc::Receiver<StopSignal>) -> Self {
        *self.signals.lock().unwrap_or_else(|e| e.into_inner()) = Some(signals);
        self
    }

    /// Runs one attempt: see [`supervise`].
    pub async fn run(&self, plan: &Plan) -> Result<Conclusion, SuperviseError> {
        let signals = self
            .signals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let sh = &Shell {
            out: self.out.clone(),
            clock: self.clock.clone(),
            mono: self.mono.clone(),
        };
        attempt(plan, sh, self.launcher.as_ref(), signals).await
    }
}

async fn attempt(
    plan: &Plan,
    sh: &Shell,
    launcher: &dyn Launcher,
    signals: Option<mpsc::Receiver<StopSignal>>,
) -> Result<Conclusion, SuperviseError> {
    let started = sh.instant();
    let mut at = Attempt {
        times: AttemptTimes {
            started_ms: sh.now_ms(),
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
    let metrics = Arc::new(Mutex::new(crate::metrics::Snapshot {
        job: plan.job.clone(),
        phase: "start-up",
        goodput: account(&history.attempts),
        ..Default::default()
    }));
    if let Some(addr) = plan.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| SuperviseError::Usage(format!("--metrics-listen {addr}: {e}")))?;
        sh.say(&format!(
            "metrics on http://{}/metrics{}",
            listener.local_addr().map_or(addr, |a| a),
            if plan.metrics_token.is_some() {
                " (bearer token required)"
            } else {
                ""
            }
        ));
        tokio::spawn(serve_metrics(
            sh.clone(),
            listener,
            metrics.clone(),
            plan.metrics_token.clone(),
        ));
    }
    std::fs::create_dir_all(&plan.ckpt_dir)
        .map_err(SuperviseError::io("create", &plan.ckpt_dir))?;

    // Signals are taken from the start: a warning (`--signal=B:USR1@...`)
    // that Slurm sends during the pre-flight checks or the restore must
    // not kill keel (their default action); it is answered once the
    // trainer runs.
    let (tx, rx) = mpsc::channel::<Note>();
    match signals {
        Some(signals) => {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for s in signals {
                    if tx.send(Note::Signal(s.name())).is_err() {
                        break;
                    }
                }
            });
        }
        None => {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).map_err(SuperviseError::Signal)?;
            let mut usr1 = signal(SignalKind::user_defined1()).map_err(SuperviseError::Signal)?;
            let mut usr2 = signal(SignalKind::user_defined2()).map_err(SuperviseError::Signal)?;
            let tx = tx.clone();
            tokio::spawn(async move {
                loop {
                    let name = tokio::select! {
                        _ = term.recv() => StopSignal::Term,
                        _ = usr1.recv() => StopSignal::Usr1,
                        _ = usr2.recv() => StopSignal::Usr2,
                    };
                    if tx.send(Note::Signal(name.name())).is_err() {
                        break;
                    }
                }
            });
        }
    }

    if let Some(m) = &plan.slurm {
        mark_job(sh, plan, m);
        let avoid = crate::placed_on_excluded(&history, &m.nodes, &plan.policy);
        if !avoid.is_empty() {
            // The last requeue's exclusions did not take: requeue again
            // before training there. Counted as a start-up failure, so a
            // list something keeps rewriting ends in the retry budget.
            sh.say(&format!(
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
            return conclude(sh, plan, &outcome, d, at, None);
        }
        let t = sh.instant();
        let reports = check_nodes(sh, m);
        at.times.preflight_ms = u64::try_from(sh.since(t).as_millis()).unwrap_or(0);
        let bad: Vec<String> = reports
            .iter()
            .filter(|r| matches!(r.verdict, crate::Verdict::Unhealthy { .. }))
            .map(|r| r.info.name.clone())
            .collect();
        if !bad.is_empty() {
            sh.say(&format!(
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
            return conclude(sh, plan, &outcome, d, at, None);
        }
        sh.say(&format!("pre-flight: {} nodes passed", m.nodes.len()));
    }

    // Resume from the newest checkpoint that verifies.
    let ck = Ckpt::new(&plan.store, &plan.run)?;
    let topts = TransferOptions::default();
    let restore_started = sh.instant();
    let latest = ck
        .latest()
        .await
        .map_err(|source| SuperviseError::Checkpoints {
            what: "read the checkpoints of",
            run: plan.run.clone(),
            source: Box::new(source),
        })?;
    let mut resume: Option<(PathBuf, u64)> = None;
    if latest.is_some() {
        remove_earlier_restores(sh, &plan.restore_dir);
        let dir = plan
            .restore_dir
            .join(format!("attempt-{}", at.times.started_ms));
        let r = ck
            .pull(
                Selector::Latest,
                &dir,
                false,
                &sh.ckpt_context(&plan.host),
                &topts,
            )
            .await
            .map_err(|source| SuperviseError::Checkpoints {
                what: "restore a checkpoint of",
                run: plan.run.clone(),
                source: Box::new(source),
            })?;
        for f in &r.fell_back_from {
            sh.say(&format!(
                "WARNING: step {} failed verification and was not used: {}",
                f.checkpoint.step, f.error
            ));
        }
        sh.say(&format!(
            "resuming from step {} ({})",
            r.checkpoint.step,
            r.dir.display()
        ));
        resume = Some((r.dir, r.checkpoint.step));
    } else {
        sh.say("no checkpoint yet: starting fresh");
    }
    at.times.restore_ms = u64::try_from(sh.since(restore_started).as_millis()).unwrap_or(0);

    // Scheduled Events, on their own thread: a failure there is logged
    // and never ends training.
    if let Some(imds) = plan.imds.clone() {
        let tx = tx.clone();
        let sh = sh.clone();
        let vm = plan.vm_name.clone();
        let others = plan.job_vms.clone();
        std::thread::spawn(move || poll_imds(&sh, imds, vm, others, tx));
    }
    if let Some(imds) = plan.aws_imds.clone() {
        let tx = tx.clone();
        let sh = sh.clone();
        std::thread::spawn(move || poll_aws(&sh, &imds, &tx));
    }
    if let Some(md) = plan.gcp_metadata.clone() {
        let tx = tx.clone();
        let sh = sh.clone();
        std::thread::spawn(move || poll_gcp(&sh, &md, &tx));
    }

    // A request left by an earlier attempt is not this attempt's.
    match std::fs::remove_file(&plan.request_file) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(SuperviseError::io(
                "remove the old checkpoint request",
                &plan.request_file,
            )(e))
        }
    }
    let mut launch = Launch {
        command: plan.command.clone(),
        env: vec![
            ("KEEL_CKPT_DIR".into(), plan.ckpt_dir.clone().into()),
            ("KEEL_CKPT_REQUEST".into(), plan.request_file.clone().into()),
        ],
        env_remove: vec!["KEEL_RESUME_DIR".into(), "KEEL_RESUME_STEP".into()],
    };
    if let Some((dir, step)) = &resume {
        launch
            .env
            .push(("KEEL_RESUME_DIR".into(), dir.clone().into()));
        launch
            .env
            .push(("KEEL_RESUME_STEP".into(), step.to_string().into()));
    }
    if let Some(f) = &plan.heartbeat_file {
        launch
            .env
            .push(("KEEL_HEARTBEAT_FILE".into(), f.clone().into()));
    }
    if let Some(d) = &plan.heartbeat_dir {
        std::fs::create_dir_all(d).map_err(SuperviseError::io("create", d))?;
        launch
            .env
            .push(("KEEL_HEARTBEAT_DIR".into(), d.clone().into()));
    }
    let mut child = launcher.launch(&launch).map_err(|e| {
        let shown: String = plan.command[0].chars().take(200).collect();
        SuperviseError::Usage(format!("cannot start the trainer {shown:?}: {e}"))
    })?;
    at.times.training_started_ms = Some(sh.now_ms());
    if let Some(out) = child.take_stdout() {
        let tx = tx.clone();
        let console = sh.out.clone();
        let pattern = plan.heartbeat_pattern.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = Vec::new();
            while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                console.trainer_stdout(&line);
                if let Some(p) = &pattern {
                    if crate::hang::line_is_heartbeat(&String::from_utf8_lossy(&line), p) {
                        let _ = tx.send(Note::Heartbeat);
                    }
                }
                line.clear();
            }
        });
    }
    if let Some(err) = child.take_stderr() {
        let tx = tx.clone();
        let console = sh.out.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(err);
            let mut line = Vec::new();
            while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                console.trainer_stderr(&line);
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
    let mut det = HangDetector::new(plan.hang, sh.since(origin));
    let mut watcher = Watcher::new(
        ck,
        &plan.ckpt_dir,
        plan.marker.clone(),
        format!("keel-run-{}", plan.host),
    );
    let mut heartbeat_mtime = plan.heartbeat_file.as_deref().and_then(mtime);
    // Per node (or rank) of --heartbeat-dir: its last mtime and detector.
    let mut per_name: std::collections::BTreeMap<String, (SystemTime, HangDetector)> =
        std::collections::BTreeMap::new();
    let mut commits_seen = 0u64;
    let mut last_commit: Option<Duration> = None;
    let mut next_pass = sh.instant();
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
                sh.say(&format!(
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
            stop(sh, child.as_mut(), stop_plan(sh, plan, kill_wait).grace);
            outcome = Outcome::Cancelled;
            break;
        }
        if let Some(status) = child.try_wait() {
            // A last pass pushes what the trainer wrote before it exited.
            push_pass(
                sh,
                &plan.host,
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
            sh.sleep(Duration::from_millis(200));
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
                Note::Heartbeat => det.beat(sh.since(origin)),
                Note::Tick => {}
                Note::TaskFailed(node) => {
                    if !failed_nodes.contains(&node) {
                        failed_nodes.push(node);
                    }
                }
                Note::Signal(name) => {
                    if cancelled_by_user(plan) {
                        sh.say(&format!(
                            "{name}: the job was cancelled; stopping the trainer without a checkpoint"
                        ));
                        cancelled = true;
                    } else if draining.is_none() {
                        let left = slurm_until_kill(sh, plan, name == "SIGTERM", kill_wait);
                        let waits = stop_plan(sh, plan, left);
                        sh.say(&format!(
                            "{name}: asking the trainer to checkpoint now (waiting up to {:.1} s for the commit, {:.1} s to stop{})",
                            waits.checkpoint_deadline.as_secs_f64(),
                            waits.grace.as_secs_f64(),
                            left.map_or(String::new(), |l| format!(
                                "; Slurm kills the job in {:.0} s",
                                l.as_secs_f64()
                            ))
                        ));
                        request_checkpoint(sh, plan, child.as_ref(), name);
                        draining = Some(Draining {
                            deadline: sh.instant() + waits.checkpoint_deadline,
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
                        let waits = stop_plan(sh, plan, (!notice.is_zero()).then_some(notice));
                        let on = if resources.is_empty() {
                            String::new()
                        } else {
                            format!(" for {}", resources.join(","))
                        };
                        sh.say(&format!(
                            "scheduled event {kind} ({id}){on}, {:.0} s notice: asking the trainer to checkpoint now",
                            notice.as_secs_f64()
                        ));
                        request_checkpoint(sh, plan, child.as_ref(), &kind);
                        draining = Some(Draining {
                            deadline: sh.instant() + waits.checkpoint_deadline,
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
                det.beat(sh.since(origin));
            }
        }
        if let Some(d) = &plan.heartbeat_dir {
            let now = sh.since(origin);
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
        if sh.instant() >= next_pass {
            let before = sh.instant();
            push_pass(
                sh,
                &plan.host,
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
                at.times.stall_ms += u64::try_from(sh.since(before).as_millis()).unwrap_or(0);
            }
            next_pass = sh.instant() + plan.watch_interval;
        }
        if let Some(Draining {
            deadline,
            grace,
            commits_then,
            event,
        }) = &draining
        {
            let committed = at.commits > *commits_then;
            if committed || sh.instant() >= *deadline {
                if committed {
                    sh.say("the checkpoint is committed; stopping the trainer");
                } else {
                    sh.say("WARNING: no checkpoint was committed before the deadline; stopping the trainer");
                }
                stop(sh, child.as_mut(), *grace);
                push_pass(
                    sh,
                    &plan.host,
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
                        let e = crate::events::Event {
                            id: id.clone(),
                            kind: crate::events::EventType::Other(String::new()),
                            resources: resources.clone(),
                            status: String::new(),
                            not_before: None,
                            duration: None,
                            source: String::new(),
                        };
                        match crate::events::ack(&e, job_vms, at.commits > *commits_then) {
                            crate::events::Ack::Yes => match imds.acknowledge(&[id]) {
                                Ok(()) => sh.say(&format!("acknowledged scheduled event {id}")),
                                Err(e) => sh.say(&format!("cannot acknowledge event {id}: {e}")),
                            },
                            crate::events::Ack::NotCommitted => sh.say(&format!(
                                "scheduled event {id} not acknowledged: no checkpoint was committed"
                            )),
                            crate::events::Ack::Foreign(vms) => sh.say(&format!(
                                "scheduled event {id} not acknowledged: it names {}, outside this job",
                                vms.join(",")
                            )),
                        }
                    }
                }
                outcome = Outcome::Preempted;
                break;
            }
        } else if let Some((names, silent_for, timeout)) = (det.phase() == crate::Phase::Training
            && last_commit.is_none_or(|c| sh.since(origin) > c + det.training_timeout()))
        .then(|| stopped_names(&per_name, sh.since(origin)))
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
                sh,
                hung,
                child.as_mut(),
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
        } = det.check(sh.since(origin))
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
                sh,
                hung,
                child.as_mut(),
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
            let now = sh.since(origin);
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
        tokio::time::sleep(sh.mono.wait(Duration::from_millis(100))).await;
    }

    let mut outcome = outcome;
    let mut reports = Vec::new();
    if let Some(m) = &plan.slurm {
        // A user's scancel ends the steps (the trainer fails) and marks
        // the job cancelled: never requeued.
        let ended_early = matches!(outcome, Outcome::Failed { .. } | Outcome::Preempted);
        if ended_early && cancelled_by_user(plan) {
            sh.say("the job was cancelled (Slurm is ending it); it is not requeued");
            outcome = Outcome::Cancelled;
        } else if matches!(outcome, Outcome::Failed { .. }) {
            reports = check_nodes(sh, m);
            for r in reports.iter().filter(|r| r.unreachable()) {
                sh.say(&format!(
                    "node {} is {} in Slurm: recorded as not responding and excluded; its state is left alone",
                    r.info.name,
                    slurm_state(&r.info)
                ));
            }
        }
    }
    let d = decide(&outcome, &history, &reports, &plan.policy);
    conclude(sh, plan, &outcome, d, at, resume.map(|r| r.1))
}

/// Records the attempt, carries out the decision and picks the exit code.
fn conclude(
    sh: &Shell,
    plan: &Plan,
    outcome: &Outcome,
    d: crate::Decision,
    mut at: Attempt,
    resumed: Option<u64>,
) -> Result<Conclusion, SuperviseError> {
    at.times.ended_ms = sh.now_ms();
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
        (_, Next::Done) => (Ending::Done, "completed".to_owned()),
        (_, Next::Stop { reason }) => (Ending::Stop, reason.clone()),
        (Outcome::Preempted, Next::Requeue) => (
            Ending::Requeue,
            "preempted: requeue to resume from the committed checkpoint".to_owned(),
        ),
        (Outcome::Failed { detail, .. }, Next::Requeue) => (
            Ending::Failed,
            format!("failed ({detail}); requeue to resume"),
        ),
        (_, Next::Requeue) => (Ending::Requeue, "requeue".to_owned()),
    };
    if let Some(m) = &plan.slurm {
        for (node, reason) in &d.drain {
            match m.client.drain(node, reason) {
                Ok(()) => sh.say(&format!("drained {node}: {reason}")),
                Err(e) => sh.say(&format!("cannot drain {node}: {e}")),
            }
        }
        if d.next == Next::Requeue {
            let job = plan.slurm_job_id();
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
                    code = Ending::Requeue;
                }
                Err(e @ keel_slurm::SlurmError::NotExcluded { .. }) => {
                    // Requeued all the same: the next attempt finds itself
                    // on the node and requeues again (placed_on_excluded).
                    what = format!("{what}; WARNING: {e}");
                    code = Ending::Requeue;
                }
                Err(e) => what = format!("{what}; cannot requeue job {job}: {e}"),
            }
        }
    }
    sh.say(&what);
    Ok(Conclusion {
        job: plan.job.clone(),
        outcome: at.times.ended,
        result: what,
        ending: code,
        resumed_from_step: resumed,
        commits: at.commits,
        exclude: d.exclude,
        drained: d.drain.into_iter().map(|(n, _)| n).collect(),
    })
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
fn remove_earlier_restores(sh: &Shell, root: &Path) {
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
                sh.say(&format!("cannot remove {}: {err}", e.path().display()));
            }
        }
    }
}

/// The nodes a failure is recorded against: under Slurm those srun named
/// (`srun: error: n2: task 1: Exited with exit code 1`), else this host.
fn blame(plan: &Plan, failed: &[String]) -> Vec<String> {
    if plan.slurm.is_some() {
        failed.to_vec()
    } else {
        vec![plan.host.clone()]
    }
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
