//! The drain/resume decision: a pure function from what Slurm says about a
//! node and what the health checks concluded to what to do, so that every
//! rule is tested without a cluster.
//!
//! The rules, in order:
//!
//! 1. Hands off a node that is down (or failing), in the future (not in
//!    service), powered down, powering up or down, pending power-down, or
//!    pending or undergoing a reboot: those are someone else's business and
//!    not health problems.
//! 2. `Unknown` does nothing (fail open) unless the policy is fail-closed,
//!    in which case it is treated like `Unhealthy`.
//! 3. `Unhealthy` drains, unless the node is already drained with exactly
//!    this reason (never rewrite an identical reason) or drained with a
//!    reason keel did not write (someone else's drain is left alone). A node
//!    keel drained for a different reason gets the new reason.
//! 4. `Healthy` resumes only a node keel drained (its reason starts with the
//!    policy's prefix) for a check that ran and passed this time (the
//!    check id after the prefix, `keel: <check>: ...`, is among the
//!    verdict's passed checks): a node drained by a check this run did not
//!    make (a benchmark, `--expect-idle`) stays drained until that check
//!    passes. Any other node is left as it is.
//!
//! Every drain reason keel writes starts with the prefix: a reason given
//! without it gets it prepended, so keel can always recognise its own
//! drains.

use crate::NodeInfo;

/// What the health checks concluded about a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing failed; `passed` names the checks that ran and passed (or
    /// only warned) in this run.
    Healthy { passed: Vec<String> },
    /// A check failed; `reason` is the drain reason (`keel: ecc: ...`).
    Unhealthy { reason: String },
    /// A check could not tell (a reading failed, a timeout).
    Unknown { reason: String },
}

/// How keel treats nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// What every reason keel writes starts with, and how keel recognises
    /// its own drains: `keel:`.
    pub prefix: String,
    /// Drain on `Unknown` too. Off by default: a check that cannot tell
    /// never takes a node out of service.
    pub fail_closed: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            prefix: "keel:".to_owned(),
            fail_closed: false,
        }
    }
}

impl Policy {
    /// The check a reason keel wrote names: `gpu.ecc` in
    /// `keel: gpu.ecc: 3 uncorrectable`; `None` for a reason keel did not
    /// write or one that names no check.
    pub fn check_of<'a>(&self, reason: &'a str) -> Option<&'a str> {
        if !self.owns(reason) {
            return None;
        }
        let (id, _) = reason[self.prefix.len()..].split_once(':')?;
        let id = id.trim();
        (!id.is_empty() && !id.contains(char::is_whitespace)).then_some(id)
    }

    /// Whether keel wrote this reason.
    pub fn owns(&self, reason: &str) -> bool {
        !self.prefix.is_empty() && reason.starts_with(&self.prefix)
    }

    /// The reason keel writes: one line (control characters become
    /// spaces), as given when it carries the prefix, else with the prefix
    /// prepended.
    pub fn drain_reason(&self, reason: &str) -> String {
        let line: String = reason
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let reason = line.trim();
        if self.owns(reason) || (self.prefix.is_empty() && !reason.is_empty()) {
            reason.to_owned()
        } else if reason.is_empty() {
            format!("{} unhealthy", self.prefix)
        } else {
            format!("{} {reason}", self.prefix)
        }
    }
}

/// What to do to a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `scontrol update NodeName=... State=DRAIN Reason=...`.
    Drain { reason: String },
    /// `scontrol update NodeName=... State=RESUME`.
    Resume,
    /// Leave the node as it is, and why.
    Nothing { why: String },
}

fn nothing(why: impl Into<String>) -> Action {
    Action::Nothing { why: why.into() }
}

