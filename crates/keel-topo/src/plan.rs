//! Process-pinning plans: which CPUs, memory node, GPU and HCA each local
//! rank should use, written for srun, mpirun, torchrun and numactl.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::idset::{CpuSet, NodeSet};
use crate::machine::Machine;
use crate::pci::Relation;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    Srun,
    Mpirun,
    Torchrun,
    Numactl,
}

impl FromStr for Launcher {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "srun" => Ok(Self::Srun),
            "mpirun" => Ok(Self::Mpirun),
            "torchrun" => Ok(Self::Torchrun),
            "numactl" => Ok(Self::Numactl),
            _ => Err(format!(
                "unknown launcher {s:?}: expected srun, mpirun, torchrun or numactl"
            )),
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Srun => "srun",
            Self::Mpirun => "mpirun",
            Self::Torchrun => "torchrun",
            Self::Numactl => "numactl",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanRequest {
    pub launcher: Launcher,
    /// Ranks on this node; defaults to the GPU count.
    pub ranks_per_node: Option<usize>,
    /// CPUs per rank (cores, for mpirun's `pe=`); defaults to the whole NUMA
    /// node for srun, torchrun and numactl, and one core for mpirun.
    pub cpus_per_rank: Option<usize>,
}

/// Why no plan can be made. Nothing is guessed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no NVIDIA GPU found: a pinning plan puts one rank next to each GPU")]
    NoGpus,
    #[error("{ranks} ranks requested but the machine has only {cpus} CPUs")]
    MoreRanksThanCpus { ranks: usize, cpus: usize },
    #[error("--ranks-per-node must be at least 1")]
    ZeroRanks,
    #[error("--cpus-per-rank must be at least 1")]
    ZeroCpus,
    #[error("{ranks} ranks cannot be spread evenly over {gpus} GPUs: use a multiple or a divisor of {gpus}")]
    Uneven { ranks: usize, gpus: usize },
    #[error(
        "GPU {gpu} ({pci}) has no NUMA node in sysfs (numa_node is -1): its local CPUs are unknown"
    )]
    GpuWithoutNode { gpu: usize, pci: String },
    #[error("NUMA node {node} has {available} CPUs in {cores} cores; {ranks} ranks x {cpus_per_rank} CPUs do not fit")]
    DoesNotFit {
        node: u32,
        available: usize,
        cores: usize,
        ranks: usize,
        cpus_per_rank: usize,
    },
    #[error("mpirun's --map-by ppr:K:numa places K ranks on every NUMA node, but {detail}; use --launcher srun, or --launcher numactl and run its wrapper under mpirun")]
    NotPerNuma { detail: String },
}

#[derive(Debug, Clone, Serialize)]
pub struct RankPlan {
    pub local_rank: usize,
    /// GPU indices (PCI bus order) this rank drives.
    pub gpus: Vec<usize>,
    pub numa_nodes: NodeSet,
    pub cpus: CpuSet,
    /// The CPUs as a Slurm `mask_cpu` hex mask.
    pub mask: String,
    pub hca: Option<String>,
    pub hca_port: Option<u32>,
    /// How the HCA is connected to the rank's first GPU.
    pub hca_relation: Option<Relation>,
    /// `UCX_NET_DEVICES=...` value for this rank: UCX (MPI's traffic)
    /// takes its devices per process. NCCL's `NCCL_IB_HCA` is not set per
    /// rank (see [`Plan::nccl_ib_hca`]).
    pub ucx_net_devices: Option<String>,
    /// The per-rank `numactl` prefix.
    pub numactl: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub launcher: Launcher,
    pub ranks_per_node: usize,
    pub cpus_per_rank: Option<usize>,
    pub ranks: Vec<RankPlan>,
    /// `CUDA_VISIBLE_DEVICES` to export (mpirun), in rank order.
    pub cuda_visible_devices: Option<String>,
    /// `NCCL_IB_HCA=...` for every rank of the node alike: every
    /// InfiniBand HCA's port, exact names (`=`), so NCCL uses them all and
    /// pairs each GPU with its nearest itself, and leaves out Ethernet
    /// devices (the accelerated-networking VF). NCCL's maintainers: "You
    /// should not set NCCL_IB_HCA differently on each rank" (NVIDIA/nccl
    /// issue 1478). `None` without InfiniBand HCAs.
    pub nccl_ib_hca: Option<String>,
    /// The launcher line (srun, mpirun) or the wrapper script (torchrun,
    /// numactl).
    pub command: String,
    /// Why the plan is what it is, a sentence per line.
    pub explain: Vec<String>,
}

