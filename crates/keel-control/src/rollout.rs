//! Progressive rollouts of the models that follow the registry: the
//! gateway's side of `keel_canary::rollout`.
//!
//! [`Rollouts::start`] checks that the model follows a registry model
//! whose canary alias names a version other than the stable one, watches
//! the model's per-request samples ([`keel_gateway::SampleBook`]) and sets the
//! canary's first weight. Every `interval_s` a task takes the samples of
//! the stable and canary deployments (`v<N>`), hands the step's windows to
//! the rollout, and carries out its action:
//!
//! - a new weight: the follow's canary share, applied by waking the
//!   follower at once; the windows start again;
//! - abort (a failed check, or an operator): canary share 0 at once, then
//!   the canary alias is deleted in the registry with the reason (the
//!   failed checks and their numbers);
//! - promotion: the stable alias moves to the canary's version with the
//!   evidence as its reason, and the canary share returns to 0.
//!
//! Before anything changes, `start` asks the registry (a dry run of both
//! alias changes) whether the write key may move the stable alias to the
//! canary's version and delete the canary alias: a key without those
//! rights is [`RolloutError::WriteRefused`] (HTTP 403 from the admin API).
//!
//! Every weight change, verdict, promotion and rollback is an audit event
//! (`rollout_start`, `rollout_weight`, `rollout_verdict`, `rollout_pause`,
//! `rollout_resume`, `rollout_abort`, `rollout_rollback`,
//! `rollout_promote`, and after a restart `rollout_recover` or
//! `rollout_stop`) carrying `rollout_id`, the id that also opens the
//! reason recorded in the registry's alias history.
//!
//! ## Across restarts
//!
//! Every change of a rollout's state (start, verdict, step, pause, end,
//! the registry's answer) rewrites `registry.rollout_state_file`
//! atomically (mode 0600): id, models and aliases, the versions, the plan,
//! phase, step, every verdict, the reason it ended, and whether an alias
//! change the registry has not yet answered is owed. At start
//! ([`Rollouts::new`]) the file is read back (a file that cannot be read
//! is an error naming it, never a silent reset) and [`Rollouts::recover`]
//! takes each rollout up again:
//!
//! - one in progress or paused is checked against the registry first: if
//!   the stable alias still names its stable version and the canary alias
//!   its canary version, it continues at its step and weight, the step's
//!   analysis starting from new windows (samples are not kept across a
//!   restart); if the aliases changed while the gateway was down (say the
//!   canary alias was deleted by hand), it stops (`rollout_stop`, phase
//!   `aborted`, weight 0) with the reason recorded, and changes no alias;
//!   while the registry cannot be reached the check is retried and the
//!   canary gets no traffic;
//! - one that ended but whose alias change was never answered (the
//!   gateway stopped in between, or the registry could not be reached)
//!   makes that change again;
//! - a finished one is shown by `status` as it ended.
//!
//! An alias change the registry did not answer (unreachable, timed out,
//! 5xx) stays owed and is sent again with a growing wait (1 s doubling to
//! 30 s) until the registry answers; a refusal (4xx) is final. The state
//! file is locked (`keel_fs::Lock`) while the gateway runs: a second
//! gateway on the same file is [`RolloutError::StateLocked`].

// Errors are returned per admin call: their size does not matter.
#![allow(clippy::result_large_err)]

mod shared;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_canary::analysis::{Sample, StepCounts, StepPolicy, Thresholds};
use keel_canary::rollout::{Action, Phase, Plan, Rollout, Verdict};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::registry_follow::Follow;
use crate::registry_source::{RegistryClient, RegistrySourceError};
use keel_gateway::config::RolloutConfig;
use keel_gateway::Gateway;

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("model {model:?} does not follow the registry (models[].registry): only such models roll out")]
    NotFollowed { model: String },
    #[error("model {model:?} names no canary alias (models[].registry.canary)")]
    NoCanaryAlias { model: String },
    #[error("registry model {registry_model:?} has no version under its canary alias {alias:?}: set it first (keel model alias set {registry_model} {alias} VERSION)")]
    NoCanary {
        registry_model: String,
        alias: String,
    },
    #[error("registry model {registry_model:?}: the canary alias {alias:?} names version {version}, the stable version: there is nothing to roll out")]
    CanaryIsStable {
        registry_model: String,
        alias: String,
        version: u64,
    },
    #[error("cannot read registry model {registry_model:?}")]
    Registry {
        registry_model: String,
        #[source]
        source: RegistrySourceError,
    },
    #[error("rollouts move registry aliases and need registry.write_key_file (a registry key with write rights)")]
    NoWriteKey,
    #[error("the registry refused the gateway's write key (registry.write_key_file) the alias changes of registry model {registry_model:?}: nothing was changed; give the gateway a key with write rights (keel model keys create NAME --role write)")]
    WriteRefused {
        registry_model: String,
        #[source]
        source: RegistrySourceError,
    },
    #[error("the rollout state file {path} is not what keel writes ({reason}): nothing was reset; repair it or move it away")]
    StateCorrupt { path: PathBuf, reason: String },
    #[error("another process holds the rollout state file {path} (its lock .{}.lock): another gateway keeps its rollouts there; give each gateway its own registry.rollout_state_file", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default())]
    StateLocked { path: PathBuf },
    #[error("cannot read the rollout state file")]
    StateRead(#[source] keel_fs::FsError),
    #[error("cannot write the rollout state file {path}: the rollout was not started")]
    NotRecorded {
        path: PathBuf,
        #[source]
        source: keel_fs::FsError,
    },
    #[error("model {model:?} has rollout {id} in progress")]
    Running { model: String, id: String },
    #[error("model {model:?}: rollout {id} ended but the registry has not yet made its alias change, which the gateway sends again until it answers: start the next rollout after that")]
    AliasChangeOwed { model: String, id: String },
    #[error("model {model:?} has no rollout")]
    NoRollout { model: String },
    #[error("the rollouts' Redis (registry.rollout_store = \"redis\") cannot be used: {reason}")]
    Store { reason: String },
    #[error("model {model:?}: the rollout changed on another replica meanwhile; nothing was changed here: look at its status and try again")]
    Changed { model: String },
    #[error("rollout {id}")]
    State {
        id: String,
        #[source]
        source: keel_canary::rollout::RolloutError,
    },
}

