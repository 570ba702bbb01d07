//! The drift action of the models that follow the registry: every
//! `drift.interval_s` a task per model reads which version the stable
//! alias names, evaluates that version's drift
//! ([`keel_gateway::DriftBook::evaluate`]: the largest PSI of its features
//! whose windows are full) and feeds a [`Sustained`] run: the PSI above
//! `drift.psi_threshold` on `drift.consecutive` consecutive conclusive
//! evaluations. An evaluation is inconclusive, and neither counts nor
//! breaks the run, while no feature has both windows full or when no
//! answer arrived since the previous one.
//!
//! When the run is complete:
//!
//! - `notify` (the default): a warning in the log, a `drift_alarm` audit
//!   event with a drift id (`dr-...`), and
//!   `keel_drift_actions_total{action="notify"}`;
//! - `fallback`: the same, then the stable alias moves to
//!   `drift.fallback_version` in the registry (write key), with the drift
//!   id and the numbers as the reason in the alias history; a
//!   `drift_fallback` audit event carries the same id, the follower applies
//!   the new routing at once, and `keel_drift_actions_total
//!   {action="fallback"}` counts it. The gateway falls back from a version
//!   at most once while it runs: an operator who moves the alias back
//!   (`keel model alias set`, `keel model rollback`) keeps it there.
//!
//! The consecutive breaches are `keel_drift_breaches{model,version}`.
//!
//! Only the output features (completion tokens, answer characters,
//! latency, finish reason, prompt tokens) drive the run and the action.
//! The input features of OIP models are what clients send, so any key
//! allowed to infer could move them: their drift runs alongside on its own
//! [`Sustained`] run (`keel_drift_input_breaches`) and, when it lasts, is a
//! warning, a `drift_input_alarm` audit event and
//! `keel_drift_actions_total{action="input_notify"}`, never a fallback.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_canary::drift::Sustained;
use serde_json::{Map, Value};

use crate::registry_follow::Follow;
use crate::registry_source::{ModelSource, RegistryClient, RegistrySourceError};
use keel_gateway::config::{DriftAction, DriftConfig, GatewayConfig};
use keel_gateway::Gateway;

/// A fallback version the registry cannot route to, found at start.
#[derive(Debug, thiserror::Error)]
#[error("model {model:?}: drift.fallback_version {version} of registry model {registry_model:?} cannot take the traffic")]
pub struct FallbackError {
    pub model: String,
    pub registry_model: String,
    pub version: u64,
    #[source]
    pub source: RegistrySourceError,
}

/// What the drift tasks need.
#[derive(Debug, Clone)]
pub struct DriftActions {
    reader: RegistryClient,
    writer: Option<RegistryClient>,
    wake: Arc<tokio::sync::Notify>,
    models: Vec<(Follow, DriftConfig)>,
    seq: Arc<AtomicU64>,
}

