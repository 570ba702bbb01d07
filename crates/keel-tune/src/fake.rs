//! An in-memory GPU behind [`ClockControl`] that keeps NVML's rules, for
//! tests of the clock planner and for dry runs against recorded machines:
//!
//! - application clocks must be a supported (memory, graphics) pair, else
//!   `NVML_ERROR_INVALID_ARGUMENT`; a GPU without them answers
//!   `NVML_ERROR_NOT_SUPPORTED` to every application-clock call;
//! - locks need Volta or later (`lock_gpu`) and memory locks a run-time
//!   memory-clock switch (`lock_memory`); a lock's range must lie within
//!   the supported clocks;
//! - every set and reset needs root (`NVML_ERROR_NO_PERMISSION`);
//! - a reset undoes only its own setting;
//! - like NVML, locks are not readable unless `locks_readable` is set.

use std::path::PathBuf;

use keel_gpu::clocks::{
    ClockCaps, ClockControl, ClockPair, ClockState, ControlError, ControlledGpu, Lock, Range,
};

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeGpu {
    pub pci_bus_id: String,
    pub name: String,
    pub caps: ClockCaps,
    pub applications: Option<ClockPair>,
    pub locked_gpu: Option<Range>,
    pub locked_memory: Option<Range>,
}

impl FakeGpu {
    /// An A100-SXM4-40GB: application clocks 1095/1215 by default, maxima
    /// 1410/1215; memory clocks do not lock at run time.
    pub fn a100(pci: &str) -> Self {
        let grs: Vec<u32> = (0..=80).map(|i| 1410 - 15 * i).collect();
        let pair = ClockPair {
            graphics_mhz: 1095,
            memory_mhz: 1215,
        };
        Self {
            pci_bus_id: pci.into(),
            name: "NVIDIA A100-SXM4-40GB".into(),
            caps: ClockCaps {
                max_graphics_mhz: Some(1410),
                max_memory_mhz: Some(1215),
                default_applications: Some(pair),
                supported: vec![(1215, grs)],
                applications: true,
                lock_gpu: true,
                lock_memory: false,
            },
            applications: Some(pair),
            locked_gpu: None,
            locked_memory: None,
        }
    }

    /// A GPU without application clocks (as NVML 13 deprecates them), with
    /// GPU and memory locks, maxima 1980/2619.
    pub fn lock_only(pci: &str) -> Self {
        let grs: Vec<u32> = (0..=110).map(|i| 1980 - 15 * i).collect();
        Self {
            pci_bus_id: pci.into(),
            name: "NVIDIA H100 80GB HBM3".into(),
            caps: ClockCaps {
                max_graphics_mhz: Some(1980),
                max_memory_mhz: Some(2619),
                default_applications: None,
                supported: vec![(2619, grs)],
                applications: false,
                lock_gpu: true,
                lock_memory: true,
            },
            applications: None,
            locked_gpu: None,
            locked_memory: None,
        }
    }

    /// The GPU a recorded NVML reading describes: its maxima, default and
    /// current application clocks; graphics clocks supported in 15 MHz
    /// steps from the maximum down to 210 MHz (as NVML lists them for
    /// A100 and H100), at the maximum memory clock. `None` without clocks.
    pub fn from_reading(g: &keel_gpu::GpuReading) -> Option<Self> {
        let c = g.clocks?;
        let (max_gr, max_mem) = (c.max_graphics_mhz?, c.max_memory_mhz?);
        let pair = |gr: Option<u32>, mem: Option<u32>| {
            Some(ClockPair {
                graphics_mhz: gr?,
                memory_mhz: mem?,
            })
        };
        let applications = pair(c.app_graphics_mhz, c.app_memory_mhz);
        let grs: Vec<u32> = (0..)
            .map(|i| max_gr.saturating_sub(15 * i))
            .take_while(|g| *g >= 210)
            .collect();
        Some(Self {
            pci_bus_id: g.pci_bus_id.clone(),
            name: g.name.clone().unwrap_or_default(),
            caps: ClockCaps {
                max_graphics_mhz: Some(max_gr),
                max_memory_mhz: Some(max_mem),
                default_applications: pair(c.default_app_graphics_mhz, c.default_app_memory_mhz),
                supported: vec![(max_mem, grs)],
                applications: applications.is_some(),
                lock_gpu: true,
                lock_memory: false,
            },
            applications,
            locked_gpu: None,
            locked_memory: None,
        })
    }

    fn graphics_range(&self) -> Option<(u32, u32)> {
        let all = self
            .caps
            .supported
            .iter()
            .flat_map(|(_, g)| g.iter().copied());
        let min = all.clone().min()?;
        Some((min, all.max()?))
    }
}

/// A machine of [`FakeGpu`]s.
#[derive(Debug, Clone, Default)]
pub struct FakeControl {
    pub gpus: Vec<FakeGpu>,
    /// The caller may change clocks (runs as root).
    pub root: bool,
    /// Report locks (NVML cannot: they read as unknown).
    pub locks_readable: bool,
    /// Sets and resets made, in order (`gpu`, call).
    pub calls: Vec<(u32, &'static str)>,
    /// After this many successful changes every call fails, as if the
    /// process had died there.
    pub die_after: Option<usize>,
    /// A file that must exist at every change (the state file: changes
    /// happen only after the record).
    pub require_file: Option<PathBuf>,
}

impl FakeControl {
    pub fn new(gpus: Vec<FakeGpu>) -> Self {
        Self {
            gpus,
            root: true,
            ..Self::default()
        }
    }

