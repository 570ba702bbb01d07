//! Following the registry: the gateway models that name a registry model
//! route to the versions its aliases point at, and follow alias changes
//! (`keel model alias set`, `keel model rollback`, MLflow's API) by polling
//! the registry ([`Follower::run`], every second by default) and swapping
//! in the new routing ([`Gateway::apply`]) when it changed.
//!
//! At start ([`Follower::new`]) every followed model must resolve: a bad
//! model, alias, backend tag or key is an error, never a fallback. Later,
//! when the registry cannot be read or refuses a change (say, an alias
//! moved to a version with no backend), the gateway keeps serving its last
//! known routing; each failed poll counts in `keel_errors_total{route=
//! "registry", kind="registry_unreachable" | "registry_refused"}` and the
//! first of a run of failures, and the recovery, are logged.
//!
//! A followed model's deployments in the configuration are its template:
//! the first one's backend model name and health path apply to every
//! version; the deployments become `v<N>` with the URL of version N's
//! `keel.backend` tag, the stable version taking `100 - canary_percent` and
//! the canary version (when its alias is set and the percentage is above
//! 0) `canary_percent`.

// Errors are returned once at start or per reload, never per request: their
// size does not matter.
#![allow(clippy::result_large_err)]

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::registry_source::{ModelSource, RegistryClient, RegistrySourceError, Routing};
use keel_gateway::config::{DeploymentConfig, GatewayConfig};
use keel_gateway::Gateway;

/// A gateway model that follows a registry model's aliases.
#[derive(Debug, Clone)]
pub struct Follow {
    /// The model's name in the gateway configuration.
    pub model: String,
    pub source: ModelSource,
    /// The canary's share of traffic in percent (0 to 100), read at every
    /// poll: a rollout moves it.
    pub canary_percent: Arc<AtomicU32>,
    /// The stable version of the routing this gateway serves now (0 until
    /// the follower applied one): replicas sharing a rollout return the
    /// canary's share to 0 after a promotion only once they route the
    /// stable alias to the promoted version.
    pub applied_stable: Arc<AtomicU64>,
}

#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    #[error("gateway model {model:?} follows registry model {registry_model:?}")]
    Source {
        model: String,
        registry_model: String,
        #[source]
        source: RegistrySourceError,
    },
    #[error("gateway model {model:?} is not in the configuration or has no deployment to use as its template")]
    NoTemplate { model: String },
    #[error("the models that follow the registry, or their aliases, changed: restart keel serve to follow {now:?}")]
    FollowsChanged { now: Vec<String> },
    #[error("cannot read the registry key file {path}")]
    KeyFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the registry key file {path} is empty")]
    EmptyKey { path: std::path::PathBuf },
    #[error("the registry client cannot be set up")]
    Client(#[source] RegistrySourceError),
}

/// The follows a configuration asks for (its models with `registry`),
/// every canary share starting at 0.
pub fn follows(cfg: &GatewayConfig) -> Vec<Follow> {
    cfg.models
        .iter()
        .filter_map(|m| {
            let r = m.registry.as_ref()?;
            Some(Follow {
                model: m.name.clone(),
                source: ModelSource {
                    model: r.model.clone(),
                    stable_alias: r.stable.clone(),
                    canary_alias: r.canary.clone(),
                    require_signature: r.require_signature,
                    allowed_backends: r.allowed_backends.clone(),
                },
                canary_percent: Arc::new(AtomicU32::new(0)),
                applied_stable: Arc::new(AtomicU64::new(0)),
            })
        })
        .collect()
}

/// The registry client of a configuration's `[registry]`, with the key
/// read from its key file (first line, trimmed); `None` without one.
pub fn client(cfg: &GatewayConfig) -> Result<Option<RegistryClient>, FollowError> {
    let Some(r) = &cfg.registry else {
        return Ok(None);
    };
    client_with(&r.url, r.ca_file.as_deref(), &r.key_file).map(Some)
}

/// The registry client rollouts change aliases with: the key of
/// `registry.write_key_file`; `None` without one.
pub fn write_client(cfg: &GatewayConfig) -> Result<Option<RegistryClient>, FollowError> {
    let Some(r) = &cfg.registry else {
        return Ok(None);
    };
    let Some(path) = &r.write_key_file else {
        return Ok(None);
    };
    client_with(&r.url, r.ca_file.as_deref(), path).map(Some)
}

