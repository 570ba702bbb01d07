//! A GPU's three names, in one place: its NVML index (PCI bus order, what
//! nvidia-smi, NVML and `CUDA_DEVICE_ORDER=PCI_BUS_ID` number), the minor
//! number of its `/dev/nvidiaN` file (NVML's `nvmlDeviceGetMinorNumber`,
//! the driver's `Device Minor:` in `/proc/driver/nvidia/gpus/<bus>/information`)
//! and its PCI bus id.
//!
//! They differ on real machines: the driver numbers device files in the
//! order it probes the GPUs, which on Azure's Hyper-V VMs is not their PCI
//! order. Slurm's GPU ids are the device files' numbers when gres.conf
//! lists them with `File=/dev/nvidia[0-7]` and no `AutoDetect` (as Azure
//! CycleCloud writes it), and PCI-ordered indices with `AutoDetect=nvml`.
//! Every keel command that is handed Slurm's ids (`SLURM_JOB_GPUS`, a
//! job-mapping directory) or holds a device file turns them into NVML
//! indices here.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::TopoError;
use crate::machine::Machine;
use crate::pci::PciAddr;
use crate::root::Root;

/// One GPU's names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuId {
    /// NVML's index.
    pub index: u32,
    /// The minor number of its device file; `None` when neither NVML nor
    /// the driver's procfs gave it.
    pub minor: Option<u32>,
    /// PCI address in sysfs form, lowercase (`0001:00:00.0`).
    pub pci: String,
}

/// What a list of GPU ids means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IdKind {
    /// Device minor numbers: `/dev/nvidiaN`, and Slurm's ids under
    /// gres.conf `File=` lines.
    #[default]
    Minor,
    /// NVML indices (PCI bus order), and Slurm's ids under
    /// `AutoDetect=nvml`.
    Index,
}

impl FromStr for IdKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "minor" => Ok(Self::Minor),
            "index" => Ok(Self::Index),
            _ => Err(format!(
                "unknown GPU id kind {:?}: expected minor (device files, Slurm with gres.conf File= lines) or index (NVML, Slurm with AutoDetect=nvml)",
                s.chars().take(32).collect::<String>()
            )),
        }
    }
}

impl fmt::Display for IdKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Minor => "minor",
            Self::Index => "index",
        })
    }
}

/// Why ids could not be turned into NVML indices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuIdError {
    #[error(
        "no GPU has device minor {minor} (/dev/nvidia{minor}); this node's minors are {known}"
    )]
    UnknownMinor { minor: u32, known: String },
    #[error("no GPU has NVML index {index}; this node has {count} GPUs")]
    UnknownIndex { index: u32, count: usize },
    #[error("the device minor of GPU {index} ({pci}) is unknown (no Device Minor in /proc/driver/nvidia/gpus/{pci}/information, and NVML did not give it): device minors cannot be turned into NVML indices")]
    MinorUnknown { index: u32, pci: String },
}

/// Every GPU of a node by its three names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GpuIds {
    gpus: Vec<GpuId>,
}

impl GpuIds {
    /// From NVML's view, `(index, PCI bus id in sysfs form, minor number)`
    /// per GPU, with the minors the driver's procfs gives (by PCI address)
    /// filling in those NVML did not give.
    pub fn new(
        nvml: impl IntoIterator<Item = (u32, String, Option<u32>)>,
        procfs: &BTreeMap<PciAddr, u32>,
    ) -> Self {
        let mut gpus: Vec<GpuId> = nvml
            .into_iter()
            .map(|(index, pci, minor)| {
                let from_procfs = pci
                    .parse::<PciAddr>()
                    .ok()
                    .and_then(|a| procfs.get(&a).copied());
                GpuId {
                    index,
                    minor: minor.or(from_procfs),
                    pci: pci.to_ascii_lowercase(),
                }
            })
            .collect();
        gpus.sort_by_key(|g| g.index);
        Self { gpus }
    }

    /// From sysfs and procfs alone: NVML numbers GPUs in PCI bus order,
    /// which is the order `keel topo` reads them in.
    pub fn from_machine(machine: &Machine) -> Self {
        Self {
            gpus: machine
                .gpus
                .iter()
                .map(|g| GpuId {
                    index: g.index as u32,
                    minor: g.minor,
                    pci: g.pci.to_string(),
                })
                .collect(),
        }
    }

    pub fn gpus(&self) -> &[GpuId] {
        &self.gpus
    }

    pub fn by_index(&self, index: u32) -> Option<&GpuId> {
        self.gpus.iter().find(|g| g.index == index)
    }

    pub fn by_minor(&self, minor: u32) -> Option<&GpuId> {
        self.gpus.iter().find(|g| g.minor == Some(minor))
    }

    pub fn index_of_minor(&self, minor: u32) -> Option<u32> {
        self.by_minor(minor).map(|g| g.index)
    }

    pub fn minor_of_index(&self, index: u32) -> Option<u32> {
        self.by_index(index).and_then(|g| g.minor)
    }

