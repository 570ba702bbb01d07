//! The control plane's settings of a model: where its versions come from
//! in the registry (`registry`), its rollout policy (`rollout`) and its
//! drift watch (`drift`), validated into their config types.

use super::*;

/// A model's `registry` key: the aliases it follows, and the template of
/// its versions' deployments (the first deployment of the file, else one
/// named `registry` with the defaults; its URL is replaced by each
/// version's `keel.backend` tag before anything is routed).
pub(super) fn model_registry(
    model: &str,
    r: FileModelRegistry,
    have_registry: bool,
    mirror: bool,
    deployments: &mut Vec<DeploymentConfig>,
    protocol: Protocol,
) -> Result<ModelRegistryConfig, ConfigError> {
    let bad = |m: String| Err(ConfigError::Config(format!("model {model:?}: {m}")));
    if !have_registry {
        return bad("it follows a registry model but there is no [registry] section".into());
    }
    if mirror {
        return bad("a model that follows the registry cannot mirror a deployment".into());
    }
    if r.model.trim().is_empty() {
        return bad("registry.model is empty".into());
    }
    let stable = r.stable.unwrap_or_else(|| "production".into());
    if r.canary.as_deref() == Some(stable.as_str()) {
        return bad(format!(
            "registry.canary and registry.stable are both {stable:?}"
        ));
    }
    deployments.truncate(1);
    if deployments.is_empty() {
        deployments.push(DeploymentConfig {
            name: "registry".into(),
            url: "http://registry.invalid".into(),
            weight: 1,
            model: model.into(),
            health_path: match protocol {
                Protocol::Openai => "/health",
                Protocol::Oip => "/v2/health/ready",
            }
            .into(),
        });
    }
    let require_signature = r.require_signature.unwrap_or(false);
    let allowed_backends: Vec<String> = r
        .allowed_backends
        .unwrap_or_default()
        .into_iter()
        .map(|b| b.trim().trim_end_matches('/').to_owned())
        .collect();
    for b in &allowed_backends {
        let ok = (b.starts_with("http://") || b.starts_with("https://"))
            && b.parse::<http::Uri>().is_ok_and(|u| u.host().is_some());
        if !ok {
            return Err(ConfigError::Config(format!(
                "model {model:?}: registry.allowed_backends entry {:?} is not an http:// or https:// URL",
                b.chars().take(200).collect::<String>()
            )));
        }
    }
    if require_signature && allowed_backends.is_empty() {
        return Err(ConfigError::Config(format!(
            "model {model:?}: registry.require_signature needs registry.allowed_backends, the backends its versions may be served from: the signature covers the files, the backend tag is the registry's to change"
        )));
    }
    Ok(ModelRegistryConfig {
        model: r.model,
        stable,
        canary: r.canary,
        require_signature,
        allowed_backends,
    })
}

pub(super) fn registry_config(
    r: FileRegistry,
    rel: &impl Fn(PathBuf) -> PathBuf,
) -> Result<RegistryConfig, ConfigError> {
    let url = r.url.trim_end_matches('/').to_owned();
    let host = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    if host.is_none_or(str::is_empty) {
        return Err(ConfigError::Config(format!(
            "registry.url {:?} must be http://host:port or https://host:port",
            r.url.chars().take(200).collect::<String>()
        )));
    }
    if r.ca_file.is_some() && !url.starts_with("https://") {
        return Err(ConfigError::Config(
            "registry.ca_file is for an https:// registry.url".into(),
        ));
    }
    let poll_ms = r.poll_ms.unwrap_or(1000);
    if !(100..=60_000).contains(&poll_ms) {
        return Err(ConfigError::Config(format!(
            "registry.poll_ms {poll_ms} must be within 100..60000"
        )));
    }
    let rollout_lease_ms = r.rollout_lease_ms.unwrap_or(10_000);
    if !(1000..=600_000).contains(&rollout_lease_ms) {
        return Err(ConfigError::Config(format!(
            "registry.rollout_lease_ms {rollout_lease_ms} must be within 1000..600000"
        )));
    }
    Ok(RegistryConfig {
        url,
        key_file: rel(r.key_file),
        ca_file: r.ca_file.map(rel),
        poll_ms,
        public_key_file: r.public_key_file.map(rel),
        write_key_file: r.write_key_file.map(rel),
        rollout_state_file: rel(r
            .rollout_state_file
            .unwrap_or_else(|| PathBuf::from("rollouts.json"))),
        rollout_store: r.rollout_store.unwrap_or(RolloutStore::File),
        rollout_lease_ms,
        drift_reference_requests: drift_size(
            "drift_reference_requests",
            r.drift_reference_requests,
        )?,
        drift_window_requests: drift_size("drift_window_requests", r.drift_window_requests)?,
    })
}

