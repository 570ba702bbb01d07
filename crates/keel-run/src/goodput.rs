//! Goodput across the attempts of a job: where the wall-clock time went.
//!
//! Every millisecond from the start of the first attempt to the end of the
//! last is in exactly one bucket: waiting in the queue between attempts,
//! pre-flight checks, restoring a checkpoint, checkpoint stalls (training
//! waiting for a save or the final commit), work lost (trained since the
//! last committed checkpoint of an attempt that did not complete), and
//! productive training (the rest). The effective training time ratio is
//! productive / wall.
//!
//! Times are wall-clock milliseconds since the Unix epoch, recorded by the
//! supervisor and passed in.

use serde::{Deserialize, Serialize};

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ended {
    /// The trainer finished: nothing is lost.
    Completed,
    /// It failed (crash, hang, node failure, start-up failure).
    Failed,
    /// It was preempted or evicted, or reached its time limit.
    Preempted,
    /// The user cancelled it.
    Cancelled,
}

/// What the supervisor recorded about one attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttemptTimes {
    /// When the supervisor started.
    pub started_ms: u64,
    /// When it ended.
    pub ended_ms: u64,
    /// Spent in pre-flight checks.
    #[serde(default)]
    pub preflight_ms: u64,
    /// Spent finding and restoring a checkpoint.
    #[serde(default)]
    pub restore_ms: u64,
    /// Training waiting on checkpoint saves and the final commit.
    #[serde(default)]
    pub stall_ms: u64,
    /// When the trainer was started (after restore).
    #[serde(default)]
    pub training_started_ms: Option<u64>,
    /// The last checkpoint committed during this attempt.
    #[serde(default)]
    pub last_commit_ms: Option<u64>,
    pub ended: Ended,
}

/// The accounting of a job's attempts, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    pub version: u32,
    pub attempts: u32,
    pub wall_ms: u64,
    pub queue_ms: u64,
    pub preflight_ms: u64,
    pub restore_ms: u64,
    pub stall_ms: u64,
    pub lost_ms: u64,
    pub productive_ms: u64,
    /// productive / wall; `None` when no time passed.
    pub ettr: Option<f64>,
}

/// Accounts the attempts (in the order they ran). Inconsistent records
/// (an end before a start, parts longer than the attempt) are clamped so
/// that the buckets always add up to the wall time.
pub fn account(attempts: &[AttemptTimes]) -> Goodput {
    let mut g = Goodput {
        version: 1,
        attempts: u32::try_from(attempts.len()).unwrap_or(u32::MAX),
        ..Goodput::default()
    };
    let mut previous_end: Option<u64> = None;
    for a in attempts {
        if let Some(end) = previous_end {
            g.queue_ms += a.started_ms.saturating_sub(end);
        }
        let ended = a.ended_ms.max(a.started_ms);
        previous_end = Some(previous_end.map_or(ended, |p| p.max(ended)));
        let mut left = ended - a.started_ms;
        let mut take = |want: u64| {
            let got = want.min(left);
            left -= got;
            got
        };
        g.preflight_ms += take(a.preflight_ms);
        g.restore_ms += take(a.restore_ms);
        g.stall_ms += take(a.stall_ms);
        if a.ended != Ended::Completed {
            let since = a
                .last_commit_ms
                .or(a.training_started_ms)
                .unwrap_or(a.started_ms)
                .max(a.started_ms);
            g.lost_ms += take(ended.saturating_sub(since));
        }
        g.productive_ms += left;
    }
    g.wall_ms =
        g.queue_ms + g.preflight_ms + g.restore_ms + g.stall_ms + g.lost_ms + g.productive_ms;
    #[allow(clippy::cast_precision_loss)]
    {
        g.ettr = (g.wall_ms > 0).then(|| g.productive_ms as f64 / g.wall_ms as f64);
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn attempt(started: u64, ended: u64, commit: Option<u64>, how: Ended) -> AttemptTimes {
        AttemptTimes {
            started_ms: started,
            ended_ms: ended,
            preflight_ms: 10,
            restore_ms: 20,
            stall_ms: 5,
            training_started_ms: Some(started + 30),
            last_commit_ms: commit,
            ended: how,
        }
    }

    #[test]
    fn a_failure_loses_the_work_since_the_last_commit_and_queue_time_counts() {
        let g = account(&[
            attempt(0, 1_000, Some(700), Ended::Failed),
            attempt(1_500, 3_000, Some(2_900), Ended::Completed),
        ]);
        assert_eq!(g.queue_ms, 500);
        assert_eq!(g.preflight_ms, 20);
        assert_eq!(g.restore_ms, 40);
        assert_eq!(g.stall_ms, 10);
        assert_eq!(g.lost_ms, 300);
        assert_eq!(g.wall_ms, 3_000);
        assert_eq!(g.productive_ms, 3_000 - 500 - 20 - 40 - 10 - 300);
        assert_eq!(g.ettr, Some(2_130.0 / 3_000.0));
    }

    #[test]
    fn a_failure_before_any_commit_loses_the_whole_training_time() {
        let g = account(&[attempt(0, 1_000, None, Ended::Failed)]);
        assert_eq!(g.lost_ms, 1_000 - 10 - 20 - 5);
        assert_eq!(g.productive_ms, 0);
        assert_eq!(g.ettr, Some(0.0));
        assert_eq!(account(&[]).ettr, None);
    }

    fn any_attempt() -> impl Strategy<Value = AttemptTimes> {
        (
            0u64..10_000_000,
            0u64..10_000_000,
            0u64..100_000,
            0u64..100_000,
            0u64..100_000,
            proptest::option::of(0u64..20_000_000),
            proptest::option::of(0u64..20_000_000),
            prop_oneof![
                Just(Ended::Completed),
                Just(Ended::Failed),
                Just(Ended::Preempted),
                Just(Ended::Cancelled)
            ],
        )
            .prop_map(|(s, len, p, r, st, t, c, e)| AttemptTimes {
                started_ms: s,
                ended_ms: s.saturating_add(len),
                preflight_ms: p,
                restore_ms: r,
                stall_ms: st,
                training_started_ms: t,
                last_commit_ms: c,
                ended: e,
            })
    }

    proptest! {
        #[test]
        fn the_buckets_add_up_and_the_ratio_is_a_fraction(
            mut attempts in proptest::collection::vec(any_attempt(), 0..8)
        ) {
            attempts.sort_by_key(|a| a.started_ms);
            let g = account(&attempts);
            prop_assert_eq!(
                g.wall_ms,
                g.queue_ms + g.preflight_ms + g.restore_ms + g.stall_ms + g.lost_ms + g.productive_ms
            );
            let spans: u64 = attempts.iter().map(|a| a.ended_ms - a.started_ms).sum();
            prop_assert_eq!(g.wall_ms - g.queue_ms, spans);
            if let Some(r) = g.ettr {
                prop_assert!((0.0..=1.0).contains(&r));
            }
            prop_assert_eq!(g.ettr.is_none(), g.wall_ms == 0);
        }

        // A completed attempt never loses work, whatever its commits.
        #[test]
        fn completed_attempts_lose_nothing(a in any_attempt()) {
            let a = AttemptTimes { ended: Ended::Completed, ..a };
            prop_assert_eq!(account(&[a]).lost_ms, 0);
        }
    }
}