impl RolloutError {
    /// The HTTP status the admin API answers with.
    pub fn status(&self) -> u16 {
        match self {
            RolloutError::NotFollowed { .. } | RolloutError::NoRollout { .. } => 404,
            RolloutError::Registry {
                source:
                    RegistrySourceError::Unreachable { .. }
                    | RegistrySourceError::Timeout { .. }
                    | RegistrySourceError::Status { .. },
                ..
            } => 502,
            RolloutError::WriteRefused { .. } => 403,
            RolloutError::StateRead(_) | RolloutError::NotRecorded { .. } => 500,
            RolloutError::Store { .. } => 503,
            _ => 409,
        }
    }

    /// The admin API's error type: `registry_write_refused` when the
    /// registry refused the write key, else `rollout_error`.
    pub fn kind(&self) -> &'static str {
        match self {
            RolloutError::WriteRefused { .. } => "registry_write_refused",
            _ => "rollout_error",
        }
    }
}

/// The running and finished rollouts of a gateway, one per model.
#[derive(Debug, Clone)]
pub struct Rollouts(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    reader: RegistryClient,
    writer: Option<RegistryClient>,
    follows: Vec<Follow>,
    configs: HashMap<String, RolloutConfig>,
    wake: Arc<tokio::sync::Notify>,
    runs: Mutex<HashMap<String, Arc<Mutex<Run>>>>,
    seq: AtomicU64,
    /// `registry.rollout_state_file`; `None`: nothing is kept.
    state_path: Option<PathBuf>,
    /// Held from a snapshot of the runs to its write, so that an older
    /// snapshot never replaces a newer one.
    save_lock: Mutex<()>,
    /// The state file's lock, held while the gateway runs: one gateway
    /// keeps a state file.
    _state_lock: Option<keel_fs::Lock>,
    /// `registry.rollout_store = "redis"`: the rollouts are the fleet's.
    shared: Option<shared::Shared>,
}

/// One rollout and what it needs to act.
#[derive(Debug)]
struct Run {
    rollout: Rollout,
    model: String,
    registry_model: String,
    stable_alias: String,
    canary_alias: String,
    stable_version: u64,
    canary_version: u64,
    interval_s: u64,
    stable: Vec<Sample>,
    canary: Vec<Sample>,
    /// What the registry said to the last alias change.
    registry: Option<Value>,
    started: String,
    /// Why it ended (abort, promotion, stop).
    end_reason: Option<String>,
    /// An abort or promotion whose alias change the registry has not
    /// answered yet.
    registry_pending: bool,
    /// When it ended (gateway clock, ms).
    ended_ms: Option<u64>,
    /// The revision of the shared record this run was read at (0 with a
    /// state file).
    rev: u64,
}

/// `registry.rollout_state_file`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    version: u32,
    rollouts: Vec<Record>,
}

/// One rollout in the state file.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    id: String,
    model: String,
    registry_model: String,
    stable_alias: String,
    canary_alias: String,
    stable_version: u64,
    canary_version: u64,
    interval_s: u64,
    started: String,
    steps: Vec<u32>,
    min_canary_samples: u64,
    max_intervals: u32,
    /// The latency check's absolute floor (absent in files written before
    /// it existed: the default).
    #[serde(default = "default_latency_floor")]
    latency_min_increase_ms: f64,
    phase: Phase,
    step: usize,
    /// The canary's weight when written (for a reader; derived from the
    /// step and phase on reading).
    weight: u32,
    verdicts: Vec<Verdict>,
    /// The rate checks' counts of the finished steps.
    earlier: Vec<StepCounts>,
    registry: Option<Value>,
    end_reason: Option<String>,
    registry_pending: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ended_ms: Option<u64>,
}

const STATE_VERSION: u32 = 1;

fn default_latency_floor() -> f64 {
    Thresholds::default().latency_min_increase_ms
}

fn record(r: &Run) -> Record {
    Record {
        id: r.rollout.id.clone(),
        model: r.model.clone(),
        registry_model: r.registry_model.clone(),
        stable_alias: r.stable_alias.clone(),
        canary_alias: r.canary_alias.clone(),
        stable_version: r.stable_version,
        canary_version: r.canary_version,
        interval_s: r.interval_s,
        started: r.started.clone(),
        steps: r.rollout.plan.steps.clone(),
        min_canary_samples: r.rollout.plan.policy.min_canary_samples,
        max_intervals: r.rollout.plan.policy.max_intervals,
        latency_min_increase_ms: r.rollout.plan.thresholds.latency_min_increase_ms,
        phase: r.rollout.phase,
        step: r.rollout.step,
        weight: r.rollout.weight(),
        verdicts: r.rollout.verdicts.clone(),
        earlier: r.rollout.earlier.clone(),
        registry: r.registry.clone(),
        end_reason: r.end_reason.clone(),
        registry_pending: r.registry_pending,
        ended_ms: r.ended_ms,
    }
}

