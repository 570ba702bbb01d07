//! GPU clock control: the [`ClockControl`] boundary through which keel
//! reads and changes application and locked clocks, and its NVML
//! implementation [`NvmlControl`].
//!
//! The trait mirrors NVML's rules (`nvml.h`, NVML API 12.x and 13):
//!
//! - Application clocks (`nvmlDeviceSetApplicationsClocks`) take a
//!   (memory, graphics) pair from the supported lists
//!   (`nvmlDeviceGetSupportedMemoryClocks`, then
//!   `nvmlDeviceGetSupportedGraphicsClocks` for that memory clock); they are
//!   undone only by `nvmlDeviceResetApplicationsClocks`.
//! - Locked GPU clocks (`nvmlDeviceSetGpuLockedClocks`, Volta and later)
//!   override application clocks at once; undone only by
//!   `nvmlDeviceResetGpuLockedClocks`.
//! - Locked memory clocks (`nvmlDeviceSetMemoryLockedClocks`, Ampere and
//!   later, not at run time on Hopper: `NVML_FI_DEV_MCLK_SWITCH_TYPE` says
//!   so) are undone only by `nvmlDeviceResetMemoryLockedClocks`.
//! - Every set and reset needs root (`NVML_ERROR_NO_PERMISSION` otherwise).
//!
//! NVML has no call that reads a lock set earlier: [`Lock::Unknown`] says
//! so, and planners must treat it as such. This module never touches power
//! limits, persistence or compute mode, and nothing here decides what to
//! set: that is `keel-tune`'s job.

use std::fmt;
use std::path::Path;

use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::enums::device::{GpuLockedClocksSetting, SampleValue};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::Nvml;
use serde::{Deserialize, Serialize};

/// `NVML_FI_DEV_MCLK_SWITCH_TYPE`: 0 unsupported, 1 deferred (module
/// reload), 2 at run time. Newer than the NVML of driver 580 (whose
/// `NVML_FI_MAX` is 274): there the field is refused and memory clocks are
/// never locked, only graphics clocks.
pub const FI_MCLK_SWITCH_TYPE: u32 = 298;

/// A (graphics, memory) clock pair in MHz.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockPair {
    pub graphics_mhz: u32,
    pub memory_mhz: u32,
}

impl fmt::Display for ClockPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} MHz", self.graphics_mhz, self.memory_mhz)
    }
}

/// A clock lock range in MHz.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Range {
    pub min_mhz: u32,
    pub max_mhz: u32,
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{} MHz", self.min_mhz, self.max_mhz)
    }
}

/// The state of a clock lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Lock {
    /// NVML cannot say (it has no getter for locks set earlier).
    Unknown,
    Unlocked,
    Locked(Range),
}

impl fmt::Display for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unknown => f.write_str("unknown"),
            Self::Unlocked => f.write_str("unlocked"),
            Self::Locked(r) => write!(f, "locked {r}"),
        }
    }
}

/// What a GPU's clocks are set to now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockState {
    /// Application clocks; `None` where the GPU has none (or unreadable).
    pub applications: Option<ClockPair>,
    pub locked_gpu: Lock,
    pub locked_memory: Lock,
}

/// What a GPU supports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockCaps {
    pub max_graphics_mhz: Option<u32>,
    pub max_memory_mhz: Option<u32>,
    /// Default application clocks (what a reset restores).
    pub default_applications: Option<ClockPair>,
    /// Supported (memory clock, graphics clocks for it), highest first.
    pub supported: Vec<(u32, Vec<u32>)>,
    /// Application clocks can be read and set.
    pub applications: bool,
    /// `nvmlDeviceSetGpuLockedClocks` is available (Volta and later).
    pub lock_gpu: bool,
    /// Memory clocks can be locked at run time (switch type 2).
    pub lock_memory: bool,
}

/// One GPU as the control boundary names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlledGpu {
    pub index: u32,
    /// PCI address in sysfs form, lowercase.
    pub pci_bus_id: String,
    pub name: Option<String>,
}

