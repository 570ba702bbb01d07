//! The machine model read from sysfs and procfs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::TopoError;
use crate::idset::{CpuSet, IdSet, NodeSet};
use crate::pci::{self, PciAddr, Placement, Relation};
use crate::root::Root;

/// Everything keel knows about a machine's layout.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Online logical CPUs.
    pub cpus: CpuSet,
    /// Logical CPUs per physical core (1 with SMT off); `None` when the
    /// topology files are absent.
    pub threads_per_core: Option<u32>,
    pub sockets: Vec<Socket>,
    pub numa_nodes: Vec<NumaNode>,
    /// Whether NUMA nodes come from sysfs (`false`: the kernel exposes no
    /// NUMA information and the machine is shown as one node 0).
    pub numa_from_sysfs: bool,
    /// NVIDIA GPUs in PCI bus order; `index` is the position here.
    pub gpus: Vec<Gpu>,
    pub hcas: Vec<Hca>,
    pub nics: Vec<Nic>,
    pub nvme: Vec<Nvme>,
    /// Logical CPUs and their place in the core/socket hierarchy.
    #[serde(skip)]
    pub cpu_info: Vec<Cpu>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Cpu {
    pub id: u32,
    pub socket: Option<u32>,
    pub core: Option<u32>,
    pub siblings: Option<CpuSet>,
    pub numa_node: Option<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Socket {
    pub id: u32,
    pub cpus: CpuSet,
    pub numa_nodes: NodeSet,
    /// Physical cores (distinct `core_id`s).
    pub cores: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct NumaNode {
    pub id: u32,
    pub cpus: CpuSet,
    pub memory_bytes: Option<u64>,
    /// SLIT distances to the nodes in `numa_nodes` order.
    pub distances: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct PcieLink {
    /// GT/s per lane, e.g. 16.0 for PCIe Gen4.
    pub current_speed_gts: Option<f64>,
    pub current_width: Option<u32>,
    pub max_speed_gts: Option<f64>,
    pub max_width: Option<u32>,
}

impl PcieLink {
    /// Whether the link trained below what the device supports.
    pub fn degraded(&self) -> Option<bool> {
        let speed = match (self.current_speed_gts, self.max_speed_gts) {
            (Some(c), Some(m)) => Some(c + 0.01 < m),
            _ => None,
        };
        let width = match (self.current_width, self.max_width) {
            (Some(c), Some(m)) => Some(c < m),
            _ => None,
        };
        match (speed, width) {
            (Some(true), _) | (_, Some(true)) => Some(true),
            (Some(false), Some(false)) => Some(false),
            _ => None,
        }
    }
}

/// PCIe generation for a per-lane rate.
pub fn pcie_gen(gts: f64) -> Option<u32> {
    [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
    ]
    .iter()
    .find(|(rate, _)| (gts - rate).abs() < 0.01)
    .map(|(_, g)| *g)
}

#[derive(Debug, Clone, Serialize)]
pub struct Gpu {
    /// Index in PCI bus order (`CUDA_DEVICE_ORDER=PCI_BUS_ID`, NVML).
    pub index: usize,
    pub pci: PciAddr,
    pub device_id: String,
    pub model: Option<String>,
    pub numa_node: Option<u32>,
    pub local_cpus: Option<CpuSet>,
    pub link: PcieLink,
    pub driver: Option<String>,
    /// Minor number of its `/dev/nvidiaN` node, from the driver's procfs.
    pub minor: Option<u32>,
    #[serde(skip)]
    pub placement: Placement,
}

#[derive(Debug, Clone, Serialize)]
pub struct Hca {
    pub name: String,
    pub pci: Option<PciAddr>,
    pub device_id: Option<String>,
    pub numa_node: Option<u32>,
    pub firmware: Option<String>,
    pub ports: Vec<HcaPort>,
    /// IPoIB or Ethernet interfaces on this HCA.
    pub netdevs: Vec<String>,
    /// GPUs behind the same PCIe switch, by index.
    pub switch_gpus: Vec<usize>,
    #[serde(skip)]
    pub placement: Option<Placement>,
}

impl Hca {
    /// `InfiniBand` when any port is, else the first port's link layer.
    pub fn link_layer(&self) -> Option<&str> {
        if self
            .ports
            .iter()
            .any(|p| p.link_layer.as_deref() == Some("InfiniBand"))
        {
            return Some("InfiniBand");
        }
        self.ports.iter().find_map(|p| p.link_layer.as_deref())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct HcaPort {
    pub port: u32,
    /// `ACTIVE`, `DOWN`, `INIT`, `ARMED`.
    pub state: Option<String>,
    /// `LinkUp`, `Polling`, `Disabled`.
    pub phys_state: Option<String>,
    pub rate_gbps: Option<f64>,
    /// The kernel's rate string, e.g. `200 Gb/sec (4X HDR)`.
    pub rate: Option<String>,
    pub link_layer: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Nic {
    pub name: String,
    /// `ethernet`, `ipoib` or `other` (from the ARP hardware type).
    pub kind: String,
    pub driver: Option<String>,
    pub pci: Option<PciAddr>,
    /// `pci`, `vmbus` or `other`.
    pub bus: String,
    pub numa_node: Option<u32>,
    pub operstate: Option<String>,
    pub speed_mbps: Option<u64>,
    pub mtu: Option<u32>,
    /// A virtual function: SR-IOV (`physfn` present) or the Azure
    /// accelerated-networking VF under a `hv_netvsc` interface.
    pub virtual_function: bool,
    /// The physical function of an SR-IOV VF.
    pub physfn: Option<PciAddr>,
    /// For a physical function: VFs enabled and supported.
    pub sriov_numvfs: Option<u32>,
    pub sriov_totalvfs: Option<u32>,
    /// Lower interfaces (Azure: the accelerated-networking VF).
    pub lower: Vec<String>,
    /// The interface this one is enslaved to.
    pub master: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Nvme {
    pub name: String,
    pub model: Option<String>,
    pub pci: Option<PciAddr>,
    pub numa_node: Option<u32>,
    /// Total size of its namespaces.
    pub capacity_bytes: Option<u64>,
    pub namespaces: Vec<String>,
}

impl Machine {
    pub fn node(&self, id: u32) -> Option<&NumaNode> {
        self.numa_nodes.iter().find(|n| n.id == id)
    }

    /// The NUMA node holding a CPU.
    pub fn node_of_cpu(&self, cpu: u32) -> Option<u32> {
        self.numa_nodes
            .iter()
            .find(|n| n.cpus.contains(cpu))
            .map(|n| n.id)
    }

    /// The NUMA nodes a set of CPUs touches.
    pub fn nodes_of(&self, cpus: &CpuSet) -> NodeSet {
        self.numa_nodes
            .iter()
            .filter(|n| n.cpus.intersects(cpus))
            .map(|n| n.id)
            .collect()
    }

    /// Physical cores of a NUMA node, each as its logical CPUs, ordered by
    /// first CPU. Without topology files every CPU is its own core.
    pub fn cores_of_node(&self, node: u32) -> Vec<CpuSet> {
        let Some(n) = self.node(node) else {
            return Vec::new();
        };
        let mut seen = CpuSet::new();
        let mut cores = Vec::new();
        for cpu in n.cpus.iter() {
            if seen.contains(cpu) {
                continue;
            }
            let siblings = self
                .cpu_info
                .iter()
                .find(|c| c.id == cpu)
                .and_then(|c| c.siblings.clone())
                .unwrap_or_else(|| [cpu].into_iter().collect());
            let core = siblings.intersection(&n.cpus);
            let core = if core.is_empty() {
                [cpu].into_iter().collect()
            } else {
                core
            };
            seen = seen.union(&core);
            cores.push(core);
        }
        cores
    }

    /// The PCIe relation between a GPU and an HCA.
    pub fn gpu_hca_relation(&self, gpu: &Gpu, hca: &Hca) -> Relation {
        match &hca.placement {
            Some(p) => pci::relation(&gpu.placement, p),
            None => match (gpu.numa_node, hca.numa_node) {
                (Some(a), Some(b)) if a == b => Relation::Node,
                _ => Relation::Sys,
            },
        }
    }

    /// The HCAs a GPU should use, best first: those behind a common PCIe
    /// switch, else those on its NUMA node. InfiniBand HCAs are preferred;
    /// Ethernet (RoCE) ones are considered only when there is no
    /// InfiniBand HCA at all, so that the Azure accelerated-networking
    /// adapter or storage NICs are never picked for NCCL.
    pub fn nearest_hcas(&self, gpu: &Gpu) -> Vec<(&Hca, Relation)> {
        let any_ib = self
            .hcas
            .iter()
            .any(|h| h.link_layer() == Some("InfiniBand"));
        let mut found: Vec<(&Hca, Relation)> = self
            .hcas
            .iter()
            .filter(|h| !any_ib || h.link_layer() == Some("InfiniBand"))
            .map(|h| (h, self.gpu_hca_relation(gpu, h)))
            .filter(|(_, r)| *r != Relation::Sys)
            .collect();
        found.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.name.cmp(&b.0.name)));
        if let Some(best) = found.first().map(|f| f.1) {
            found.retain(|f| f.1 == best);
        }
        found
    }
}

/// Reads the machine under `root`.
pub fn read_machine(root: &Root) -> Result<Machine, TopoError> {
    let online_path = "sys/devices/system/cpu/online";
    let cpus = parse_list(root, online_path, &root.read(online_path)?)?;

    let (numa_nodes, numa_from_sysfs) = read_numa(root, &cpus)?;

    let mut cpu_info = Vec::new();
    for id in cpus.iter() {
        let dir = format!("sys/devices/system/cpu/cpu{id}/topology");
        let socket = read_u32(root, format!("{dir}/physical_package_id"))?;
        let core = read_u32(root, format!("{dir}/core_id"))?;
        let sib_path = format!("{dir}/thread_siblings_list");
        let siblings = match root.read_opt(&sib_path)? {
            Some(s) => Some(parse_list(root, &sib_path, &s)?),
            None => None,
        };
        let numa_node = numa_nodes
            .iter()
            .find(|n| n.cpus.contains(id))
            .map(|n| n.id);
        cpu_info.push(Cpu {
            id,
            socket,
            core,
            siblings,
            numa_node,
        });
    }
    let threads_per_core = if cpu_info.iter().all(|c| c.siblings.is_some()) && !cpu_info.is_empty()
    {
        cpu_info
            .iter()
            .filter_map(|c| c.siblings.as_ref().map(|s| s.len() as u32))
            .max()
    } else {
        None
    };

    let mut sockets: BTreeMap<u32, (CpuSet, NodeSet, IdSet)> = BTreeMap::new();
    for c in &cpu_info {
        if let Some(s) = c.socket {
            let e = sockets.entry(s).or_default();
            e.0.insert(c.id);
            if let Some(n) = c.numa_node {
                e.1.insert(n);
            }
            e.2.insert(c.core.unwrap_or(c.id));
        }
    }
    let sockets = sockets
        .into_iter()
        .map(|(id, (cpus, numa_nodes, cores))| Socket {
            id,
            cpus,
            numa_nodes,
            cores: cores.len(),
        })
        .collect();

    let single_node = if numa_nodes.len() == 1 {
        Some(numa_nodes[0].id)
    } else {
        None
    };
    let pci_devices = read_pci(root, single_node)?;
    let gpus = read_gpus(root, &pci_devices)?;
    let mut hcas = read_hcas(root, &pci_devices)?;
    let nics = read_nics(root, &pci_devices)?;
    let nvme = read_nvme(root, &pci_devices)?;

    for hca in &mut hcas {
        hca.netdevs = nics
            .iter()
            .filter(|n| n.pci.is_some() && n.pci == hca.pci)
            .map(|n| n.name.clone())
            .collect();
        if let Some(p) = &hca.placement {
            hca.switch_gpus = gpus
                .iter()
                .filter(|g| pci::relation(&g.placement, p).shares_switch())
                .map(|g| g.index)
                .collect();
        }
    }

    Ok(Machine {
        cpus,
        threads_per_core,
        sockets,
        numa_nodes,
        numa_from_sysfs,
        gpus,
        hcas,
        nics,
        nvme,
        cpu_info,
    })
}

fn read_numa(root: &Root, cpus: &CpuSet) -> Result<(Vec<NumaNode>, bool), TopoError> {
    let online_path = "sys/devices/system/node/online";
    let Some(online) = root.read_opt(online_path)? else {
        // No NUMA support in the kernel: one node holding everything.
        let memory = match root.read_opt("proc/meminfo")? {
            Some(s) => meminfo_total(root, "proc/meminfo", &s, "MemTotal:")?,
            None => None,
        };
        let node = NumaNode {
            id: 0,
            cpus: cpus.clone(),
            memory_bytes: memory,
            distances: None,
        };
        return Ok((vec![node], false));
    };
    let ids = parse_list(root, online_path, &online)?;
    let mut nodes = Vec::new();
    for id in ids.iter() {
        let dir = format!("sys/devices/system/node/node{id}");
        let cpulist = format!("{dir}/cpulist");
        let node_cpus = parse_list(root, &cpulist, &root.read(&cpulist)?)?;
        let meminfo = format!("{dir}/meminfo");
        let memory_bytes = match root.read_opt(&meminfo)? {
            Some(s) => meminfo_total(root, &meminfo, &s, "MemTotal:")?,
            None => None,
        };
        let distance = format!("{dir}/distance");
        let distances = match root.read_opt(&distance)? {
            Some(s) => Some(
                s.split_whitespace()
                    .map(|t| {
                        t.parse::<u32>().map_err(|_| {
                            TopoError::parse(root.path(&distance), &s, "expected numbers")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
        nodes.push(NumaNode {
            id,
            cpus: node_cpus.intersection(cpus),
            memory_bytes,
            distances,
        });
    }
    Ok((nodes, true))
}

/// Parses `Node 0 MemTotal:  263868708 kB` or `MemTotal: 263868708 kB`.
fn meminfo_total(
    root: &Root,
    path: &str,
    content: &str,
    key: &str,
) -> Result<Option<u64>, TopoError> {
    for line in content.lines() {
        let mut words = line.split_whitespace().skip_while(|w| *w != key);
        if words.next().is_some() {
            let value = words.next();
            let unit = words.next();
            let bytes = value.and_then(|v| v.parse::<u64>().ok()?.checked_mul(1024));
            return match (bytes, unit) {
                (Some(b), Some("kB")) => Ok(Some(b)),
                _ => Err(TopoError::parse(
                    root.path(path),
                    line,
                    "expected `<number> kB`",
                )),
            };
        }
    }
    Ok(None)
}

/// A PCI device's identity and place, as read once for all devices.
#[derive(Debug, Clone)]
pub(crate) struct PciDevice {
    pub addr: PciAddr,
    pub rel: PathBuf,
    pub vendor: u16,
    pub device: u16,
    pub class: u32,
    pub numa_node: Option<u32>,
    pub placement: Placement,
}

fn read_pci(
    root: &Root,
    single_node: Option<u32>,
) -> Result<BTreeMap<PciAddr, PciDevice>, TopoError> {
    let mut out = BTreeMap::new();
    for name in root.list("sys/bus/pci/devices")? {
        let rel = PathBuf::from("sys/bus/pci/devices").join(&name);
        let addr: PciAddr = name
            .parse()
            .map_err(|reason: String| TopoError::parse(root.path(&rel), &name, reason))?;
        let vendor = read_hex(root, rel.join("vendor"))? as u16;
        let device = read_hex(root, rel.join("device"))? as u16;
        let class = read_hex(root, rel.join("class"))? as u32;
        let numa_node = read_numa_node(root, rel.join("numa_node"))?.or(single_node);
        let resolved = root.resolve(&rel)?.unwrap_or_else(|| rel.clone());
        let (host_bridge, chain) = pci::chain(&resolved);
        let placement = Placement {
            host_bridge,
            chain,
            numa_node,
        };
        out.insert(
            addr,
            PciDevice {
                addr,
                rel,
                vendor,
                device,
                class,
                numa_node,
                placement,
            },
        );
    }
    Ok(out)
}

fn read_gpus(root: &Root, pci: &BTreeMap<PciAddr, PciDevice>) -> Result<Vec<Gpu>, TopoError> {
    let minors = crate::gpu_ids::read_procfs_minors(root)?;
    let mut gpus = Vec::new();
    for dev in pci.values() {
        if dev.vendor != 0x10de || dev.class >> 16 != 0x03 {
            continue;
        }
        let local_path = dev.rel.join("local_cpulist");
        let local_cpus = match root.read_opt(&local_path)? {
            Some(s) => Some(parse_list(root, &local_path, &s)?),
            None => None,
        };
        gpus.push(Gpu {
            index: gpus.len(),
            pci: dev.addr,
            device_id: format!("0x{:04x}", dev.device),
            model: pci::nvidia_model(dev.device).map(str::to_owned),
            numa_node: dev.numa_node,
            local_cpus,
            link: read_link_info(root, &dev.rel)?,
            driver: link_name(root, dev.rel.join("driver"))?,
            minor: minors.get(&dev.addr).copied(),
            placement: dev.placement.clone(),
        });
    }
    Ok(gpus)
}

fn read_link_info(root: &Root, dev: &Path) -> Result<PcieLink, TopoError> {
    let width = |name: &str| {
        let rel = dev.join(name);
        parse_u32(root, &rel, root.read_attr(&rel)?)
    };
    Ok(PcieLink {
        current_speed_gts: read_speed(root, dev.join("current_link_speed"))?,
        current_width: width("current_link_width")?,
        max_speed_gts: read_speed(root, dev.join("max_link_speed"))?,
        max_width: width("max_link_width")?,
    })
}

/// `16.0 GT/s PCIe` (newer kernels), `16 GT/s`, `8.0 GT/s`; `Unknown` or an
/// unreadable file is `None`.
fn read_speed(root: &Root, rel: PathBuf) -> Result<Option<f64>, TopoError> {
    let Some(s) = root.read_attr(&rel)? else {
        return Ok(None);
    };
    let t = s.trim();
    if t.eq_ignore_ascii_case("unknown") || t.is_empty() {
        return Ok(None);
    }
    let number = t.split_whitespace().next().unwrap_or("");
    let unit_ok = t.contains("GT/s");
    match number.parse::<f64>() {
        Ok(v) if unit_ok && v.is_finite() && v > 0.0 => Ok(Some(v)),
        _ => Err(TopoError::parse(
            root.path(&rel),
            &s,
            "expected `<rate> GT/s`",
        )),
    }
}

fn read_hcas(root: &Root, pci: &BTreeMap<PciAddr, PciDevice>) -> Result<Vec<Hca>, TopoError> {
    let mut hcas = Vec::new();
    for name in root.list("sys/class/infiniband")? {
        let rel = PathBuf::from("sys/class/infiniband").join(&name);
        let dev = pci_of(root, &rel.join("device"), pci)?;
        let mut ports = Vec::new();
        for port in root.list(rel.join("ports"))? {
            let Ok(num) = port.parse::<u32>() else {
                continue;
            };
            let p = rel.join("ports").join(&port);
            let rate = root.read_attr(p.join("rate"))?.map(|s| s.trim().to_owned());
            let rate_gbps = match &rate {
                Some(r) => Some(
                    r.split_whitespace()
                        .next()
                        .and_then(|v| v.parse::<f64>().ok())
                        .ok_or_else(|| {
                            TopoError::parse(
                                root.path(p.join("rate")),
                                r,
                                "expected `<n> Gb/sec ...`",
                            )
                        })?,
                ),
                None => None,
            };
            ports.push(HcaPort {
                port: num,
                state: read_state(root, p.join("state"))?,
                phys_state: read_state(root, p.join("phys_state"))?,
                rate_gbps,
                rate,
                link_layer: root
                    .read_opt(p.join("link_layer"))?
                    .map(|s| s.trim().to_owned()),
            });
        }
        ports.sort_by_key(|p| p.port);
        hcas.push(Hca {
            name,
            pci: dev.map(|d| d.addr),
            device_id: dev.map(|d| format!("0x{:04x}", d.device)),
            numa_node: dev.and_then(|d| d.numa_node),
            firmware: root
                .read_opt(rel.join("fw_ver"))?
                .map(|s| s.trim().to_owned()),
            ports,
            netdevs: Vec::new(),
            switch_gpus: Vec::new(),
            placement: dev.map(|d| d.placement.clone()),
        });
    }
    Ok(hcas)
}

/// `4: ACTIVE` -> `ACTIVE`.
fn read_state(root: &Root, rel: PathBuf) -> Result<Option<String>, TopoError> {
    Ok(root.read_attr(&rel)?.map(|s| {
        let t = s.trim();
        t.split_once(':')
            .map_or(t, |(_, name)| name.trim())
            .to_owned()
    }))
}

fn read_nics(root: &Root, pci: &BTreeMap<PciAddr, PciDevice>) -> Result<Vec<Nic>, TopoError> {
    let mut nics = Vec::new();
    for name in root.list("sys/class/net")? {
        let rel = PathBuf::from("sys/class/net").join(&name);
        let Some(resolved) = root.resolve(&rel)? else {
            continue;
        };
        if resolved.starts_with("sys/devices/virtual") {
            continue;
        }
        let kind = match read_u32(root, rel.join("type"))? {
            Some(1) => "ethernet",
            Some(32) => "ipoib",
            _ => "other",
        };
        let (_, chain) = pci::chain(&resolved);
        let addr = chain.last().copied();
        let dev = addr.and_then(|a| pci.get(&a));
        let bus = if addr.is_some() {
            "pci"
        } else if resolved.components().any(|c| c.as_os_str() == "VMBUS:00") {
            "vmbus"
        } else {
            "other"
        };
        let physfn = match root.resolve(rel.join("device/physfn"))? {
            Some(p) => pci::chain(&p).1.last().copied(),
            None => None,
        };
        let mut lower = Vec::new();
        for entry in root.list(&rel)? {
            if let Some(l) = entry.strip_prefix("lower_") {
                // Read (and so record) the link, so snapshots keep it.
                if root.read_link(rel.join(&entry))?.is_some() {
                    lower.push(l.to_owned());
                }
            }
        }
        let speed = match root.read_opt(rel.join("speed")) {
            Ok(Some(s)) => s
                .trim()
                .parse::<i64>()
                .ok()
                .filter(|v| *v > 0)
                .map(|v| v as u64),
            Ok(None) => None,
            // The kernel answers EINVAL for the speed of a link that is down.
            Err(TopoError::Read { .. }) => None,
            Err(e) => return Err(e),
        };
        nics.push(Nic {
            kind: kind.to_owned(),
            driver: link_name(root, rel.join("device/driver"))?,
            pci: addr,
            bus: bus.to_owned(),
            numa_node: dev.and_then(|d| d.numa_node),
            operstate: root
                .read_opt(rel.join("operstate"))?
                .map(|s| s.trim().to_owned()),
            speed_mbps: speed,
            mtu: read_u32(root, rel.join("mtu"))?,
            virtual_function: physfn.is_some(),
            physfn,
            sriov_numvfs: read_u32(root, rel.join("device/sriov_numvfs"))?,
            sriov_totalvfs: read_u32(root, rel.join("device/sriov_totalvfs"))?,
            lower,
            master: link_name(root, rel.join("master"))?,
            name,
        });
    }
    // Azure accelerated networking: the VF is the lower device of a
    // hv_netvsc interface and has no `physfn` inside the VM.
    let vfs: Vec<String> = nics
        .iter()
        .filter(|n| n.driver.as_deref() == Some("hv_netvsc"))
        .flat_map(|n| n.lower.clone())
        .collect();
    for nic in &mut nics {
        if vfs.contains(&nic.name) {
            nic.virtual_function = true;
        }
    }
    Ok(nics)
}

fn read_nvme(root: &Root, pci: &BTreeMap<PciAddr, PciDevice>) -> Result<Vec<Nvme>, TopoError> {
    let mut out = Vec::new();
    for name in root.list("sys/class/nvme")? {
        let rel = PathBuf::from("sys/class/nvme").join(&name);
        let dev = pci_of(root, &rel.join("device"), pci)?;
        let mut namespaces = Vec::new();
        let mut capacity: Option<u64> = None;
        let prefix = format!("{name}n");
        for entry in root.list(&rel)? {
            let Some(rest) = entry.strip_prefix(&prefix) else {
                continue;
            };
            if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            if let Some(sectors) = read_u64(root, rel.join(&entry).join("size"))? {
                capacity = Some(
                    capacity
                        .unwrap_or(0)
                        .saturating_add(sectors.saturating_mul(512)),
                );
            }
            namespaces.push(entry);
        }
        out.push(Nvme {
            model: root
                .read_opt(rel.join("model"))?
                .map(|s| s.trim().to_owned()),
            pci: dev.map(|d| d.addr),
            numa_node: dev.and_then(|d| d.numa_node),
            capacity_bytes: capacity,
            namespaces,
            name,
        });
    }
    Ok(out)
}

/// The PCI device a class device's `device` link points at, if it is one.
fn pci_of<'a>(
    root: &Root,
    device_link: &Path,
    pci: &'a BTreeMap<PciAddr, PciDevice>,
) -> Result<Option<&'a PciDevice>, TopoError> {
    let Some(resolved) = root.resolve(device_link)? else {
        return Ok(None);
    };
    Ok(pci::chain(&resolved).1.last().and_then(|a| pci.get(a)))
}

fn link_name(root: &Root, rel: PathBuf) -> Result<Option<String>, TopoError> {
    Ok(root
        .read_link(rel)?
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned())))
}

pub(crate) fn parse_list(root: &Root, rel: impl AsRef<Path>, s: &str) -> Result<CpuSet, TopoError> {
    IdSet::parse_list(s).map_err(|e| TopoError::parse(root.path(rel), s, e))
}

fn read_u64(root: &Root, rel: impl AsRef<Path>) -> Result<Option<u64>, TopoError> {
    let rel = rel.as_ref();
    match root.read_opt(rel)? {
        Some(s) => {
            s.trim().parse().map(Some).map_err(|_| {
                TopoError::parse(root.path(rel), &s, "expected a non-negative integer")
            })
        }
        None => Ok(None),
    }
}

fn read_u32(root: &Root, rel: impl AsRef<Path>) -> Result<Option<u32>, TopoError> {
    let rel = rel.as_ref();
    parse_u32(root, rel, root.read_opt(rel)?)
}

/// The text of `rel`, if read, as a `u32`.
fn parse_u32(root: &Root, rel: &Path, text: Option<String>) -> Result<Option<u32>, TopoError> {
    match text {
        Some(s) => {
            s.trim().parse().map(Some).map_err(|_| {
                TopoError::parse(root.path(rel), &s, "expected a non-negative integer")
            })
        }
        None => Ok(None),
    }
}

/// `numa_node`: `-1` means the platform gives no affinity.
fn read_numa_node(root: &Root, rel: PathBuf) -> Result<Option<u32>, TopoError> {
    match root.read_opt(&rel)? {
        Some(s) => match s.trim().parse::<i64>() {
            Ok(-1) => Ok(None),
            Ok(v) if (0..=i64::from(crate::idset::MAX_ID)).contains(&v) => Ok(Some(v as u32)),
            _ => Err(TopoError::parse(
                root.path(&rel),
                &s,
                "expected a node number or -1",
            )),
        },
        None => Ok(None),
    }
}

fn read_hex(root: &Root, rel: PathBuf) -> Result<u64, TopoError> {
    let s = root.read(&rel)?;
    let t = s.trim();
    let digits = t.strip_prefix("0x").unwrap_or(t);
    u64::from_str_radix(digits, 16)
        .ok()
        .filter(|_| !digits.is_empty() && digits.len() <= 8)
        .ok_or_else(|| TopoError::parse(root.path(&rel), &s, "expected a hex number like 0x10de"))
}
