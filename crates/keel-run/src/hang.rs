//! Hang detection from heartbeats.
//!
//! A heartbeat is any sign of progress the supervisor sees: the trainer
//! touching a file, a line on its standard output matching a pattern, or a
//! committed checkpoint. The detector reports a hang when no heartbeat came
//! for longer than the timeout of the current phase:
//!
//! - **start-up** (before the first heartbeat): `startup` allowance;
//! - **training**: the configured timeout, or a learned one: the longest
//!   interval observed between heartbeats times `safety_factor` (as
//!   nvidia-resiliency-ext calculates its heartbeat timeouts), never below
//!   `floor`; until `min_samples` intervals were seen, `before_learned`;
//! - **saving** (a checkpoint is being written): the training timeout plus
//!   the `save` allowance. An interval that spans a save is not learned
//!   from, so a slow save does not inflate the training timeout.
//!
//! Time is a [`Duration`] since an origin the caller picks (the
//! supervisor's start); the detector never reads a clock.

use std::time::Duration;

/// How the training timeout is obtained.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Timeout {
    /// A fixed timeout.
    Fixed(Duration),
    /// Learned: longest observed interval × `safety_factor`, at least
    /// `floor`; `before_learned` until `min_samples` intervals were seen.
    Learned {
        safety_factor: f64,
        min_samples: u32,
        floor: Duration,
        before_learned: Duration,
    },
}

/// The detector's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HangConfig {
    /// From the start of the step to the first heartbeat.
    pub startup: Duration,
    /// The timeout between heartbeats while training.
    pub timeout: Timeout,
    /// Added to the training timeout while a checkpoint is being saved.
    pub save: Duration,
}

/// The phase the step is in, as far as the detector knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Startup,
    Training,
    Saving,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Startup => "start-up",
            Phase::Training => "training",
            Phase::Saving => "checkpoint save",
        }
    }
}

/// What [`HangDetector::check`] concluded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HangStatus {
    /// Progressing; a hang is declared if nothing comes by `deadline`.
    Alive { deadline: Duration },
    /// No heartbeat for `silent_for`, over the phase's `timeout`.
    Hung {
        phase: Phase,
        silent_for: Duration,
        timeout: Duration,
    },
}

/// Follows the heartbeats of one step.
#[derive(Debug, Clone)]
pub struct HangDetector {
    config: HangConfig,
    /// The start of the step, or the last heartbeat.
    last: Duration,
    beats: u64,
    saving_since: Option<Duration>,
    /// Whether the interval now running spans a save.
    interval_saw_save: bool,
    max_interval: Option<Duration>,
    samples: u32,
}

impl HangDetector {
    /// A detector for a step that started at `now`.
    pub fn new(config: HangConfig, now: Duration) -> Self {
        Self {
            config,
            last: now,
            beats: 0,
            saving_since: None,
            interval_saw_save: false,
            max_interval: None,
            samples: 0,
        }
    }

    /// A detector that starts with what an earlier attempt learned (the
    /// longest interval and how many intervals it saw).
    pub fn with_learned(mut self, max_interval: Option<Duration>, samples: u32) -> Self {
        self.max_interval = max_interval;
        self.samples = samples;
        self
    }

    /// A heartbeat at `now`. Heartbeats that appear to go back in time
    /// are counted but do not move the last heartbeat back.
    pub fn beat(&mut self, now: Duration) {
        if self.beats > 0 && now >= self.last && !self.interval_saw_save {
            let interval = now - self.last;
            self.max_interval = Some(self.max_interval.map_or(interval, |m| m.max(interval)));
            self.samples = self.samples.saturating_add(1);
        }
        self.beats += 1;
        self.last = self.last.max(now);
        self.interval_saw_save = self.saving_since.is_some();
    }

    /// A checkpoint save began at `now`.
    pub fn save_started(&mut self, now: Duration) {
        if self.saving_since.is_none() {
            self.saving_since = Some(now);
        }
        self.interval_saw_save = true;
    }

    /// The save finished and the checkpoint was committed at `now`: that
    /// counts as a heartbeat.
    pub fn save_committed(&mut self, now: Duration) {
        self.saving_since = None;
        self.interval_saw_save = true;
        self.beat(now);
        self.interval_saw_save = false;
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        if self.beats == 0 {
            Phase::Startup
        } else if self.saving_since.is_some() {
            Phase::Saving
        } else {
            Phase::Training
        }
    }

    /// The longest interval learned from and how many intervals were seen.
    pub fn learned(&self) -> (Option<Duration>, u32) {
        (self.max_interval, self.samples)
    }

    /// The last heartbeat (or the start of the step).
    pub fn last(&self) -> Duration {
        self.last
    }

    /// The number of heartbeats seen.
    pub fn beats(&self) -> u64 {
        self.beats
    }

    /// The training timeout in force now.
    pub fn training_timeout(&self) -> Duration {
        match self.config.timeout {
            Timeout::Fixed(t) => t,
            Timeout::Learned {
                safety_factor,
                min_samples,
                floor,
                before_learned,
            } => match self.max_interval {
                Some(m) if self.samples >= min_samples.max(1) => {
                    let factor = if safety_factor.is_finite() && safety_factor > 0.0 {
                        safety_factor
                    } else {
                        1.0
                    };
                    Duration::try_from_secs_f64(m.as_secs_f64() * factor)
                        .unwrap_or(Duration::MAX)
                        .max(floor)
                }
                _ => before_learned,
            },
        }
    }

    /// The timeout of the current phase.
    pub fn timeout(&self) -> Duration {
        match self.phase() {
            Phase::Startup => self.config.startup,
            Phase::Training => self.training_timeout(),
            Phase::Saving => self.training_timeout().saturating_add(self.config.save),
        }
    }

