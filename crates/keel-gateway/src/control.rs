//! The data plane's face to its control plane (keel-control): routing
//! comes in through [`Gateway::apply`](crate::Gateway::apply), per-request
//! samples and drift windows go out ([`Gateway::samples`](crate::Gateway::samples),
//! [`Gateway::drift`](crate::Gateway::drift)), the control plane's events go
//! into the audit log (`audit_rollout`, `audit_drift`) and its failures
//! into the error counter (`metrics().error`), its time comes from the
//! gateway's injected clock (`now_ms`), and the admin API's rollout routes
//! are answered by the [`RolloutAdmin`] the control plane installs. The
//! data plane knows nothing else of it.

use std::future::Future;
use std::pin::Pin;

use serde_json::Value;

/// A call on a model's rollout from the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutCall {
    /// `GET /admin/rollouts/MODEL`.
    Status,
    /// `POST /admin/rollouts/MODEL/start`.
    Start,
    /// `POST /admin/rollouts/MODEL/pause`.
    Pause,
    /// `POST /admin/rollouts/MODEL/abort`.
    Abort,
}

/// A refused call: the HTTP status, the error's type and its message
/// (the error and its sources on one line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
}

/// What a [`RolloutAdmin`] call returns: the rollout's status as JSON.
pub type AdminFuture<'a> = Pin<Box<dyn Future<Output = Result<Value, AdminError>> + Send + 'a>>;

/// The control plane's answer to the admin API's rollout routes. The
/// gateway holds it, so it holds the gateway only weakly
/// ([`Gateway::downgrade`](crate::Gateway::downgrade)).
pub trait RolloutAdmin: Send + Sync + std::fmt::Debug {
    fn call<'a>(&'a self, call: RolloutCall, model: &'a str) -> AdminFuture<'a>;
}