/// Decides what to do to `node` given the checks' `verdict`. See the module
/// documentation for the rules.
pub fn decide(node: &NodeInfo, verdict: Verdict, policy: &Policy) -> Action {
    use crate::NodeState::{Down, Fail, Failing, Future};
    let flags = &node.flags;
    if matches!(node.state, Down | Fail | Failing) || flags.fail {
        return nothing(format!(
            "node {} is {}: left to the administrator",
            node.name, node.state
        ));
    }
    if node.state == Future {
        return nothing(format!("node {} is not in service (future)", node.name));
    }
    if flags.power_or_reboot() {
        let what = if flags.powered_down {
            "powered down"
        } else if flags.powering_up {
            "powering up"
        } else if flags.powering_down {
            "powering down"
        } else if flags.power_down_pending {
            "pending power-down"
        } else {
            "pending a reboot"
        };
        return nothing(format!(
            "node {} is {what}: power saving and reboots are not health problems",
            node.name
        ));
    }

    let reason = match verdict {
        Verdict::Healthy { passed } => return decide_healthy(node, &passed, policy),
        Verdict::Unhealthy { reason } => reason,
        Verdict::Unknown { reason } if policy.fail_closed => reason,
        Verdict::Unknown { reason } => {
            return nothing(format!(
                "health of node {} unknown ({reason}): not draining (fail open)",
                node.name
            ))
        }
    };
    let reason = policy.drain_reason(&reason);
    if !node.is_drained() {
        return Action::Drain { reason };
    }
    match node.reason.as_deref() {
        Some(current) if current == reason => nothing(format!(
            "node {} is already {} with this reason",
            node.name, node.state
        )),
        Some(current) if policy.owns(current) => Action::Drain { reason },
        current => nothing(foreign(node, current)),
    }
}

fn decide_healthy(node: &NodeInfo, passed: &[String], policy: &Policy) -> Action {
    if !node.is_drained() {
        return nothing(format!("node {} is healthy and not drained", node.name));
    }
    match node.reason.as_deref() {
        Some(current) if policy.owns(current) => match policy.check_of(current) {
            Some(id) if passed.iter().any(|p| p == id) => Action::Resume,
            Some(id) => nothing(format!(
                "node {} was {} by keel for {id}, which did not run and pass this time: left drained until it does",
                node.name, node.state
            )),
            None => nothing(format!(
                "node {} was {} by keel with a reason that names no check ({current:?}): left drained",
                node.name, node.state
            )),
        },
        current => nothing(foreign(node, current)),
    }
}

