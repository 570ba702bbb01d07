//! The NVML probe: reads the GPUs through the driver's `libnvidia-ml.so.1`.
//!
//! The library is loaded at run time (`nvml-wrapper`, through `libloading`),
//! so keel builds and starts on machines without a GPU; there the probe
//! answers [`GpuError::Unavailable`]. All NVML work (loading included) runs
//! on a thread of its own, and [`NvmlProbe::snapshot`] gives up with
//! [`GpuError::Timeout`] when that thread has not answered in time: a hung
//! driver must not hang keel. A thread that timed out cannot be cancelled
//! while it is inside the driver; it is left behind and ends when (if) the
//! driver returns. Until it does, no other NVML call starts in this process
//! ([`CallGate`]): later snapshots wait for the hung call up to their own
//! timeout and answer [`GpuError::Timeout`], so a driver that hangs for a
//! day costs one thread, not one per scrape.
//!
//! Every reading is asked for separately; a call that fails or is not
//! supported leaves its field `None`. Only NVML's device count is
//! essential ([`GpuError::Nvml`] when it fails). A device that NVML counts
//! but cannot open (a GPU that fell off the bus, or one this process may
//! not use), or whose PCI address it cannot give, is left out of
//! [`GpuSnapshot::gpus`] and listed in [`GpuSnapshot::unopened`] with NVML's
//! error: the model identifies every GPU by its PCI address, and the check
//! that compares NVML's GPUs with those on the PCI bus reports it missing
//! (`fail` when NVML said the GPU is lost, `unknown` for any other error).
//!
//! This module holds no `unsafe`: everything goes through `nvml-wrapper`'s
//! safe API. No reading needs a raw call: remapped rows, for which
//! `nvml-wrapper` has no method, come from NVML field values
//! (`NVML_FI_DEV_REMAPPED_*`), and ECC counters per SRAM/DRAM location from
//! `nvmlDeviceGetMemoryErrorCounter`.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, MemoryLocation, TemperatureSensor,
};
use nvml_wrapper::enums::device::{SampleValue, UsedGpuMemory};
use nvml_wrapper::error::{Bits, NvmlError};
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_MEMORY_TEMP, NVML_FI_DEV_REMAPPED_COR, NVML_FI_DEV_REMAPPED_FAILURE,
    NVML_FI_DEV_REMAPPED_PENDING, NVML_FI_DEV_REMAPPED_UNC,
};
use nvml_wrapper::{Device, Nvml};

use crate::{
    ClockReading, EccCounters, GpuError, GpuProbe, GpuProcess, GpuReading, GpuSnapshot,
    NvlinkErrors, PcieReading, RemappedRows, SNAPSHOT_VERSION,
};

/// The library the driver installs (the unversioned `libnvidia-ml.so` only
/// comes with development packages).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// How long a snapshot may take by default, loading NVML included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// `NVML_NVLINK_MAX_LINKS` in `nvml.h` (not re-exported by `nvml-wrapper`).
pub const NVLINK_MAX_LINKS: u32 = 18;

/// Reads the GPUs through NVML.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlProbe {
    library: PathBuf,
    timeout: Duration,
}

impl Default for NvmlProbe {
    fn default() -> Self {
        Self::with_library(DEFAULT_LIBRARY)
    }
}

