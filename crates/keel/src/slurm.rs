//! `keel check --slurm`: turning a report into a drain or resume of this
//! node, safely (keel-slurm decides and applies; this is the glue).

use std::time::Duration;

use serde::Serialize;

use keel_check::report::{describe, Report};
use keel_check::Status;
use keel_slurm::{decide, Action, NodeInfo, Policy, Slurm, SlurmConfig, SlurmError, Verdict};

use crate::config::CheckConfig;

/// Longest drain reason written; Slurm stores longer ones, but a reason is
/// read in `sinfo` columns.
const MAX_REASON: usize = 240;

/// What happened to the node.
#[derive(Debug, Clone, Serialize)]
pub struct SlurmOutcome {
    pub node: Option<String>,
    /// `drain`, `resume`, or `nothing`.
    pub action: &'static str,
    pub reason: Option<String>,
    /// One line for humans.
    pub message: String,
    /// Set when Slurm could not be asked or told (timeout, no scontrol):
    /// keel then does nothing to the node.
    pub error: Option<String>,
}

/// The verdict for Slurm: failures drain, unknown drains only when fail
/// closed, warnings and passes are healthy; a healthy verdict names the
/// checks that ran and passed, the only ones whose drains it may undo.
pub fn verdict(report: &Report) -> Verdict {
    let reason = |r: &keel_check::CheckResult| {
        let mut s = format!("keel: {}: {}", r.id, describe(r));
        if s.len() > MAX_REASON {
            let mut cut = MAX_REASON;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
        }
        s
    };
    match (report.status, report.worst()) {
        (Status::Fail, Some(r)) => Verdict::Unhealthy { reason: reason(r) },
        (Status::Unknown, Some(r)) => Verdict::Unknown { reason: reason(r) },
        _ => Verdict::Healthy {
            passed: report
                .results
                .iter()
                .filter(|r| matches!(r.status, Status::Pass | Status::Warn))
                .map(|r| r.id.clone())
                .collect(),
        },
    }
}

/// The client `--slurm` uses.
fn client(cfg: &CheckConfig) -> Slurm {
    Slurm::new(SlurmConfig {
        timeout: Duration::from_secs_f64(cfg.slurm_timeout_s),
        ..SlurmConfig::default()
    })
}

/// The node as Slurm describes it before the checks run: its `Gres` GPUs
/// are the count the checks expect when `check.gpus` is not set.
pub fn read_node(node: &str, cfg: &CheckConfig) -> Result<NodeInfo, SlurmError> {
    client(cfg).node(node)
}

/// Drains or resumes `node` by the report. `before` is what
/// [`read_node`] found before the checks: when it timed out, Slurm is not
/// asked again (a hung controller holds the check once, not twice); after
/// any other failure it is.
pub fn apply(
    report: &Report,
    node: Option<String>,
    before: Option<&Result<NodeInfo, SlurmError>>,
    cfg: &CheckConfig,
) -> SlurmOutcome {
    let Some(node) = node else {
        return SlurmOutcome {
            node: None,
            action: "nothing",
            reason: None,
            message: "no Slurm node name (set SLURMD_NODENAME or --node): did nothing".into(),
            error: Some("no node name".into()),
        };
    };
    let slurm = client(cfg);
    let policy = Policy {
        fail_closed: cfg.fail_closed,
        ..Policy::default()
    };
    let failed = |what: &str, e: &SlurmError| SlurmOutcome {
        node: Some(node.clone()),
        action: "nothing",
        reason: None,
        message: format!("{what} {node} failed, did nothing to it: {e}"),
        error: Some(e.to_string()),
    };
    if let Some(Err(e @ SlurmError::Timeout { .. })) = before {
        return failed("reading node", e);
    }
    let info = match slurm.node(&node) {
        Ok(i) => i,
        Err(e) => return failed("reading node", &e),
    };
    let action = decide(&info, verdict(report), &policy);
    if let Err(e) = slurm.apply(&node, &action) {
        let what = match &action {
            Action::Drain { .. } => "draining",
            Action::Resume => "resuming",
            Action::Nothing { .. } => "reading",
        };
        return failed(what, &e);
    }
    match action {
        Action::Drain { reason } => SlurmOutcome {
            node: Some(node.clone()),
            action: "drain",
            message: format!("drained {node}: {reason}"),
            reason: Some(reason),
            error: None,
        },
        Action::Resume => SlurmOutcome {
            node: Some(node.clone()),
            action: "resume",
            reason: None,
            message: format!("resumed {node} (keel had drained it)"),
            error: None,
        },
        Action::Nothing { why } => SlurmOutcome {
            node: Some(node.clone()),
            action: "nothing",
            reason: None,
            message: format!("left {node} as it is: {why}"),
            error: None,
        },
    }
}
