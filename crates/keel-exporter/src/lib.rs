//! `keel exporter`: GPU and node metrics for Prometheus.
//!
//! Collection and exposition. A scrape asks the GPU probe (keel-gpu's
//! `GpuProbe`: NVML, a recorded snapshot, or a [`replay::ReplayProbe`])
//! through a [`sampler::Sampler`] that never waits past a deadline, reads
//! HCA ports, the kernel log's XIDs and keel check's textfile under a
//! machine root ([`host`]), finds the Slurm jobs holding each GPU
//! ([`jobs`]), keeps idle-GPU time per job ([`idle`]), and renders it all
//! ([`expose`], or dcgm-exporter's names in [`dcgm`]) from plain
//! [`readings::Readings`]. [`server`] serves `/metrics` behind a bearer
//! token with a connection limit and timeouts.
//!
//! It does not talk to NVML itself (the probe does), decide a node's health
//! (keel check does; its verdicts are passed through) or act on idle jobs
//! (the binary does, when asked).

pub mod cost;
pub mod dcgm;
pub mod expose;
pub mod host;
pub mod idle;
pub mod jobs;
pub mod readings;
pub mod replay;
pub mod sampler;
pub mod server;
pub mod text;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_gpu::GpuProbe;
use keel_topo::Root;

pub use idle::IdlePolicy;
pub use readings::Readings;
pub use sampler::Sampler;

/// The monotonic clock, injected so tests and replays control time.
pub use keel_time::{Monotonic, SystemClock};

/// Which metric names to expose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Naming {
    /// keel's names (`keel_gpu_*`), units in the names.
    #[default]
    Keel,
    /// dcgm-exporter's names and labels (`DCGM_FI_DEV_*`), so dashboards
    /// made for it work unchanged.
    Dcgm,
}

/// What an [`Exporter`] reads and how.
#[derive(Debug, Clone)]
pub struct ExporterOptions {
    /// The machine root (`/`, or a fixture).
    pub root: PathBuf,
    /// How long a scrape waits for the GPU probe before it shows the last
    /// good readings.
    pub deadline: Duration,
    /// keel check's Prometheus textfile, passed through.
    pub check_textfile: Option<PathBuf>,
    /// dcgm-exporter's job-mapping directory.
    pub job_mapping_dir: Option<PathBuf>,
    /// Find jobs from the GPUs' processes (`/proc/<pid>/cgroup`, environ).
    pub jobs_from_processes: bool,
    /// Also find jobs from the processes holding a GPU's device file open:
    /// the files' pattern, `{}` standing for the GPU's device minor
    /// (`/dev/nvidia{}`). `None`: not scanned.
    pub device_file_pattern: Option<String>,
    pub naming: Naming,
    /// The node's name (dcgm-exporter's `Hostname` label).
    pub hostname: String,
    /// Scrapes closer together than this get the same text (bounds the work
    /// a scrape flood causes).
    pub min_interval: Duration,
    pub idle: Option<IdlePolicy>,
    /// The GPU count the node's SKU expects (`keel_gpu_devices_expected`).
    pub expected: Option<readings::ExpectedGpus>,
    /// How far back `DCGM_EXP_XID_ERRORS_COUNT` counts XIDs (dcgm-exporter's
    /// `-x`, 5 minutes by default).
    pub xid_window: Duration,
    /// What the Slurm GPU ids in the job-mapping directory are: device
    /// minors (gres.conf `File=/dev/nvidiaN` lines, as CycleCloud writes
    /// them) or NVML indices.
    pub slurm_gpu_ids: keel_topo::IdKind,
}

impl ExporterOptions {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            deadline: Duration::from_secs(2),
            check_textfile: None,
            job_mapping_dir: None,
            jobs_from_processes: true,
            device_file_pattern: None,
            naming: Naming::Keel,
            hostname: String::new(),
            min_interval: Duration::from_millis(500),
            idle: None,
            expected: None,
            xid_window: Duration::from_secs(300),
            slurm_gpu_ids: keel_topo::IdKind::Minor,
        }
    }
}

#[derive(Debug)]
struct HostState {
    xids: host::XidTail,
    idle: idle::IdleTracker,
}

