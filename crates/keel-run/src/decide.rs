//! What to do after an attempt ends: a pure function of how it ended, the
//! job's failure history and what the health checks and Slurm say about
//! the job's nodes.
//!
//! The rules:
//!
//! 1. A completed run is done; a run the user cancelled is never requeued
//!    and nothing is drained.
//! 2. A preemption (Slurm's SIGTERM, a Scheduled Event, the time limit) is
//!    requeued without blaming any node.
//! 3. A failure is recorded against the nodes it names (those that crashed
//!    or stopped reporting) and against every node whose check failed.
//!    Nodes are drained by keel-slurm's rules ([`keel_slurm::decide`]):
//!    only for a failed check, never over someone else's drain, never a
//!    node that is down. Nothing is ever resumed here.
//! 4. A node Slurm reports down or not responding (`down`, `allocated*`)
//!    after a failure is recorded as not responding and excluded from the
//!    requeue at once. It is never drained or resumed: Slurm already keeps
//!    it out of service, and its state may be an administrator's.
//! 5. The job is requeued excluding every node drained now, every node down
//!    or not responding, and every node that failed this job
//!    `exclude_after` times or more, even when its checks pass (a "black
//!    hole" node that looks healthy).
//! 6. A failure before the trainer's first heartbeat is a start-up failure;
//!    after `startup_retries` of them in a row the job stops with a reason
//!    that says so. An attempt that reached training resets the count.

use std::collections::BTreeSet;

pub use keel_slurm::Verdict;

use crate::history::{Cause, JobHistory};

/// What Slurm and the health check say about one of the job's nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReport {
    /// The node as Slurm reports it (state, flags, reason).
    pub info: keel_slurm::NodeInfo,
    pub verdict: Verdict,
}

impl NodeReport {
    /// Slurm reports the node down or not responding (`down`, `idle*`,
    /// `allocated*`): its check could not run there.
    pub fn unreachable(&self) -> bool {
        self.info.state == keel_slurm::NodeState::Down || self.info.flags.not_responding
    }
}

/// How the attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// The user cancelled the job.
    Cancelled,
    /// Preemption, eviction or the time limit.
    Preempted,
    Failed {
        cause: Cause,
        /// The nodes the failure points at (a task exited there, or it
        /// stopped reporting); may be empty.
        nodes: Vec<String>,
        /// Before the trainer's first heartbeat.
        during_startup: bool,
        /// For the final reason: `exit code 1`, `no heartbeat for 40 s`.
        detail: String,
    },
}

/// The knobs of the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPolicy {
    pub slurm: keel_slurm::Policy,
    /// Failures of this job on one node after which it is excluded even
    /// when its checks pass.
    pub exclude_after: u32,
    /// Start-up failures in a row after which the job stops.
    pub startup_retries: u32,
}

impl Default for RunPolicy {
    fn default() -> Self {
        Self {
            slurm: keel_slurm::Policy::default(),
            exclude_after: 2,
            startup_retries: 3,
        }
    }
}

/// What happens to the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Finished: exit successfully.
    Done,
    /// Requeue (excluding [`Decision::exclude`]).
    Requeue,
    /// Stop for good, with the reason.
    Stop { reason: String },
}

/// The decision after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Nodes to drain, with the reason to write.
    pub drain: Vec<(String, String)>,
    /// Nodes the requeued job must not run on (sorted).
    pub exclude: Vec<String>,
    /// Failures to add to the history.
    pub record: Vec<(String, Cause)>,
    /// The start-up failures in a row after this attempt.
    pub startup_failures: u32,
    pub next: Next,
}