    /// Whether the step is hung at `now`.
    pub fn check(&self, now: Duration) -> HangStatus {
        let timeout = self.timeout();
        let silent_for = now.saturating_sub(self.last);
        if silent_for > timeout {
            HangStatus::Hung {
                phase: self.phase(),
                silent_for,
                timeout,
            }
        } else {
            HangStatus::Alive {
                deadline: self.last.saturating_add(timeout),
            }
        }
    }
}

/// Whether a line of the trainer's output is a heartbeat: it contains
/// `pattern` (an empty pattern matches nothing).
pub fn line_is_heartbeat(line: &str, pattern: &str) -> bool {
    !pattern.is_empty() && line.contains(pattern)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn learned(factor: f64) -> HangConfig {
        HangConfig {
            startup: s(60),
            timeout: Timeout::Learned {
                safety_factor: factor,
                min_samples: 3,
                floor: s(1),
                before_learned: s(600),
            },
            save: s(30),
        }
    }

    #[test]
    fn start_up_uses_its_own_allowance() {
        let d = HangDetector::new(learned(2.0), s(0));
        assert_eq!(d.phase(), Phase::Startup);
        assert_eq!(d.check(s(60)), HangStatus::Alive { deadline: s(60) });
        assert_eq!(
            d.check(s(61)),
            HangStatus::Hung {
                phase: Phase::Startup,
                silent_for: s(61),
                timeout: s(60)
            }
        );
    }

    #[test]
    fn learns_the_longest_interval_times_the_factor_after_enough_samples() {
        let mut d = HangDetector::new(learned(2.0), s(0));
        d.beat(s(10)); // first heartbeat: no interval yet
        d.beat(s(13));
        d.beat(s(17));
        assert_eq!(d.training_timeout(), s(600), "two samples are not enough");
        d.beat(s(19));
        assert_eq!(d.learned(), (Some(s(4)), 3));
        assert_eq!(d.training_timeout(), s(8));
        assert!(matches!(d.check(s(27)), HangStatus::Alive { .. }));
        assert!(matches!(
            d.check(s(28)),
            HangStatus::Hung {
                phase: Phase::Training,
                ..
            }
        ));
    }

    #[test]
    fn a_save_gets_its_allowance_and_is_not_learned_from() {
        let mut d = HangDetector::new(learned(2.0), s(0));
        for t in [1, 3, 5, 7] {
            d.beat(s(t));
        }
        assert_eq!(d.training_timeout(), s(4));
        d.save_started(s(8));
        assert_eq!(d.phase(), Phase::Saving);
        assert!(matches!(d.check(s(40)), HangStatus::Alive { .. }));
        assert!(matches!(
            d.check(s(42)),
            HangStatus::Hung {
                phase: Phase::Saving,
                ..
            }
        ));
        d.save_committed(s(30));
        assert_eq!(
            d.training_timeout(),
            s(4),
            "the save interval is not learned"
        );
        d.beat(s(32));
        assert_eq!(d.training_timeout(), s(4));
    }

    #[test]
    fn a_fixed_timeout_is_used_as_given() {
        let mut d = HangDetector::new(
            HangConfig {
                startup: s(5),
                timeout: Timeout::Fixed(s(9)),
                save: s(1),
            },
            s(0),
        );
        d.beat(s(1));
        d.beat(s(100));
        assert_eq!(d.timeout(), s(9));
    }

    #[test]
    fn heartbeat_lines() {
        assert!(line_is_heartbeat("step 12 loss 0.3", "step "));
        assert!(!line_is_heartbeat("loading", "step "));
        assert!(!line_is_heartbeat("anything", ""));
    }

    proptest! {
        // Heartbeats no further apart than anything already learned never
        // read as a hang, and the learned timeout covers every learned
        // interval times the factor.
        #[test]
        fn regular_heartbeats_are_never_a_hang(
            gaps in proptest::collection::vec(1u64..5_000, 4..60),
            factor in 1.0f64..10.0,
        ) {
            let mut d = HangDetector::new(learned(factor), Duration::ZERO);
            let mut now = Duration::from_millis(100);
            d.beat(now);
            let mut longest = Duration::ZERO;
            for g in &gaps {
                let gap = Duration::from_millis(*g);
                // Until learned the fallback applies; after, any gap up to
                // the longest seen must pass.
                if d.learned().1 >= 3 && gap <= longest {
                    let alive = matches!(d.check(now + gap), HangStatus::Alive { .. });
                    prop_assert!(alive, "a gap of {:?} read as a hang", gap);
                }
                now += gap;
                d.beat(now);
                longest = longest.max(gap);
            }
            let t = d.training_timeout();
            prop_assert!(t.as_secs_f64() + 1e-6 >= longest.as_secs_f64() * factor);
            prop_assert!(t >= Duration::from_secs(1));
        }

        // A hang is always detected: past the deadline the status is Hung,
        // and never before it.
        #[test]
        fn detected_exactly_after_the_timeout(
            gaps in proptest::collection::vec(1u64..5_000, 0..30),
            silence in 0u64..2_000_000,
            factor in 1.0f64..10.0,
        ) {
            let mut d = HangDetector::new(learned(factor), Duration::ZERO);
            let mut now = Duration::ZERO;
            for g in &gaps {
                now += Duration::from_millis(*g);
                d.beat(now);
            }
            let at = now + Duration::from_millis(silence);
            let hung = matches!(d.check(at), HangStatus::Hung { .. });
            prop_assert_eq!(hung, Duration::from_millis(silence) > d.timeout());
        }
    }
}
