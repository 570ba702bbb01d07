//! `keel topo`: show, plan, verify, snapshot.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use serde::Serialize;

use keel_topo::machine::{pcie_gen, PcieLink};
use keel_topo::verify::Severity;
use keel_topo::{Launcher, Machine, Plan, PlanRequest, Root, Scope, Selection, Verification};

use crate::exit::{Code, UsageError};
use crate::output::Out;
use crate::table::{bytes, opt, Table};
use crate::Cli;

#[derive(Debug, Subcommand)]
pub enum TopoCommand {
    /// Show sockets, NUMA nodes, GPUs, InfiniBand HCAs, NICs and NVMe drives.
    Show,
    /// Print the CPU/GPU/HCA pinning for one rank per GPU.
    Plan {
        /// The launcher to write the pinning for.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["srun", "mpirun", "torchrun", "numactl"]))]
        launcher: String,
        /// Ranks on this node (default: one per GPU).
        #[arg(long, value_name = "N")]
        ranks_per_node: Option<usize>,
        /// CPUs for each rank (cores for mpirun's pe=); default: the whole
        /// NUMA node of the rank's GPU (one core with mpirun).
        #[arg(long, value_name = "C")]
        cpus_per_rank: Option<usize>,
        /// Say why each rank gets what it gets.
        #[arg(long)]
        explain: bool,
    },
    /// Check running processes: NUMA placement against their GPU, shared
    /// cores, piled threads, idle GPUs.
    Verify {
        /// Inspect these processes only.
        #[arg(long, value_name = "PID", num_args = 1..)]
        pid: Vec<u32>,
        /// Also inspect processes with a launcher's rank variables that hold
        /// no GPU (CPU ranks, data loaders).
        #[arg(long, conflicts_with = "pid")]
        all: bool,
    },
    /// Copy the sysfs/procfs files keel reads into DIR, for `--root DIR`.
    Snapshot {
        /// A new (or empty) directory.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

pub fn run(cli: &Cli, cmd: &TopoCommand, out: &mut Out) -> anyhow::Result<Code> {
    match cmd {
        TopoCommand::Show => {
            let root = Root::new(&cli.root);
            let m = read(&root)?;
            if out.json {
                out.json(
                    "topo show",
                    &ShowJson {
                        root: &cli.root,
                        machine: &m,
                    },
                )?;
            } else {
                out.text(&render_show(&m))?;
            }
            Ok(Code::Ok)
        }
        TopoCommand::Plan {
            launcher,
            ranks_per_node,
            cpus_per_rank,
            explain,
        } => {
            let root = Root::new(&cli.root);
            let m = read(&root)?;
            let launcher: Launcher = launcher.parse().map_err(UsageError)?;
            let req = PlanRequest {
                launcher,
                ranks_per_node: *ranks_per_node,
                cpus_per_rank: *cpus_per_rank,
            };
            let plan = keel_topo::plan(&m, &req).context("cannot make a pinning plan")?;
            if out.json {
                out.json("topo plan", &plan)?;
            } else {
                out.text(&render_plan(&plan, *explain))?;
            }
            Ok(Code::Ok)
        }
        TopoCommand::Verify { pid, all } => {
            let root = Root::new(&cli.root);
            let m = read(&root)?;
            let (selection, scope) = if !pid.is_empty() {
                (Selection::Pids(pid.clone()), Scope::Given)
            } else if *all {
                (Selection::All, Scope::GpuAndRankProcesses)
            } else {
                (Selection::All, Scope::GpuProcesses)
            };
            let procs = keel_topo::read_processes(&root, &selection)?;
            let nvml = nvml_processes(cli, &m);
            let v = keel_topo::verify(&m, &procs, scope, nvml.as_ref());
            let code = if v.processes.is_empty() {
                Code::Unknown
            } else {
                match v.worst() {
                    Some(Severity::Error) => Code::Failed,
                    Some(Severity::Warning) => Code::Warning,
                    None => Code::Ok,
                }
            };
            if out.json {
                out.json(
                    "topo verify",
                    &VerifyJson {
                        status: status_word(code),
                        verification: &v,
                    },
                )?;
            } else {
                out.text(&render_verify(&m, &v, code))?;
            }
            Ok(code)
        }
        TopoCommand::Snapshot { out: dir } => {
            let root = Root::recording(&cli.root);
            let m = read(&root)?;
            // Read every process as verify does, so the snapshot can be
            // verified too.
            let _ = keel_topo::read_processes(&root, &Selection::All)?;
            // And the host files `keel check` reads, so that the snapshot
            // reproduces its checks under `--root`.
            keel_topo::read_host_files(&root)?;
            let recorded = root.recorded();
            // The kernel log's XIDs and carrier losses, as `dev/kmsg`
            // (left out when it cannot be read, e.g. without root).
            let mut extra = Vec::new();
            match keel_check::gather::kernel_log_for_snapshot(
                root.base(),
                std::time::Duration::from_secs(5),
            ) {
                Ok(log) => extra.push((PathBuf::from("dev/kmsg"), log.into_bytes())),
                Err(e) => eprintln!("keel: warning: the snapshot has no kernel log: {e}"),
            }
            // Free space is no file: what statvfs says of each mount, so
            // that `keel check --root` judges the disks as they were.
            let (disks, left_out) = keel_check::gather::disk_record_for_snapshot(
                root.base(),
                std::time::Duration::from_secs(2),
            );
            for e in left_out {
                eprintln!("keel: warning: the snapshot leaves out a mount: {e}");
            }
            extra.push((
                PathBuf::from(keel_check::gather::DISK_RECORD),
                format!("{}\n", serde_json::to_string_pretty(&disks)?).into_bytes(),
            ));
            let summary = keel_topo::write_snapshot(&root, &recorded, &extra, dir)
                .with_context(|| format!("cannot write the snapshot to {}", dir.display()))?;
            if out.json {
                out.json("topo snapshot", &summary)?;
            } else {
                let mut s = format!(
                    "wrote {} files, {} links ({}) to {}\n",
                    summary.files,
                    summary.links,
                    bytes(summary.bytes),
                    summary.out.display()
                );
                s.push_str(&format!(
                    "machine: {}, {}, {}, {}\n",
                    plural(m.cpus.len(), "CPU"),
                    plural(m.numa_nodes.len(), "NUMA node"),
                    plural(m.gpus.len(), "GPU"),
                    plural(m.hcas.len(), "HCA")
                ));
                for f in &summary.skipped {
                    s.push_str(&format!("left out (too large): {}\n", f.display()));
                }
                s.push_str(&format!(
                    "reproduce with: keel --root {} topo show\n",
                    summary.out.display()
                ));
                out.text(&s)?;
            }
            Ok(Code::Ok)
        }
    }
}

/// NVML's processes per GPU, when NVML is there and the root is the live
/// machine (a fixture's GPUs are not the ones NVML sees).
fn nvml_processes(cli: &Cli, m: &Machine) -> Option<keel_topo::verify::GpuProcessMap> {
    if cli.root != std::path::Path::new("/") || m.gpus.is_empty() {
        return None;
    }
    let probe = crate::gpu::nvml_probe(None, std::time::Duration::from_secs(5));
    let snap = probe.snapshot().ok()?;
    Some(gpu_process_map(m, &snap))
}

/// Maps NVML's per-GPU process lists onto keel-topo's GPU indices (by PCI
/// address).
pub fn gpu_process_map(
    m: &Machine,
    snap: &keel_gpu::GpuSnapshot,
) -> keel_topo::verify::GpuProcessMap {
    let mut map = keel_topo::verify::GpuProcessMap::new();
    for reading in &snap.gpus {
        let Some(gpu) = m
            .gpus
            .iter()
            .find(|g| g.pci.to_string() == reading.pci_bus_id)
        else {
            continue;
        };
        for p in reading.processes.iter().flatten() {
            map.entry(p.pid).or_default().push(gpu.index);
        }
    }
    map
}

fn read(root: &Root) -> anyhow::Result<Machine> {
    keel_topo::read_machine(root)
        .with_context(|| format!("cannot read the machine under {}", root.base().display()))
}

fn status_word(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Warning => "warning",
        Code::Failed => "failed",
        _ => "unknown",
    }
}

#[derive(Serialize)]
struct ShowJson<'a> {
    root: &'a PathBuf,
    machine: &'a Machine,
}