/// Decides; see the module documentation for the rules.
pub fn decide(
    outcome: &Outcome,
    history: &JobHistory,
    nodes: &[NodeReport],
    policy: &RunPolicy,
) -> Decision {
    let mut d = Decision {
        drain: Vec::new(),
        exclude: Vec::new(),
        record: Vec::new(),
        startup_failures: history.startup_failures,
        next: Next::Requeue,
    };
    let (cause, blamed, during_startup, detail) = match outcome {
        Outcome::Completed => {
            d.startup_failures = 0;
            d.next = Next::Done;
            return d;
        }
        Outcome::Cancelled => {
            d.next = Next::Stop {
                reason: "cancelled by the user; not requeued".to_owned(),
            };
            return d;
        }
        Outcome::Preempted => {
            d.exclude = excluded(history, &[], policy.exclude_after);
            return d;
        }
        Outcome::Failed {
            cause,
            nodes,
            during_startup,
            detail,
        } => (*cause, nodes, *during_startup, detail),
    };
    let mut seen = BTreeSet::new();
    let mut keel_drained = Vec::new();
    let mut unreachable = Vec::new();
    for node in blamed {
        if seen.insert((node.clone(), cause)) {
            d.record.push((node.clone(), cause));
        }
    }
    for r in nodes {
        if r.unreachable() {
            // Slurm holds it down already: blame and exclude it, but
            // leave its state (perhaps an administrator's) alone.
            if seen.insert((r.info.name.clone(), Cause::NotResponding)) {
                d.record.push((r.info.name.clone(), Cause::NotResponding));
            }
            unreachable.push(r.info.name.clone());
            continue;
        }
        if matches!(r.verdict, Verdict::Unhealthy { .. })
            && seen.insert((r.info.name.clone(), Cause::Check))
        {
            d.record.push((r.info.name.clone(), Cause::Check));
        }
        if let keel_slurm::Action::Drain { reason } =
            keel_slurm::decide(&r.info, r.verdict.clone(), &policy.slurm)
        {
            d.drain.push((r.info.name.clone(), reason));
        } else if r.info.is_drained()
            && r.info
                .reason
                .as_deref()
                .is_some_and(|x| policy.slurm.owns(x))
        {
            // Drained by keel's own check already (`keel check --slurm`
            // run on the node): nothing to drain, but keep the job off it.
            keel_drained.push(r.info.name.clone());
        }
    }
    let mut exclude = excluded(history, &d.record, policy.exclude_after);
    exclude.extend(keel_drained);
    exclude.extend(unreachable);
    exclude.extend(d.drain.iter().map(|(n, _)| n.clone()));
    exclude.sort();
    exclude.dedup();
    d.exclude = exclude;
    if during_startup {
        d.startup_failures = history.startup_failures.saturating_add(1);
        if d.startup_failures >= policy.startup_retries.max(1) {
            d.next = Next::Stop {
                reason: format!(
                    "the trainer failed at start-up {} times in a row (last: {detail}); not requeued",
                    d.startup_failures
                ),
            };
        }
    } else {
        d.startup_failures = 0;
    }
    d
}

/// The nodes of an allocation the job must not run on: those that failed
/// it `exclude_after` times or more. An attempt placed on one was requeued
/// without its exclusions taking effect (the supervisor killed between
/// the requeue and the `ExcNodeList` update, or a site's plugin rewriting
/// the list); it is requeued again before it trains there.
pub fn placed_on_excluded(
    history: &JobHistory,
    allocation: &[String],
    policy: &RunPolicy,
) -> Vec<String> {
    let bad = excluded(history, &[], policy.exclude_after);
    let mut hit: Vec<String> = allocation
        .iter()
        .filter(|n| bad.contains(n))
        .cloned()
        .collect();
    hit.sort();
    hit.dedup();
    hit
}

