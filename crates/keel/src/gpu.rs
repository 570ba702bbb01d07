//! The GPU probe keel uses on a live node.

use std::path::Path;
use std::time::Duration;

use keel_gpu::nvml::NvmlProbe;
use keel_gpu::GpuProbe;

/// NVML (`libnvidia-ml.so.1`), loaded at run time; on a machine without
/// the driver every reading is `unknown`.
pub fn nvml_probe(library: Option<&Path>, timeout: Duration) -> Box<dyn GpuProbe> {
    let probe = match library {
        Some(l) => NvmlProbe::with_library(l),
        None => NvmlProbe::new(),
    };
    Box::new(probe.with_timeout(timeout))
}

/// A probe that always answers "unavailable", with the reason.
pub struct Unavailable(pub String);

impl GpuProbe for Unavailable {
    fn snapshot(&self) -> Result<keel_gpu::GpuSnapshot, keel_gpu::GpuError> {
        Err(keel_gpu::GpuError::Unavailable {
            reason: self.0.clone(),
        })
    }
}