#[derive(Serialize)]
struct VerifyJson<'a> {
    status: &'static str,
    #[serde(flatten)]
    verification: &'a Verification,
}

fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

fn list<T: ToString>(items: impl IntoIterator<Item = T>) -> String {
    let v: Vec<String> = items.into_iter().map(|x| x.to_string()).collect();
    if v.is_empty() {
        "-".to_owned()
    } else {
        v.join(",")
    }
}

fn link(l: &PcieLink) -> String {
    let one = |speed: Option<f64>, width: Option<u32>| match (speed, width) {
        (None, None) => "?".to_owned(),
        (s, w) => {
            let g = s.and_then(pcie_gen).map_or_else(
                || s.map_or("?".into(), |v| format!("{v} GT/s")),
                |g| format!("Gen{g}"),
            );
            format!("{g} x{}", opt(w))
        }
    };
    let cur = one(l.current_speed_gts, l.current_width);
    let max = one(l.max_speed_gts, l.max_width);
    let mut s = format!("{cur} / {max}");
    if l.degraded() == Some(true) {
        s.push_str(" DEGRADED");
    }
    s
}

pub fn render_show(m: &Machine) -> String {
    let mut s = String::new();
    let smt = match m.threads_per_core {
        Some(1) => "SMT off".to_owned(),
        Some(t) => format!("SMT {t} threads/core"),
        None => "SMT unknown".to_owned(),
    };
    s.push_str(&format!(
        "{}, {}{}, {} ({smt}), {}, {}, {}\n\n",
        plural(m.sockets.len(), "socket"),
        plural(m.numa_nodes.len(), "NUMA node"),
        if m.numa_from_sysfs {
            ""
        } else {
            " (no NUMA in sysfs)"
        },
        plural(m.cpus.len(), "CPU"),
        plural(m.gpus.len(), "GPU"),
        plural(m.hcas.len(), "HCA"),
        plural(m.nvme.len(), "NVMe drive")
    ));

    let mut t = Table::new(&["NUMA", "Socket", "CPUs", "Memory", "GPUs", "HCAs", "NVMe"]);
    for n in &m.numa_nodes {
        let sockets = list(
            m.sockets
                .iter()
                .filter(|so| so.numa_nodes.contains(n.id))
                .map(|so| so.id),
        );
        t.row(vec![
            n.id.to_string(),
            sockets,
            if n.cpus.is_empty() {
                "-".into()
            } else {
                n.cpus.to_list()
            },
            opt(n.memory_bytes.map(bytes)),
            list(
                m.gpus
                    .iter()
                    .filter(|g| g.numa_node == Some(n.id))
                    .map(|g| g.index),
            ),
            list(
                m.hcas
                    .iter()
                    .filter(|h| h.numa_node == Some(n.id))
                    .map(|h| h.name.clone()),
            ),
            list(
                m.nvme
                    .iter()
                    .filter(|d| d.numa_node == Some(n.id))
                    .map(|d| d.name.clone()),
            ),
        ]);
    }
    s.push_str(&t.render());

    if !m.gpus.is_empty() {
        s.push('\n');
        let mut t = Table::new(&[
            "GPU",
            "PCI",
            "Model",
            "NUMA",
            "Local CPUs",
            "PCIe now / max",
            "Nearest HCA",
        ]);
        for g in &m.gpus {
            let near = m.nearest_hcas(g);
            let near = if near.is_empty() {
                "-".to_owned()
            } else {
                format!(
                    "{} ({})",
                    list(near.iter().map(|(h, _)| h.name.clone())),
                    near[0].1.as_str()
                )
            };
            t.row(vec![
                g.index.to_string(),
                g.pci.to_string(),
                g.model
                    .clone()
                    .unwrap_or_else(|| format!("NVIDIA device {}", g.device_id)),
                opt(g.numa_node),
                opt(g.local_cpus.as_ref().map(|c| c.to_list())),
                link(&g.link),
                near,
            ]);
        }
        s.push_str(&t.render());
    }

    if !m.hcas.is_empty() {
        s.push('\n');
        let mut t = Table::new(&[
            "HCA",
            "PCI",
            "NUMA",
            "Port",
            "State",
            "Rate",
            "Layer",
            "Netdev",
            "Switch GPUs",
        ]);
        for h in &m.hcas {
            let port = h.ports.first();
            t.row(vec![
                h.name.clone(),
                opt(h.pci),
                opt(h.numa_node),
                opt(port.map(|p| p.port)),
                opt(port.and_then(|p| p.state.clone())),
                opt(port.and_then(|p| p.rate.clone())),
                opt(port.and_then(|p| p.link_layer.clone())),
                list(h.netdevs.iter()),
                list(h.switch_gpus.iter()),
            ]);
        }
        s.push_str(&t.render());
    }

    let eth: Vec<_> = m.nics.iter().filter(|n| n.kind != "ipoib").collect();
    if !eth.is_empty() {
        s.push('\n');
        let mut t = Table::new(&[
            "NIC", "Driver", "Bus", "PCI", "NUMA", "State", "Speed", "SR-IOV",
        ]);
        for n in eth {
            let sriov = if n.virtual_function {
                match (&n.physfn, &n.master) {
                    (Some(pf), _) => format!("VF of {pf}"),
                    (None, Some(master)) => format!("VF under {master} (accelerated networking)"),
                    _ => "VF".to_owned(),
                }
            } else if let Some(vfs) = n.sriov_numvfs.filter(|v| *v > 0) {
                format!("PF, {vfs}/{} VFs", opt(n.sriov_totalvfs))
            } else if !n.lower.is_empty() {
                format!("accelerated by {}", n.lower.join(","))
            } else {
                "-".to_owned()
            };
            t.row(vec![
                n.name.clone(),
                opt(n.driver.clone()),
                n.bus.clone(),
                opt(n.pci),
                opt(n.numa_node),
                opt(n.operstate.clone()),
                opt(n.speed_mbps.map(|v| format!("{v} Mb/s"))),
                sriov,
            ]);
        }
        s.push_str(&t.render());
    }

    if !m.nvme.is_empty() {
        s.push('\n');
        let mut t = Table::new(&["NVMe", "Model", "PCI", "NUMA", "Capacity"]);
        for d in &m.nvme {
            t.row(vec![
                d.name.clone(),
                opt(d.model.clone()),
                opt(d.pci),
                opt(d.numa_node),
                opt(d.capacity_bytes.map(bytes)),
            ]);
        }
        s.push_str(&t.render());
    }
    s
}

