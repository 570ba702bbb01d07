//! Progressive rollouts of the models that follow the registry: the
//! gateway's side of `keel_canary::rollout`.
//!
//! [`Rollouts::start`] checks that the model follows a registry model
//! whose canary alias names a version other than the stable one, watches
//! the model's per-request samples ([`crate::samples`]) and sets the
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
//! Every weight change, verdict, promotion and rollback is an audit event
//! (`rollout_start`, `rollout_weight`, `rollout_verdict`, `rollout_pause`,
//! `rollout_resume`, `rollout_abort`, `rollout_rollback`,
//! `rollout_promote`) carrying `rollout_id`, the id that also opens the
//! reason recorded in the registry's alias history.

// Errors are returned per admin call: their size does not matter.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_canary::analysis::{Sample, StepPolicy, Thresholds};
use keel_canary::rollout::{Action, Phase, Plan, Rollout};
use serde_json::{json, Map, Value};

use crate::config::RolloutConfig;
use crate::registry_follow::Follow;
use crate::registry_source::{RegistryClient, RegistrySourceError};
use crate::Gateway;

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
    #[error("model {model:?} has rollout {id} in progress")]
    Running { model: String, id: String },
    #[error("model {model:?} has no rollout")]
    NoRollout { model: String },
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
            _ => 409,
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
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Rollouts {
    /// `reader` resolves aliases, `writer` (a key with write rights)
    /// changes them; `wake` makes the follower apply a new canary share at
    /// once.
    pub fn new(
        cfg: &crate::GatewayConfig,
        follows: Vec<Follow>,
        reader: RegistryClient,
        writer: Option<RegistryClient>,
        wake: Arc<tokio::sync::Notify>,
    ) -> Self {
        let configs = cfg
            .models
            .iter()
            .map(|m| (m.name.clone(), m.rollout.clone()))
            .collect();
        Rollouts(Arc::new(Inner {
            reader,
            writer,
            follows,
            configs,
            wake,
            runs: Mutex::new(HashMap::new()),
            seq: AtomicU64::new(0),
        }))
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
                    Phase::Aborted | Phase::Promoted => None,
                }
            };
            if let Some(action) = resumed {
                self.act(gw, &run, action).await;
                let s = status(&lock(&run));
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
        let cfg = self.0.configs.get(model).cloned().unwrap_or_default();
        let plan = Plan {
            steps: cfg.steps.clone(),
            thresholds: Thresholds::default(),
            policy: StepPolicy {
                min_canary_samples: cfg.min_canary_samples,
                max_intervals: cfg.max_intervals,
            },
        };
        let now = gw.now_ms();
        let id = format!(
            "ro-{}-{}",
            crate::clock::rfc3339(now)
                .replace([':', '-'], "")
                .trim_end_matches('Z')
                .split('.')
                .next()
                .unwrap_or_default(),
            self.0.seq.fetch_add(1, Ordering::Relaxed) + 1
        );
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
            started: crate::clock::rfc3339(now),
        }));
        {
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
            runs.insert(model.to_owned(), run.clone());
        }
        gw.samples().watch(model);
        {
            let r = lock(&run);
            let mut m = Map::new();
            m.insert("steps".into(), json!(cfg.steps));
            m.insert("interval_s".into(), cfg.interval_s.into());
            audit(gw, "rollout_start", &r, m);
        }
        self.act(gw, &run, action).await;
        let me = self.clone();
        let gw2 = gw.clone();
        let run2 = run.clone();
        tokio::spawn(async move { me.drive(gw2, run2).await });
        let s = status(&lock(&run));
        Ok(s)
    }

    /// An operator's pause: the weight stays, the analysis stops.
    pub fn pause(&self, gw: &Gateway, model: &str) -> Result<Value, RolloutError> {
        let run = self.run(model)?;
        let mut r = lock(&run);
        let id = r.rollout.id.clone();
        r.rollout
            .pause()
            .map_err(|source| RolloutError::State { id, source })?;
        let mut m = Map::new();
        m.insert("reason".into(), "paused by an operator".into());
        audit(gw, "rollout_pause", &r, m);
        Ok(status(&r))
    }

    /// An operator's abort: canary weight 0, canary alias deleted.
    pub async fn abort(&self, gw: &Gateway, model: &str) -> Result<Value, RolloutError> {
        let run = self.run(model)?;
        let action = {
            let mut r = lock(&run);
            let id = r.rollout.id.clone();
            r.rollout
                .abort("the canary alias is rolled back")
                .map_err(|source| RolloutError::State { id, source })?
        };
        self.act(gw, &run, action).await;
        let s = status(&lock(&run));
        Ok(s)
    }

    /// The model's last rollout: phase, weight and every verdict.
    pub fn status(&self, model: &str) -> Result<Value, RolloutError> {
        self.follow(model)?;
        let run = self.run(model)?;
        let s = status(&lock(&run));
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
                action
            };
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
                gw.samples().take(&r.model);
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
                let (model, alias, rm) = {
                    let r = lock(run);
                    let mut m = Map::new();
                    m.insert("from".into(), from.into());
                    m.insert("weight".into(), 0.into());
                    m.insert("reason".into(), reason.clone().into());
                    audit(gw, "rollout_abort", &r, m);
                    gw.samples().unwatch(&r.model);
                    (
                        r.registry_model.clone(),
                        r.canary_alias.clone(),
                        r.model.clone(),
                    )
                };
                let res = match &self.0.writer {
                    Some(w) => w.delete_alias(&model, &alias, &reason).await,
                    None => Ok(()),
                };
                self.registry_result(gw, run, "rollout_rollback", &reason, res);
                tracing::warn!(model = %rm, registry_model = %model, %reason, "rollout aborted; canary alias rolled back");
            }
            Action::Promote { reason } => {
                set(100);
                let (model, alias, version, m_name) = {
                    let r = lock(run);
                    let mut m = Map::new();
                    m.insert("weight".into(), 100.into());
                    audit(gw, "rollout_weight", &r, m);
                    gw.samples().unwatch(&r.model);
                    (
                        r.registry_model.clone(),
                        r.stable_alias.clone(),
                        r.canary_version,
                        r.model.clone(),
                    )
                };
                let res = match &self.0.writer {
                    Some(w) => w.set_alias(&model, &alias, version, &reason).await,
                    None => Ok(()),
                };
                let ok = res.is_ok();
                self.registry_result(gw, run, "rollout_promote", &reason, res);
                if ok {
                    // The follower reads the moved stable alias first; the
                    // canary share then returns to 0 so that the next
                    // canary starts from nothing.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    set(0);
                }
                tracing::info!(model = %m_name, registry_model = %model, %reason, "rollout promoted");
            }
        }
    }

    fn registry_result(
        &self,
        gw: &Gateway,
        run: &Arc<Mutex<Run>>,
        event: &str,
        reason: &str,
        res: Result<(), RegistrySourceError>,
    ) {
        let mut r = lock(run);
        let mut m = Map::new();
        m.insert("registry_model".into(), r.registry_model.clone().into());
        m.insert("reason".into(), reason.into());
        m.insert("ok".into(), res.is_ok().into());
        if let Err(e) = &res {
            let msg = chain(e);
            tracing::error!(model = %r.model, error = %msg, "the registry refused the rollout's alias change");
            m.insert("error".into(), msg.into());
        }
        r.registry = Some(Value::Object(m.clone()));
        audit(gw, event, &r, m);
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
        "samples": {"stable": r.stable.len(), "canary": r.canary.len()},
        "registry": r.registry,
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
