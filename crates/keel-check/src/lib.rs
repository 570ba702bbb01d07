//! Node health checks for GPU training nodes.
//!
//! The engine takes what was read from a node ([`Inputs`]: the machine
//! layout from keel-topo, a GPU snapshot from a [`keel_gpu::GpuProbe`], host
//! facts from procfs and the kernel log) and a SKU [`profile::Profile`], and
//! returns one [`CheckResult`] per check and device. Checks are pure
//! functions of their inputs; gathering the inputs ([`gather`]) is the only
//! I/O, and every read there has a timeout.
//!
//! This crate decides health. It does not drain nodes (keel-slurm applies a
//! verdict), run GPU workloads, print, or read the environment or clock
//! (time comes from the node's own `/proc/uptime` and an injected
//! [`Monotonic`] clock, keel-time's).

pub mod active;
pub mod checks;
pub mod fleet;
pub mod gather;
pub mod imds;
pub mod kmsg;
pub mod profile;
pub mod report;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use gather::{gather, GatherOptions, HostFacts, Inputs};
pub use profile::Profile;
pub use report::Report;

/// How a check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Does not apply to this node (no InfiniBand expected...).
    Skip,
    Pass,
    Warn,
    /// Could not run: a library, tool, file or permission is missing. Never
    /// drains a node.
    Unknown,
    Fail,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Skip => "skip",
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Unknown => "unknown",
            Status::Fail => "fail",
        }
    }
}

/// `passive` checks only read (seconds, safe as Slurm's
/// HealthCheckProgram); `active` checks run workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Passive,
    Active,
}

/// The device a result is about.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// NVML index (PCI bus order).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub gpu: Option<u32>,
    /// The GPU's device minor (`/dev/nvidiaN`): Slurm's GPU id under
    /// gres.conf `File=` lines, which is not the NVML index on every
    /// machine (keel-topo's `GpuIds`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub minor: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pci: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub serial: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub hca: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub port: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub mount: Option<String>,
}

impl Device {
    /// `GPU 3 (0004:00:00.0)`, `mlx5_ib0 port 1`, `/mnt`.
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if let Some(g) = self.gpu {
            parts.push(format!("GPU {g}"));
        }
        if let Some(h) = &self.hca {
            parts.push(h.clone());
        }
        if let Some(p) = self.port {
            parts.push(format!("port {p}"));
        }
        if let Some(m) = &self.mount {
            parts.push(m.clone());
        }
        let mut s = parts.join(" ");
        if let Some(pci) = &self.pci {
            if s.is_empty() {
                s = pci.clone();
            } else {
                s.push_str(&format!(" ({pci})"));
            }
        }
        s
    }
}

/// One check's result for one device (or the node).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    pub id: String,
    pub tier: Tier,
    pub status: Status,
    /// Stable fault code when the status is not `pass`/`skip`
    /// (`ECC_UNCORRECTABLE`, `NVML_UNAVAILABLE`...).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub code: Option<String>,
    /// One line for humans.
    pub detail: String,
    /// The measured value, when there is one number to show.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub value: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub unit: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub threshold: Option<String>,
    /// Whether a larger value is better, for fleet outlier detection.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub higher_is_better: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device: Option<Device>,
    /// The log lines or counters the verdict rests on.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub evidence: Vec<String>,
    pub duration_ms: f64,
}

impl CheckResult {
    pub fn new(id: &str, status: Status, detail: impl Into<String>) -> Self {
        Self {
            id: id.to_owned(),
            tier: Tier::Passive,
            status,
            code: None,
            detail: detail.into(),
            value: None,
            unit: None,
            threshold: None,
            higher_is_better: None,
            device: None,
            evidence: Vec::new(),
            duration_ms: 0.0,
        }
    }
    pub fn code(mut self, code: &str) -> Self {
        self.code = Some(code.to_owned());
        self
    }
    pub fn value(mut self, v: f64, unit: &str) -> Self {
        self.value = Some(v);
        self.unit = Some(unit.to_owned());
        self
    }
    pub fn threshold(mut self, t: impl Into<String>) -> Self {
        self.threshold = Some(t.into());
        self
    }
    pub fn better(mut self, higher: bool) -> Self {
        self.higher_is_better = Some(higher);
        self
    }
    pub fn device(mut self, d: Device) -> Self {
        self.device = Some(d);
        self
    }
    pub fn evidence(mut self, e: impl Into<String>) -> Self {
        self.evidence.push(e.into());
        self
    }
}

pub use keel_time::{FrozenClock, Monotonic, SystemClock};

/// Options that change which checks run.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// The node should have no GPU processes (prolog/epilog use): leftover
    /// processes fail.
    pub expect_idle: bool,
}

/// Runs every passive check.
pub fn run(
    profile: &Profile,
    inputs: &Inputs,
    opts: RunOptions,
    clock: &dyn Monotonic,
) -> Vec<CheckResult> {
    let mut out = Vec::new();
    for (_, check) in checks::PASSIVE {
        let start = clock.now();
        let mut results = check(profile, inputs, opts);
        let elapsed = clock.now().duration_since(start);
        let each = elapsed.as_secs_f64() * 1000.0 / results.len().max(1) as f64;
        for r in &mut results {
            r.duration_ms = (each * 1000.0).round() / 1000.0;
        }
        out.extend(results);
    }
    out
}

/// Runs `f` on its own thread and gives up after `timeout`. A read of a
/// wedged device or a hung network mount can block forever; the thread is
/// then left behind and the caller reports the check as unknown.
pub fn with_timeout<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("keel-check-read".into())
        .spawn(move || {
            let _ = tx.send(f());
        });
    if spawned.is_err() {
        return None;
    }
    rx.recv_timeout(timeout).ok()
}

/// The overall status of a set of results: fail > unknown > warn > pass.
pub fn overall(results: &[CheckResult]) -> Status {
    let has = |s| results.iter().any(|r| r.status == s);
    if has(Status::Fail) {
        Status::Fail
    } else if has(Status::Unknown) {
        Status::Unknown
    } else if has(Status::Warn) {
        Status::Warn
    } else {
        Status::Pass
    }
}

/// The kind of an error of this crate or of the crates under it whose errors it passes on
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; profile::ProfileError; keel_gpu::error_kind, keel_topo::error_kind)
}
