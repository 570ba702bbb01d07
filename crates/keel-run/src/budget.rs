//! How long a stop may take: the checkpoint wait and the trainer's grace
//! after a stop request, capped by what Slurm (or a notice) allows before
//! its SIGKILL.
//!
//! Slurm's kill sequence (`_rpc_terminate_job`, for the time limit,
//! `scancel`, `scontrol requeue` and the end of a preemption's GraceTime)
//! is SIGCONT and SIGTERM, then SIGKILL `KillWait` seconds later (default
//! 30 s). So after a SIGTERM the batch step has `KillWait`; after the
//! `--signal` warning it has the time left to the job's end (which a
//! preemption with GraceTime moves to now + GraceTime) plus `KillWait`.
//! Within that the supervisor must see the checkpoint committed, stop the
//! trainer and requeue the job: the requeue's reserve comes off first, and
//! the rest is shared between the checkpoint wait and the stop's grace.

use std::time::Duration;

/// What the supervisor was configured to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopConfig {
    /// Longest wait for the requested checkpoint's commit.
    pub checkpoint_deadline: Duration,
    /// From SIGTERM to SIGKILL when the trainer is stopped.
    pub grace: Duration,
    /// Kept back for what follows the stop (pushing the last checkpoint's
    /// record, draining, the requeue's scontrol calls).
    pub reserve: Duration,
}

/// The waits of one stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopPlan {
    pub checkpoint_deadline: Duration,
    pub grace: Duration,
    /// Whether the configured waits had to be shortened to fit.
    pub shortened: bool,
}

/// The waits for a stop with `until_kill` left before the SIGKILL
/// (`None`: unknown, the configured waits). The configured grace is kept
/// when it fits in half of what is left after the reserve; the checkpoint
/// wait gets the rest, up to its configured deadline.
pub fn plan_stop(until_kill: Option<Duration>, cfg: StopConfig) -> StopPlan {
    let Some(left) = until_kill else {
        return StopPlan {
            checkpoint_deadline: cfg.checkpoint_deadline,
            grace: cfg.grace,
            shortened: false,
        };
    };
    let usable = left.saturating_sub(cfg.reserve);
    let grace = cfg.grace.min(usable / 2);
    let checkpoint_deadline = cfg.checkpoint_deadline.min(usable - grace);
    StopPlan {
        checkpoint_deadline,
        grace,
        shortened: checkpoint_deadline < cfg.checkpoint_deadline || grace < cfg.grace,
    }
}

/// What Slurm allows from a signal to its SIGKILL: for SIGTERM (the kill
/// sequence has begun) `KillWait`; for the warning signal the time left
/// plus `KillWait`. `None` when what it needs could not be read.
pub fn until_kill(
    sigterm: bool,
    kill_wait: Option<Duration>,
    time_left: Option<Duration>,
) -> Option<Duration> {
    let kw = kill_wait?;
    if sigterm {
        Some(kw)
    } else {
        Some(time_left? + kw)
    }
}

/// The least `--signal` time (seconds before the job's end) under which a
/// warning leaves keel run its configured waits: the checkpoint deadline,
/// the grace and the reserve, less the `KillWait` that follows the end.
pub fn least_signal_secs(cfg: StopConfig, kill_wait: Duration) -> Duration {
    (cfg.checkpoint_deadline + cfg.grace + cfg.reserve).saturating_sub(kill_wait)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: u64) -> Duration {
        Duration::from_secs(x)
    }

    const CFG: StopConfig = StopConfig {
        checkpoint_deadline: Duration::from_secs(120),
        grace: Duration::from_secs(30),
        reserve: Duration::from_secs(5),
    };

    #[test]
    fn unknown_limits_keep_the_configured_waits() {
        let p = plan_stop(None, CFG);
        assert_eq!(
            (p.checkpoint_deadline, p.grace, p.shortened),
            (s(120), s(30), false)
        );
        assert_eq!(until_kill(true, None, Some(s(60))), None);
        assert_eq!(until_kill(false, Some(s(30)), None), None);
    }

    #[test]
    fn sigterm_gets_killwait_shared_after_the_reserve() {
        // Slurm's default KillWait: 30 s, 5 s kept for the requeue.
        let p = plan_stop(until_kill(true, Some(s(30)), None), CFG);
        assert_eq!(
            (p.checkpoint_deadline, p.grace),
            (Duration::from_millis(12_500), Duration::from_millis(12_500))
        );
        assert!(p.shortened);
        assert!(p.checkpoint_deadline + p.grace + CFG.reserve <= s(30));
        // Less than the reserve: nothing to wait for.
        let p = plan_stop(Some(s(3)), CFG);
        assert_eq!((p.checkpoint_deadline, p.grace), (s(0), s(0)));
    }

    #[test]
    fn the_warning_gets_the_time_left_and_killwait() {
        // The old recipe: USR1 120 s before the end, KillWait 30 s.
        let left = until_kill(false, Some(s(30)), Some(s(120))).expect("known");
        assert_eq!(left, s(150));
        let p = plan_stop(Some(left), CFG);
        assert_eq!((p.checkpoint_deadline, p.grace), (s(115), s(30)));
        assert!(p.checkpoint_deadline + p.grace + CFG.reserve <= left);
        // Plenty of time: the configured waits.
        let p = plan_stop(Some(s(600)), CFG);
        assert_eq!(
            (p.checkpoint_deadline, p.grace, p.shortened),
            (s(120), s(30), false)
        );
    }

    #[test]
    fn the_least_signal_time_covers_every_wait() {
        assert_eq!(least_signal_secs(CFG, s(30)), s(125));
        let p = plan_stop(until_kill(false, Some(s(30)), Some(s(125))), CFG);
        assert!(!p.shortened);
    }
}