pub fn render_plan(p: &Plan, explain: bool) -> String {
    let mut s = String::new();
    let mut t = Table::new(&["Rank", "GPU", "NUMA", "CPUs", "Mask", "HCA", "Binding"]);
    for r in &p.ranks {
        t.row(vec![
            r.local_rank.to_string(),
            list(r.gpus.iter()),
            r.numa_nodes.to_list(),
            r.cpus.to_list(),
            r.mask.clone(),
            match (&r.hca, r.hca_relation) {
                (Some(h), Some(rel)) => format!("{h} ({})", rel.as_str()),
                _ => "-".to_owned(),
            },
            r.numactl.clone(),
        ]);
    }
    s.push_str(&t.render());
    s.push('\n');
    match p.launcher {
        Launcher::Srun | Launcher::Mpirun => {
            s.push_str(&p.command);
            s.push('\n');
        }
        Launcher::Torchrun | Launcher::Numactl => {
            s.push_str("keel-bind.sh:\n");
            s.push_str(&p.command);
        }
    }
    if explain {
        s.push('\n');
        for line in &p.explain {
            s.push_str("# ");
            s.push_str(line);
            s.push('\n');
        }
    }
    s
}

pub fn render_verify(m: &Machine, v: &Verification, code: Code) -> String {
    let mut s = String::new();
    if v.processes.is_empty() {
        s.push_str("no GPU process found: nothing to verify\n");
        return s;
    }
    let mut t = Table::new(&[
        "PID", "Name", "Rank", "GPU", "GPU NUMA", "CPUs", "CPU NUMA", "Mems", "Threads",
    ]);
    for p in &v.processes {
        t.row(vec![
            p.pid.to_string(),
            p.name.clone(),
            opt(p.local_rank),
            match (p.gpu, p.gpu_source) {
                (Some(g), Some(src)) => format!(
                    "{g} ({})",
                    serde_json::to_value(src)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
                ),
                _ => "?".to_owned(),
            },
            opt(p.gpu_numa_node),
            p.cpus_allowed.to_list(),
            p.cpu_numa_nodes.to_list(),
            opt(p.mems_allowed.as_ref().map(|n| n.to_list())),
            format!("{} ({} running)", p.threads, p.running_threads),
        ]);
    }
    s.push_str(&t.render());
    s.push('\n');
    let used = v.gpu_processes.len();
    s.push_str(&format!(
        "{} processes on {used} of {} GPUs\n",
        v.processes.len(),
        m.gpus.len()
    ));
    if v.findings.is_empty() {
        s.push_str("ok: every process is on its GPU's NUMA node, with cores of its own\n");
    } else {
        for f in &v.findings {
            let sev = match f.severity {
                Severity::Error => "error",
                Severity::Warning => "warning",
            };
            s.push_str(&format!("{sev}[{}]: {}\n", f.code, f.message));
        }
        s.push_str(&format!("{}\n", status_word(code)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_processes_map_to_topo_gpu_indices_by_pci_address() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/nd96asr_v4");
        let m = keel_topo::read_machine(&Root::new(&root)).expect("machine");
        let mut snap = keel_gpu::recorded::load(&root.join("gpu.json")).expect("snapshot");
        // NVML lists GPU 5 (000c:00:00.0) as running pid 41006.
        let i = snap
            .gpus
            .iter()
            .position(|g| g.pci_bus_id == "000c:00:00.0")
            .expect("gpu");
        snap.gpus[i].processes = Some(vec![keel_gpu::GpuProcess {
            pid: 41006,
            used_memory_bytes: Some(1 << 30),
        }]);
        let map = gpu_process_map(&m, &snap);
        assert_eq!(map.get(&41006), Some(&vec![5]));
        assert_eq!(map.len(), 1);
        let procs = keel_topo::read_processes(&Root::new(&root), &Selection::All).expect("procs");
        let v = keel_topo::verify(&m, &procs, Scope::GpuProcesses, Some(&map));
        let p = v.processes.iter().find(|p| p.pid == 41006).expect("pid");
        assert_eq!(p.gpu, Some(5));
        assert_eq!(p.gpu_source, Some(keel_topo::verify::GpuSource::Nvml));
    }
}