impl NvmlProbe {
    /// A probe that loads [`DEFAULT_LIBRARY`] through the dynamic loader's
    /// search path, with [`DEFAULT_TIMEOUT`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A probe that loads NVML from `library`: a path, or a bare file name
    /// that the dynamic loader searches for.
    pub fn with_library(library: impl Into<PathBuf>) -> Self {
        Self {
            library: library.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Sets how long a snapshot may take before it is abandoned.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn library(&self) -> &Path {
        &self.library
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl GpuProbe for NvmlProbe {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        let library = self.library.clone();
        run_with_timeout(self.timeout, move || read(&library))
    }
}

/// At most one call outstanding: the NVML work of this process goes
/// through [`CallGate::nvml`], which starts a thread for a call only when
/// the previous one has returned. A call into a hung driver never returns
/// (or returns hours later), and every call after it would hang in the
/// same driver: starting a thread for each would leak one per attempt.
#[derive(Debug, Default)]
pub struct CallGate {
    /// The thread of the call in progress: its sender is dropped when the
    /// thread's work ends (returned or panicked), which disconnects this.
    busy: Mutex<Option<Receiver<Infallible>>>,
}

static NVML_CALLS: CallGate = CallGate::new();

impl CallGate {
    pub const fn new() -> Self {
        Self {
            busy: Mutex::new(None),
        }
    }

    /// The gate every NVML call of this process goes through.
    pub fn nvml() -> &'static CallGate {
        &NVML_CALLS
    }

    /// Whether a call started through this gate has not returned yet.
    pub fn is_busy(&self) -> bool {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        Self::settle(&mut busy, Duration::ZERO);
        busy.is_some()
    }

    /// Waits up to `wait` for the outstanding call (if any) to end; true
    /// when none is outstanding afterwards.
    fn settle(busy: &mut Option<Receiver<Infallible>>, wait: Duration) -> bool {
        if let Some(done) = busy.as_ref() {
            match done.recv_timeout(wait) {
                Err(RecvTimeoutError::Timeout) => return false,
                Ok(never) => match never {},
                Err(RecvTimeoutError::Disconnected) => *busy = None,
            }
        }
        true
    }

    /// Runs `work` on a thread of its own and waits at most `timeout` for
    /// its answer. While an earlier call through this gate is still
    /// running, no thread is started: this call waits for the earlier one
    /// within the same `timeout`, and gives [`GpuError::Timeout`] when it
    /// has not ended (callers are served one at a time).
    pub fn run<T, F>(&self, timeout: Duration, work: F) -> Result<T, GpuError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, GpuError> + Send + 'static,
    {
        let start = Instant::now();
        let timed_out = || GpuError::Timeout {
            seconds: timeout.as_secs_f64(),
        };
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if !Self::settle(&mut busy, timeout) {
            return Err(timed_out());
        }
        // Capacity 1: a thread that answers after the deadline does not
        // block on a receiver that is gone.
        let (answer, answered) = mpsc::sync_channel(1);
        let (running, done) = mpsc::sync_channel::<Infallible>(0);
        std::thread::Builder::new()
            .name("keel-nvml".into())
            .spawn(move || {
                let _running = running;
                let _ = answer.send(work());
            })
            .map_err(|e| GpuError::Unavailable {
                reason: format!("cannot start a thread for NVML: {e}"),
            })?;
        *busy = Some(done);
        match answered.recv_timeout(timeout.saturating_sub(start.elapsed())) {
            Ok(result) => {
                // The thread ends as soon as it has sent.
                *busy = None;
                result
            }
            Err(RecvTimeoutError::Timeout) => Err(timed_out()),
            Err(RecvTimeoutError::Disconnected) => {
                *busy = None;
                Err(GpuError::Nvml {
                    call: "snapshot",
                    message: "the NVML thread ended without an answer (it panicked)".into(),
                })
            }
        }
    }
}

/// Runs `work` through the process's NVML gate ([`CallGate::nvml`]).
fn run_with_timeout<T, F>(timeout: Duration, work: F) -> Result<T, GpuError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, GpuError> + Send + 'static,
{
    CallGate::nvml().run(timeout, work)
}

/// An NVML probe for a long-running process (`keel exporter`): NVML is
/// loaded and initialised at the first snapshot and kept for the next ones,
/// instead of at every snapshot as [`NvmlProbe`] does. Each snapshot still
/// runs on a thread of its own under the timeout. When NVML answers that it
/// is not initialised or the driver is gone, the handle is dropped and the
/// next snapshot loads it again.
#[derive(Clone)]
pub struct LoadedNvmlProbe {
    probe: NvmlProbe,
    nvml: Arc<Mutex<Option<Arc<Nvml>>>>,
}

impl std::fmt::Debug for LoadedNvmlProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let loaded = self.nvml.lock().map(|n| n.is_some()).unwrap_or(false);
        f.debug_struct("LoadedNvmlProbe")
            .field("probe", &self.probe)
            .field("loaded", &loaded)
            .finish()
    }
}