impl DriftActions {
    /// The drift watches of `cfg`'s followed models; `reader` resolves the
    /// stable alias, `writer` moves it for `fallback`, `wake` makes the
    /// follower apply a moved alias at once.
    pub fn new(
        cfg: &GatewayConfig,
        follows: &[Follow],
        reader: RegistryClient,
        writer: Option<RegistryClient>,
        wake: Arc<tokio::sync::Notify>,
    ) -> Self {
        let models = follows
            .iter()
            .filter_map(|f| {
                let m = cfg.models.iter().find(|m| m.name == f.model)?;
                Some((f.clone(), m.drift.clone()))
            })
            .collect();
        DriftActions {
            reader,
            writer,
            wake,
            models,
            seq: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Checks that every fallback version can take the traffic now
    /// (READY, signed when required, a backend): an error at start rather
    /// than at the first drift.
    pub async fn check(&self) -> Result<(), FallbackError> {
        for (f, d) in &self.models {
            if let (DriftAction::Fallback, Some(v)) = (d.action, d.fallback_version) {
                self.reader
                    .route_version(&f.source, "drift.fallback_version", v)
                    .await
                    .map_err(|source| FallbackError {
                        model: f.model.clone(),
                        registry_model: f.source.model.clone(),
                        version: v,
                        source,
                    })?;
            }
        }
        Ok(())
    }

    /// Starts one task per followed model.
    pub fn spawn(&self, gw: &Gateway) {
        for (f, d) in &self.models {
            let me = self.clone();
            let (f, d, gw) = (f.clone(), d.clone(), gw.clone());
            tokio::spawn(async move { me.watch(gw, f, d).await });
        }
    }

    async fn watch(self, gw: Gateway, f: Follow, d: DriftConfig) {
        let every = Duration::from_secs(d.interval_s);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut run = Sustained::new(d.psi_threshold, d.consecutive);
        let mut input_run = Sustained::new(d.psi_threshold, d.consecutive);
        let mut watched: Option<u64> = None;
        let mut fell_back: HashSet<u64> = HashSet::new();
        loop {
            tick.tick().await;
            // The registry down: no evaluation (the follower says so).
            let Ok(routing) = self.reader.resolve(&f.source).await else {
                continue;
            };
            let version = routing.stable.version;
            if watched != Some(version) {
                run.reset();
                input_run.reset();
                watched = Some(version);
            }
            let dep = format!("v{version}");
            // Input drift is the clients' to choose: reported, never acted
            // on.
            let (evaluation, worst) = gw.drift().evaluate_inputs(&f.model, &dep);
            let input_fired = input_run.observe(evaluation);
            gw.drift()
                .set_input_streak(&f.model, &dep, input_run.streak());
            if input_fired {
                let (feature, psi) = worst.unwrap_or_default();
                tracing::warn!(model = %f.model, version = %dep, %feature, psi, "input drift above the threshold (reported only)");
                gw.audit_drift("drift_input_alarm", alarm(&f.model, &dep, feature, psi, &d));
                gw.drift().count_action(&f.model, &dep, "input_notify");
            }
            let (evaluation, worst) = gw.drift().evaluate(&f.model, &dep);
            let fired = run.observe(evaluation);
            gw.drift().set_streak(&f.model, &dep, run.streak());
            if !fired {
                continue;
            }
            let (feature, psi) = worst.unwrap_or_default();
            let now = gw.now_ms();
            let id = crate::event_id("dr", now, self.seq.fetch_add(1, Ordering::Relaxed) + 1);
            let reason = format!(
                "drift {id}: {dep} PSI {psi:.3} of {feature} above {} on {} consecutive evaluations",
                d.psi_threshold, d.consecutive
            );
            tracing::warn!(model = %f.model, version = %dep, %feature, psi, drift_id = %id, "output drift above the threshold");
            let mut m = alarm(&f.model, &dep, feature, psi, &d);
            m.insert("drift_id".into(), id.clone().into());
            m.insert(
                "action".into(),
                match d.action {
                    DriftAction::Notify => "notify",
                    DriftAction::Fallback => "fallback",
                }
                .into(),
            );
            gw.audit_drift("drift_alarm", m);
            gw.drift().count_action(&f.model, &dep, "notify");
            let (DriftAction::Fallback, Some(to)) = (d.action, d.fallback_version) else {
                continue;
            };
            let skip = if to == version {
                Some("the drifting version is the fallback version")
            } else if fell_back.contains(&version) {
                Some("the gateway already fell back from this version and an operator moved the alias back")
            } else {
                None
            };
            let res = match skip {
                Some(s) => Err(s.to_owned()),
                None => self.fall_back(&f.source, version, to, &reason).await,
            };
            let mut m = Map::new();
            m.insert("drift_id".into(), id.clone().into());
            m.insert("model".into(), f.model.clone().into());
            m.insert("registry_model".into(), f.source.model.clone().into());
            m.insert("alias".into(), f.source.stable_alias.clone().into());
            m.insert("from_version".into(), version.into());
            m.insert("to_version".into(), to.into());
            m.insert("reason".into(), reason.clone().into());
            m.insert("ok".into(), res.is_ok().into());
            if let Err(e) = &res {
                m.insert("error".into(), e.clone().into());
            }
            gw.audit_drift("drift_fallback", m);
            match res {
                Ok(()) => {
                    // A new drift of this version starts from nothing.
                    run.reset();
                    gw.drift().set_streak(&f.model, &dep, 0);
                    fell_back.insert(version);
                    gw.drift().count_action(&f.model, &dep, "fallback");
                    gw.drift().clear_current(&f.model, &dep);
                    self.wake.notify_one();
                    tracing::warn!(model = %f.model, from = version, to, drift_id = %id, "drift: the stable alias moved to the fallback version");
                }
                Err(e) => {
                    tracing::error!(model = %f.model, from = version, to, drift_id = %id, error = %e, "drift: no fallback")
                }
            }
        }
    }

    /// Moves `src`'s stable alias from `from` to `to`, if `to` can take
    /// the traffic.
    async fn fall_back(
        &self,
        src: &ModelSource,
        from: u64,
        to: u64,
        reason: &str,
    ) -> Result<(), String> {
        let w = self
            .writer
            .as_ref()
            .ok_or("no registry.write_key_file to move the alias with")?;
        self.reader
            .route_version(src, "drift.fallback_version", to)
            .await
            .map_err(|e| chain(&e))?;
        w.set_alias(
            &src.model,
            &src.stable_alias,
            to,
            &format!("{reason}; stable traffic moves from version {from} to version {to}"),
        )
        .await
        .map_err(|e| chain(&e))
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

/// The drift status of `model` for the admin API.
pub fn status(gw: &Gateway, model: &str) -> Option<Value> {
    gw.drift().status(model)
}

/// What both drift alarms say: the model, its version, the worst feature
/// and its PSI, and the rule that fired.
fn alarm(
    model: &str,
    version: &str,
    feature: String,
    psi: f64,
    d: &DriftConfig,
) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("model".into(), model.into());
    m.insert("version".into(), version.into());
    m.insert("feature".into(), feature.into());
    m.insert("psi".into(), psi.into());
    m.insert("threshold".into(), d.psi_threshold.into());
    m.insert("consecutive".into(), d.consecutive.into());
    m
}