/// Nodes with `at_least` failures of this job, counting `new` ones.
fn excluded(history: &JobHistory, new: &[(String, Cause)], at_least: u32) -> Vec<String> {
    let mut h = history.clone();
    for (n, c) in new {
        h.record_failure(n, *c);
    }
    let nodes: BTreeSet<&str> = h.failures.iter().map(|r| r.node.as_str()).collect();
    nodes
        .into_iter()
        .filter(|n| h.failures_of(n) >= at_least.max(1))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_on_a_node_the_job_excludes_is_found() {
        let mut h = JobHistory::default();
        h.record_failure("n2", Cause::Crash);
        let p = RunPolicy::default();
        let alloc = vec!["n1".to_owned(), "n2".to_owned()];
        assert!(placed_on_excluded(&h, &alloc, &p).is_empty());
        h.record_failure("n2", Cause::Check);
        assert_eq!(placed_on_excluded(&h, &alloc, &p), vec!["n2".to_owned()]);
        assert!(placed_on_excluded(&h, &["n1".to_owned(), "n3".to_owned()], &p).is_empty());
    }
    use keel_slurm::{parse_state, NodeInfo};

    fn node(name: &str, state: &str, reason: Option<&str>, verdict: Verdict) -> NodeReport {
        let (state, flags) = parse_state(state);
        NodeReport {
            info: NodeInfo {
                name: name.into(),
                state,
                flags,
                reason: reason.map(str::to_owned),
                gpus: None,
            },
            verdict,
        }
    }

    fn healthy() -> Verdict {
        Verdict::Healthy {
            passed: vec!["gpu.ecc".into()],
        }
    }

    fn unhealthy() -> Verdict {
        Verdict::Unhealthy {
            reason: "keel: gpu.ecc: 3 uncorrectable".into(),
        }
    }

    fn crash_on(nodes: &[&str], during_startup: bool) -> Outcome {
        Outcome::Failed {
            cause: Cause::Crash,
            nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
            during_startup,
            detail: "exit code 1".into(),
        }
    }

    #[test]
    fn a_crash_on_a_node_whose_check_fails_drains_and_excludes_it() {
        let d = decide(
            &crash_on(&["n2"], false),
            &JobHistory::default(),
            &[
                node("n1", "allocated", None, healthy()),
                node("n2", "allocated", None, unhealthy()),
            ],
            &RunPolicy::default(),
        );
        assert_eq!(
            d.drain,
            vec![("n2".into(), "keel: gpu.ecc: 3 uncorrectable".into())]
        );
        assert_eq!(d.exclude, vec!["n2".to_owned()]);
        assert_eq!(
            d.record,
            vec![("n2".into(), Cause::Crash), ("n2".into(), Cause::Check)]
        );
        assert_eq!(d.next, Next::Requeue);
    }

    #[test]
    fn a_node_slurm_reports_not_responding_or_down_is_excluded_and_never_drained() {
        // The check cannot run on such a node: its verdict is whatever the
        // check left, healthy or not; neither drains it.
        for (state, reason, verdict) in [
            ("allocated*", None, healthy()),
            ("mixed*", None, unhealthy()),
            ("down*", Some("Not responding"), healthy()),
            ("down", Some("ops: bad PSU"), unhealthy()),
            (
                "IDLE+DRAIN+NOT_RESPONDING",
                Some("ops: replacing a fan"),
                unhealthy(),
            ),
        ] {
            let d = decide(
                &crash_on(&["n1"], false),
                &JobHistory::default(),
                &[
                    node("n1", "allocated", None, healthy()),
                    node("n2", state, reason, verdict),
                ],
                &RunPolicy::default(),
            );
            assert!(d.drain.is_empty(), "{state}: {d:?}");
            assert_eq!(d.exclude, vec!["n2".to_owned()], "{state}");
            assert_eq!(
                d.record,
                vec![
                    ("n1".into(), Cause::Crash),
                    ("n2".into(), Cause::NotResponding)
                ],
                "{state}"
            );
            assert_eq!(d.next, Next::Requeue, "{state}");
        }
    }

    #[test]
    fn a_responding_node_is_not_blamed_for_its_state_and_a_cancel_ignores_it() {
        // Drained by an administrator, powered down, completing: all
        // responding, none recorded or excluded.
        let d = decide(
            &crash_on(&[], false),
            &JobHistory::default(),
            &[
                node("n2", "drained", Some("ops"), healthy()),
                node("n3", "idle~", None, healthy()),
                node("n4", "completing", None, healthy()),
            ],
            &RunPolicy::default(),
        );
        assert!(d.record.is_empty() && d.exclude.is_empty(), "{d:?}");
        let d = decide(
            &Outcome::Cancelled,
            &JobHistory::default(),
            &[node("n2", "down*", None, healthy())],
            &RunPolicy::default(),
        );
        assert!(d.record.is_empty() && d.exclude.is_empty(), "{d:?}");
    }

    #[test]
    fn a_node_that_failed_twice_is_excluded_though_its_checks_pass() {
        let policy = RunPolicy::default();
        let nodes = [
            node("n1", "allocated", None, healthy()),
            node("n3", "allocated", None, healthy()),
        ];
        let mut h = JobHistory::default();
        let first = decide(&crash_on(&["n3"], false), &h, &nodes, &policy);
        assert!(first.drain.is_empty());
        assert!(first.exclude.is_empty(), "one failure is not enough");
        for (n, c) in &first.record {
            h.record_failure(n, *c);
        }
        let second = decide(&crash_on(&["n3"], false), &h, &nodes, &policy);
        assert!(second.drain.is_empty(), "healthy nodes are never drained");
        assert_eq!(second.exclude, vec!["n3".to_owned()]);
        // And it stays excluded across a later preemption.
        for (n, c) in &second.record {
            h.record_failure(n, *c);
        }
        let later = decide(&Outcome::Preempted, &h, &nodes, &policy);
        assert_eq!(later.exclude, vec!["n3".to_owned()]);
        assert!(later.record.is_empty());
    }

    #[test]
    fn a_node_keel_already_drained_is_excluded_and_not_drained_again() {
        let reason = "keel: gpu.ecc: 3 uncorrectable";
        let d = decide(
            &crash_on(&["n2"], false),
            &JobHistory::default(),
            &[node(
                "n2",
                "drained",
                Some(reason),
                Verdict::Unhealthy {
                    reason: reason.into(),
                },
            )],
            &RunPolicy::default(),
        );
        assert!(d.drain.is_empty(), "{d:?}");
        assert_eq!(d.exclude, vec!["n2".to_owned()]);
    }

    #[test]
    fn an_admins_drain_is_left_alone() {
        let d = decide(
            &crash_on(&["n1"], false),
            &JobHistory::default(),
            &[node("n2", "drained", Some("bad fan (ops)"), unhealthy())],
            &RunPolicy::default(),
        );
        assert!(d.drain.is_empty(), "{d:?}");
        assert!(d.exclude.is_empty(), "{d:?}");
        assert_eq!(d.next, Next::Requeue);
    }

    #[test]
    fn start_up_failures_stop_after_the_budget_and_training_resets_it() {
        let policy = RunPolicy {
            startup_retries: 3,
            ..RunPolicy::default()
        };
        let mut h = JobHistory::default();
        for _ in 0..2 {
            let d = decide(&crash_on(&[], true), &h, &[], &policy);
            assert_eq!(d.next, Next::Requeue);
            h.startup_failures = d.startup_failures;
        }
        let d = decide(&crash_on(&[], true), &h, &[], &policy);
        assert_eq!(
            d.next,
            Next::Stop {
                reason: "the trainer failed at start-up 3 times in a row (last: exit code 1); not requeued"
                    .into()
            }
        );
        let d = decide(&crash_on(&[], false), &h, &[], &policy);
        assert_eq!(d.startup_failures, 0);
        assert_eq!(d.next, Next::Requeue);
    }

    #[test]
    fn a_cancelled_job_is_never_requeued_and_a_completed_one_is_done() {
        let mut h = JobHistory::default();
        h.record_failure("n1", Cause::Hang);
        h.record_failure("n1", Cause::Hang);
        let d = decide(
            &Outcome::Cancelled,
            &h,
            &[node("n2", "allocated", None, unhealthy())],
            &RunPolicy::default(),
        );
        assert!(matches!(d.next, Next::Stop { .. }));
        assert!(d.drain.is_empty() && d.exclude.is_empty());
        assert_eq!(
            decide(&Outcome::Completed, &h, &[], &RunPolicy::default()).next,
            Next::Done
        );
    }
}