pub(super) fn drift_size(key: &str, v: Option<usize>) -> Result<usize, ConfigError> {
    let v = v.unwrap_or(1000);
    if !(10..=1_000_000).contains(&v) {
        return Err(ConfigError::Config(format!(
            "registry.{key} {v} must be within 10..1000000"
        )));
    }
    Ok(v)
}

pub(super) fn drift_config(
    model: &str,
    d: FileModelDrift,
    rel: &impl Fn(PathBuf) -> PathBuf,
    have_write_key: bool,
) -> Result<DriftConfig, ConfigError> {
    let bad = |m: String| Err(ConfigError::Config(format!("model {model:?}: drift.{m}")));
    let def = DriftConfig::default();
    let action = d.action.unwrap_or(def.action);
    match (action, d.fallback_version) {
        (DriftAction::Fallback, None) => {
            return bad("action = \"fallback\" needs fallback_version, the registry version the stable alias moves to".into())
        }
        (DriftAction::Notify, Some(_)) => {
            return bad("fallback_version is used only with action = \"fallback\"".into())
        }
        (DriftAction::Fallback, Some(_)) if !have_write_key => {
            return bad("action = \"fallback\" moves the stable alias and needs registry.write_key_file (a registry key with write rights)".into())
        }
        _ => {}
    }
    let psi_threshold = d.psi_threshold.unwrap_or(def.psi_threshold);
    if !(psi_threshold > 0.0 && psi_threshold <= 100.0) {
        return bad(format!(
            "psi_threshold {psi_threshold} must be above 0 and at most 100"
        ));
    }
    let consecutive = d.consecutive.unwrap_or(def.consecutive);
    if !(1..=1000).contains(&consecutive) {
        return bad(format!("consecutive {consecutive} must be within 1..1000"));
    }
    let interval_s = d.interval_s.unwrap_or(def.interval_s);
    if !(1..=86_400).contains(&interval_s) {
        return bad(format!("interval_s {interval_s} must be within 1..86400"));
    }
    let baseline_file = d.baseline_file.map(rel);
    let baseline = match &baseline_file {
        Some(p) => Some(std::sync::Arc::new(
            crate::drift_baseline::Baseline::read(p, model).map_err(|e| {
                let mut msg = format!("model {model:?}: drift.baseline_file: {e}");
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    msg.push_str(&format!(": {s}"));
                    src = s.source();
                }
                ConfigError::Config(msg)
            })?,
        )),
        None => None,
    };
    Ok(DriftConfig {
        baseline_file,
        action,
        fallback_version: d.fallback_version,
        psi_threshold,
        consecutive,
        interval_s,
        baseline,
    })
}

pub(super) fn rollout_config(model: &str, r: FileRollout) -> Result<RolloutConfig, ConfigError> {
    let d = RolloutConfig::default();
    let c = RolloutConfig {
        steps: r.steps.unwrap_or(d.steps),
        interval_s: r.interval_s.unwrap_or(d.interval_s),
        min_canary_samples: r.min_canary_samples.unwrap_or(d.min_canary_samples),
        max_intervals: r.max_intervals.unwrap_or(d.max_intervals),
        latency_min_increase_ms: r
            .latency_min_increase_ms
            .unwrap_or(d.latency_min_increase_ms),
    };
    let bad = |m: String| Err(ConfigError::Config(format!("model {model:?}: rollout.{m}")));
    let rising = c.steps.windows(2).all(|w| w[0] < w[1]);
    if c.steps.is_empty() || !rising || c.steps[0] == 0 || c.steps.iter().any(|&s| s > 100) {
        return bad(format!(
            "steps {:?} must be weights in percent rising strictly within 1..=100, e.g. [1, 5, 25, 50, 100]",
            c.steps.iter().take(20).collect::<Vec<_>>()
        ));
    }
    if !(1..=86_400).contains(&c.interval_s) {
        return bad(format!(
            "interval_s {} must be within 1..86400",
            c.interval_s
        ));
    }
    // Below the checks' own minimum a step could advance with checks that
    // cannot judge its requests (issue: 0 passed, 7 inconclusive, promoted).
    let least = keel_canary::analysis::Thresholds::default().largest_min_samples();
    if c.min_canary_samples < least {
        return bad(format!(
            "min_canary_samples {} is below {least}, the sample size the canary checks need to decide (error rate, finish reason, empty answers, stream aborts): use at least {least}",
            c.min_canary_samples
        ));
    }
    if c.max_intervals == 0 {
        return bad("max_intervals must be at least 1".into());
    }
    if !(0.0..=3_600_000.0).contains(&c.latency_min_increase_ms) {
        return bad(format!(
            "latency_min_increase_ms {} must be within 0..3600000 (milliseconds)",
            c.latency_min_increase_ms
        ));
    }
    Ok(c)
}
