//! GPU readings for keel's health checks.
//!
//! [`GpuProbe`] is the boundary: the check engine asks a probe for a
//! [`GpuSnapshot`] and never knows where it came from. Two probes exist:
//! [`recorded::RecordedProbe`] reads a snapshot recorded on a real machine
//! (JSON, used by fixtures and tests), and [`nvml::NvmlProbe`] reads the
//! driver through `libnvidia-ml.so.1`, loaded at run time so that keel builds
//! and runs on machines without a GPU. [`record`] takes a snapshot from any
//! probe for writing to a file (`keel check record`).
//!
//! [`clocks`] is the one place that changes a GPU: the `ClockControl`
//! boundary (application clocks and clock locks, never power, persistence
//! or compute mode) and its NVML implementation, used by `keel-tune`.
//!
//! Every reading is an `Option`: `None` means it could not be read (not
//! supported by the device, or the call failed), never zero. This crate runs
//! no GPU work and decides nothing about health.

pub mod clocks;
pub mod nvml;
pub mod recorded;

pub use nvml::{CallGate, LoadedNvmlProbe, NvmlProbe};
pub use recorded::record;

use serde::{Deserialize, Serialize};

/// The version of the snapshot JSON format.
pub const SNAPSHOT_VERSION: u32 = 1;

/// Why no snapshot could be taken at all.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The driver library is not there or does not load: the checks that
    /// need it are `unknown`.
    #[error("NVML is unavailable: {reason}")]
    Unavailable { reason: String },
    /// NVML loaded but a call every check needs failed.
    #[error("NVML call {call} failed: {message}")]
    Nvml { call: &'static str, message: String },
    /// NVML did not answer in time (a hung driver).
    #[error("NVML did not answer within {seconds} s")]
    Timeout { seconds: f64 },
    #[error("failed to read the recorded snapshot {path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a GPU snapshot: {message}")]
    Format {
        path: std::path::PathBuf,
        message: String,
    },
}

/// Something that can read the GPUs.
pub trait GpuProbe {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError>;
}

/// Everything NVML says about a machine's GPUs at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSnapshot {
    pub version: u32,
    /// What machine this was recorded on, free text (fixtures say which
    /// real machine they describe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub driver_version: Option<String>,
    pub nvml_version: Option<String>,
    /// CUDA driver API version, e.g. 12040 for 12.4.
    pub cuda_driver_version: Option<i32>,
    /// GPUs in NVML index order (PCI bus order).
    pub gpus: Vec<GpuReading>,
    /// Devices NVML counts but could not open or locate, so left out of
    /// `gpus`: a GPU that fell off the bus (`lost`), or one this process
    /// may not use (no permission, a job's device cgroup).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unopened: Vec<Unopened>,
}

/// A device NVML counts but could not open (see [`GpuSnapshot::unopened`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Unopened {
    pub index: u32,
    /// NVML said the GPU is lost (`NVML_ERROR_GPU_IS_LOST`): it fell off
    /// the bus. Any other error says nothing about the GPU's health.
    pub lost: bool,
    /// NVML's error.
    pub error: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuReading {
    pub index: u32,
    /// PCI address in sysfs form, lowercase: `0000:07:00.0`.
    pub pci_bus_id: String,
    /// The minor number of its device file, `/dev/nvidia<minor>`
    /// (`nvmlDeviceGetMinorNumber`). Not the index: the driver numbers
    /// device files in the order it finds the GPUs, which need not be PCI
    /// order. Absent from snapshots recorded before it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_number: Option<u32>,
    pub uuid: Option<String>,
    pub serial: Option<String>,
    pub name: Option<String>,
    pub persistence_mode: Option<bool>,
    /// ECC mode currently in effect.
    pub ecc_enabled: Option<bool>,
    /// ECC mode after the next reboot.
    pub ecc_pending: Option<bool>,
    pub ecc: EccCounters,
    /// Pre-Ampere page retirement: pages waiting for a reboot.
    pub retired_pages_pending: Option<bool>,
    /// Ampere and later.
    pub remapped_rows: Option<RemappedRows>,
    /// NVML clocks-event (throttle) reason bit mask.
    pub throttle_reasons: Option<u64>,
    pub pcie: PcieReading,
    /// State of each NVLink link (true = active); `None` when the device has
    /// no NVLink or it could not be read.
    pub nvlink_active: Option<Vec<bool>>,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    pub memory_total_bytes: Option<u64>,
    /// Compute processes on the GPU.
    pub processes: Option<Vec<GpuProcess>>,
    /// Percent of the last sample period (1/6 s to 1 s) in which a kernel
    /// ran (`nvmlDeviceGetUtilizationRates`). Readings below are absent
    /// from snapshots recorded before they existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_gpu_percent: Option<u32>,
    /// Percent of the sample period in which device memory was read or
    /// written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_memory_percent: Option<u32>,
    /// Device memory in use, bytes (NVML counts reserved memory as used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
    /// Energy used since the driver loaded, millijoules (Volta and later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub energy_millijoules: Option<u64>,
    /// The power limit the driver enforces, watts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_limit_w: Option<f64>,
    /// Device (HBM) memory temperature, °C (NVML field 82; not every GPU
    /// reports it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_temperature_c: Option<u32>,
    /// Streaming multiprocessor clock, MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz: Option<u32>,
    /// Memory clock, MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_clock_mhz: Option<u32>,
    /// Error counters of each NVLink link, in link order (as
    /// `nvlink_active`); `None` when they could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_errors: Option<Vec<NvlinkErrors>>,
    /// Clocks; absent from snapshots recorded before they were read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clocks: Option<ClockReading>,
}