    /// The NVML indices of `ids`, read as `kind`, in the order given.
    /// Every id must name a GPU of this node: a wrong id is an error,
    /// never a guess.
    pub fn to_indices(&self, ids: &[u32], kind: IdKind) -> Result<Vec<u32>, GpuIdError> {
        ids.iter()
            .map(|&id| match kind {
                IdKind::Index => self.by_index(id).map(|g| g.index).ok_or({
                    GpuIdError::UnknownIndex {
                        index: id,
                        count: self.gpus.len(),
                    }
                }),
                IdKind::Minor => {
                    if let Some(g) = self.by_minor(id) {
                        return Ok(g.index);
                    }
                    if let Some(g) = self.gpus.iter().find(|g| g.minor.is_none()) {
                        return Err(GpuIdError::MinorUnknown {
                            index: g.index,
                            pci: g.pci.clone(),
                        });
                    }
                    let known: Vec<String> = self
                        .gpus
                        .iter()
                        .filter_map(|g| g.minor.map(|m| m.to_string()))
                        .collect();
                    Err(GpuIdError::UnknownMinor {
                        minor: id,
                        known: if known.is_empty() {
                            "none".into()
                        } else {
                            known.join(",")
                        },
                    })
                }
            })
            .collect()
    }
}

/// The device minor of each GPU the NVIDIA driver lists under
/// `/proc/driver/nvidia/gpus/<pci>/information` (`Device Minor: N`). An
/// absent directory (no driver) is an empty map.
pub fn read_procfs_minors(root: &Root) -> Result<BTreeMap<PciAddr, u32>, TopoError> {
    let mut out = BTreeMap::new();
    for name in root.list("proc/driver/nvidia/gpus")? {
        let Ok(addr) = name.parse::<PciAddr>() else {
            continue;
        };
        let rel = format!("proc/driver/nvidia/gpus/{name}/information");
        let Some(info) = root.read_opt(&rel)? else {
            continue;
        };
        if let Some(minor) = parse_information(&info)
            .map_err(|line| TopoError::parse(root.path(&rel), &line, "expected a number"))?
        {
            out.insert(addr, minor);
        }
    }
    Ok(out)
}

/// The `Device Minor:` of an `information` file; the offending line when
/// it is not a number.
pub fn parse_information(text: &str) -> Result<Option<u32>, String> {
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("Device Minor:") {
            return v.trim().parse().map(Some).map_err(|_| line.to_owned());
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> GpuIds {
        // NDv4-like: minors a permutation of the PCI-ordered indices, one
        // GPU whose minor only procfs gives.
        let procfs: BTreeMap<PciAddr, u32> = [("0004:00:00.0", 0)]
            .into_iter()
            .map(|(a, m)| (a.parse().expect("addr"), m))
            .collect();
        GpuIds::new(
            [
                (1, "0002:00:00.0".to_owned(), Some(2)),
                (0, "0001:00:00.0".to_owned(), Some(3)),
                (3, "0004:00:00.0".to_owned(), None),
                (2, "0003:00:00.0".to_owned(), Some(1)),
            ],
            &procfs,
        )
    }

    #[test]
    fn minors_and_indices_map_both_ways() {
        let ids = ids();
        assert_eq!(
            ids.gpus().iter().map(|g| g.index).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(ids.index_of_minor(3), Some(0));
        assert_eq!(ids.index_of_minor(0), Some(3), "the minor from procfs");
        assert_eq!(ids.minor_of_index(2), Some(1));
        assert_eq!(ids.index_of_minor(9), None);
        assert_eq!(ids.to_indices(&[3, 1], IdKind::Minor), Ok(vec![0, 2]));
        assert_eq!(ids.to_indices(&[3, 1], IdKind::Index), Ok(vec![3, 1]));
        assert_eq!(
            ids.to_indices(&[7], IdKind::Minor),
            Err(GpuIdError::UnknownMinor {
                minor: 7,
                known: "3,2,1,0".into()
            })
        );
        assert_eq!(
            ids.to_indices(&[4], IdKind::Index),
            Err(GpuIdError::UnknownIndex { index: 4, count: 4 })
        );
    }

    #[test]
    fn a_missing_minor_is_an_error_not_a_guess() {
        let ids = GpuIds::new([(0, "0001:00:00.0".to_owned(), None)], &BTreeMap::new());
        assert_eq!(
            ids.to_indices(&[0], IdKind::Minor),
            Err(GpuIdError::MinorUnknown {
                index: 0,
                pci: "0001:00:00.0".into()
            })
        );
        assert_eq!(ids.to_indices(&[0], IdKind::Index), Ok(vec![0]));
    }

    #[test]
    fn information_files() {
        assert_eq!(
            parse_information("Model: \t\t A100\nDevice Minor: \t 5\nGPU Excluded:\t No\n"),
            Ok(Some(5))
        );
        assert_eq!(parse_information("Model: x\n"), Ok(None));
        assert!(parse_information("Device Minor: five\n").is_err());
        assert_eq!("index".parse::<IdKind>(), Ok(IdKind::Index));
        assert!("bus".parse::<IdKind>().is_err());
    }
}