/// Makes a plan for `machine`.
pub fn plan(machine: &Machine, req: &PlanRequest) -> Result<Plan, PlanError> {
    let gpus = &machine.gpus;
    if gpus.is_empty() {
        return Err(PlanError::NoGpus);
    }
    let g = gpus.len();
    let n = req.ranks_per_node.unwrap_or(g);
    if n == 0 {
        return Err(PlanError::ZeroRanks);
    }
    if req.cpus_per_rank == Some(0) {
        return Err(PlanError::ZeroCpus);
    }
    if n > machine.cpus.len() {
        return Err(PlanError::MoreRanksThanCpus {
            ranks: n,
            cpus: machine.cpus.len(),
        });
    }
    if !n.is_multiple_of(g) && !g.is_multiple_of(n) {
        return Err(PlanError::Uneven { ranks: n, gpus: g });
    }
    for gpu in gpus {
        if gpu.numa_node.is_none() {
            return Err(PlanError::GpuWithoutNode {
                gpu: gpu.index,
                pci: gpu.pci.to_string(),
            });
        }
    }
    let node_of = |i: usize| gpus[i].numa_node.unwrap_or_default();
    let mut explain = Vec::new();

    // The order in which ranks take GPUs. With srun, torchrun and numactl,
    // local rank i uses GPU i (PCI bus order). mpirun's ppr:K:numa fills NUMA
    // nodes in order, so CUDA_VISIBLE_DEVICES lists each node's GPUs in turn.
    let mut order: Vec<usize> = (0..g).collect();
    if req.launcher == Launcher::Mpirun {
        order.sort_by_key(|&i| (node_of(i), i));
    }

    // GPUs of each rank.
    let rank_gpus: Vec<Vec<usize>> = (0..n)
        .map(|r| {
            if n >= g {
                vec![order[r / (n / g)]]
            } else {
                let per = g / n;
                order[r * per..(r + 1) * per].to_vec()
            }
        })
        .collect();
    let rank_nodes: Vec<NodeSet> = rank_gpus
        .iter()
        .map(|gs| gs.iter().map(|&i| node_of(i)).collect())
        .collect();

    // mpirun: ppr:K:numa needs the same number of ranks on every NUMA node
    // that has CPUs.
    let cpu_nodes: Vec<u32> = machine
        .numa_nodes
        .iter()
        .filter(|nd| !nd.cpus.is_empty())
        .map(|nd| nd.id)
        .collect();
    let mut ppr = 0;
    if req.launcher == Launcher::Mpirun {
        if rank_nodes.iter().any(|s| s.len() != 1) {
            return Err(PlanError::NotPerNuma {
                detail: "some ranks drive GPUs on several NUMA nodes".to_owned(),
            });
        }
        let counts: Vec<usize> = cpu_nodes
            .iter()
            .map(|&id| rank_nodes.iter().filter(|s| s.contains(id)).count())
            .collect();
        if counts.is_empty() {
            return Err(PlanError::NotPerNuma {
                detail: "no NUMA node lists any CPU".to_owned(),
            });
        }
        if counts.iter().any(|&c| c != counts[0]) || counts[0] == 0 {
            let detail = cpu_nodes
                .iter()
                .zip(&counts)
                .map(|(id, c)| format!("{c} on NUMA {id}"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(PlanError::NotPerNuma {
                detail: format!("one rank per GPU puts {detail}"),
            });
        }
        ppr = counts[0];
    }

    // CPUs of each rank.
    let mut rank_cpus: Vec<CpuSet> = Vec::with_capacity(n);
    let mut taken: std::collections::BTreeMap<NodeSet, usize> = std::collections::BTreeMap::new();
    let per_rank = match req.launcher {
        Launcher::Mpirun => Some(req.cpus_per_rank.unwrap_or(1)),
        _ => req.cpus_per_rank,
    };
    for nodes in &rank_nodes {
        let all: CpuSet = nodes
            .iter()
            .filter_map(|id| machine.node(id))
            .fold(CpuSet::new(), |acc, nd| acc.union(&nd.cpus));
        let Some(c) = per_rank else {
            rank_cpus.push(all);
            continue;
        };
        // Whole cores, in order, so that two ranks never share a core's
        // hardware threads.
        let cores: Vec<CpuSet> = nodes
            .iter()
            .flat_map(|id| machine.cores_of_node(id))
            .collect();
        let tpc = cores.iter().map(CpuSet::len).max().unwrap_or(1).max(1);
        let cores_each = if req.launcher == Launcher::Mpirun {
            c
        } else {
            c.div_ceil(tpc)
        };
        let j = taken.entry(nodes.clone()).or_insert(0);
        let start = *j * cores_each;
        let sharing = rank_nodes.iter().filter(|s| *s == nodes).count();
        if (*j + 1) * cores_each > cores.len() {
            return Err(PlanError::DoesNotFit {
                node: nodes.first().unwrap_or_default(),
                available: all.len(),
                cores: cores.len(),
                ranks: sharing,
                cpus_per_rank: c,
            });
        }
        *j += 1;
        let mut cpus = CpuSet::new();
        for core in &cores[start..start + cores_each] {
            for cpu in core.iter() {
                if req.launcher == Launcher::Mpirun || cpus.len() < c {
                    cpus.insert(cpu);
                }
            }
        }
        rank_cpus.push(cpus);
    }

    // HCAs: the nearest ones to the rank's first GPU, shared round-robin
    // among the ranks that have the same candidates.
    let mut hca_use: std::collections::BTreeMap<Vec<String>, usize> =
        std::collections::BTreeMap::new();
    let mut ranks = Vec::with_capacity(n);
    for r in 0..n {
        let first = &gpus[rank_gpus[r][0]];
        let near = machine.nearest_hcas(first);
        let names: Vec<String> = near.iter().map(|(h, _)| h.name.clone()).collect();
        let (hca, port, relation) = if near.is_empty() {
            (None, None, None)
        } else {
            let k = hca_use.entry(names).or_insert(0);
            let (h, rel) = near[*k % near.len()];
            *k += 1;
            let port = h
                .ports
                .iter()
                .find(|p| p.state.as_deref() == Some("ACTIVE"))
                .or(h.ports.first())
                .map(|p| p.port);
            (Some(h.name.clone()), port, Some(rel))
        };
        let nodes = rank_nodes[r].clone();
        let cpus = rank_cpus[r].clone();
        let node_list = nodes.to_list();
        let numactl = if per_rank.is_some() {
            format!(
                "numactl --physcpubind={} --membind={}",
                cpus.to_list(),
                node_list
            )
        } else {
            format!("numactl --cpunodebind={node_list} --membind={node_list}")
        };
        ranks.push(RankPlan {
            local_rank: r,
            gpus: rank_gpus[r].clone(),
            mask: cpus.to_mask(),
            ucx_net_devices: hca.as_ref().map(|h| format!("{h}:{}", port.unwrap_or(1))),
            hca,
            hca_port: port,
            hca_relation: relation,
            numa_nodes: nodes,
            cpus,
            numactl,
        });
    }

    // Explanation.
    for nd in &machine.numa_nodes {
        let on: Vec<String> = gpus
            .iter()
            .filter(|gp| gp.numa_node == Some(nd.id))
            .map(|gp| gp.index.to_string())
            .collect();
        if !on.is_empty() {
            explain.push(format!(
                "NUMA node {} has CPUs {} and GPUs {}",
                nd.id,
                nd.cpus,
                on.join(",")
            ));
        }
    }
    match req.launcher {
        Launcher::Mpirun => explain.push(format!(
            "mpirun --map-by ppr:{ppr}:numa places {ppr} ranks on each NUMA node in node order, so CUDA_VISIBLE_DEVICES lists the GPUs node by node and local rank i uses its i-th entry"
        )),
        _ => explain.push(
            "local rank i uses GPU i in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID, nvidia-smi and NVML numbering)".to_owned(),
        ),
    }
    match (req.launcher, req.cpus_per_rank) {
        (Launcher::Mpirun, None) => explain.push(
            "--bind-to core without pe= binds each rank to one core; pass --cpus-per-rank C to give each rank C cores (pe=C)".to_owned(),
        ),
        (Launcher::Mpirun, Some(c)) => explain.push(format!("each rank is bound to {c} whole cores of its GPU's NUMA node (pe={c})")),
        (_, None) => explain.push(
            "each rank may run on every CPU of its GPU's NUMA node; ranks on one node share it and the scheduler balances them".to_owned(),
        ),
        (_, Some(c)) => explain.push(format!(
            "each rank gets {c} CPUs of its GPU's NUMA node, taken in whole cores so that no two ranks share a core"
        )),
    }
    for rk in &ranks {
        let mut line = format!(
            "local rank {} -> GPU {} on NUMA {} -> CPUs {} (mask {})",
            rk.local_rank,
            rk.gpus
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            rk.numa_nodes,
            rk.cpus,
            rk.mask
        );
        match (&rk.hca, rk.hca_relation) {
            (Some(h), Some(rel)) => line.push_str(&format!(", HCA {h} ({})", describe(rel))),
            _ => line.push_str(", no InfiniBand HCA near it"),
        }
        explain.push(line);
    }

    let nccl_ib_hca = node_ib_hcas(machine);
    match &nccl_ib_hca {
        Some(v) => explain.push(format!(
            "NCCL_IB_HCA={v} on every rank alike (NCCL pairs each GPU with its nearest HCA itself; a different value per rank breaks its rings across nodes, NVIDIA/nccl issue 1478); UCX_NET_DEVICES, which UCX takes per process, names each rank's nearest HCA"
        )),
        None => explain.push("no InfiniBand HCA: NCCL_IB_HCA is not set".to_owned()),
    }

    let cvd = (req.launcher == Launcher::Mpirun).then(|| {
        order
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    });
    let command = match req.launcher {
        Launcher::Srun => format!(
            "srun --ntasks-per-node={n} --cpu-bind=mask_cpu:{}",
            ranks
                .iter()
                .map(|r| r.mask.as_str())
                .collect::<Vec<_>>()
                .join(",")
        ),
        Launcher::Mpirun => {
            let pe = req
                .cpus_per_rank
                .map(|c| format!(":pe={c}"))
                .unwrap_or_default();
            format!(
                "mpirun -x CUDA_VISIBLE_DEVICES={} --map-by ppr:{ppr}:numa{pe} --bind-to core",
                cvd.clone().unwrap_or_default()
            )
        }
        Launcher::Torchrun | Launcher::Numactl => wrapper_script(req.launcher, n, &ranks),
    };

    Ok(Plan {
        launcher: req.launcher,
        ranks_per_node: n,
        cpus_per_rank: req.cpus_per_rank,
        ranks,
        cuda_visible_devices: cvd,
        nccl_ib_hca,
        command,
        explain,
    })
}

/// Every InfiniBand HCA port of the node as an exact `NCCL_IB_HCA` list
/// (`=mlx5_ib0:1,mlx5_ib1:1`): the same value for every rank. Ports whose
/// link layer is Ethernet are left out.
pub fn node_ib_hcas(machine: &Machine) -> Option<String> {
    let mut ports = Vec::new();
    for h in &machine.hcas {
        for p in &h.ports {
            let ib = match p.link_layer.as_deref() {
                Some(l) => l == "InfiniBand",
                None => h.link_layer() == Some("InfiniBand"),
            };
            if ib {
                ports.push(format!("{}:{}", h.name, p.port));
            }
        }
    }
    (!ports.is_empty()).then(|| format!("={}", ports.join(",")))
}

fn describe(rel: Relation) -> &'static str {
    match rel {
        Relation::Pix => "same PCIe switch",
        Relation::Pxb => "shares a PCIe switch",
        Relation::Phb => "same PCIe host bridge",
        Relation::Node => "same NUMA node",
        Relation::Sys => "another NUMA node",
    }
}

fn wrapper_script(launcher: Launcher, n: usize, ranks: &[RankPlan]) -> String {
    let mut s = String::new();
    s.push_str("#!/bin/sh\n");
    s.push_str("# Binds a local rank to the CPUs and memory next to its GPU, and UCX to the\n# nearest HCA (NCCL_IB_HCA is one value for the whole node: keel tune env).\n");
    match launcher {
        Launcher::Torchrun => s.push_str(&format!(
            "# Use: torchrun --nproc-per-node={n} --no-python ./keel-bind.sh python train.py ...\n"
        )),
        _ => s.push_str(
            "# Use: ./keel-bind.sh COMMAND ... (one per local rank, e.g. under srun or mpirun)\n",
        ),
    }
    s.push_str("rank=\"${LOCAL_RANK:-${SLURM_LOCALID:-${OMPI_COMM_WORLD_LOCAL_RANK:-}}}\"\n");
    s.push_str("case \"$rank\" in\n");
    for r in ranks {
        let mut env = String::new();
        if let Some(u) = &r.ucx_net_devices {
            env = format!("UCX_NET_DEVICES={u} ");
        }
        s.push_str(&format!(
            "  {}) exec env {env}{} \"$@\" ;;\n",
            r.local_rank, r.numactl
        ));
    }
    s.push_str(&format!(
        "  *) echo \"keel-bind.sh: local rank '$rank' is not 0-{}\" >&2; exit 64 ;;\n",
        n.saturating_sub(1)
    ));
    s.push_str("esac\n");
    s
}

impl keel_error::HasKind for PlanError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::NoGpus | Self::GpuWithoutNode { .. } => K::Unavailable,
            _ => K::Usage,
        }
    }
}