/// Why a control call did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("NVML is unavailable: {reason}")]
    Unavailable { reason: String },
    #[error("{call} is not supported on GPU {gpu}")]
    NotSupported { call: &'static str, gpu: u32 },
    #[error("{call} on GPU {gpu} needs root (NVML_ERROR_NO_PERMISSION)")]
    NoPermission { call: &'static str, gpu: u32 },
    #[error("{call} on GPU {gpu} refused its argument: {message}")]
    InvalidArgument {
        call: &'static str,
        gpu: u32,
        message: String,
    },
    #[error("{call} on GPU {gpu} failed: {message}")]
    Failed {
        call: &'static str,
        gpu: u32,
        message: String,
    },
}

impl ControlError {
    /// Unsupported, no permission or no NVML: the answer is "unknown",
    /// not a fault of the node.
    pub fn is_unknown(&self) -> bool {
        matches!(
            self,
            Self::Unavailable { .. } | Self::NotSupported { .. } | Self::NoPermission { .. }
        )
    }
}

/// Reads and changes GPU clocks. Implementations: [`NvmlControl`] (the
/// driver) and in-memory GPUs in tests.
pub trait ClockControl {
    fn gpus(&self) -> Result<Vec<ControlledGpu>, ControlError>;
    fn caps(&self, gpu: u32) -> Result<ClockCaps, ControlError>;
    fn state(&self, gpu: u32) -> Result<ClockState, ControlError>;
    fn set_applications_clocks(&mut self, gpu: u32, pair: ClockPair) -> Result<(), ControlError>;
    fn reset_applications_clocks(&mut self, gpu: u32) -> Result<(), ControlError>;
    fn set_locked_gpu_clocks(&mut self, gpu: u32, range: Range) -> Result<(), ControlError>;
    fn reset_locked_gpu_clocks(&mut self, gpu: u32) -> Result<(), ControlError>;
    fn set_locked_memory_clocks(&mut self, gpu: u32, range: Range) -> Result<(), ControlError>;
    fn reset_locked_memory_clocks(&mut self, gpu: u32) -> Result<(), ControlError>;
}

/// Clock control through NVML (`libnvidia-ml.so.1`, loaded at run time).
/// Its set and reset calls change the hardware: keel's tests never build
/// one.
pub struct NvmlControl {
    nvml: Nvml,
}

impl fmt::Debug for NvmlControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlControl").finish_non_exhaustive()
    }
}

impl NvmlControl {
    /// Loads NVML from `library` (a path or a file name the loader finds).
    pub fn open(library: &Path) -> Result<Self, ControlError> {
        let nvml = Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|e| ControlError::Unavailable {
                reason: format!("cannot load {}: {e}", library.display()),
            })?;
        Ok(Self { nvml })
    }

    fn device(&self, gpu: u32) -> Result<nvml_wrapper::Device<'_>, ControlError> {
        self.nvml
            .device_by_index(gpu)
            .map_err(|e| map_err("nvmlDeviceGetHandleByIndex", gpu, e))
    }
}

fn map_err(call: &'static str, gpu: u32, e: NvmlError) -> ControlError {
    match e {
        NvmlError::NotSupported => ControlError::NotSupported { call, gpu },
        NvmlError::NoPermission => ControlError::NoPermission { call, gpu },
        NvmlError::InvalidArg => ControlError::InvalidArgument {
            call,
            gpu,
            message: "NVML_ERROR_INVALID_ARGUMENT".into(),
        },
        e => ControlError::Failed {
            call,
            gpu,
            message: e.to_string(),
        },
    }
}