fn foreign(node: &NodeInfo, reason: Option<&str>) -> String {
    match reason {
        Some(reason) => format!(
            "node {} was {} by someone else ({reason:?}): left alone",
            node.name, node.state
        ),
        None => format!(
            "node {} is {} without a reason keel wrote: left alone",
            node.name, node.state
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NodeFlags, NodeState};

    const KEEL_X: &str = "keel: gpu: xid 79";
    const KEEL_Y: &str = "keel: ecc: 3 uncorrectable";
    const ADMIN: &str = "admin: replacing fan";

    fn node(state: &str, reason: Option<&str>) -> NodeInfo {
        let (state, flags) = crate::parse_state(state);
        NodeInfo {
            name: "n1".into(),
            state,
            flags,
            reason: reason.map(str::to_owned),
            gpus: None,
        }
    }

    /// Healthy, with the checks of KEEL_X and KEEL_Y among those passed.
    fn healthy() -> Verdict {
        Verdict::Healthy {
            passed: vec!["cpu".into(), "gpu".into(), "ecc".into()],
        }
    }
    fn unhealthy(reason: &str) -> Verdict {
        Verdict::Unhealthy {
            reason: reason.into(),
        }
    }
    fn unknown(reason: &str) -> Verdict {
        Verdict::Unknown {
            reason: reason.into(),
        }
    }
    fn drain(reason: &str) -> Option<Action> {
        Some(Action::Drain {
            reason: reason.into(),
        })
    }
    fn resume() -> Option<Action> {
        Some(Action::Resume)
    }
    /// `Nothing`, with a `why` containing this text.
    fn nothing_because(text: &'static str) -> Option<Action> {
        Some(Action::Nothing { why: text.into() })
    }

    /// One row: node state and reason, verdict, fail-closed, expected action
    /// (for `Nothing`, a fragment of the `why`).
    type Row = (
        &'static str,
        Option<&'static str>,
        Verdict,
        bool,
        Option<Action>,
    );

    #[test]
    fn every_rule() {
        let rows: Vec<Row> = vec![
            // Unhealthy drains a node in service.
            ("idle", None, unhealthy(KEEL_X), false, drain(KEEL_X)),
            ("allocated", None, unhealthy(KEEL_X), false, drain(KEEL_X)),
            ("mixed", None, unhealthy(KEEL_X), false, drain(KEEL_X)),
            ("completing", None, unhealthy(KEEL_X), false, drain(KEEL_X)),
            ("idle*", None, unhealthy(KEEL_X), false, drain(KEEL_X)),
            ("idle$", None, unhealthy(KEEL_X), false, drain(KEEL_X)),
            // A reason without the prefix gets it.
            ("idle", None, unhealthy("gpu: xid 79"), false, drain(KEEL_X)),
            ("idle", None, unhealthy(""), false, drain("keel: unhealthy")),
            (
                "idle",
                None,
                unhealthy("keel: gpu: a\nb\r"),
                false,
                drain("keel: gpu: a b"),
            ),
            // Never rewrite an identical reason.
            (
                "drained",
                Some(KEEL_X),
                unhealthy(KEEL_X),
                false,
                nothing_because("already drained with this reason"),
            ),
            (
                "draining",
                Some(KEEL_X),
                unhealthy(KEEL_X),
                false,
                nothing_because("already draining with this reason"),
            ),
            (
                "IDLE+DRAIN",
                Some(KEEL_X),
                unhealthy(KEEL_X),
                false,
                nothing_because("already drained with this reason"),
            ),
            // keel's own drain with another reason is updated.
            (
                "drained",
                Some(KEEL_Y),
                unhealthy(KEEL_X),
                false,
                drain(KEEL_X),
            ),
            (
                "draining",
                Some(KEEL_Y),
                unhealthy(KEEL_X),
                false,
                drain(KEEL_X),
            ),
            // Someone else's drain is left alone, healthy or not.
            (
                "drained",
                Some(ADMIN),
                unhealthy(KEEL_X),
                false,
                nothing_because("by someone else"),
            ),
            (
                "draining",
                Some(ADMIN),
                unhealthy(KEEL_X),
                false,
                nothing_because("by someone else"),
            ),
            (
                "drained",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("without a reason keel wrote"),
            ),
            (
                "drained",
                Some(ADMIN),
                healthy(),
                false,
                nothing_because("by someone else"),
            ),
            (
                "draining",
                Some(ADMIN),
                healthy(),
                false,
                nothing_because("by someone else"),
            ),
            (
                "drained",
                Some("keelhaul: not ours"),
                healthy(),
                false,
                nothing_because("by someone else"),
            ),
            (
                "drained",
                None,
                healthy(),
                false,
                nothing_because("without a reason keel wrote"),
            ),
            // Healthy resumes only keel's drains.
            ("drained", Some(KEEL_X), healthy(), false, resume()),
            ("draining", Some(KEEL_X), healthy(), false, resume()),
            ("drained*", Some(KEEL_X), healthy(), false, resume()),
            // ... and only when the check that drained it ran and passed.
            (
                "drained",
                Some("keel: bench.gemm: GEMM mismatch"),
                healthy(),
                false,
                nothing_because("for bench.gemm, which did not run and pass this time"),
            ),
            (
                "drained",
                Some(KEEL_X),
                Verdict::Healthy { passed: vec![] },
                false,
                nothing_because("for gpu, which did not run and pass"),
            ),
            (
                "drained",
                Some("keel: unhealthy"),
                healthy(),
                false,
                nothing_because("names no check"),
            ),
            (
                "idle",
                None,
                healthy(),
                false,
                nothing_because("healthy and not drained"),
            ),
            (
                "allocated",
                None,
                healthy(),
                false,
                nothing_because("healthy and not drained"),
            ),
            // Unknown never drains and never resumes, unless fail-closed.
            (
                "idle",
                None,
                unknown("keel: nvml: timeout"),
                false,
                nothing_because("unknown"),
            ),
            (
                "drained",
                Some(KEEL_X),
                unknown("keel: nvml: timeout"),
                false,
                nothing_because("fail open"),
            ),
            (
                "idle",
                None,
                unknown("keel: nvml: timeout"),
                true,
                drain("keel: nvml: timeout"),
            ),
            (
                "drained",
                Some("keel: nvml: timeout"),
                unknown("keel: nvml: timeout"),
                true,
                nothing_because("already drained"),
            ),
            (
                "drained",
                Some(ADMIN),
                unknown("keel: nvml: timeout"),
                true,
                nothing_because("by someone else"),
            ),
            (
                "drained",
                Some(KEEL_X),
                unknown("keel: nvml: timeout"),
                true,
                drain("keel: nvml: timeout"),
            ),
            // Fail-closed changes nothing for the other verdicts.
            ("drained", Some(KEEL_X), healthy(), true, resume()),
            ("idle", None, unhealthy(KEEL_X), true, drain(KEEL_X)),
            // Hands off: down, failing, future, power saving, reboots.
            (
                "down",
                Some("Not responding"),
                unhealthy(KEEL_X),
                false,
                nothing_because("is down"),
            ),
            (
                "down*",
                Some(KEEL_X),
                healthy(),
                false,
                nothing_because("is down"),
            ),
            (
                "DOWN+DRAIN",
                Some(KEEL_X),
                healthy(),
                false,
                nothing_because("is down"),
            ),
            ("down", None, unknown("x"), true, nothing_because("is down")),
            (
                "fail",
                Some(KEEL_X),
                healthy(),
                false,
                nothing_because("is fail"),
            ),
            (
                "failing",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("is failing"),
            ),
            (
                "IDLE+FAIL",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("left to the administrator"),
            ),
            (
                "future",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("not in service"),
            ),
            (
                "idle~",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("powered down"),
            ),
            (
                "drained~",
                Some(KEEL_X),
                healthy(),
                false,
                nothing_because("powered down"),
            ),
            (
                "idle#",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("powering up"),
            ),
            (
                "idle%",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("powering down"),
            ),
            (
                "idle!",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("pending power-down"),
            ),
            (
                "drained!",
                Some(KEEL_X),
                healthy(),
                false,
                nothing_because("pending power-down"),
            ),
            (
                "idle@",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("pending a reboot"),
            ),
            (
                "reboot",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("pending a reboot"),
            ),
            (
                "reboot^",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("pending a reboot"),
            ),
            (
                "MIXED+REBOOT_REQUESTED",
                None,
                unhealthy(KEEL_X),
                false,
                nothing_because("pending a reboot"),
            ),
            (
                "IDLE+POWERED_DOWN",
                None,
                unknown("x"),
                true,
                nothing_because("powered down"),
            ),
        ];
        for (state, reason, verdict, fail_closed, want) in rows {
            let policy = Policy {
                prefix: "keel:".into(),
                fail_closed,
            };
            let label = format!("{state} {reason:?} {verdict:?} fail_closed={fail_closed}");
            let got = decide(&node(state, reason), verdict, &policy);
            match (want, &got) {
                (Some(Action::Nothing { why: fragment }), Action::Nothing { why }) => {
                    assert!(
                        why.contains(&fragment),
                        "{label}: {why:?} lacks {fragment:?}"
                    );
                }
                (want, got) => assert_eq!(want.as_ref(), Some(got), "{label}"),
            }
        }
    }

    #[test]
    fn the_check_a_reason_names() {
        let p = Policy::default();
        assert_eq!(
            p.check_of("keel: gpu.ecc: 3 uncorrectable"),
            Some("gpu.ecc")
        );
        assert_eq!(p.check_of("keel:gpu.xid:79"), Some("gpu.xid"));
        assert_eq!(p.check_of("keel: unhealthy"), None);
        assert_eq!(p.check_of("keel: two words: x"), None);
        assert_eq!(p.check_of("keel: : x"), None);
        assert_eq!(p.check_of("admin: gpu: x"), None);
    }

    #[test]
    fn unknown_states_are_treated_as_in_service() {
        // A state word from a newer Slurm is not a reason to skip a node.
        let node = NodeInfo {
            name: "n1".into(),
            state: NodeState::Other("blocked".into()),
            flags: NodeFlags::default(),
            reason: None,
            gpus: None,
        };
        assert_eq!(
            decide(&node, unhealthy(KEEL_X), &Policy::default()),
            Action::Drain {
                reason: KEEL_X.into()
            }
        );
    }

    #[test]
    fn an_empty_prefix_owns_nothing() {
        let policy = Policy {
            prefix: String::new(),
            fail_closed: false,
        };
        assert_eq!(
            decide(&node("drained", Some(ADMIN)), healthy(), &policy),
            Action::Nothing {
                why: format!("node n1 was drained by someone else ({ADMIN:?}): left alone")
            }
        );
    }
}
