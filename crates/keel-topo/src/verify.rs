//! Checking running processes against the machine's layout: is each rank
//! on the NUMA node of its GPU, alone on its cores, and is every GPU used?

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::idset::{CpuSet, NodeSet};
use crate::machine::Machine;
use crate::procs::Process;

/// Which processes a verification looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Processes holding an NVIDIA device open.
    GpuProcesses,
    /// Those, and every process carrying a launcher's local-rank variable.
    GpuAndRankProcesses,
    /// Exactly the processes given.
    Given,
}

/// GPU facts from NVML, when it is present: which pids run on which GPU
/// index. Overrides what procfs suggests.
pub type GpuProcessMap = BTreeMap<u32, Vec<usize>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Warning,
    Error,
}

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub severity: Severity,
    /// Stable code: `remote-numa`, `remote-memory`, `spans-numa`,
    /// `shared-cores`, `threads-piled`, `idle-gpu`, `shared-gpu`,
    /// `unknown-gpu`.
    pub code: &'static str,
    pub message: String,
    pub pids: Vec<u32>,
    pub gpu: Option<usize>,
}

/// How a process's GPU was worked out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuSource {
    /// NVML's list of processes per GPU.
    Nvml,
    /// The only `/dev/nvidiaN` file it holds open.
    DeviceFile,
    /// `CUDA_VISIBLE_DEVICES` and the launcher's local rank.
    Environment,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessReport {
    pub pid: u32,
    pub name: String,
    pub local_rank: Option<u32>,
    pub gpu: Option<usize>,
    pub gpu_source: Option<GpuSource>,
    pub gpu_numa_node: Option<u32>,
    pub cpus_allowed: CpuSet,
    pub cpu_numa_nodes: NodeSet,
    pub mems_allowed: Option<NodeSet>,
    pub threads: usize,
    pub running_threads: usize,
    /// CPUs its threads last ran on.
    pub cpus_used: CpuSet,
    pub cuda_visible_devices: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    pub processes: Vec<ProcessReport>,
    pub findings: Vec<Finding>,
    /// GPU index -> pids attributed to it.
    pub gpu_processes: BTreeMap<usize, Vec<u32>>,
}

impl Verification {
    pub fn worst(&self) -> Option<Severity> {
        self.findings.iter().map(|f| f.severity).max()
    }
}

