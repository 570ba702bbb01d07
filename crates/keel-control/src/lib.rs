//! keel serve's control plane: the gateway models that follow the model
//! registry route to the versions its aliases name ([`registry_follow`],
//! over the registry's HTTP API in [`registry_source`]), a model's canary
//! rolls out step by step on the gateway's own samples ([`rollout`]), and
//! drift on a stable version notifies or falls back ([`drift_action`]).
//!
//! It drives the data plane (keel-gateway) through its narrow face,
//! `keel_gateway::control`: routing tables and weights in
//! (`Gateway::apply`), samples and drift windows out, its events into the
//! audit log, and the admin API's rollout routes answered by [`Rollouts`].
//! [`Control::prepare`] resolves the routing to start the gateway with;
//! [`Control::start`] starts every task on the running gateway.
//!
//! It reads no environment and no wall clock (the gateway's injected
//! clock), prints nothing and never exits.

pub mod drift_action;
pub mod registry_follow;
pub mod registry_source;
pub mod rollout;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keel_gateway::control::{AdminError, AdminFuture, RolloutAdmin, RolloutCall};
use keel_gateway::{Gateway, GatewayConfig, WeakGateway};

pub use drift_action::{DriftActions, FallbackError};
pub use registry_follow::{FollowError, Follower, Reroute};
pub use registry_source::{RegistryClient, SignatureCheck};
pub use rollout::{RolloutError, Rollouts};

/// Why the control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Follow(Box<FollowError>),
    #[error(transparent)]
    Fallback(Box<FallbackError>),
    #[error(transparent)]
    Rollout(Box<RolloutError>),
}

impl From<FollowError> for ControlError {
    fn from(e: FollowError) -> Self {
        ControlError::Follow(Box::new(e))
    }
}

impl From<FallbackError> for ControlError {
    fn from(e: FallbackError) -> Self {
        ControlError::Fallback(Box::new(e))
    }
}

impl From<RolloutError> for ControlError {
    fn from(e: RolloutError) -> Self {
        ControlError::Rollout(Box::new(e))
    }
}

/// The kind of an error of this crate
/// (keel-error's contract: the binary maps a kind to an exit code). A
/// drift fallback version the registry cannot route to is left
/// unclassified (the binary's default), as it always was.
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    use keel_error::HasKind;
    if let Some(c) = e.downcast_ref::<ControlError>() {
        return match c {
            ControlError::Follow(e) => Some(HasKind::kind(&**e)),
            ControlError::Rollout(e) => Some(HasKind::kind(&**e)),
            ControlError::Fallback(_) => None,
        };
    }
    keel_error::classify!(e; RolloutError, FollowError)
}

/// The id of a rollout (`ro`) or drift action (`dr`): the prefix, the
/// UTC time to the second and a sequence number
/// (`ro-20260528T202640-3`), as the audit log and the admin API show it.
pub(crate) fn event_id(prefix: &str, now_ms: u64, n: u64) -> String {
    let stamp = keel_gateway::rfc3339(now_ms).replace([':', '-'], "");
    let second = stamp
        .trim_end_matches('Z')
        .split('.')
        .next()
        .unwrap_or_default();
    format!("{prefix}-{second}-{n}")
}

/// The control plane of a configuration whose models follow the
/// registry, prepared before the gateway starts.
#[derive(Debug)]
pub struct Control {
    follower: Follower,
    every: Duration,
    writer: Option<RegistryClient>,
    cfg: GatewayConfig,
    drift: DriftActions,
}

impl Control {
    /// For a configuration whose models follow the registry: resolves the
    /// routing the registry's aliases name now (an error for anything the
    /// registry refuses, never a fallback), checks the write key and
    /// every drift fallback version, and returns the routed configuration
    /// to start the gateway with and the control plane to start on it.
    /// Without a followed model, the configuration as it is and `None`.
    /// `signature_check` makes the check of versions' signatures from
    /// `registry.public_key_file`, once the registry client is made; its
    /// error is returned as it is (`E`, which takes this crate's errors
    /// too).
    pub async fn prepare<E: From<ControlError>>(
        cfg: GatewayConfig,
        signature_check: impl FnOnce(&Path) -> Result<Arc<dyn SignatureCheck>, E>,
    ) -> Result<(GatewayConfig, Option<Control>), E> {
        let Some(mut client) = registry_follow::client(&cfg).map_err(ControlError::from)? else {
            return Ok((cfg, None));
        };
        if let Some(path) = cfg
            .registry
            .as_ref()
            .and_then(|r| r.public_key_file.as_deref())
        {
            client = client.with_signature_check(signature_check(path)?);
        }
        Self::prepare_with(cfg, client).await.map_err(E::from)
    }

