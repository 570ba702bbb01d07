//! The job environment for a node: the SKU profile's NCCL/UCX/MPI settings
//! (each with its reason and source), `CUDA_DEVICE_ORDER`, NCCL's topology
//! file where the machine image ships one, `NCCL_IB_HCA` as one value for
//! the whole node (every InfiniBand HCA: NCCL pairs GPUs and HCAs itself,
//! and its maintainers say never to set it differently per rank, NVIDIA/nccl
//! issue 1478), and per local rank only what a library takes per process:
//! `UCX_NET_DEVICES`, the HCA nearest the rank's GPU as `keel topo plan`
//! chooses it.
//!
//! Pure: the caller gives the machine, the profile and whether each
//! candidate topology file exists; rendering as shell, JSON or Slurm
//! TaskProlog output is the binary's.

use keel_check::profile::Profile;
use keel_topo::{Launcher, Machine, PlanRequest};
use serde::Serialize;

/// One variable to set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Var {
    pub name: String,
    pub value: String,
    pub reason: String,
    pub source: String,
}

/// The variables one local rank sets on top of the node's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankVars {
    pub local_rank: usize,
    pub gpus: Vec<usize>,
    pub vars: Vec<Var>,
}

/// The environment for one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeEnv {
    pub sku: String,
    pub launcher: Launcher,
    pub gpus: usize,
    /// For every rank.
    pub vars: Vec<Var>,
    pub ranks: Vec<RankVars>,
    /// What was left out and why, a sentence each.
    pub notes: Vec<String>,
}

/// Why no environment can be given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("no NVIDIA GPU on this node: there is no GPU job environment to set")]
    NoGpus,
}

const CUDA_ORDER_SOURCE: &str =
    "CUDA programming guide, environment variables (CUDA_DEVICE_ORDER); keel topo numbers GPUs in PCI bus order";

/// The environment for `machine` under `profile`. `topo_file_exists` says
/// whether a path the profile names exists on this node.
pub fn node_env(
    machine: &Machine,
    profile: &Profile,
    launcher: Launcher,
    topo_file_exists: &dyn Fn(&str) -> bool,
) -> Result<NodeEnv, EnvError> {
    if machine.gpus.is_empty() {
        return Err(EnvError::NoGpus);
    }
    let mut notes = Vec::new();
    let mut vars = vec![Var {
        name: "CUDA_DEVICE_ORDER".into(),
        value: "PCI_BUS_ID".into(),
        reason: "number GPUs in PCI bus order, as NVML, NCCL's topology file and keel do (CUDA's default is fastest first)".into(),
        source: CUDA_ORDER_SOURCE.into(),
    }];
    let launcher_name = launcher.to_string();
    for s in &profile.tune.env {
        if !s.launchers.is_empty() && !s.launchers.contains(&launcher_name) {
            notes.push(format!(
                "{} not set: it applies to {} only",
                s.name,
                s.launchers.join(", ")
            ));
            continue;
        }
        vars.push(Var {
            name: s.name.clone(),
            value: s.value.clone(),
            reason: s.reason.clone(),
            source: format!("profile {}: {}", profile.name, s.source),
        });
    }
    let files = &profile.tune.nccl_topo_files;
    match files.iter().find(|f| topo_file_exists(f)) {
        Some(f) => vars.push(Var {
            name: "NCCL_TOPO_FILE".into(),
            value: f.clone(),
            reason: "the PCIe topology the VM hides: which GPU, NIC and NUMA node belong together"
                .into(),
            source: format!(
                "profile {}: {}",
                profile.name,
                profile
                    .tune
                    .nccl_topo_source
                    .as_deref()
                    .unwrap_or("the machine image")
            ),
        }),
        None if files.is_empty() => notes.push(format!(
            "NCCL_TOPO_FILE not set: profile {} names no topology file (NCCL detects the topology itself)",
            profile.name
        )),
        None => notes.push(format!(
            "NCCL_TOPO_FILE not set: the image does not ship {} (install the azhpc-images topology file, or NCCL detects a VM's topology less well)",
            files.join(" or ")
        )),
    }
    if profile.tune.env.is_empty() {
        notes.push(format!(
            "profile {} has no NCCL/UCX/MPI settings: only the GPU order and each rank's HCA are set",
            profile.name
        ));
    }
    let mut ranks = Vec::new();
    let plan = keel_topo::plan(
        machine,
        &PlanRequest {
            launcher,
            ranks_per_node: None,
            cpus_per_rank: None,
        },
    );
    match plan {
        Ok(plan) => {
            if let Some(v) = &plan.nccl_ib_hca {
                vars.push(Var {
                    name: "NCCL_IB_HCA".into(),
                    value: v.clone(),
                    reason: "every InfiniBand HCA of the node and nothing else (no Ethernet VF), the same on every rank: NCCL pairs each GPU with its nearest HCA itself (from the PCI topology or NCCL_TOPO_FILE)".into(),
                    source: "NCCL environment variables (NCCL_IB_HCA: =exact names, port after the colon); NVIDIA/nccl issue 1478: \"You should not set NCCL_IB_HCA differently on each rank\"; keel topo (sysfs /sys/class/infiniband)".into(),
                });
            }
            for r in &plan.ranks {
                let mut rv = Vec::new();
                let why = match (&r.hca, r.hca_relation) {
                    (Some(h), Some(rel)) => format!(
                        "the InfiniBand HCA nearest this rank's GPU ({h}, {})",
                        rel.as_str()
                    ),
                    (Some(h), None) => format!("the InfiniBand HCA for this rank's GPU ({h})"),
                    _ => String::new(),
                };
                if let Some(v) = &r.ucx_net_devices {
                    rv.push(Var {
                        name: "UCX_NET_DEVICES".into(),
                        value: v.clone(),
                        reason: format!(
                            "{why}, for MPI's traffic over UCX, which reads it per process"
                        ),
                        source: "keel topo plan (sysfs PCI topology)".into(),
                    });
                }
                ranks.push(RankVars {
                    local_rank: r.local_rank,
                    gpus: r.gpus.clone(),
                    vars: rv,
                });
            }
            if ranks.iter().all(|r| r.vars.is_empty()) {
                notes.push(
                    "NCCL_IB_HCA and UCX_NET_DEVICES not set: no InfiniBand HCA found".into(),
                );
            }
        }
        Err(e) => notes.push(format!("NCCL_IB_HCA and UCX_NET_DEVICES not set: {e}")),
    }
    Ok(NodeEnv {
        sku: profile.name.clone(),
        launcher,
        gpus: machine.gpus.len(),
        vars,
        ranks,
        notes,
    })
}

