//! A progressive rollout as a state machine: the canary's weight moves
//! through the plan's steps, each analysed at the end of every interval
//! ([`crate::analysis::evaluate_step`]) before the next; a failed check
//! aborts (weight 0), a step without its samples after
//! [`StepPolicy::max_intervals`] pauses, and passing the last step below
//! 100% promotes. The caller owns the clock, the windows and the side
//! effects: it calls [`Rollout::on_interval`] with the samples of the step
//! so far and carries out the returned [`Action`] (weights, registry
//! aliases, audit log), starting new windows whenever the weight changes.
//!
//! Every action carries the rollout's id and a reason with the numbers
//! (the failed checks, or each step's verdict), meant for the registry's
//! alias history and the gateway's audit log alike.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::analysis::{
    evaluate_step, step_counts, Analysis, Sample, StepCounts, StepDecision, StepPolicy, Thresholds,
};

/// Longest reason an action carries (the registry keeps reasons short).
pub const MAX_REASON: usize = 900;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RolloutError {
    #[error("a rollout needs at least one step")]
    NoSteps,
    #[error("step weights must rise strictly within 1..=100: {steps:?}")]
    BadSteps { steps: Vec<u32> },
    #[error("the rollout is {phase:?}: it cannot {what}")]
    Finished { phase: Phase, what: &'static str },
    #[error("step {step} is past the plan's analysed steps {steps:?}")]
    BadStep { step: usize, steps: Vec<u32> },
}

/// Steps, thresholds and the step policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Canary weights in percent, rising; reaching 100 is the promotion
    /// (with no stable traffic left there is nothing to compare), so a
    /// plan `[1, 5, 25, 50, 100]` analyses four steps.
    pub steps: Vec<u32>,
    pub thresholds: Thresholds,
    pub policy: StepPolicy,
}

impl Plan {
    pub fn validate(&self) -> Result<(), RolloutError> {
        if self.steps.is_empty() {
            return Err(RolloutError::NoSteps);
        }
        let rising = self.steps.windows(2).all(|w| w[0] < w[1]);
        if !rising || self.steps[0] == 0 || self.steps.iter().any(|&s| s > 100) {
            return Err(RolloutError::BadSteps {
                steps: self.steps.clone(),
            });
        }
        Ok(())
    }

    /// The analysed steps: those under 100.
    fn analysed(&self) -> &[u32] {
        let n = self.steps.iter().take_while(|&&s| s < 100).count();
        &self.steps[..n]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Progressing,
    /// Held by an operator, or by a step that never got its samples.
    Paused,
    Aborted,
    Promoted,
}

/// What the caller must do now.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Nothing changes; keep the windows growing.
    Continue,
    /// Move the canary to this weight (percent) and start new windows.
    SetWeight { weight: u32 },
    /// Canary weight 0 at once, roll the canary alias back.
    Abort { reason: String },
    /// Canary weight 100; move the stable alias to the canary's version.
    Promote { reason: String },
    /// Keep the weight; wait for an operator.
    Pause { reason: String },
}

/// One interval's verdict, kept for the status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub step: usize,
    pub weight: u32,
    /// The interval of the step this verdict ends (1 for the first).
    pub interval: u32,
    /// The step's canary requests so far.
    #[serde(default)]
    pub canary_requests: u64,
    pub decision: StepDecision,
    pub analysis: Analysis,
}

/// A rollout's state and history.
#[derive(Debug, Clone, Serialize)]
pub struct Rollout {
    pub id: String,
    pub plan: Plan,
    pub phase: Phase,
    /// Index into the analysed steps.
    pub step: usize,
    intervals: u32,
    pub verdicts: Vec<Verdict>,
    /// The rate checks' counts of each finished step, which the later
    /// steps' rate checks include ([`crate::analysis::analyse_after`]).
    pub earlier: Vec<StepCounts>,
}

impl Rollout {
    /// A rollout at its first step; the action sets the first weight.
    pub fn start(id: impl Into<String>, plan: Plan) -> Result<(Self, Action), RolloutError> {
        plan.validate()?;
        let r = Rollout {
            id: id.into(),
            plan,
            phase: Phase::Progressing,
            step: 0,
            intervals: 0,
            verdicts: Vec::new(),
            earlier: Vec::new(),
        };
        let action = match r.plan.analysed().first() {
            Some(&w) => Action::SetWeight { weight: w },
            // A plan of only 100: nothing to analyse.
            None => return Ok(r.promote()),
        };
        Ok((r, action))
    }

