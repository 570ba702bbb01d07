//! What one scrape knows: plain data, gathered by [`crate::collect`] and
//! turned into text by [`crate::expose`].

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_gpu::GpuSnapshot;

/// Everything a scrape exposes.
#[derive(Debug, Clone, Default)]
pub struct Readings {
    pub gpu: GpuState,
    /// InfiniBand/RoCE ports under `/sys/class/infiniband`; `None` when
    /// the directory could not be listed (absent on a node without HCAs
    /// is an empty list).
    pub hca_ports: Option<Vec<HcaPort>>,
    /// XIDs in the kernel log since it was opened (the ring buffer's
    /// oldest record onwards); `None` when the log could not be read.
    pub xids: Option<Vec<XidCount>>,
    /// `keel check`'s textfile: its metric lines, or why it could not be
    /// read. `None` when no textfile is configured.
    pub check: Option<Result<String, String>>,
    /// Slurm jobs holding each GPU, by NVML index.
    pub jobs: BTreeMap<u32, Vec<Job>>,
    /// Idle accounting per job, when a policy is set.
    pub idle: Vec<IdleJob>,
    /// The node's name (dcgm-exporter's `Hostname` label).
    pub hostname: String,
    /// The GPU count the node's SKU expects, when known.
    pub expected: Option<ExpectedGpus>,
    /// XIDs of the last [`XidWindow::window_ms`] and each GPU's last XID,
    /// as dcgm-exporter reports them; `None` when the kernel log or the
    /// node's uptime could not be read.
    pub xid_window: Option<XidWindow>,
}

/// The GPU count a node should have, from its SKU profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedGpus {
    /// The profile's name (`nd96isr_h100_v5`), or `configured` for a bare
    /// `exporter.gpus`.
    pub sku: String,
    pub gpus: u32,
}

/// XIDs in a recent window of the kernel log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct XidWindow {
    pub window_ms: u64,
    /// XIDs logged within the window, by PCI device (`dddd:bb:dd`) and code.
    pub counts: Vec<XidCount>,
    /// The last XID logged for each PCI device, since the log begins.
    pub last: Vec<(String, u32)>,
}

/// The GPU probe's answer as a scrape sees it.
#[derive(Debug, Clone, Default)]
pub struct GpuState {
    /// The newest snapshot the probe gave, possibly from an earlier scrape.
    pub snapshot: Option<Arc<GpuSnapshot>>,
    /// Seconds since `snapshot` was taken.
    pub age_s: Option<f64>,
    /// The probe did not answer this scrape in time, or failed: the
    /// snapshot is an earlier one.
    pub stale: bool,
    /// The probe's last error, if its last answer was one.
    pub error: Option<ProbeFailure>,
}

/// Why the probe gave no snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeFailure {
    /// No driver: a node without GPUs.
    Unavailable,
    /// The probe did not answer within the deadline (a hung driver).
    Timeout,
    /// Any other failure.
    Error,
}

impl ProbeFailure {
    pub fn label(self) -> &'static str {
        match self {
            ProbeFailure::Unavailable => "unavailable",
            ProbeFailure::Timeout => "timeout",
            ProbeFailure::Error => "error",
        }
    }
}

/// One HCA port; every reading `None` when its file could not be read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HcaPort {
    pub hca: String,
    pub port: u32,
    /// `ACTIVE`, `DOWN`, `INIT`, `ARMED`.
    pub state: Option<String>,
    /// `LinkUp`, `Polling`, `Disabled`.
    pub phys_state: Option<String>,
    pub link_layer: Option<String>,
    pub rate_gbps: Option<f64>,
    /// `counters/<name>` values, sorted by name.
    pub counters: Vec<(String, u64)>,
}

/// How many times an XID was logged for a PCI device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidCount {
    /// `dddd:bb:dd` as the driver prints it, lowercase.
    pub pci: String,
    pub code: u32,
    pub count: u64,
}

/// A Slurm job that holds a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Job {
    pub id: String,
    /// User name, else numeric uid; `None` when unknown.
    pub user: Option<String>,
    /// `SLURM_JOB_PARTITION` of its processes; `None` when unknown.
    pub partition: Option<String>,
}

/// One job's idle accounting.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleJob {
    pub job: String,
    pub user: Option<String>,
    pub partition: Option<String>,
    /// GPU-seconds the job's GPUs spent below the threshold.
    pub idle_gpu_seconds: f64,
    /// GPU-seconds observed in all.
    pub observed_gpu_seconds: f64,
    /// The job's GPUs have all been below the threshold for the policy's
    /// `idle_minutes`.
    pub idle: bool,
}