/// The rollouts of a state file, by model.
fn load(path: &std::path::Path) -> Result<HashMap<String, Arc<Mutex<Run>>>, RolloutError> {
    let Some(bytes) = keel_fs::read_optional(path).map_err(RolloutError::StateRead)? else {
        return Ok(HashMap::new());
    };
    let corrupt = |reason: String| RolloutError::StateCorrupt {
        path: path.to_owned(),
        reason,
    };
    let doc: StateFile = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    if doc.version != STATE_VERSION {
        return Err(corrupt(format!(
            "version {} is not known ({STATE_VERSION} is)",
            doc.version
        )));
    }
    let mut runs = HashMap::new();
    for rec in doc.rollouts {
        let model = rec.model.clone();
        let run = run_from_record(rec).map_err(corrupt)?;
        if runs
            .insert(model.clone(), Arc::new(Mutex::new(run)))
            .is_some()
        {
            return Err(corrupt(format!("model {model:?} has two rollouts")));
        }
    }
    Ok(runs)
}

/// A run from its record (a state file's entry, or the shared record);
/// an error says what is wrong with it.
fn run_from_record(rec: Record) -> Result<Run, String> {
    if rec.interval_s == 0 {
        return Err(format!("rollout {}: interval_s is 0", rec.id));
    }
    if !(rec.latency_min_increase_ms >= 0.0 && rec.latency_min_increase_ms.is_finite()) {
        return Err(format!(
            "rollout {}: latency_min_increase_ms {} is not a duration",
            rec.id, rec.latency_min_increase_ms
        ));
    }
    let plan = Plan {
        steps: rec.steps,
        thresholds: Thresholds {
            latency_min_increase_ms: rec.latency_min_increase_ms,
            ..Thresholds::default()
        },
        policy: StepPolicy {
            min_canary_samples: rec.min_canary_samples,
            max_intervals: rec.max_intervals,
        },
    };
    let rollout = Rollout::restore(
        rec.id.clone(),
        plan,
        rec.phase,
        rec.step,
        rec.verdicts,
        rec.earlier,
    )
    .map_err(|e| format!("rollout {}: {e}", rec.id))?;
    Ok(Run {
        rollout,
        model: rec.model,
        registry_model: rec.registry_model,
        stable_alias: rec.stable_alias,
        canary_alias: rec.canary_alias,
        stable_version: rec.stable_version,
        canary_version: rec.canary_version,
        interval_s: rec.interval_s,
        stable: Vec::new(),
        canary: Vec::new(),
        registry: rec.registry,
        started: rec.started,
        end_reason: rec.end_reason,
        registry_pending: rec.registry_pending,
        ended_ms: rec.ended_ms,
        rev: 0,
    })
}