    /// A rollout as it was recorded (after a restart of the process that
    /// ran it): at `step` of `plan` in `phase` with its `verdicts` and the
    /// counts of its finished steps. The step starts a new interval count:
    /// its analysis starts from new windows.
    pub fn restore(
        id: impl Into<String>,
        plan: Plan,
        phase: Phase,
        step: usize,
        verdicts: Vec<Verdict>,
        earlier: Vec<StepCounts>,
    ) -> Result<Self, RolloutError> {
        plan.validate()?;
        let live = matches!(phase, Phase::Progressing | Phase::Paused);
        if live && step >= plan.analysed().len() || step > plan.analysed().len() {
            return Err(RolloutError::BadStep {
                step,
                steps: plan.steps.clone(),
            });
        }
        Ok(Rollout {
            id: id.into(),
            plan,
            phase,
            step,
            intervals: 0,
            verdicts,
            earlier,
        })
    }

    /// Ends a running or paused rollout that can no longer go on (its
    /// registry aliases changed under it): canary weight 0, and unlike
    /// [`Rollout::abort`] nothing to roll back. Returns the reason.
    pub fn stop(&mut self, why: &str) -> Result<String, RolloutError> {
        self.live("stop")?;
        let weight = self.weight();
        self.phase = Phase::Aborted;
        Ok(cut(format!(
            "rollout {}: stopped at {weight}%: {why}",
            self.id
        )))
    }

    /// The canary's weight now, in percent.
    pub fn weight(&self) -> u32 {
        match self.phase {
            Phase::Aborted => 0,
            Phase::Promoted => 100,
            _ => self.plan.analysed().get(self.step).copied().unwrap_or(100),
        }
    }

    /// The end of an interval: `stable` and `canary` are the samples since
    /// the current weight was set.
    pub fn on_interval(&mut self, stable: &[Sample], canary: &[Sample]) -> Action {
        if self.phase != Phase::Progressing {
            return Action::Continue;
        }
        self.intervals += 1;
        let (analysis, decision) = evaluate_step(
            stable,
            canary,
            &self.earlier,
            &self.plan.thresholds,
            &self.plan.policy,
            self.intervals,
        );
        let weight = self.weight();
        self.verdicts.push(Verdict {
            step: self.step,
            weight,
            interval: self.intervals,
            canary_requests: canary.len() as u64,
            decision,
            analysis,
        });
        match decision {
            StepDecision::Hold => Action::Continue,
            StepDecision::Abort => {
                self.phase = Phase::Aborted;
                let failed: Vec<String> = self
                    .verdicts
                    .last()
                    .map(|v| v.analysis.failures().map(|c| c.to_string()).collect())
                    .unwrap_or_default();
                Action::Abort {
                    reason: cut(format!(
                        "rollout {}: aborted at {weight}% (interval {}): {}",
                        self.id,
                        self.intervals,
                        failed.join("; ")
                    )),
                }
            }
            StepDecision::Pause => {
                self.phase = Phase::Paused;
                let min = self.plan.policy.min_canary_samples;
                let why = if (canary.len() as u64) < min {
                    format!("fewer than {min} canary requests")
                } else {
                    "no check could decide (every one inconclusive)".to_owned()
                };
                Action::Pause {
                    reason: format!(
                        "rollout {}: paused at {weight}%: {why} after {} intervals",
                        self.id, self.intervals
                    ),
                }
            }
            StepDecision::Advance => {
                self.earlier
                    .push(step_counts(stable, canary, &self.plan.thresholds));
                self.step += 1;
                self.intervals = 0;
                match self.plan.analysed().get(self.step) {
                    Some(&w) => Action::SetWeight { weight: w },
                    None => self.promote_in_place(),
                }
            }
        }
    }

    /// An operator's pause: the weight stays, analysis stops.
    pub fn pause(&mut self) -> Result<(), RolloutError> {
        self.live("pause")?;
        self.phase = Phase::Paused;
        Ok(())
    }

    /// Resumes a paused rollout at its step, with new windows.
    pub fn resume(&mut self) -> Result<Action, RolloutError> {
        if self.phase != Phase::Paused {
            return Err(RolloutError::Finished {
                phase: self.phase,
                what: "resume",
            });
        }
        self.phase = Phase::Progressing;
        self.intervals = 0;
        Ok(Action::SetWeight {
            weight: self.weight(),
        })
    }

    /// An operator's abort.
    pub fn abort(&mut self, why: &str) -> Result<Action, RolloutError> {
        self.live("abort")?;
        let weight = self.weight();
        self.phase = Phase::Aborted;
        Ok(Action::Abort {
            reason: cut(format!(
                "rollout {}: aborted by an operator at {weight}%: {why}",
                self.id
            )),
        })
    }