fn client_with(
    url: &str,
    ca_file: Option<&std::path::Path>,
    path: &std::path::Path,
) -> Result<RegistryClient, FollowError> {
    let text =
        keel_fs::read_regular_to_string(path, keel_fs::MAX_CONFIG_BYTES).map_err(|source| {
            FollowError::KeyFile {
                path: path.to_owned(),
                source,
            }
        })?;
    let key = text.lines().next().unwrap_or_default().trim();
    if key.is_empty() {
        return Err(FollowError::EmptyKey {
            path: path.to_owned(),
        });
    }
    RegistryClient::with_ca(url, key, ca_file).map_err(FollowError::Client)
}

/// What one poll did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poll {
    /// The registry says what it said last time.
    Unchanged,
    /// The routing changed and the new configuration is being served.
    Applied,
    /// The registry could not be read, or refused; the last known routing
    /// stays.
    Kept(String),
}

/// Polls the registry for the followed models.
#[derive(Debug)]
pub struct Follower {
    client: RegistryClient,
    follows: Vec<Follow>,
    shared: Shared,
    failing: bool,
    wake: Arc<tokio::sync::Notify>,
}

/// What a reload needs: the configuration routes are laid over and the
/// routing last applied, per follow.
#[derive(Debug, Clone)]
struct Shared(Arc<Mutex<State>>);

/// The configuration routes are laid over, and the routing last applied.
type State = (GatewayConfig, Vec<(Routing, u32)>);

impl Shared {
    fn get(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Lays the registry's routing over configurations read again (SIGHUP,
/// `POST /admin/reload`), so a reload keeps following the registry.
#[derive(Debug, Clone)]
pub struct Reroute {
    follows: Vec<(String, ModelSource)>,
    shared: Shared,
}

impl Reroute {
    /// `cfg` with the last known routing; refused when the configuration
    /// changes which models follow the registry or how.
    pub fn apply(&self, cfg: GatewayConfig) -> Result<GatewayConfig, FollowError> {
        let now: Vec<(String, ModelSource)> = follows(&cfg)
            .into_iter()
            .map(|f| (f.model, f.source))
            .collect();
        if now != self.follows {
            return Err(FollowError::FollowsChanged {
                now: now.into_iter().map(|(m, _)| m).collect(),
            });
        }
        let mut g = self.shared.get();
        let fs: Vec<Follow> = self
            .follows
            .iter()
            .map(|(m, s)| Follow {
                model: m.clone(),
                source: s.clone(),
                canary_percent: Arc::new(AtomicU32::new(0)),
                applied_stable: Arc::new(AtomicU64::new(0)),
            })
            .collect();
        let routed = routed(&cfg, &fs, &g.1)?;
        g.0 = cfg;
        Ok(routed)
    }
}

impl Follower {
    /// Resolves every followed model and returns the follower with the
    /// configuration to start the gateway with.
    pub async fn new(
        client: RegistryClient,
        follows: Vec<Follow>,
        base: GatewayConfig,
    ) -> Result<(Self, GatewayConfig), FollowError> {
        let mut last = Vec::with_capacity(follows.len());
        for f in &follows {
            let r = client
                .resolve(&f.source)
                .await
                .map_err(|source| FollowError::Source {
                    model: f.model.clone(),
                    registry_model: f.source.model.clone(),
                    source,
                })?;
            f.applied_stable.store(r.stable.version, Ordering::SeqCst);
            last.push((r, f.canary_percent.load(Ordering::Relaxed).min(100)));
        }
        let cfg = routed(&base, &follows, &last)?;
        Ok((
            Follower {
                client,
                follows,
                shared: Shared(Arc::new(Mutex::new((base, last)))),
                failing: false,
                wake: Arc::new(tokio::sync::Notify::new()),
            },
            cfg,
        ))
    }

    /// The handle a reload function lays the routing over new
    /// configurations with.
    pub fn reroute(&self) -> Reroute {
        Reroute {
            follows: self
                .follows
                .iter()
                .map(|f| (f.model.clone(), f.source.clone()))
                .collect(),
            shared: self.shared.clone(),
        }
    }

    /// The followed models, with the canary shares a rollout moves.
    pub fn follows(&self) -> &[Follow] {
        &self.follows
    }

    /// The registry client the follower reads with.
    pub fn client(&self) -> &RegistryClient {
        &self.client
    }

    /// Notifying it makes [`Follower::run`] poll at once (a rollout that
    /// changed a canary share).
    pub fn waker(&self) -> Arc<tokio::sync::Notify> {
        self.wake.clone()
    }

    /// The routing last applied for each followed model.
    pub fn routing(&self) -> Vec<(String, Routing, u32)> {
        self.follows
            .iter()
            .zip(&self.shared.get().1)
            .map(|(f, (r, p))| (f.model.clone(), r.clone(), *p))
            .collect()
    }

    /// Reads the registry once and applies a changed routing to `gw`.
    pub async fn poll(&mut self, gw: &Gateway) -> Poll {
        let mut next = Vec::with_capacity(self.follows.len());
        for f in &self.follows {
            match self.client.resolve(&f.source).await {
                Ok(r) => next.push((r, f.canary_percent.load(Ordering::Relaxed).min(100))),
                Err(e) => {
                    let kind = match e {
                        RegistrySourceError::Unreachable { .. }
                        | RegistrySourceError::Timeout { .. }
                        | RegistrySourceError::Status { .. } => "registry_unreachable",
                        _ => "registry_refused",
                    };
                    gw.metrics().error("registry", kind);
                    let msg = format!("{:#}", DisplayChain(&e));
                    if !self.failing {
                        tracing::warn!(
                            model = %f.model,
                            registry = %self.client.url(),
                            error = %msg,
                            "cannot follow the registry; serving the last known routing"
                        );
                    }
                    self.failing = true;
                    return Poll::Kept(msg);
                }
            }
        }
        if self.failing {
            tracing::info!(registry = %self.client.url(), "following the registry again");
            self.failing = false;
        }
        let cfg = {
            let g = self.shared.get();
            if next == g.1 {
                return Poll::Unchanged;
            }
            match routed(&g.0, &self.follows, &next) {
                Ok(c) => c,
                Err(e) => return Poll::Kept(e.to_string()),
            }
        };
        if let Err(e) = gw.apply(cfg).await {
            gw.metrics().error("registry", "registry_refused");
            tracing::warn!(error = %e, "the registry's routing was not applied; serving the last known routing");
            return Poll::Kept(e.to_string());
        }
        for (f, (r, p)) in self.follows.iter().zip(&next) {
            f.applied_stable.store(r.stable.version, Ordering::SeqCst);
            tracing::info!(
                model = %f.model,
                stable = r.stable.version,
                canary = r.canary.as_ref().map(|c| c.version),
                canary_percent = p,
                "routing follows the registry"
            );
        }
        self.shared.get().1 = next;
        Poll::Applied
    }

    /// Polls every `interval`, and whenever woken ([`Follower::waker`]),
    /// until `shutdown` completes.
    pub async fn run(
        mut self,
        gw: Gateway,
        interval: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let wake = self.wake.clone();
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tick.tick() => { self.poll(&gw).await; }
                _ = wake.notified() => { self.poll(&gw).await; }
            }
        }
    }
}