/// A GPU's clocks in MHz: current, application (what CUDA contexts ask
/// for), their defaults and the maxima.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockReading {
    pub graphics_mhz: Option<u32>,
    pub memory_mhz: Option<u32>,
    pub app_graphics_mhz: Option<u32>,
    pub app_memory_mhz: Option<u32>,
    pub default_app_graphics_mhz: Option<u32>,
    pub default_app_memory_mhz: Option<u32>,
    pub max_graphics_mhz: Option<u32>,
    pub max_memory_mhz: Option<u32>,
}

/// One NVLink link's error counters since the driver loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvlinkErrors {
    pub replay: Option<u64>,
    pub recovery: Option<u64>,
    pub crc_flit: Option<u64>,
    pub crc_data: Option<u64>,
}

/// ECC error counters. Volatile counters reset at driver load; aggregate
/// ones persist across reboots.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EccCounters {
    pub volatile_sram_uncorrected: Option<u64>,
    pub volatile_dram_uncorrected: Option<u64>,
    pub volatile_sram_corrected: Option<u64>,
    pub volatile_dram_corrected: Option<u64>,
    pub aggregate_sram_uncorrected: Option<u64>,
    pub aggregate_dram_uncorrected: Option<u64>,
    pub aggregate_sram_corrected: Option<u64>,
    pub aggregate_dram_corrected: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemappedRows {
    pub correctable: u32,
    pub uncorrectable: u32,
    pub pending: bool,
    pub failure: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcieReading {
    pub current_gen: Option<u32>,
    pub max_gen: Option<u32>,
    pub current_width: Option<u32>,
    pub max_width: Option<u32>,
    /// PCIe replay counter since driver load.
    pub replay_counter: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuProcess {
    pub pid: u32,
    pub used_memory_bytes: Option<u64>,
}

/// NVML clocks-event reason bits (`nvmlClocksEventReason*`).
pub mod throttle {
    pub const GPU_IDLE: u64 = 0x1;
    pub const APPLICATIONS_CLOCKS_SETTING: u64 = 0x2;
    pub const SW_POWER_CAP: u64 = 0x4;
    pub const HW_SLOWDOWN: u64 = 0x8;
    pub const SYNC_BOOST: u64 = 0x10;
    pub const SW_THERMAL_SLOWDOWN: u64 = 0x20;
    pub const HW_THERMAL_SLOWDOWN: u64 = 0x40;
    pub const HW_POWER_BRAKE_SLOWDOWN: u64 = 0x80;
    pub const DISPLAY_CLOCK_SETTING: u64 = 0x100;

    /// Names of the bits set in `mask`.
    pub fn names(mask: u64) -> Vec<&'static str> {
        [
            (GPU_IDLE, "gpu_idle"),
            (APPLICATIONS_CLOCKS_SETTING, "applications_clocks_setting"),
            (SW_POWER_CAP, "sw_power_cap"),
            (HW_SLOWDOWN, "hw_slowdown"),
            (SYNC_BOOST, "sync_boost"),
            (SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
            (HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
            (HW_POWER_BRAKE_SLOWDOWN, "hw_power_brake_slowdown"),
            (DISPLAY_CLOCK_SETTING, "display_clock_setting"),
        ]
        .iter()
        .filter(|(bit, _)| mask & bit != 0)
        .map(|(_, n)| *n)
        .collect()
    }
}

impl keel_error::HasKind for GpuError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Unavailable { .. } | Self::Timeout { .. } | Self::Nvml { .. } => K::Unavailable,
            Self::Read { .. } => K::Io,
            Self::Format { .. } => K::Input,
        }
    }
}

/// The kind of an error of this crate.
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; GpuError)
}