    fn gpu(&self, i: u32) -> Result<&FakeGpu, ControlError> {
        self.gpus
            .get(i as usize)
            .ok_or_else(|| ControlError::Failed {
                call: "nvmlDeviceGetHandleByIndex",
                gpu: i,
                message: "NVML_ERROR_INVALID_ARGUMENT".into(),
            })
    }

    /// Checks the rules every change shares, then applies `f`.
    fn change(
        &mut self,
        i: u32,
        call: &'static str,
        f: impl FnOnce(&mut FakeGpu) -> Result<(), ControlError>,
    ) -> Result<(), ControlError> {
        self.gpu(i)?;
        if self.die_after.is_some_and(|n| self.calls.len() >= n) {
            return Err(ControlError::Failed {
                call,
                gpu: i,
                message: "the process died here".into(),
            });
        }
        if let Some(f) = &self.require_file {
            assert!(
                f.exists(),
                "{call} on GPU {i} before {} was written",
                f.display()
            );
        }
        if !self.root {
            return Err(ControlError::NoPermission { call, gpu: i });
        }
        f(&mut self.gpus[i as usize])?;
        self.calls.push((i, call));
        Ok(())
    }
}

fn invalid(call: &'static str, gpu: u32, message: String) -> ControlError {
    ControlError::InvalidArgument { call, gpu, message }
}

impl ClockControl for FakeControl {
    fn gpus(&self) -> Result<Vec<ControlledGpu>, ControlError> {
        Ok(self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| ControlledGpu {
                index: i as u32,
                pci_bus_id: g.pci_bus_id.clone(),
                name: Some(g.name.clone()),
            })
            .collect())
    }

    fn caps(&self, gpu: u32) -> Result<ClockCaps, ControlError> {
        Ok(self.gpu(gpu)?.caps.clone())
    }

    fn state(&self, gpu: u32) -> Result<ClockState, ControlError> {
        let g = self.gpu(gpu)?;
        let lock = |l: Option<Range>| match (self.locks_readable, l) {
            (false, _) => Lock::Unknown,
            (true, None) => Lock::Unlocked,
            (true, Some(r)) => Lock::Locked(r),
        };
        Ok(ClockState {
            applications: g.applications,
            locked_gpu: lock(g.locked_gpu),
            locked_memory: lock(g.locked_memory),
        })
    }

    fn set_applications_clocks(&mut self, i: u32, pair: ClockPair) -> Result<(), ControlError> {
        const CALL: &str = "nvmlDeviceSetApplicationsClocks";
        self.change(i, CALL, |g| {
            if !g.caps.applications {
                return Err(ControlError::NotSupported { call: CALL, gpu: i });
            }
            let ok = g
                .caps
                .supported
                .iter()
                .any(|(m, grs)| *m == pair.memory_mhz && grs.contains(&pair.graphics_mhz));
            if !ok {
                return Err(invalid(CALL, i, format!("{pair} is not a supported pair")));
            }
            g.applications = Some(pair);
            Ok(())
        })
    }

    fn reset_applications_clocks(&mut self, i: u32) -> Result<(), ControlError> {
        const CALL: &str = "nvmlDeviceResetApplicationsClocks";
        self.change(i, CALL, |g| {
            if !g.caps.applications {
                return Err(ControlError::NotSupported { call: CALL, gpu: i });
            }
            g.applications = g.caps.default_applications;
            Ok(())
        })
    }

    fn set_locked_gpu_clocks(&mut self, i: u32, r: Range) -> Result<(), ControlError> {
        const CALL: &str = "nvmlDeviceSetGpuLockedClocks";
        self.change(i, CALL, |g| {
            if !g.caps.lock_gpu {
                return Err(ControlError::NotSupported { call: CALL, gpu: i });
            }
            let (lo, hi) = g.graphics_range().unwrap_or((0, 0));
            if r.min_mhz > r.max_mhz || r.min_mhz < lo || r.max_mhz > hi {
                return Err(invalid(CALL, i, format!("{r} outside {lo}-{hi} MHz")));
            }
            g.locked_gpu = Some(r);
            Ok(())
        })
    }

    fn reset_locked_gpu_clocks(&mut self, i: u32) -> Result<(), ControlError> {
        const CALL: &str = "nvmlDeviceResetGpuLockedClocks";
        self.change(i, CALL, |g| {
            if !g.caps.lock_gpu {
                return Err(ControlError::NotSupported { call: CALL, gpu: i });
            }
            g.locked_gpu = None;
            Ok(())
        })
    }

    fn set_locked_memory_clocks(&mut self, i: u32, r: Range) -> Result<(), ControlError> {
        const CALL: &str = "nvmlDeviceSetMemoryLockedClocks";
        self.change(i, CALL, |g| {
            if !g.caps.lock_memory {
                return Err(ControlError::NotSupported { call: CALL, gpu: i });
            }
            let ok = g.caps.supported.iter().any(|(m, _)| *m == r.max_mhz)
                && g.caps.supported.iter().any(|(m, _)| *m == r.min_mhz);
            if !ok {
                return Err(invalid(
                    CALL,
                    i,
                    format!("{r} is not a supported memory clock"),
                ));
            }
            g.locked_memory = Some(r);
            Ok(())
        })
    }

    fn reset_locked_memory_clocks(&mut self, i: u32) -> Result<(), ControlError> {
        const CALL: &str = "nvmlDeviceResetMemoryLockedClocks";
        self.change(i, CALL, |g| {
            if !g.caps.lock_memory {
                return Err(ControlError::NotSupported { call: CALL, gpu: i });
            }
            g.locked_memory = None;
            Ok(())
        })
    }
}