/// Notes the end an action brings: its reason, and the alias change owed.
fn note_end(r: &mut Run, action: &Action) {
    if let Action::Abort { reason } | Action::Promote { reason } = action {
        r.end_reason = Some(reason.clone());
        r.registry_pending = true;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Rollouts {
    /// `reader` resolves aliases, `writer` (a key with write rights)
    /// changes them; `wake` makes the follower apply a new canary share at
    /// once. The rollouts recorded in `registry.rollout_state_file` are
    /// read back (see [`Rollouts::recover`]); a file that cannot be read
    /// or parsed is an error naming it.
    ///
    /// With `registry.rollout_store = "redis"` nothing is read at start:
    /// the rollouts are the records the replicas share in the Redis of
    /// `limits.redis_url`, and `replica` names this gateway in their
    /// leases (see the `shared` module).
    pub fn new(
        cfg: &keel_gateway::GatewayConfig,
        follows: Vec<Follow>,
        reader: RegistryClient,
        writer: Option<RegistryClient>,
        wake: Arc<tokio::sync::Notify>,
        replica: &str,
    ) -> Result<Self, RolloutError> {
        let configs = cfg
            .models
            .iter()
            .map(|m| (m.name.clone(), m.rollout.clone()))
            .collect();
        let shared = match (&cfg.registry, &cfg.limits.redis_url) {
            (Some(r), Some(url))
                if r.rollout_store == keel_gateway::config::RolloutStore::Redis =>
            {
                Some(shared::Shared::new(url, replica, r.rollout_lease_ms)?)
            }
            _ => None,
        };
        let state_path = cfg
            .registry
            .as_ref()
            .filter(|_| shared.is_none())
            .map(|r| r.rollout_state_file.clone());
        // A lock that cannot be created (no such directory, no write
        // rights there) leaves a state file that cannot be written either:
        // `start` refuses rollouts then, so none is kept twice.
        let state_lock = match &state_path {
            Some(p) => match keel_fs::Lock::try_exclusive(p) {
                Ok(Some(l)) => Some(l),
                Ok(None) => return Err(RolloutError::StateLocked { path: p.clone() }),
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %chain(&e), "the rollout state file cannot be locked: rollouts cannot be recorded");
                    None
                }
            },
            None => None,
        };
        let runs = match &state_path {
            Some(p) => load(p)?,
            None => HashMap::new(),
        };
        Ok(Rollouts(Arc::new(Inner {
            reader,
            writer,
            follows,
            configs,
            wake,
            seq: AtomicU64::new(runs.len() as u64),
            runs: Mutex::new(runs),
            state_path,
            save_lock: Mutex::new(()),
            _state_lock: state_lock,
            shared,
        })))
    }

    /// Takes up the rollouts read at start: those in progress or paused
    /// continue once the registry confirms their aliases (or stop if the
    /// aliases changed), and ended ones owing an alias change make it.
    ///
    /// With a shared store, starts the replica's loop instead: it applies
    /// the fleet's rollouts' weights, pools this replica's samples and
    /// takes over a rollout whose driver is gone.
    pub fn recover(&self, gw: &Gateway) {
        if self.shared().is_some() {
            tokio::spawn(self.clone().sync(gw.clone()));
            return;
        }
        let runs: Vec<_> = lock(&self.0.runs).values().cloned().collect();
        for run in runs {
            let due = {
                let r = lock(&run);
                r.registry_pending || matches!(r.rollout.phase, Phase::Progressing | Phase::Paused)
            };
            if due {
                let me = self.clone();
                let gw = gw.clone();
                tokio::spawn(async move { me.recover_one(gw, run).await });
            }
        }
    }

    async fn recover_one(self, gw: Gateway, run: Arc<Mutex<Run>>) {
        let model = lock(&run).model.clone();
        let pending = {
            let r = lock(&run);
            match (r.registry_pending, r.rollout.phase, &r.end_reason) {
                (true, Phase::Aborted, Some(reason)) => Some(Action::Abort {
                    reason: reason.clone(),
                }),
                (true, Phase::Promoted, Some(reason)) => Some(Action::Promote {
                    reason: reason.clone(),
                }),
                _ => None,
            }
        };
        if let Some(action) = pending {
            tracing::warn!(model = %model, "a rollout ended before the registry answered its alias change: making it again");
            self.act(&gw, &run, action).await;
            return;
        }
        let checked = self.check_aliases(&run).await;
        match checked {
            Ok(()) => {
                let weight = {
                    let r = lock(&run);
                    // An operator may have ended it while the registry was
                    // being asked.
                    if !matches!(r.rollout.phase, Phase::Progressing | Phase::Paused) {
                        return;
                    }
                    let mut m = Map::new();
                    m.insert("phase".into(), json!(r.rollout.phase));
                    m.insert("step".into(), r.rollout.step.into());
                    m.insert("weight".into(), r.rollout.weight().into());
                    m.insert(
                        "reason".into(),
                        "the gateway restarted: the step goes on with new windows".into(),
                    );
                    audit(&gw, "rollout_recover", &r, m);
                    r.rollout.weight()
                };
                tracing::info!(model = %model, weight, "rollout taken up after a restart");
                gw.samples().watch(&model);
                self.act(&gw, &run, Action::SetWeight { weight }).await;
                self.drive(gw, run).await;
            }
            Err(why) => {
                let reason = {
                    let mut r = lock(&run);
                    let Ok(reason) = r.rollout.stop(&why) else {
                        return;
                    };
                    r.end_reason = Some(reason.clone());
                    let mut m = Map::new();
                    m.insert("weight".into(), 0.into());
                    m.insert("reason".into(), reason.clone().into());
                    audit(&gw, "rollout_stop", &r, m);
                    reason
                };
                if let Ok(f) = self.follow(&model) {
                    f.canary_percent.store(0, Ordering::SeqCst);
                    self.0.wake.notify_one();
                }
                gw.samples().unwatch(&model);
                self.save();
                tracing::warn!(model = %model, %reason, "rollout stopped after a restart");
            }
        }
    }

    /// Whether the registry's aliases still name the rollout's versions
    /// and the configuration still follows its registry model and aliases
    /// (asked again while the registry cannot be reached); the reason to
    /// stop it when not.
    async fn check_aliases(&self, run: &Arc<Mutex<Run>>) -> Result<(), String> {
        let (model, registry_model, stable_alias, canary_alias, stable_version, canary_version) = {
            let r = lock(run);
            (
                r.model.clone(),
                r.registry_model.clone(),
                r.stable_alias.clone(),
                r.canary_alias.clone(),
                r.stable_version,
                r.canary_version,
            )
        };
        let every = Duration::from_secs(lock(run).interval_s.clamp(1, 5));
        let mut warned = false;
        loop {
            let follow = match self.follow(&model) {
                Ok(f) => f.clone(),
                Err(_) => return Err(format!("model {model:?} no longer follows the registry")),
            };
            let src = &follow.source;
            if src.model != registry_model
                || src.stable_alias != stable_alias
                || src.canary_alias.as_deref() != Some(canary_alias.as_str())
            {
                return Err(format!(
                    "the configuration changed: model {model:?} now follows {:?} with aliases {:?} and {:?}, the rollout {registry_model:?} with {stable_alias:?} and {canary_alias:?}",
                    src.model, src.stable_alias, src.canary_alias
                ));
            }
            match self.0.reader.resolve(src).await {
                Ok(routing) => {
                    if routing.stable.version != stable_version {
                        return Err(format!(
                            "the registry's aliases changed while the gateway was down: {stable_alias:?} names version {}, not {stable_version}",
                            routing.stable.version
                        ));
                    }
                    match routing.canary.map(|c| c.version) {
                        None => {
                            return Err(format!(
                                "the registry's aliases changed while the gateway was down: the canary alias {canary_alias:?} was deleted"
                            ))
                        }
                        Some(v) if v != canary_version => {
                            return Err(format!(
                                "the registry's aliases changed while the gateway was down: the canary alias {canary_alias:?} names version {v}, not {canary_version}"
                            ))
                        }
                        Some(_) => return Ok(()),
                    }
                }
                Err(
                    e @ (RegistrySourceError::Unreachable { .. }
                    | RegistrySourceError::Timeout { .. }
                    | RegistrySourceError::Status { .. }),
                ) => {
                    if !warned {
                        tracing::warn!(model = %model, error = %chain(&e), "a rollout waits for the registry to confirm its aliases before it continues");
                        warned = true;
                    }
                    tokio::time::sleep(every).await;
                }
                Err(e) => {
                    return Err(format!(
                        "the registry refuses the rollout's versions: {}",
                        chain(&e)
                    ))
                }
            }
        }
    }

    /// Rewrites the state file from every rollout; a failure is logged
    /// (the rollout goes on; its state is written again at its next
    /// change).
    fn save(&self) {
        if let Err(e) = self.try_save() {
            tracing::error!(path = ?self.0.state_path, error = %chain(&e), "the rollout state file could not be written");
        }
    }

    fn try_save(&self) -> Result<(), keel_fs::FsError> {
        let Some(path) = &self.0.state_path else {
            return Ok(());
        };
        let _g = lock(&self.0.save_lock);
        let runs: Vec<_> = lock(&self.0.runs).values().cloned().collect();
        let mut rollouts: Vec<Record> = runs.iter().map(|r| record(&lock(r))).collect();
        rollouts.sort_by(|a, b| a.model.cmp(&b.model));
        let doc = StateFile {
            version: STATE_VERSION,
            rollouts,
        };
        let mut bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
        bytes.push(b'\n');
        keel_fs::write_atomic(path, &bytes, 0o600)
    }

    fn follow(&self, model: &str) -> Result<&Follow, RolloutError> {
        self.0
            .follows
            .iter()
            .find(|f| f.model == model)
            .ok_or_else(|| RolloutError::NotFollowed {
                model: model.to_owned(),
            })
    }

    fn run(&self, model: &str) -> Result<Arc<Mutex<Run>>, RolloutError> {
        lock(&self.0.runs)
            .get(model)
            .cloned()
            .ok_or_else(|| RolloutError::NoRollout {
                model: model.to_owned(),
            })
    }

    /// Starts a rollout of `model`'s canary, or resumes a paused one.
    pub async fn start(&self, gw: &Gateway, model: &str) -> Result<Value, RolloutError> {
        let follow = self.follow(model)?.clone();
        self.pull(model).await?;
        if let Ok(run) = self.run(model) {
            let resumed = {
                let mut r = lock(&run);
                match r.rollout.phase {
                    Phase::Progressing => {
                        return Err(RolloutError::Running {
                            model: model.to_owned(),
                            id: r.rollout.id.clone(),
                        })
                    }
                    Phase::Paused => {
                        let id = r.rollout.id.clone();
                        let action = r
                            .rollout
                            .resume()
                            .map_err(|source| RolloutError::State { id, source })?;
                        audit(gw, "rollout_resume", &r, Map::new());
                        Some(action)
                    }
                    Phase::Aborted | Phase::Promoted if r.registry_pending => {
                        return Err(RolloutError::AliasChangeOwed {
                            model: model.to_owned(),
                            id: r.rollout.id.clone(),
                        })
                    }
                    Phase::Aborted | Phase::Promoted => None,
                }
            };
            if let Some(action) = resumed {
                if self.shared().is_some() {
                    self.commit(&run).await?;
                    self.try_drive(gw, model).await;
                } else {
                    self.save();
                }
                self.act(gw, &run, action).await;
                let mut s = status(&lock(&run));
                self.shared_status(&run, &mut s).await;
                return Ok(s);
            }
        }
        let Some(canary_alias) = follow.source.canary_alias.clone() else {
            return Err(RolloutError::NoCanaryAlias {
                model: model.to_owned(),
            });
        };
        if self.0.writer.is_none() {
            return Err(RolloutError::NoWriteKey);
        }
        let registry_model = follow.source.model.clone();
        let routing = self
            .0
            .reader
            .resolve(&follow.source)
            .await
            .map_err(|source| RolloutError::Registry {
                registry_model: registry_model.clone(),
                source,
            })?;
        let Some(canary) = routing.canary else {
            return Err(RolloutError::NoCanary {
                registry_model,
                alias: canary_alias,
            });
        };
        if canary.version == routing.stable.version {
            return Err(RolloutError::CanaryIsStable {
                registry_model,
                alias: canary_alias,
                version: canary.version,
            });
        }
        // The write key's rights, asked without changing anything: a
        // rollout that could neither promote nor roll back never starts.
        if let Some(w) = &self.0.writer {
            w.may_change_aliases(
                &registry_model,
                (&follow.source.stable_alias, canary.version),
                &canary_alias,
            )
            .await
            .map_err(|source| match source {
                RegistrySourceError::NoWriteRights { .. } => RolloutError::WriteRefused {
                    registry_model: registry_model.clone(),
                    source,
                },
                source => RolloutError::Registry {
                    registry_model: registry_model.clone(),
                    source,
                },
            })?;
        }
        let cfg = self.0.configs.get(model).cloned().unwrap_or_default();
        let plan = Plan {
            steps: cfg.steps.clone(),
            thresholds: cfg.thresholds(),
            policy: StepPolicy {
                min_canary_samples: cfg.min_canary_samples,
                max_intervals: cfg.max_intervals,
            },
        };
        let now = gw.now_ms();
        // With a shared store the record's next revision numbers it: only
        // one replica can write that revision.
        let prev_rev = self.run(model).map(|r| lock(&r).rev).unwrap_or(0);
        let n = if self.shared().is_some() {
            prev_rev + 1
        } else {
            self.0.seq.fetch_add(1, Ordering::Relaxed) + 1
        };
        let id = crate::event_id("ro", now, n);
        let (rollout, action) =
            Rollout::start(id.clone(), plan).map_err(|source| RolloutError::State {
                id: id.clone(),
                source,
            })?;
        let run = Arc::new(Mutex::new(Run {
            rollout,
            model: model.to_owned(),
            registry_model,
            stable_alias: follow.source.stable_alias.clone(),
            canary_alias,
            stable_version: routing.stable.version,
            canary_version: canary.version,
            interval_s: cfg.interval_s,
            stable: Vec::new(),
            canary: Vec::new(),
            registry: None,
            started: keel_gateway::rfc3339(now),
            end_reason: None,
            registry_pending: false,
            ended_ms: None,
            rev: prev_rev,
        }));
        let before = {
            let mut runs = lock(&self.0.runs);
            if let Some(r) = runs.get(model) {
                let r = lock(r);
                if matches!(r.rollout.phase, Phase::Progressing | Phase::Paused) {
                    return Err(RolloutError::Running {
                        model: model.to_owned(),
                        id: r.rollout.id.clone(),
                    });
                }
            }
            runs.insert(model.to_owned(), run.clone())
        };
        // Recorded before any weight changes: a rollout whose state cannot
        // be kept does not start.
        if self.shared().is_some() {
            if let Err(e) = self.commit(&run).await {
                let mut runs = lock(&self.0.runs);
                match before {
                    Some(b) => runs.insert(model.to_owned(), b),
                    None => runs.remove(model),
                };
                return Err(e);
            }
        } else if let Err(source) = self.try_save() {
            let mut runs = lock(&self.0.runs);
            match before {
                Some(b) => runs.insert(model.to_owned(), b),
                None => runs.remove(model),
            };
            return Err(RolloutError::NotRecorded {
                path: self.0.state_path.clone().unwrap_or_default(),
                source,
            });
        }
        gw.samples().watch(model);
        {
            let r = lock(&run);
            let mut m = Map::new();
            m.insert("steps".into(), json!(cfg.steps));
            m.insert("interval_s".into(), cfg.interval_s.into());
            audit(gw, "rollout_start", &r, m);
        }
        if let Some(sh) = self.shared() {
            let step = lock(&run).rollout.step;
            lock(&sh.applied).insert(model.to_owned(), (id.clone(), step));
        }
        self.act(gw, &run, action).await;
        if self.shared().is_some() {
            // The replica that started it drives it while it can.
            self.try_drive(gw, model).await;
        } else {
            let me = self.clone();
            let gw2 = gw.clone();
            let run2 = run.clone();
            tokio::spawn(async move { me.drive(gw2, run2).await });
        }
        let mut s = status(&lock(&run));
        self.shared_status(&run, &mut s).await;
        Ok(s)
    }

    /// An operator's pause: the weight stays, the analysis stops.
    pub async fn pause(&self, gw: &Gateway, model: &str) -> Result<Value, RolloutError> {
        self.follow(model)?;
        self.pull(model).await?;
        let run = self.run(model)?;
        {
            let mut r = lock(&run);
            let id = r.rollout.id.clone();
            r.rollout
                .pause()
                .map_err(|source| RolloutError::State { id, source })?;
        }
        if self.shared().is_some() {
            self.commit(&run).await?;
        } else {
            self.save();
        }
        let r = lock(&run);
        let mut m = Map::new();
        m.insert("reason".into(), "paused by an operator".into());
        audit(gw, "rollout_pause", &r, m);
        let s = status(&r);
        drop(r);
        Ok(s)
    }

    /// An operator's abort: canary weight 0, canary alias deleted.
    pub async fn abort(&self, gw: &Gateway, model: &str) -> Result<Value, RolloutError> {
        self.follow(model)?;
        self.pull(model).await?;
        let run = self.run(model)?;
        let action = {
            let mut r = lock(&run);
            let id = r.rollout.id.clone();
            let action = r
                .rollout
                .abort("the canary alias is rolled back")
                .map_err(|source| RolloutError::State { id, source })?;
            note_end(&mut r, &action);
            r.ended_ms = Some(gw.now_ms());
            action
        };
        if self.shared().is_some() {
            self.commit(&run).await?;
        } else {
            self.save();
        }
        self.act(gw, &run, action).await;
        let mut s = status(&lock(&run));
        self.shared_status(&run, &mut s).await;
        Ok(s)
    }

    /// The model's last rollout: phase, weight and every verdict; with a
    /// shared store also the replica driving it (`driver`) and the step's
    /// samples pooled from every replica.
    pub async fn status(&self, model: &str) -> Result<Value, RolloutError> {
        self.follow(model)?;
        self.pull(model).await?;
        let run = self.run(model)?;
        let mut s = status(&lock(&run));
        self.shared_status(&run, &mut s).await;
        Ok(s)
    }

    async fn drive(self, gw: Gateway, run: Arc<Mutex<Run>>) {
        let every = Duration::from_secs(lock(&run).interval_s);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let action = {
                let mut r = lock(&run);
                let windows = gw.samples().take(&r.model).unwrap_or_default();
                match r.rollout.phase {
                    Phase::Aborted | Phase::Promoted => return,
                    Phase::Paused => continue,
                    Phase::Progressing => {}
                }
                let (sv, cv) = (
                    format!("v{}", r.stable_version),
                    format!("v{}", r.canary_version),
                );
                for (d, w) in windows {
                    if d == sv {
                        r.stable.extend(w.samples);
                    } else if d == cv {
                        r.canary.extend(w.samples);
                    }
                }
                let Run {
                    rollout,
                    stable,
                    canary,
                    ..
                } = &mut *r;
                let action = rollout.on_interval(stable, canary);
                if let Some(v) = r.rollout.verdicts.last() {
                    let mut m = Map::new();
                    m.insert("step".into(), v.step.into());
                    m.insert("weight".into(), v.weight.into());
                    m.insert("interval".into(), v.interval.into());
                    m.insert("decision".into(), json!(v.decision));
                    m.insert(
                        "checks".into(),
                        v.analysis
                            .checks
                            .iter()
                            .map(|c| Value::String(c.to_string()))
                            .collect(),
                    );
                    audit(&gw, "rollout_verdict", &r, m);
                }
                note_end(&mut r, &action);
                action
            };
            // Every verdict is kept, the held steps' ones included.
            self.save();
            self.act(&gw, &run, action).await;
        }
    }

    /// Carries out what the rollout asked for.
    async fn act(&self, gw: &Gateway, run: &Arc<Mutex<Run>>, action: Action) {
        let follow = {
            let r = lock(run);
            match self.follow(&r.model) {
                Ok(f) => f.clone(),
                Err(_) => return,
            }
        };
        let set = |w: u32| {
            follow.canary_percent.store(w, Ordering::SeqCst);
            self.0.wake.notify_one();
        };
        match action {
            Action::Continue => {}
            Action::SetWeight { weight } => {
                let from = follow.canary_percent.load(Ordering::SeqCst);
                set(weight);
                let mut r = lock(run);
                r.stable.clear();
                r.canary.clear();
                // With a shared store the replica's samples are pooled
                // under the step they were served at.
                if self.shared().is_none() {
                    gw.samples().take(&r.model);
                }
                let mut m = Map::new();
                m.insert("from".into(), from.into());
                m.insert("weight".into(), weight.into());
                audit(gw, "rollout_weight", &r, m);
            }
            Action::Pause { reason } => {
                let r = lock(run);
                let mut m = Map::new();
                m.insert("reason".into(), reason.into());
                audit(gw, "rollout_pause", &r, m);
            }
            Action::Abort { reason } => {
                let from = follow.canary_percent.load(Ordering::SeqCst);
                set(0);
                let (rm, model) = {
                    let r = lock(run);
                    let mut m = Map::new();
                    m.insert("from".into(), from.into());
                    m.insert("weight".into(), 0.into());
                    m.insert("reason".into(), reason.clone().into());
                    audit(gw, "rollout_abort", &r, m);
                    gw.samples().unwatch(&r.model);
                    (r.registry_model.clone(), r.model.clone())
                };
                tracing::warn!(model = %model, registry_model = %rm, %reason, "rollout aborted; the canary alias is rolled back");
                self.change_alias(gw, run, Action::Abort { reason }).await;
            }
            Action::Promote { reason } => {
                set(100);
                let (model, m_name) = {
                    let r = lock(run);
                    let mut m = Map::new();
                    m.insert("weight".into(), 100.into());
                    audit(gw, "rollout_weight", &r, m);
                    gw.samples().unwatch(&r.model);
                    (r.registry_model.clone(), r.model.clone())
                };
                tracing::info!(model = %m_name, registry_model = %model, %reason, "rollout promoted; the stable alias moves to the canary's version");
                self.change_alias(gw, run, Action::Promote { reason }).await;
            }
        }
    }

    /// Makes the alias change of an abort or a promotion: at once, and
    /// while the registry cannot be reached, times out or answers 5xx,
    /// again after 1, 2, 4 ... (at most 30) seconds in a task of its own
    /// (the change stays owed in the state file, so a restarted gateway
    /// makes it too). A refusal (4xx) is final and recorded.
    async fn change_alias(&self, gw: &Gateway, run: &Arc<Mutex<Run>>, action: Action) {
        // With a shared store the replica holding the lease sends it again.
        if self.try_change_alias(gw, run, &action).await || self.shared().is_some() {
            return;
        }
        let me = self.clone();
        let gw = gw.clone();
        let run = run.clone();
        tokio::spawn(async move {
            let mut wait = Duration::from_secs(1);
            loop {
                tokio::time::sleep(wait).await;
                if me.try_change_alias(&gw, &run, &action).await {
                    return;
                }
                wait = (wait * 2).min(MAX_RETRY_WAIT);
            }
        });
    }

    /// One try of an alias change; `true` when nothing is owed any more
    /// (made, or refused for good).
    async fn try_change_alias(&self, gw: &Gateway, run: &Arc<Mutex<Run>>, action: &Action) -> bool {
        let (model, stable_alias, canary_alias, version) = {
            let r = lock(run);
            (
                r.registry_model.clone(),
                r.stable_alias.clone(),
                r.canary_alias.clone(),
                r.canary_version,
            )
        };
        let (event, reason, res) = match action {
            Action::Abort { reason } => (
                "rollout_rollback",
                reason,
                match &self.0.writer {
                    Some(w) => w.delete_alias(&model, &canary_alias, reason).await,
                    None => Ok(()),
                },
            ),
            Action::Promote { reason } => (
                "rollout_promote",
                reason,
                match &self.0.writer {
                    Some(w) => w.set_alias(&model, &stable_alias, version, reason).await,
                    None => Ok(()),
                },
            ),
            _ => return true,
        };
        let ok = res.is_ok();
        let done = self.registry_result(gw, run, event, reason, res);
        if self.shared().is_some() {
            // Every replica returns the canary share to 0 once it routes
            // the moved stable alias. The answer is recorded on the newest
            // record, whoever changed it meanwhile.
            let (registry, pending, model) = {
                let r = lock(run);
                (r.registry.clone(), r.registry_pending, r.model.clone())
            };
            for _ in 0..5 {
                match self.push(run, false).await {
                    Ok(true) => break,
                    Ok(false) => {
                        if let Ok(Some(fresh)) = self.pull(&model).await {
                            let mut r = lock(&fresh);
                            r.registry = registry.clone();
                            r.registry_pending = pending;
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %chain(&e), "the registry's answer could not be recorded in Redis");
                        break;
                    }
                }
            }
            return done;
        }
        if ok && matches!(action, Action::Promote { .. }) {
            // The follower reads the moved stable alias first; the canary
            // share then returns to 0 so that the next canary starts from
            // nothing.
            tokio::time::sleep(Duration::from_millis(500)).await;
            if let Ok(f) = self.follow(&lock(run).model) {
                f.canary_percent.store(0, Ordering::SeqCst);
                self.0.wake.notify_one();
            }
        }
        done
    }

    fn registry_result(
        &self,
        gw: &Gateway,
        run: &Arc<Mutex<Run>>,
        event: &str,
        reason: &str,
        res: Result<(), RegistrySourceError>,
    ) -> bool {
        let mut r = lock(run);
        let mut m = Map::new();
        m.insert("registry_model".into(), r.registry_model.clone().into());
        m.insert("reason".into(), reason.into());
        m.insert("ok".into(), res.is_ok().into());
        let pending = res.as_ref().err().is_some_and(retried);
        if let Err(e) = &res {
            let msg = chain(e);
            if pending {
                tracing::warn!(model = %r.model, error = %msg, "the registry did not answer the rollout's alias change: it is sent again");
            } else {
                tracing::error!(model = %r.model, error = %msg, "the registry refused the rollout's alias change");
            }
            m.insert("error".into(), msg.into());
        }
        m.insert("pending".into(), pending.into());
        r.registry = Some(Value::Object(m.clone()));
        r.registry_pending = pending;
        audit(gw, event, &r, m);
        drop(r);
        self.save();
        !pending
    }
}