impl LoadedNvmlProbe {
    /// Keeps NVML loaded between the snapshots of `probe` (its library and
    /// timeout).
    pub fn new(probe: NvmlProbe) -> Self {
        Self {
            probe,
            nvml: Arc::new(Mutex::new(None)),
        }
    }

    /// Whether NVML is loaded now.
    pub fn is_loaded(&self) -> bool {
        self.nvml.lock().map(|n| n.is_some()).unwrap_or(false)
    }
}

impl GpuProbe for LoadedNvmlProbe {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        let library = self.probe.library.clone();
        let slot = self.nvml.clone();
        run_with_timeout(self.probe.timeout, move || {
            let nvml = {
                let mut held = slot.lock().unwrap_or_else(|e| e.into_inner());
                match &*held {
                    Some(n) => n.clone(),
                    None => {
                        let n = Arc::new(init(&library)?);
                        *held = Some(n.clone());
                        n
                    }
                }
            };
            let result = read_with(&nvml);
            if matches!(result, Err(GpuError::Nvml { .. })) {
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
            }
            result
        })
    }
}

/// Loads NVML from `library` and reads every GPU.
fn read(library: &Path) -> Result<GpuSnapshot, GpuError> {
    read_with(&init(library)?)
    // The handle is dropped here, which shuts NVML down (errors ignored).
}

/// Loads and initialises NVML from `library`.
fn init(library: &Path) -> Result<Nvml, GpuError> {
    Nvml::builder()
        .lib_path(library.as_os_str())
        .init()
        .map_err(|e| GpuError::Unavailable {
            reason: match e {
                // The loader's message names the file and says why.
                NvmlError::LibloadingError(e) => format!("cannot load {}: {e}", library.display()),
                e => format!(
                    "cannot initialise NVML from {}: {}",
                    library.display(),
                    error_chain(&e)
                ),
            },
        })
}

/// Reads every GPU through an initialised NVML.
fn read_with(nvml: &Nvml) -> Result<GpuSnapshot, GpuError> {
    let count = nvml.device_count().map_err(|e| GpuError::Nvml {
        call: "nvmlDeviceGetCount",
        message: error_chain(&e),
    })?;
    let mut gpus = Vec::new();
    let mut unopened = Vec::new();
    let mut left_out = |index: u32, e: NvmlError| {
        unopened.push(crate::Unopened {
            index,
            lost: matches!(e, NvmlError::GpuLost),
            error: error_chain(&e),
        })
    };
    for index in 0..count {
        // Left out when unreadable: see the module docs.
        let device = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                left_out(index, e);
                continue;
            }
        };
        match device.pci_info() {
            Ok(pci) => gpus.push(read_device(index, &pci.bus_id, &device)),
            Err(e) => left_out(index, e),
        }
    }
    Ok(GpuSnapshot {
        version: SNAPSHOT_VERSION,
        description: None,
        driver_version: nvml.sys_driver_version().ok(),
        nvml_version: nvml.sys_nvml_version().ok(),
        cuda_driver_version: nvml.sys_cuda_driver_version().ok(),
        gpus,
        unopened,
    })
}