#[derive(Debug)]
struct Inner {
    opts: ExporterOptions,
    root: Root,
    sampler: Sampler,
    clock: Arc<dyn Monotonic>,
    host: Mutex<HostState>,
    cache: tokio::sync::Mutex<Option<(Instant, Arc<String>)>>,
}

/// Collects readings and renders them; cheap to clone.
#[derive(Debug, Clone)]
pub struct Exporter {
    inner: Arc<Inner>,
}

impl Exporter {
    /// Starts the probe's thread.
    pub fn new(
        opts: ExporterOptions,
        probe: Box<dyn GpuProbe + Send>,
        clock: Arc<dyn Monotonic>,
    ) -> std::io::Result<Self> {
        let sampler = Sampler::start(probe, clock.clone())?;
        Ok(Self {
            inner: Arc::new(Inner {
                root: Root::new(&opts.root),
                host: Mutex::new(HostState {
                    xids: host::XidTail::new(&opts.root),
                    idle: idle::IdleTracker::default(),
                }),
                opts,
                sampler,
                clock,
                cache: tokio::sync::Mutex::new(None),
            }),
        })
    }

    /// The metrics text. Scrapes run one at a time; one that comes within
    /// `min_interval` of the last gets the same text.
    pub async fn scrape(&self) -> Arc<String> {
        let mut cache = self.inner.cache.lock().await;
        if let Some((at, text)) = cache.as_ref() {
            if self.inner.clock.now().saturating_duration_since(*at) < self.inner.opts.min_interval
            {
                return text.clone();
            }
        }
        let readings = self.readings().await;
        let text = Arc::new(match self.inner.opts.naming {
            Naming::Keel => expose::render(&readings),
            Naming::Dcgm => dcgm::render(&readings),
        });
        *cache = Some((self.inner.clock.now(), text.clone()));
        text
    }

    /// Reads everything once.
    pub async fn readings(&self) -> Readings {
        let gpu = self.inner.sampler.sample(self.inner.opts.deadline).await;
        let inner = self.inner.clone();
        let host = tokio::task::spawn_blocking(move || inner.read_host(gpu)).await;
        host.unwrap_or_default()
    }
}

impl Inner {
    fn read_host(&self, gpu: readings::GpuState) -> Readings {
        let o = &self.opts;
        let mut jobs = BTreeMap::new();
        let ids = jobs::gpu_ids(&self.root, gpu.snapshot.as_deref());
        if let Some(snap) = gpu.snapshot.as_deref() {
            if o.jobs_from_processes && !gpu.stale {
                jobs = jobs::from_processes(&self.root, snap);
            }
            if let Some(pattern) = &o.device_file_pattern {
                let devices = jobs::device_files(pattern, &ids);
                jobs::merge(&mut jobs, jobs::from_device_files(&self.root, &devices));
            }
        }
        if let Some(dir) = &o.job_mapping_dir {
            let by_id = jobs::from_mapping_dir(dir);
            jobs::merge(&mut jobs, jobs::to_indices(by_id, &ids, o.slurm_gpu_ids));
        }
        let mut host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let xids = host.xids.poll();
        let xid_window = match (&xids, host::uptime_usec(&self.root)) {
            (Some(_), Some(now)) => Some(host.xids.window(
                now,
                u64::try_from(o.xid_window.as_millis()).unwrap_or(u64::MAX),
            )),
            _ => None,
        };
        let mut idle = Vec::new();
        if let Some(policy) = &o.idle {
            let now = self.clock.now();
            if !gpu.stale {
                let util: BTreeMap<u32, Option<u32>> = gpu
                    .snapshot
                    .iter()
                    .flat_map(|s| s.gpus.iter())
                    .map(|g| (g.index, g.utilization_gpu_percent))
                    .collect();
                host.idle.observe(policy, now, &jobs, &util);
            }
            idle = host.idle.report(policy, now);
        }
        drop(host);
        Readings {
            hca_ports: host::hca_ports(&self.root),
            xids,
            check: o.check_textfile.as_deref().map(host::check_textfile),
            jobs,
            idle,
            hostname: o.hostname.clone(),
            expected: o.expected.clone(),
            xid_window,
            gpu,
        }
    }
}

/// The kind of an error of this crate
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; cost::CostError)
}