/// Checks `processes` against `machine`.
pub fn verify(
    machine: &Machine,
    processes: &[Process],
    scope: Scope,
    nvml: Option<&GpuProcessMap>,
) -> Verification {
    let ids = crate::gpu_ids::GpuIds::from_machine(machine);
    let by_minor: BTreeMap<u32, usize> = ids
        .gpus()
        .iter()
        .filter_map(|g| g.minor.map(|m| (m, g.index as usize)))
        .collect();

    let selected: Vec<&Process> = processes
        .iter()
        .filter(|p| {
            let holds_gpu = p.nvidia_minors.as_ref().is_some_and(|m| !m.is_empty())
                || nvml.is_some_and(|n| n.contains_key(&p.pid));
            match scope {
                Scope::Given => true,
                Scope::GpuProcesses => holds_gpu,
                Scope::GpuAndRankProcesses => holds_gpu || p.has_rank_vars(),
            }
        })
        .collect();

    let mut findings = Vec::new();
    let mut reports = Vec::new();
    for p in &selected {
        let (gpu, source) = attribute(machine, p, &by_minor, nvml);
        let cpu_nodes = machine.nodes_of(&p.cpus_allowed);
        let gpu_node = gpu
            .and_then(|g| machine.gpus.get(g))
            .and_then(|g| g.numa_node);
        let cpus_used: CpuSet = p.threads.iter().filter_map(|t| t.last_cpu).collect();
        let running = p.threads.iter().filter(|t| t.state == Some('R')).count();
        reports.push(ProcessReport {
            pid: p.pid,
            name: p.name.clone(),
            local_rank: p.local_rank(),
            gpu,
            gpu_source: source,
            gpu_numa_node: gpu_node,
            cpus_allowed: p.cpus_allowed.clone(),
            cpu_numa_nodes: cpu_nodes.clone(),
            mems_allowed: p.mems_allowed.clone(),
            threads: p.threads.len(),
            running_threads: running,
            cpus_used,
            cuda_visible_devices: p.env_var("CUDA_VISIBLE_DEVICES").map(str::to_owned),
        });

        let holds_gpu = p.nvidia_minors.as_ref().is_some_and(|m| !m.is_empty());
        if gpu.is_none() && holds_gpu && !machine.gpus.is_empty() {
            findings.push(Finding {
                severity: Severity::Warning,
                code: "unknown-gpu",
                message: format!(
                    "pid {} ({}) holds NVIDIA devices open but its GPU cannot be told: no single device file, no local rank variable",
                    p.pid, p.name
                ),
                pids: vec![p.pid],
                gpu: None,
            });
        }

        if let (Some(g), Some(node)) = (gpu, gpu_node) {
            let node_cpus = machine
                .node(node)
                .map(|n| n.cpus.clone())
                .unwrap_or_default();
            if !p.cpus_allowed.intersects(&node_cpus) {
                findings.push(Finding {
                    severity: Severity::Error,
                    code: "remote-numa",
                    message: format!(
                        "pid {} runs on CPUs {} (NUMA {}) but its GPU {} is on NUMA {} (CPUs {})",
                        p.pid, p.cpus_allowed, cpu_nodes, g, node, node_cpus
                    ),
                    pids: vec![p.pid],
                    gpu: Some(g),
                });
            } else if let Some(mems) = &p.mems_allowed {
                if !mems.contains(node) {
                    findings.push(Finding {
                        severity: Severity::Warning,
                        code: "remote-memory",
                        message: format!(
                            "pid {} may allocate memory only on NUMA {} but its GPU {} is on NUMA {}",
                            p.pid, mems, g, node
                        ),
                        pids: vec![p.pid],
                        gpu: Some(g),
                    });
                }
            }
        }
        if cpu_nodes.len() > 1 {
            findings.push(Finding {
                severity: Severity::Warning,
                code: "spans-numa",
                message: format!(
                    "pid {} may run on CPUs {} across NUMA nodes {}: it is not pinned to one node",
                    p.pid, p.cpus_allowed, cpu_nodes
                ),
                pids: vec![p.pid],
                gpu,
            });
        }
    }

    // Ranks sharing cores. Two ranks bound to the same whole NUMA node are
    // the recommended per-node binding (the NDv4 tuning notes' srun masks)
    // and are not reported; ranks that span nodes are reported above.
    let pinned: Vec<&ProcessReport> = reports
        .iter()
        .filter(|r| r.cpu_numa_nodes.len() <= 1)
        .collect();
    for (i, a) in pinned.iter().enumerate() {
        for b in &pinned[i + 1..] {
            let overlap = a.cpus_allowed.intersection(&b.cpus_allowed);
            if overlap.is_empty() {
                continue;
            }
            let whole_node = a.cpus_allowed == b.cpus_allowed
                && machine.numa_nodes.iter().any(|n| n.cpus == a.cpus_allowed);
            if whole_node {
                continue;
            }
            findings.push(Finding {
                severity: Severity::Warning,
                code: "shared-cores",
                message: format!("pids {} and {} share CPUs {}", a.pid, b.pid, overlap),
                pids: vec![a.pid, b.pid],
                gpu: None,
            });
        }
    }

    // Running threads piled on one CPU.
    let mut running_on: BTreeMap<u32, Vec<(u32, u32)>> = BTreeMap::new();
    for p in &selected {
        for t in &p.threads {
            if let (Some('R'), Some(cpu)) = (t.state, t.last_cpu) {
                running_on.entry(cpu).or_default().push((p.pid, t.tid));
            }
        }
    }
    for (cpu, threads) in &running_on {
        if threads.len() > 1 {
            let pids: BTreeSet<u32> = threads.iter().map(|t| t.0).collect();
            let list: Vec<String> = threads.iter().map(|(p, t)| format!("{p}/{t}")).collect();
            findings.push(Finding {
                severity: Severity::Warning,
                code: "threads-piled",
                message: format!(
                    "{} running threads share CPU {cpu}: {}",
                    threads.len(),
                    list.join(", ")
                ),
                pids: pids.into_iter().collect(),
                gpu: None,
            });
        }
    }

    let mut gpu_processes: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for r in &reports {
        if let Some(g) = r.gpu {
            gpu_processes.entry(g).or_default().push(r.pid);
        }
    }
    for (g, pids) in &gpu_processes {
        if pids.len() > 1 {
            findings.push(Finding {
                severity: Severity::Warning,
                code: "shared-gpu",
                message: format!("GPU {g} is used by {} processes: {:?}", pids.len(), pids),
                pids: pids.clone(),
                gpu: Some(*g),
            });
        }
    }
    if !reports.is_empty() {
        for gpu in &machine.gpus {
            if !gpu_processes.contains_key(&gpu.index) {
                findings.push(Finding {
                    severity: Severity::Warning,
                    code: "idle-gpu",
                    message: format!("GPU {} ({}) has no process", gpu.index, gpu.pci),
                    pids: Vec::new(),
                    gpu: Some(gpu.index),
                });
            }
        }
    }

    findings.sort_by(|a, b| {
        b.severity
            .cmp(&a.severity)
            .then_with(|| a.code.cmp(b.code))
            .then_with(|| a.pids.cmp(&b.pids))
    });
    Verification {
        processes: reports,
        findings,
        gpu_processes,
    }
}

/// Works out which GPU a process uses: NVML first, then the single device
/// file it holds, then `CUDA_VISIBLE_DEVICES` with its local rank.
fn attribute(
    machine: &Machine,
    p: &Process,
    by_minor: &BTreeMap<u32, usize>,
    nvml: Option<&GpuProcessMap>,
) -> (Option<usize>, Option<GpuSource>) {
    if let Some(gpus) = nvml.and_then(|n| n.get(&p.pid)) {
        if let [g] = gpus.as_slice() {
            return (Some(*g), Some(GpuSource::Nvml));
        }
    }
    let held: Option<Vec<usize>> = p
        .nvidia_minors
        .as_ref()
        .map(|m| m.iter().filter_map(|x| by_minor.get(x).copied()).collect());
    if let Some([g]) = held.as_deref() {
        return (Some(*g), Some(GpuSource::DeviceFile));
    }
    let gpu_count = machine.gpus.len();
    let from_env = match p.env_var("CUDA_VISIBLE_DEVICES") {
        Some(cvd) => {
            let list: Option<Vec<usize>> = cvd.split(',').map(|s| s.trim().parse().ok()).collect();
            match (list, p.local_rank()) {
                // UUIDs or MIG names need NVML to map.
                (None, _) => None,
                (Some(l), _) if l.len() == 1 => Some(l[0]),
                (Some(l), Some(r)) if !l.is_empty() => Some(l[r as usize % l.len()]),
                _ => None,
            }
        }
        None => p.local_rank().map(|r| r as usize),
    };
    match from_env {
        Some(g)
            if g < gpu_count && held.as_ref().is_none_or(|h| h.is_empty() || h.contains(&g)) =>
        {
            (Some(g), Some(GpuSource::Environment))
        }
        _ => (None, None),
    }
}