    fn live(&self, what: &'static str) -> Result<(), RolloutError> {
        match self.phase {
            Phase::Progressing | Phase::Paused => Ok(()),
            phase => Err(RolloutError::Finished { phase, what }),
        }
    }

    fn promote(mut self) -> (Self, Action) {
        let a = self.promote_in_place();
        (self, a)
    }

    fn promote_in_place(&mut self) -> Action {
        self.phase = Phase::Promoted;
        // The evidence: each analysed step's last verdict.
        let mut steps = Vec::new();
        for (i, &w) in self.plan.analysed().iter().enumerate() {
            if let Some(v) = self.verdicts.iter().rev().find(|v| v.step == i) {
                let n = v.canary_requests;
                let passed = v
                    .analysis
                    .checks
                    .iter()
                    .filter(|c| c.outcome == crate::analysis::Outcome::Pass)
                    .count();
                let inconclusive = v.analysis.checks.len() - passed;
                steps.push(format!(
                    "{w}%: {n} canary requests, {passed} checks passed, {inconclusive} inconclusive"
                ));
            }
        }
        Action::Promote {
            reason: cut(format!(
                "rollout {}: promoted, no check failed ({})",
                self.id,
                steps.join("; ")
            )),
        }
    }
}

fn cut(s: String) -> String {
    match s.char_indices().nth(MAX_REASON) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{FinishReason, Outcome};

    fn ok(chars: u32) -> Sample {
        Sample {
            error: false,
            latency_ms: Some(100.0),
            completion_tokens: Some(50),
            finish_reason: Some(FinishReason::Stop),
            answer_chars: Some(chars),
            streamed: false,
            stream_aborted: false,
            output_mean: None,
        }
    }

    fn plan(steps: &[u32]) -> Plan {
        Plan {
            steps: steps.to_vec(),
            thresholds: Thresholds::default(),
            policy: StepPolicy::default(),
        }
    }

    #[test]
    fn a_healthy_canary_is_promoted_through_every_step() {
        let (mut r, a) = Rollout::start("r1", plan(&[1, 5, 25, 50, 100])).unwrap();
        assert_eq!(a, Action::SetWeight { weight: 1 });
        let stable = vec![ok(200); 2000];
        let canary = vec![ok(200); 150];
        let mut weights = vec![1];
        loop {
            match r.on_interval(&stable, &canary) {
                Action::SetWeight { weight } => weights.push(weight),
                Action::Promote { reason } => {
                    assert!(reason.starts_with("rollout r1: promoted, no check failed (1%: 150 canary requests, 5 checks passed, 2 inconclusive; 5%"), "{reason}");
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(weights, vec![1, 5, 25, 50]);
        assert_eq!((r.phase, r.weight()), (Phase::Promoted, 100));
        assert_eq!(r.verdicts.len(), 4);
    }

    #[test]
    fn empty_answers_abort_with_their_numbers() {
        let (mut r, _) = Rollout::start("r2", plan(&[1, 5, 100])).unwrap();
        let stable = vec![ok(200); 2000];
        // Too few canary requests yet: hold.
        assert_eq!(r.on_interval(&stable, &[ok(0); 10]), Action::Continue);
        let canary: Vec<_> = (0..100)
            .map(|i| ok(if i % 5 == 0 { 0 } else { 200 }))
            .collect();
        let Action::Abort { reason } = r.on_interval(&stable, &canary) else {
            panic!("not aborted")
        };
        assert!(reason.starts_with("rollout r2: aborted at 1% (interval 2): empty_answer fail: canary 0.2000 (n=100) vs stable 0.0000 (n=2000)"), "{reason}");
        assert_eq!(r.weight(), 0);
        assert_eq!(r.on_interval(&stable, &canary), Action::Continue);
        assert!(matches!(
            r.abort("again"),
            Err(RolloutError::Finished {
                phase: Phase::Aborted,
                ..
            })
        ));
    }

    #[test]
    fn operators_pause_resume_and_abort() {
        let (mut r, _) = Rollout::start("r3", plan(&[10, 100])).unwrap();
        r.pause().unwrap();
        assert_eq!(r.on_interval(&[ok(1); 10], &[ok(1); 10]), Action::Continue);
        assert_eq!(r.resume().unwrap(), Action::SetWeight { weight: 10 });
        let Action::Abort { reason } = r.abort("manual").unwrap() else {
            panic!()
        };
        assert_eq!(reason, "rollout r3: aborted by an operator at 10%: manual");
    }

    #[test]
    fn a_step_without_traffic_pauses() {
        let mut p = plan(&[1, 100]);
        p.policy.max_intervals = 2;
        let (mut r, _) = Rollout::start("r4", p).unwrap();
        assert_eq!(r.on_interval(&[], &[]), Action::Continue);
        assert!(matches!(r.on_interval(&[], &[]), Action::Pause { .. }));
        assert_eq!(r.phase, Phase::Paused);
    }

    /// Enough canary requests by the policy, but no check could judge
    /// them (too few for every check, or no stable window to compare
    /// with): the step holds, then pauses; it never promotes.
    #[test]
    fn no_step_advances_when_no_check_could_decide() {
        let mut p = plan(&[50, 100]);
        p.policy.min_canary_samples = 5;
        p.policy.max_intervals = 3;
        let (mut r, _) = Rollout::start("r6", p).unwrap();
        let stable = vec![ok(200); 2000];
        assert_eq!(r.on_interval(&stable, &[ok(200); 7]), Action::Continue);
        let v = r.verdicts.last().unwrap();
        assert_eq!(v.decision, StepDecision::Hold);
        assert!(v
            .analysis
            .checks
            .iter()
            .all(|c| c.outcome == Outcome::Inconclusive));
        assert_eq!(r.on_interval(&[], &[ok(200); 150]), Action::Continue);
        let Action::Pause { reason } = r.on_interval(&[], &[ok(200); 150]) else {
            panic!("not paused")
        };
        assert_eq!(
            reason,
            "rollout r6: paused at 50%: no check could decide (every one inconclusive) after 3 intervals"
        );
        assert_eq!((r.phase, r.weight()), (Phase::Paused, 50));
    }

    #[test]
    fn a_restored_rollout_continues_at_its_step_with_new_windows() {
        let (mut r, _) = Rollout::start("r5", plan(&[10, 50, 100])).unwrap();
        let stable = vec![ok(200); 2000];
        assert_eq!(r.on_interval(&stable, &[ok(200); 10]), Action::Continue);
        assert_eq!(
            r.on_interval(&stable, &[ok(200); 150]),
            Action::SetWeight { weight: 50 }
        );
        let mut back = Rollout::restore(
            r.id.clone(),
            r.plan.clone(),
            r.phase,
            r.step,
            r.verdicts.clone(),
            r.earlier.clone(),
        )
        .unwrap();
        assert_eq!((back.weight(), back.verdicts.len()), (50, 2));
        // The first look of the restored step is its interval 1.
        assert_eq!(back.on_interval(&stable, &[ok(200); 10]), Action::Continue);
        assert_eq!(back.verdicts.last().map(|v| v.interval), Some(1));
        assert!(matches!(
            back.on_interval(&stable, &[ok(200); 150]),
            Action::Promote { .. }
        ));
        // A step past the plan is refused; a finished rollout is restored
        // as it ended.
        assert_eq!(
            Rollout::restore("x", plan(&[10, 100]), Phase::Progressing, 1, vec![], vec![])
                .unwrap_err(),
            RolloutError::BadStep {
                step: 1,
                steps: vec![10, 100]
            }
        );
        let done =
            Rollout::restore("x", plan(&[10, 100]), Phase::Promoted, 1, vec![], vec![]).unwrap();
        assert_eq!(done.weight(), 100);
        // Stopped: weight 0, and no second end.
        let mut s =
            Rollout::restore("r6", plan(&[10, 100]), Phase::Paused, 0, vec![], vec![]).unwrap();
        assert_eq!(
            s.stop("the canary alias was deleted").unwrap(),
            "rollout r6: stopped at 10%: the canary alias was deleted"
        );
        assert_eq!((s.phase, s.weight()), (Phase::Aborted, 0));
        assert!(s.stop("again").is_err());
    }

    #[test]
    fn bad_plans_are_refused() {
        assert_eq!(
            Rollout::start("x", plan(&[])).unwrap_err(),
            RolloutError::NoSteps
        );
        for s in [&[5, 1][..], &[0, 10], &[10, 10], &[50, 101]] {
            assert!(
                matches!(
                    Rollout::start("x", plan(s)),
                    Err(RolloutError::BadSteps { .. })
                ),
                "{s:?}"
            );
        }
        let (r, a) = Rollout::start("x", plan(&[100])).unwrap();
        assert!(matches!(a, Action::Promote { .. }));
        assert_eq!(r.weight(), 100);
    }
}