/// Reads one GPU; `index` is its NVML index and `bus_id` NVML's PCI bus id.
fn read_device(index: u32, bus_id: &str, device: &Device<'_>) -> GpuReading {
    let ecc_mode = device.is_ecc_enabled().ok();
    let utilization = device.utilization_rates().ok();
    let memory = device.memory_info().ok();
    let nvlink = nvlink_active(device);
    let links = nvlink.as_ref().map(|l| l.len() as u32);
    GpuReading {
        index,
        // NVML's ids are well formed; should one not be, keep it (lowercase)
        // rather than lose the GPU: it then matches nothing on the PCI bus.
        pci_bus_id: normalize_pci_bus_id(bus_id)
            .unwrap_or_else(|| bus_id.trim().to_ascii_lowercase()),
        minor_number: device.minor_number().ok(),
        uuid: device.uuid().ok(),
        serial: device.serial().ok(),
        name: device.name().ok(),
        persistence_mode: device.is_in_persistent_mode().ok(),
        ecc_enabled: ecc_mode.as_ref().map(|m| m.currently_enabled),
        ecc_pending: ecc_mode.as_ref().map(|m| m.pending_enabled),
        ecc: ecc_counters(device),
        retired_pages_pending: device.are_pages_pending_retired().ok(),
        remapped_rows: remapped_rows(device),
        throttle_reasons: throttle_reasons(device),
        pcie: PcieReading {
            current_gen: device.current_pcie_link_gen().ok(),
            // The maximum this device reaches in this system (a Gen5 GPU in
            // a Gen4 slot says 4), which is what a degraded link is measured
            // against.
            max_gen: device.max_pcie_link_gen().ok(),
            current_width: device.current_pcie_link_width().ok(),
            max_width: device.max_pcie_link_width().ok(),
            replay_counter: device.pcie_replay_counter().ok().map(u64::from),
        },
        nvlink_active: nvlink,
        temperature_c: device.temperature(TemperatureSensor::Gpu).ok(),
        power_w: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        memory_total_bytes: memory.as_ref().map(|m| m.total),
        processes: device.running_compute_processes().ok().map(|procs| {
            procs
                .into_iter()
                .map(|p| GpuProcess {
                    pid: p.pid,
                    used_memory_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(bytes) => Some(bytes),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect()
        }),
        utilization_gpu_percent: utilization.as_ref().map(|u| u.gpu),
        utilization_memory_percent: utilization.as_ref().map(|u| u.memory),
        memory_used_bytes: memory.as_ref().map(|m| m.used),
        energy_millijoules: device.total_energy_consumption().ok(),
        power_limit_w: device
            .enforced_power_limit()
            .ok()
            .map(|mw| f64::from(mw) / 1000.0),
        memory_temperature_c: field_u64(device, NVML_FI_DEV_MEMORY_TEMP)
            .and_then(|t| u32::try_from(t).ok())
            .filter(|t| *t > 0),
        sm_clock_mhz: device.clock_info(Clock::SM).ok(),
        memory_clock_mhz: device.clock_info(Clock::Memory).ok(),
        nvlink_errors: links.map(|n| (0..n).map(|l| nvlink_errors(device, l)).collect()),
        clocks: Some(clock_reading(device)),
    }
}

/// Current, application, default application and maximum clocks.
fn clock_reading(device: &Device<'_>) -> ClockReading {
    ClockReading {
        graphics_mhz: device.clock_info(Clock::Graphics).ok(),
        memory_mhz: device.clock_info(Clock::Memory).ok(),
        app_graphics_mhz: device.applications_clock(Clock::Graphics).ok(),
        app_memory_mhz: device.applications_clock(Clock::Memory).ok(),
        default_app_graphics_mhz: device.default_applications_clock(Clock::Graphics).ok(),
        default_app_memory_mhz: device.default_applications_clock(Clock::Memory).ok(),
        max_graphics_mhz: device.max_clock_info(Clock::Graphics).ok(),
        max_memory_mhz: device.max_clock_info(Clock::Memory).ok(),
    }
}

/// One link's error counters; each `None` when NVML does not give it.
fn nvlink_errors(device: &Device<'_>, link: u32) -> NvlinkErrors {
    use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
    let link = device.link_wrapper_for(link);
    let count = |c| link.error_counter(c).ok();
    NvlinkErrors {
        replay: count(ErrorCounter::DlReplay),
        recovery: count(ErrorCounter::DlRecovery),
        crc_flit: count(ErrorCounter::DlCrcFlit),
        crc_data: count(ErrorCounter::DlCrcData),
    }
}

/// ECC counters by location: SRAM (`NVML_MEMORY_LOCATION_SRAM`, Turing and
/// later) and DRAM (`NVML_MEMORY_LOCATION_DRAM`, device memory). A GPU
/// without ECC, or a location it does not count, gives `None`.
fn ecc_counters(device: &Device<'_>) -> EccCounters {
    use EccCounter::{Aggregate, Volatile};
    use MemoryError::{Corrected, Uncorrected};
    use MemoryLocation::{Device as Dram, SRAM as Sram};
    let count =
        |error, counter, location| device.memory_error_counter(error, counter, location).ok();
    EccCounters {
        volatile_sram_uncorrected: count(Uncorrected, Volatile, Sram),
        volatile_dram_uncorrected: count(Uncorrected, Volatile, Dram),
        volatile_sram_corrected: count(Corrected, Volatile, Sram),
        volatile_dram_corrected: count(Corrected, Volatile, Dram),
        aggregate_sram_uncorrected: count(Uncorrected, Aggregate, Sram),
        aggregate_dram_uncorrected: count(Uncorrected, Aggregate, Dram),
        aggregate_sram_corrected: count(Corrected, Aggregate, Sram),
        aggregate_dram_corrected: count(Corrected, Aggregate, Dram),
    }
}

/// Row remapping (Ampere and later) from NVML field values; `None` unless
/// all four fields read (pre-Ampere GPUs answer "not supported").
fn remapped_rows(device: &Device<'_>) -> Option<RemappedRows> {
    let ids = [
        NVML_FI_DEV_REMAPPED_COR,
        NVML_FI_DEV_REMAPPED_UNC,
        NVML_FI_DEV_REMAPPED_PENDING,
        NVML_FI_DEV_REMAPPED_FAILURE,
    ]
    .map(FieldId);
    let samples = device.field_values_for(&ids).ok()?;
    let mut values = [0u64; 4];
    for (slot, (id, sample)) in values.iter_mut().zip(ids.iter().zip(samples)) {
        let sample = sample.ok()?;
        if sample.field != *id {
            return None;
        }
        *slot = sample_u64(sample.value.ok()?)?;
    }
    let [correctable, uncorrectable, pending, failure] = values;
    Some(RemappedRows {
        correctable: u32::try_from(correctable).ok()?,
        uncorrectable: u32::try_from(uncorrectable).ok()?,
        pending: pending != 0,
        failure: failure != 0,
    })
}

/// One NVML field value as an integer; `None` when it is not given.
fn field_u64(device: &Device<'_>, id: u32) -> Option<u64> {
    let sample = device
        .field_values_for(&[FieldId(id)])
        .ok()?
        .into_iter()
        .next()?
        .ok()?;
    if sample.field != FieldId(id) {
        return None;
    }
    sample_u64(sample.value.ok()?)
}

fn sample_u64(value: SampleValue) -> Option<u64> {
    match value {
        SampleValue::U32(v) => Some(u64::from(v)),
        SampleValue::U64(v) => Some(v),
        SampleValue::I64(v) => u64::try_from(v).ok(),
        SampleValue::F64(_) => None,
    }
}

/// The whole clocks-event mask, bits `nvml-wrapper` has no name for included.
fn throttle_reasons(device: &Device<'_>) -> Option<u64> {
    match device.current_throttle_reasons_strict() {
        Ok(reasons) => Some(reasons.bits()),
        // The strict call hands back the raw mask when it has unknown bits.
        Err(NvmlError::IncorrectBits(Bits::U64(raw))) => Some(raw),
        Err(_) => None,
    }
}

/// Link states from link 0 up to the first link NVML says does not exist.
/// Any other failure makes the whole list unknown: a shorter list would read
/// as missing links.
fn nvlink_active(device: &Device<'_>) -> Option<Vec<bool>> {
    let mut links = Vec::new();
    for link in 0..NVLINK_MAX_LINKS {
        match device.link_wrapper_for(link).is_active() {
            Ok(active) => links.push(active),
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
            Err(_) => return None,
        }
    }
    (!links.is_empty()).then_some(links)
}

/// NVML's PCI bus id (`00000000:07:00.0`, domain in 8 hex digits, or the
/// legacy 4-digit form) in sysfs form, lowercase: `0000:07:00.0`. Domains
/// wider than 16 bits keep all their digits, as the kernel prints them.
/// `None` when `bus_id` is not a PCI address.
pub fn normalize_pci_bus_id(bus_id: &str) -> Option<String> {
    fn hex(text: &str, max_digits: usize) -> Option<u32> {
        if text.is_empty()
            || text.len() > max_digits
            || !text.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return None;
        }
        u32::from_str_radix(text, 16).ok()
    }
    let id = bus_id.trim_matches(|c: char| c == '\0' || c.is_whitespace());
    let (domain, rest) = id.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let (domain, bus, device, function) = (
        hex(domain, 8)?,
        hex(bus, 2)?,
        hex(device, 2)?,
        hex(function, 1)?,
    );
    if device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// An error and its sources, `: `-separated.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let more = e.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn missing_library_is_unavailable() {
        let probe = NvmlProbe::with_library("/nonexistent/libnvidia-ml.so.1");
        match probe.snapshot() {
            Err(GpuError::Unavailable { reason }) => {
                assert!(
                    reason.contains("/nonexistent/libnvidia-ml.so.1"),
                    "{reason}"
                );
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    #[test]
    fn a_library_that_is_not_nvml_is_unavailable() {
        // Loads (it is a shared library) but has no nvmlInit_v2.
        let libc = [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib/aarch64-linux-gnu/libc.so.6",
            "/lib64/libc.so.6",
        ]
        .into_iter()
        .find(|p| Path::new(p).exists());
        let Some(libc) = libc else { return };
        match NvmlProbe::with_library(libc).snapshot() {
            Err(GpuError::Unavailable { reason }) => {
                assert!(reason.contains(libc), "{reason}");
                assert!(reason.contains("nvmlInit_v2"), "{reason}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    #[test]
    fn a_kept_probe_without_a_driver_is_unavailable_and_loads_nothing() {
        let probe = LoadedNvmlProbe::new(NvmlProbe::with_library("/nonexistent/libnvidia-ml.so.1"));
        for _ in 0..2 {
            match probe.snapshot() {
                Err(GpuError::Unavailable { reason }) => {
                    assert!(
                        reason.contains("/nonexistent/libnvidia-ml.so.1"),
                        "{reason}"
                    )
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
            assert!(!probe.is_loaded());
        }
        assert!(format!("{probe:?}").contains("loaded: false"));
    }

    #[test]
    fn defaults() {
        let probe = NvmlProbe::new();
        assert_eq!(probe.library(), Path::new("libnvidia-ml.so.1"));
        assert_eq!(probe.timeout(), Duration::from_secs(10));
        let probe = NvmlProbe::with_library("/opt/nvml.so").with_timeout(Duration::from_secs(3));
        assert_eq!(probe.library(), Path::new("/opt/nvml.so"));
        assert_eq!(probe.timeout(), Duration::from_secs(3));
    }

    #[test]
    fn work_that_does_not_finish_times_out() {
        let gate = CallGate::new();
        let (_keep_waiting, wait) = mpsc::channel::<()>();
        let result = gate.run(Duration::from_millis(50), move || {
            let _ = wait.recv();
            Ok(())
        });
        match result {
            Err(GpuError::Timeout { seconds }) => assert_eq!(seconds, 0.05),
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(gate.is_busy());
    }

    /// A driver that never answers: a hundred calls start one thread, each
    /// call gives up at its deadline, and once the hung call returns the
    /// next one runs.
    #[test]
    fn a_hung_call_blocks_new_threads_until_it_returns() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let gate = CallGate::new();
        let started = Arc::new(AtomicUsize::new(0));
        let (release, hang) = mpsc::channel::<()>();
        let hang = Arc::new(Mutex::new(hang));
        for _ in 0..100 {
            let (started, hang) = (started.clone(), hang.clone());
            let result = gate.run(Duration::from_millis(1), move || {
                started.fetch_add(1, Ordering::SeqCst);
                let _ = hang.lock().expect("lock").recv();
                Ok(0)
            });
            assert!(
                matches!(result, Err(GpuError::Timeout { .. })),
                "{result:?}"
            );
        }
        assert_eq!(started.load(Ordering::SeqCst), 1, "threads started");
        release.send(()).expect("the hung call is waiting");
        let started2 = started.clone();
        let answer = gate.run(Duration::from_secs(30), move || {
            started2.fetch_add(1, Ordering::SeqCst);
            Ok(7)
        });
        assert_eq!(answer.ok(), Some(7));
        assert_eq!(started.load(Ordering::SeqCst), 2);
        assert!(!gate.is_busy());
    }

    #[test]
    fn work_that_finishes_gives_its_answer() {
        let gate = CallGate::new();
        assert_eq!(gate.run(Duration::from_secs(10), || Ok(7)).ok(), Some(7));
        let err = gate.run::<(), _>(Duration::from_secs(10), || {
            Err(GpuError::Unavailable { reason: "x".into() })
        });
        assert!(matches!(err, Err(GpuError::Unavailable { reason }) if reason == "x"));
        assert!(!gate.is_busy());
    }

    #[test]
    fn work_that_panics_is_an_error() {
        let gate = CallGate::new();
        let result = gate.run::<(), _>(Duration::from_secs(10), || panic!("driver trouble"));
        assert!(
            matches!(
                result,
                Err(GpuError::Nvml {
                    call: "snapshot",
                    ..
                })
            ),
            "{result:?}"
        );
        assert!(!gate.is_busy());
    }

    fn check(bus_id: &str, expected: Option<&str>) {
        assert_eq!(
            normalize_pci_bus_id(bus_id).as_deref(),
            expected,
            "{bus_id:?}"
        );
    }

    #[test]
    fn pci_bus_ids() {
        check("00000000:07:00.0", Some("0000:07:00.0"));
        check("00000001:00:00.0", Some("0001:00:00.0"));
        check("0000000B:00:00.0", Some("000b:00:00.0"));
        check("00000000:C1:00.0", Some("0000:c1:00.0"));
        check("00000000:1F:1F.7", Some("0000:1f:1f.7"));
        check("0000:07:00.0", Some("0000:07:00.0"));
        check("00010000:00:00.0", Some("10000:00:00.0"));
        check("00000000:07:00.0\0", Some("0000:07:00.0"));
        check(" 00000000:07:00.0\n", Some("0000:07:00.0"));
        check("", None);
        check("07:00.0", None);
        check("0000:07:00", None);
        check("0000:07.00.0", None);
        check("0000:107:00.0", None);
        check("000000000:07:00.0", None);
        check("0000:07:20.0", None);
        check("0000:07:00.8", None);
        check("0000:07:00.00", None);
        check("0000:g7:00.0", None);
        check("0000:+7:00.0", None);
        check("0000::00.0", None);
        check("GPU-0000:07:00.0", None);
    }

    proptest! {
        #[test]
        fn pci_bus_id_never_panics(text in any::<String>()) {
            let _ = normalize_pci_bus_id(&text);
        }

        #[test]
        fn pci_bus_id_near_misses_never_panic(text in "[0-9a-fA-F:. \\x00]{0,24}") {
            if let Some(id) = normalize_pci_bus_id(&text) {
                prop_assert_eq!(normalize_pci_bus_id(&id), Some(id.clone()));
            }
        }

        #[test]
        fn nvml_form_becomes_sysfs_form(domain in 0u32..=0xffff, bus in 0u32..=0xff, device in 0u32..=0x1f, function in 0u32..=7) {
            let nvml = format!("{domain:08X}:{bus:02X}:{device:02X}.{function:X}");
            let sysfs = format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}");
            prop_assert_eq!(normalize_pci_bus_id(&nvml), Some(sysfs.clone()));
            prop_assert_eq!(normalize_pci_bus_id(&sysfs), Some(sysfs));
        }
    }
}
