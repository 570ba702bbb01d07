//! The GPU probe keel uses on a live node.

use std::time::Duration;

use keel_gpu::{GpuError, GpuProbe, GpuSnapshot};

/// NVML, loaded at run time.
pub fn nvml_probe(_timeout: Duration) -> Box<dyn GpuProbe> {
    Box::new(NoNvml)
}

struct NoNvml;

impl GpuProbe for NoNvml {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        Err(GpuError::Unavailable {
            reason: "this build has no NVML support".into(),
        })
    }
}