impl ClockControl for NvmlControl {
    fn gpus(&self) -> Result<Vec<ControlledGpu>, ControlError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| map_err("nvmlDeviceGetCount", 0, e))?;
        let mut out = Vec::new();
        for index in 0..count {
            let d = self.device(index)?;
            let bus = d
                .pci_info()
                .map_err(|e| map_err("nvmlDeviceGetPciInfo", index, e))?
                .bus_id;
            out.push(ControlledGpu {
                index,
                pci_bus_id: crate::nvml::normalize_pci_bus_id(&bus)
                    .unwrap_or_else(|| bus.trim().to_ascii_lowercase()),
                name: d.name().ok(),
            });
        }
        Ok(out)
    }

    fn caps(&self, gpu: u32) -> Result<ClockCaps, ControlError> {
        let d = self.device(gpu)?;
        let mut supported = Vec::new();
        if let Ok(mut mems) = d.supported_memory_clocks() {
            mems.sort_unstable_by(|a, b| b.cmp(a));
            for m in mems {
                let mut grs = d.supported_graphics_clocks(m).unwrap_or_default();
                grs.sort_unstable_by(|a, b| b.cmp(a));
                supported.push((m, grs));
            }
        }
        let default_applications = match (
            d.default_applications_clock(Clock::Graphics),
            d.default_applications_clock(Clock::Memory),
        ) {
            (Ok(g), Ok(m)) => Some(ClockPair {
                graphics_mhz: g,
                memory_mhz: m,
            }),
            _ => None,
        };
        let applications = d.applications_clock(Clock::Graphics).is_ok();
        // Volta (7.0) and later lock GPU clocks.
        let lock_gpu = d
            .cuda_compute_capability()
            .map(|c| c.major >= 7)
            .unwrap_or(false);
        let lock_memory = d
            .field_values_for(&[FieldId(FI_MCLK_SWITCH_TYPE)])
            .ok()
            .and_then(|v| v.into_iter().next())
            .and_then(|v| v.ok())
            .and_then(|v| v.value.ok())
            .is_some_and(|v| match v {
                SampleValue::U32(x) => x == 2,
                SampleValue::U64(x) => x == 2,
                SampleValue::I64(x) => x == 2,
                _ => false,
            });
        Ok(ClockCaps {
            max_graphics_mhz: d.max_clock_info(Clock::Graphics).ok(),
            max_memory_mhz: d.max_clock_info(Clock::Memory).ok(),
            default_applications,
            supported,
            applications,
            lock_gpu,
            lock_memory,
        })
    }

    fn state(&self, gpu: u32) -> Result<ClockState, ControlError> {
        let d = self.device(gpu)?;
        let applications = match (
            d.applications_clock(Clock::Graphics),
            d.applications_clock(Clock::Memory),
        ) {
            (Ok(g), Ok(m)) => Some(ClockPair {
                graphics_mhz: g,
                memory_mhz: m,
            }),
            _ => None,
        };
        Ok(ClockState {
            applications,
            locked_gpu: Lock::Unknown,
            locked_memory: Lock::Unknown,
        })
    }

    fn set_applications_clocks(&mut self, gpu: u32, pair: ClockPair) -> Result<(), ControlError> {
        let mut d = self.device(gpu)?;
        d.set_applications_clocks(pair.memory_mhz, pair.graphics_mhz)
            .map_err(|e| map_err("nvmlDeviceSetApplicationsClocks", gpu, e))
    }

    fn reset_applications_clocks(&mut self, gpu: u32) -> Result<(), ControlError> {
        let mut d = self.device(gpu)?;
        d.reset_applications_clocks()
            .map_err(|e| map_err("nvmlDeviceResetApplicationsClocks", gpu, e))
    }

    fn set_locked_gpu_clocks(&mut self, gpu: u32, range: Range) -> Result<(), ControlError> {
        let mut d = self.device(gpu)?;
        d.set_gpu_locked_clocks(GpuLockedClocksSetting::Numeric {
            min_clock_mhz: range.min_mhz,
            max_clock_mhz: range.max_mhz,
        })
        .map_err(|e| map_err("nvmlDeviceSetGpuLockedClocks", gpu, e))
    }

    fn reset_locked_gpu_clocks(&mut self, gpu: u32) -> Result<(), ControlError> {
        let mut d = self.device(gpu)?;
        d.reset_gpu_locked_clocks()
            .map_err(|e| map_err("nvmlDeviceResetGpuLockedClocks", gpu, e))
    }

    fn set_locked_memory_clocks(&mut self, gpu: u32, range: Range) -> Result<(), ControlError> {
        let mut d = self.device(gpu)?;
        d.set_mem_locked_clocks(range.min_mhz, range.max_mhz)
            .map_err(|e| map_err("nvmlDeviceSetMemoryLockedClocks", gpu, e))
    }

    fn reset_locked_memory_clocks(&mut self, gpu: u32) -> Result<(), ControlError> {
        let mut d = self.device(gpu)?;
        d.reset_mem_locked_clocks()
            .map_err(|e| map_err("nvmlDeviceResetMemoryLockedClocks", gpu, e))
    }
}
