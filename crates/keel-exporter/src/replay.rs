//! A probe that replays recorded snapshots over time, so readings change
//! while an exporter runs (tests, alert rehearsals): snapshot `i` is
//! answered from `i * step` after the probe was made, the last one from
//! then on (counters never go back).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keel_gpu::{GpuError, GpuProbe, GpuSnapshot};

use crate::Monotonic;

/// Replays snapshots in turn, `step` apart.
#[derive(Debug)]
pub struct ReplayProbe {
    snapshots: Vec<GpuSnapshot>,
    step: Duration,
    clock: Arc<dyn Monotonic>,
    start: std::time::Instant,
}

impl ReplayProbe {
    /// `snapshots` must not be empty (an empty list answers
    /// [`GpuError::Unavailable`], as a node without GPUs).
    pub fn new(snapshots: Vec<GpuSnapshot>, step: Duration, clock: Arc<dyn Monotonic>) -> Self {
        let start = clock.now();
        Self {
            snapshots,
            step,
            clock,
            start,
        }
    }

    /// Loads each file with keel-gpu's recorded-snapshot reader.
    pub fn load(
        paths: &[impl AsRef<Path>],
        step: Duration,
        clock: Arc<dyn Monotonic>,
    ) -> Result<Self, GpuError> {
        let snapshots = paths
            .iter()
            .map(|p| keel_gpu::recorded::load(p.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(snapshots, step, clock))
    }

    /// Which snapshot is answered now.
    pub fn position(&self) -> usize {
        let elapsed = self.clock.now().saturating_duration_since(self.start);
        let i = if self.step.is_zero() {
            0
        } else {
            (elapsed.as_secs_f64() / self.step.as_secs_f64()) as usize
        };
        i.min(self.snapshots.len().saturating_sub(1))
    }
}

impl GpuProbe for ReplayProbe {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        self.snapshots
            .get(self.position())
            .cloned()
            .ok_or_else(|| GpuError::Unavailable {
                reason: "the replay has no snapshots".into(),
            })
    }
}