/// `base` with each followed model's deployments replaced by its versions.
fn routed(
    base: &GatewayConfig,
    follows: &[Follow],
    routing: &[(Routing, u32)],
) -> Result<GatewayConfig, FollowError> {
    let mut cfg = base.clone();
    for (f, (r, percent)) in follows.iter().zip(routing) {
        let no_template = || FollowError::NoTemplate {
            model: f.model.clone(),
        };
        let m = cfg
            .models
            .iter_mut()
            .find(|m| m.name == f.model)
            .ok_or_else(no_template)?;
        let template = m.deployments.first().cloned().ok_or_else(no_template)?;
        let deployment = |version: u64, url: &str, weight: u32| DeploymentConfig {
            name: format!("v{version}"),
            url: url.to_owned(),
            weight,
            ..template.clone()
        };
        let mut deployments = Vec::with_capacity(2);
        let percent = match &r.canary {
            Some(c) if c.version != r.stable.version => *percent,
            _ => 0,
        };
        if percent < 100 {
            deployments.push(deployment(
                r.stable.version,
                &r.stable.backend,
                100 - percent,
            ));
        }
        if let Some(c) = r.canary.as_ref().filter(|_| percent > 0) {
            deployments.push(deployment(c.version, &c.backend, percent));
        }
        // A mirror names a deployment of the file; it cannot follow.
        m.mirror = None;
        m.deployments = deployments;
    }
    Ok(cfg)
}

/// An error with its sources, `a: b: c`.
struct DisplayChain<'a>(&'a dyn std::error::Error);

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut s = self.0.source();
        while let Some(e) = s {
            write!(f, ": {e}")?;
            s = e.source();
        }
        Ok(())
    }
}

impl keel_error::HasKind for FollowError {
    fn kind(&self) -> keel_error::ErrorKind {
        use crate::registry_source::RegistrySourceError as R;
        use keel_error::ErrorKind as K;
        match self {
            Self::KeyFile { .. } => K::Io,
            Self::Source {
                source: R::Unauthorized { .. },
                ..
            } => K::Permission,
            Self::Source {
                source: R::Unreachable { .. } | R::Timeout { .. } | R::Status { .. },
                ..
            } => K::Unavailable,
            _ => K::Usage,
        }
    }
}