    async fn prepare_with(
        cfg: GatewayConfig,
        client: RegistryClient,
    ) -> Result<(GatewayConfig, Option<Control>), ControlError> {
        let every = Duration::from_millis(cfg.registry.as_ref().map_or(1000, |r| r.poll_ms));
        let follows = registry_follow::follows(&cfg);
        if follows.is_empty() {
            return Ok((cfg, None));
        }
        // A bad write key is an error at start, not at the first rollout.
        let writer = registry_follow::write_client(&cfg)?;
        let (follower, routed) = Follower::new(client, follows, cfg).await?;
        for (model, r, _) in follower.routing() {
            tracing::info!(
                model = %model,
                stable = r.stable.version,
                canary = r.canary.as_ref().map(|c| c.version),
                "routing follows the registry"
            );
        }
        let drift = DriftActions::new(
            &routed,
            follower.follows(),
            follower.client().clone(),
            writer.clone(),
            follower.waker(),
        );
        // A fallback version that cannot take the traffic is an error at
        // start, not at the first drift.
        drift.check().await?;
        let control = Control {
            follower,
            every,
            writer,
            cfg: routed.clone(),
            drift,
        };
        Ok((routed, Some(control)))
    }

    /// The handle a reload lays the registry's routing over a new
    /// configuration with.
    pub fn reroute(&self) -> Reroute {
        self.follower.reroute()
    }

    /// Starts the control plane on `gw`: the drift watches, the rollouts
    /// (given to the admin API; those recorded before a restart go on, or
    /// stop if the registry's aliases changed meanwhile) and the follower.
    /// `replica` names this gateway in shared rollouts' leases.
    pub fn start(self, gw: &Gateway, replica: &str) -> Result<Rollouts, ControlError> {
        self.drift.spawn(gw);
        let rollouts = Rollouts::new(
            &self.cfg,
            self.follower.follows().to_vec(),
            self.follower.client().clone(),
            self.writer,
            self.follower.waker(),
            replica,
        )?;
        gw.set_rollouts(Arc::new(Admin {
            rollouts: rollouts.clone(),
            gw: gw.downgrade(),
        }));
        tokio::spawn(
            self.follower
                .run(gw.clone(), self.every, std::future::pending()),
        );
        rollouts.recover(gw);
        Ok(rollouts)
    }
}

/// The admin API's rollout routes, answered by the rollouts on the
/// gateway they were started on.
#[derive(Debug)]
struct Admin {
    rollouts: Rollouts,
    gw: WeakGateway,
}

impl RolloutAdmin for Admin {
    fn call<'a>(&'a self, call: RolloutCall, model: &'a str) -> AdminFuture<'a> {
        Box::pin(async move {
            let Some(gw) = self.gw.upgrade() else {
                return Err(AdminError {
                    status: 503,
                    kind: "unavailable",
                    message: "the gateway is stopping".into(),
                });
            };
            let r = &self.rollouts;
            let res = match call {
                RolloutCall::Status => r.status(model).await,
                RolloutCall::Start => r.start(&gw, model).await,
                RolloutCall::Pause => r.pause(&gw, model).await,
                RolloutCall::Abort => r.abort(&gw, model).await,
            };
            res.map_err(|e| AdminError {
                status: e.status(),
                kind: e.kind(),
                message: keel_error::one_line(&e),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_error::ErrorKind;

    #[test]
    fn event_ids_carry_the_second_and_the_sequence() {
        assert_eq!(event_id("ro", 1_780_000_000_123, 3), "ro-20260528T202640-3");
        assert_eq!(
            event_id("dr", 1_780_000_000_000, 12),
            "dr-20260528T202640-12"
        );
    }

    #[test]
    fn a_start_error_has_the_kind_of_what_failed() {
        let e = ControlError::from(RolloutError::StateCorrupt {
            path: "/x/rollouts.json".into(),
            reason: "not JSON".into(),
        });
        assert_eq!(error_kind(&e), Some(ErrorKind::Input));
        assert!(e.to_string().contains("/x/rollouts.json"), "{e}");
        let e = ControlError::from(RolloutError::NotFollowed { model: "m".into() });
        assert_eq!(error_kind(&e), Some(ErrorKind::Usage));
        #[derive(Debug)]
        struct Context(ControlError);
        impl std::fmt::Display for Context {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("keel serve")
            }
        }
        impl std::error::Error for Context {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let wrapped = Context(e);
        // A fallback version the registry cannot route to is left to the
        // binary's default, as before the control plane had its own crate.
        let fallback = ControlError::from(FallbackError {
            model: "m".into(),
            registry_model: "r".into(),
            version: 3,
            source: registry_source::RegistrySourceError::Unauthorized { status: 401 },
        });
        assert_eq!(error_kind(&fallback), None);
        assert_eq!(keel_error::kind_of(&fallback, &[error_kind]), None);
        assert_eq!(
            keel_error::kind_of(&wrapped, &[error_kind]),
            Some(ErrorKind::Usage)
        );
    }
}
