//! Idle-GPU accounting: per Slurm job, the GPU-seconds its GPUs spent below
//! a utilisation threshold, and whether the job is idle under a policy
//! (every GPU below the threshold for `idle_minutes`). Pure: each scrape
//! hands in the time and what it read.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::readings::{IdleJob, Job};

/// When a job counts as idle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdlePolicy {
    /// A GPU below this utilisation (percent) is idle.
    pub threshold_percent: f64,
    /// A job is idle when all its GPUs have been idle this long.
    pub idle_minutes: f64,
}

/// The longest gap between two observations that is counted: a longer one
/// (the exporter was not scraped) is counted as this much.
pub const MAX_GAP_S: f64 = 300.0;

#[derive(Debug, Clone)]
struct JobState {
    user: Option<String>,
    partition: Option<String>,
    idle_s: f64,
    observed_s: f64,
    /// Since when each of its GPUs has been idle (None: busy or unknown).
    idle_since: BTreeMap<u32, Option<Instant>>,
    last_seen: Instant,
}

/// Accumulates idle time per job across scrapes.
#[derive(Debug, Default)]
pub struct IdleTracker {
    last: Option<Instant>,
    jobs: BTreeMap<String, JobState>,
}

/// Jobs not seen for this long are forgotten.
pub const FORGET_AFTER_S: f64 = 3600.0;

impl IdleTracker {
    /// Records one observation at `now`: each GPU's jobs and utilisation
    /// (percent; `None` when unknown, which counts as neither idle nor busy
    /// time).
    pub fn observe(
        &mut self,
        policy: &IdlePolicy,
        now: Instant,
        jobs: &BTreeMap<u32, Vec<Job>>,
        utilization: &BTreeMap<u32, Option<u32>>,
    ) {
        let dt = self
            .last
            .map(|l| {
                now.saturating_duration_since(l)
                    .as_secs_f64()
                    .min(MAX_GAP_S)
            })
            .unwrap_or(0.0);
        self.last = Some(now);
        for (gpu, list) in jobs {
            let util = utilization.get(gpu).copied().flatten();
            for j in list {
                let st = self.jobs.entry(j.id.clone()).or_insert_with(|| JobState {
                    user: j.user.clone(),
                    partition: j.partition.clone(),
                    idle_s: 0.0,
                    observed_s: 0.0,
                    idle_since: BTreeMap::new(),
                    last_seen: now,
                });
                if st.user.is_none() {
                    st.user = j.user.clone();
                }
                if st.partition.is_none() {
                    st.partition = j.partition.clone();
                }
                let seen_before = st.idle_since.contains_key(gpu);
                st.last_seen = now;
                let since = st.idle_since.entry(*gpu).or_insert(None);
                let Some(u) = util else {
                    *since = None;
                    continue;
                };
                let idle = f64::from(u) < policy.threshold_percent;
                if seen_before {
                    st.observed_s += dt;
                    if idle {
                        st.idle_s += dt;
                    }
                }
                *since = match (idle, *since) {
                    (true, Some(s)) => Some(s),
                    (true, None) => Some(now),
                    (false, _) => None,
                };
            }
        }
        self.jobs.retain(|_, st| {
            now.saturating_duration_since(st.last_seen).as_secs_f64() < FORGET_AFTER_S
        });
    }

    /// Each job's totals and verdict at `now`.
    pub fn report(&self, policy: &IdlePolicy, now: Instant) -> Vec<IdleJob> {
        self.jobs
            .iter()
            .map(|(id, st)| IdleJob {
                job: id.clone(),
                user: st.user.clone(),
                partition: st.partition.clone(),
                idle_gpu_seconds: st.idle_s,
                observed_gpu_seconds: st.observed_s,
                idle: !st.idle_since.is_empty()
                    && st.idle_since.values().all(|s| {
                        s.is_some_and(|s| {
                            now.saturating_duration_since(s).as_secs_f64()
                                >= policy.idle_minutes * 60.0
                        })
                    }),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn idle_time_accumulates_and_the_policy_marks_idle_jobs() {
        let p = IdlePolicy {
            threshold_percent: 5.0,
            idle_minutes: 2.0,
        };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let jobs: BTreeMap<u32, Vec<Job>> = [
            (
                0,
                vec![Job {
                    id: "7".into(),
                    user: Some("alice".into()),
                    ..Job::default()
                }],
            ),
            (
                1,
                vec![Job {
                    id: "7".into(),
                    user: Some("alice".into()),
                    ..Job::default()
                }],
            ),
            (
                2,
                vec![Job {
                    id: "8".into(),
                    user: None,
                    ..Job::default()
                }],
            ),
        ]
        .into();
        let util = |a, b, c| -> BTreeMap<u32, Option<u32>> { [(0, a), (1, b), (2, c)].into() };
        let mut t = IdleTracker::default();
        t.observe(&p, at(0), &jobs, &util(Some(0), Some(0), Some(90)));
        t.observe(&p, at(60), &jobs, &util(Some(0), Some(3), Some(90)));
        let r = t.report(&p, at(60));
        assert_eq!(r[0].job, "7");
        assert_eq!(r[0].idle_gpu_seconds, 120.0);
        assert!(!r[0].idle, "idle for one minute only");
        t.observe(&p, at(120), &jobs, &util(Some(0), Some(1), None));
        let r = t.report(&p, at(120));
        assert_eq!(r[0].idle_gpu_seconds, 240.0);
        assert_eq!(r[0].observed_gpu_seconds, 240.0);
        assert!(r[0].idle);
        assert_eq!(r[1].job, "8");
        assert_eq!(r[1].idle_gpu_seconds, 0.0);
        assert_eq!(
            r[1].observed_gpu_seconds, 60.0,
            "unknown utilisation is not observed time"
        );
        assert!(!r[1].idle);
        // One busy sample clears the verdict.
        t.observe(&p, at(180), &jobs, &util(Some(50), Some(0), Some(0)));
        assert!(!t.report(&p, at(180))[0].idle);
    }
}