/// The longest wait between two tries of an alias change.
const MAX_RETRY_WAIT: Duration = Duration::from_secs(30);

/// Whether an alias change that failed with `e` is sent again: the
/// registry could not be reached, did not answer in time or failed
/// (5xx). A refusal (4xx) is its answer.
fn retried(e: &RegistrySourceError) -> bool {
    match e {
        RegistrySourceError::Unreachable { .. } | RegistrySourceError::Timeout { .. } => true,
        RegistrySourceError::Status { status, .. } => *status >= 500,
        _ => false,
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

fn audit(gw: &Gateway, event: &str, r: &Run, mut m: Map<String, Value>) {
    m.insert("rollout_id".into(), r.rollout.id.clone().into());
    m.insert("model".into(), r.model.clone().into());
    gw.audit_rollout(event, m);
}

/// A rollout as the admin API and `keel serve rollout status` show it.
fn status(r: &Run) -> Value {
    json!({
        "version": 1,
        "id": r.rollout.id,
        "model": r.model,
        "registry_model": r.registry_model,
        "started": r.started,
        "stable": {"alias": r.stable_alias, "version": r.stable_version},
        "canary": {"alias": r.canary_alias, "version": r.canary_version},
        "phase": r.rollout.phase,
        "weight": r.rollout.weight(),
        "steps": r.rollout.plan.steps,
        "interval_s": r.interval_s,
        "store": "file",
        "samples": {"stable": r.stable.len(), "canary": r.canary.len()},
        "registry": r.registry,
        "reason": r.end_reason,
        "verdicts": r.rollout.verdicts.iter().map(|v| json!({
            "step": v.step,
            "weight": v.weight,
            "interval": v.interval,
            "decision": v.decision,
            "checks": v.analysis.checks,
            "summary": v.analysis.checks.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

impl keel_error::HasKind for RolloutError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::StateCorrupt { .. } => K::Input,
            Self::StateLocked { .. } => K::Usage,
            Self::StateRead(_) | Self::NotRecorded { .. } => K::Io,
            Self::WriteRefused { .. } => K::Permission,
            _ => K::Usage,
        }
    }
}