/// Single-quotes `s` for POSIX shells.
pub fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:,=@+".contains(c))
    {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The environment as a POSIX shell script to source: the node's exports,
/// then each rank's chosen by its local rank (`SLURM_LOCALID`,
/// `OMPI_COMM_WORLD_LOCAL_RANK` or `LOCAL_RANK`).
pub fn render_sh(env: &NodeEnv) -> String {
    let mut s = format!(
        "# keel tune env: {} ({} GPUs), launcher {}\n",
        env.sku, env.gpus, env.launcher
    );
    for v in &env.vars {
        s.push_str(&format!("# {} [{}]\n", v.reason, v.source));
        s.push_str(&format!("export {}={}\n", v.name, sh_quote(&v.value)));
    }
    if env.ranks.iter().any(|r| !r.vars.is_empty()) {
        s.push_str(
            "# per local rank, for UCX (MPI) only: the InfiniBand HCA nearest the rank's GPU [keel topo plan]\n",
        );
        s.push_str(
            "case \"${SLURM_LOCALID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${LOCAL_RANK:-}}}\" in\n",
        );
        for r in &env.ranks {
            let exports: Vec<String> = r
                .vars
                .iter()
                .map(|v| format!("export {}={}", v.name, sh_quote(&v.value)))
                .collect();
            if !exports.is_empty() {
                s.push_str(&format!("  {}) {} ;;\n", r.local_rank, exports.join("; ")));
            }
        }
        s.push_str("esac\n");
    }
    for n in &env.notes {
        s.push_str(&format!("# note: {n}\n"));
    }
    s
}

/// The environment as Slurm TaskProlog output for one local rank: `export
/// NAME=value` lines (the value is the rest of the line, unquoted), and the
/// notes as `print` lines are left out (they would reach the job's output).
/// Variables in `already_set` are skipped: the user's value wins.
pub fn render_slurm(
    env: &NodeEnv,
    local_rank: Option<usize>,
    already_set: &dyn Fn(&str) -> bool,
) -> String {
    let mut s = String::new();
    let rank_vars = local_rank
        .and_then(|r| env.ranks.iter().find(|x| x.local_rank == r))
        .map(|r| r.vars.as_slice())
        .unwrap_or(&[]);
    for v in env.vars.iter().chain(rank_vars) {
        if already_set(&v.name) || v.value.contains('\n') {
            continue;
        }
        s.push_str(&format!("export {}={}\n", v.name, v.value));
    }
    s
}
