//! SKU profiles: what a healthy node of a given machine type looks like,
//! and the thresholds its checks use. Built-in profiles are TOML files
//! embedded in the binary; a user file overrides any value.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Built-in profiles: name and TOML text.
pub const BUILTIN: &[(&str, &str)] = &[
    ("nd96asr_v4", include_str!("../profiles/nd96asr_v4.toml")),
    (
        "nd96amsr_a100_v4",
        include_str!("../profiles/nd96amsr_a100_v4.toml"),
    ),
    (
        "nd96isr_h100_v5",
        include_str!("../profiles/nd96isr_h100_v5.toml"),
    ),
    (
        "nd96isr_h200_v5",
        include_str!("../profiles/nd96isr_h200_v5.toml"),
    ),
    ("generic", include_str!("../profiles/generic.toml")),
];

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("unknown SKU profile {name:?}; known: {known}")]
    Unknown { name: String, known: String },
    #[error("failed to read the profile file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid profile {origin}: {message}")]
    Invalid { origin: String, message: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Set from the built-in profile's name; not read from files.
    #[serde(default, skip_deserializing)]
    pub name: String,
    pub description: String,
    /// Azure `vmSize` values this profile describes.
    #[serde(default)]
    pub vm_sizes: Vec<String>,
    #[serde(default)]
    pub gpu: GpuExpect,
    #[serde(default)]
    pub xid: XidPolicy,
    #[serde(default)]
    pub infiniband: IbExpect,
    #[serde(default)]
    pub host: HostExpect,
    /// Expected GPU and HCA PCI addresses per NUMA node.
    #[serde(default)]
    pub topology: Vec<NumaLayout>,
    /// Floors for `keel bench` results (`keel check --bench FILE`).
    #[serde(default)]
    pub active: ActiveExpect,
    /// The job environment `keel tune env` prints for this SKU.
    #[serde(default)]
    pub tune: TuneProfile,
    /// Local NVMe scratch (`keel scratch`).
    #[serde(default)]
    pub scratch: ScratchExpect,
}

/// What `keel tune env` sets on this SKU, each value with its reason and
/// where it comes from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuneProfile {
    #[serde(default)]
    pub env: Vec<EnvSetting>,
    /// Where the machine image ships NCCL's topology file for this SKU,
    /// first existing path wins; none found: NCCL_TOPO_FILE is not set.
    #[serde(default)]
    pub nccl_topo_files: Vec<String>,
    /// Where the topology file paths come from.
    pub nccl_topo_source: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSetting {
    pub name: String,
    pub value: String,
    /// One line: why.
    pub reason: String,
    /// Where the value comes from.
    pub source: String,
    /// Launchers it applies to (`srun`, `mpirun`, `torchrun`); empty: all.
    #[serde(default)]
    pub launchers: Vec<String>,
}

/// Local NVMe scratch: where it is mounted and how fast a RAID0 of the
/// drives should be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScratchExpect {
    #[serde(default = "d_scratch_mount")]
    pub mount: String,
    /// Expected sequential write and read, GB/s; unset: reported, not judged.
    pub write_gbps: Option<f64>,
    pub read_gbps: Option<f64>,
    /// Where the figures come from.
    pub source: Option<String>,
    /// At or above this fraction of a figure passes.
    #[serde(default = "d_scratch_warn")]
    pub warn_factor: f64,
    /// Below this fraction of a figure fails; between it and
    /// `warn_factor`, warns.
    #[serde(default = "d_scratch_fail")]
    pub fail_factor: f64,
}

fn d_scratch_warn() -> f64 {
    0.9
}

fn d_scratch_mount() -> String {
    "/mnt/resource_nvme".into()
}
fn d_scratch_fail() -> f64 {
    0.5
}

/// Floors for the active tier; a result below one fails, below
/// `warn_factor` times it warns. Unset: the value is reported, not judged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActiveExpect {
    pub h2d_gbps: Option<f64>,
    pub d2h_gbps: Option<f64>,
    /// GPU-to-GPU peer copy.
    pub peer_gbps: Option<f64>,
    /// Device-to-device copy, bytes read plus written.
    pub hbm_tbps: Option<f64>,
    pub gemm_bf16_tflops: Option<f64>,
    /// NCCL all-reduce bus bandwidth at the largest size, on
    /// `allreduce_ranks` ranks.
    pub allreduce_busbw_gbps: Option<f64>,
    #[serde(default = "d_ranks")]
    pub allreduce_ranks: u32,
    #[serde(default = "d_warn_factor")]
    pub warn_factor: f64,
}

fn d_ranks() -> u32 {
    8
}
fn d_warn_factor() -> f64 {
    1.05
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuExpect {
    /// GPUs expected on PCI; unset: as many as PCI shows.
    pub count: Option<u32>,
    /// A substring of the GPU model name.
    pub model: Option<String>,
    /// Active NVLink links per GPU; unset: every link NVML reports must be
    /// active.
    pub nvlink_links: Option<u32>,
    pub pcie_gen: Option<u32>,
    pub pcie_width: Option<u32>,
    #[serde(default = "yes")]
    pub require_persistence: bool,
    #[serde(default = "yes")]
    pub require_ecc: bool,
    /// Aggregate corrected SRAM errors at or above which a GPU fails.
    #[serde(default = "d_sram")]
    pub ecc_sram_corrected_fail: u64,
    /// Aggregate DRAM errors (corrected + uncorrected) at or above which a
    /// GPU fails.
    #[serde(default = "d_dram")]
    pub ecc_dram_aggregate_fail: u64,
    /// PCIe replays since the last run (or since driver load on the first
    /// run) at or above which a GPU warns.
    #[serde(default = "d_replay")]
    pub pcie_replay_warn: u64,
    /// Throttle reasons that fail: HW slowdown, HW thermal, power brake.
    #[serde(default = "d_throttle_fail")]
    pub throttle_fail_mask: u64,
    /// Throttle reasons that warn: SW thermal slowdown.
    #[serde(default = "d_throttle_warn")]
    pub throttle_warn_mask: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XidPolicy {
    /// Only XIDs logged within this many hours count.
    #[serde(default = "d_xid_window")]
    pub window_hours: f64,
    /// XIDs that fail the node; any other XID warns.
    #[serde(default = "d_xid_fail")]
    pub fail: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IbExpect {
    /// InfiniBand HCAs expected; unset: as many as sysfs shows.
    pub hcas: Option<u32>,
    /// Expected port rate in Gb/s.
    pub rate_gbps: Option<f64>,
    /// "lost carrier" events within the window at or above which a port
    /// fails.
    #[serde(default = "d_flaps")]
    pub flap_fail: u32,
    #[serde(default = "d_flap_window")]
    pub flap_window_hours: f64,
    /// GPUDirect RDMA needs the nvidia_peermem module when GPUs and
    /// InfiniBand are both present.
    #[serde(default = "yes")]
    pub require_peermem: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostExpect {
    pub sockets: Option<u32>,
    /// Physical cores.
    pub cores: Option<u32>,
    pub threads_per_core: Option<u32>,
    /// Expected memory; the node fails below it by more than the tolerance.
    pub memory_gib: Option<f64>,
    #[serde(default = "d_mem_tol")]
    pub memory_tolerance_pct: f64,
    #[serde(default = "yes")]
    pub allow_swap: bool,
    pub nvme: Option<u32>,
    #[serde(default = "d_disks")]
    pub disks: Vec<DiskExpect>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskExpect {
    pub mount: String,
    pub min_free_gib: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaLayout {
    pub numa_node: u32,
    #[serde(default)]
    pub gpus: Vec<String>,
    #[serde(default)]
    pub hcas: Vec<String>,
}

fn yes() -> bool {
    true
}
fn d_sram() -> u64 {
    10_000
}
fn d_dram() -> u64 {
    20_000_000
}
fn d_replay() -> u64 {
    100
}
fn d_throttle_fail() -> u64 {
    keel_gpu::throttle::HW_SLOWDOWN
        | keel_gpu::throttle::HW_THERMAL_SLOWDOWN
        | keel_gpu::throttle::HW_POWER_BRAKE_SLOWDOWN
}
fn d_throttle_warn() -> u64 {
    keel_gpu::throttle::SW_THERMAL_SLOWDOWN
}
fn d_xid_window() -> f64 {
    2.0
}
/// XIDs that mean a hardware or driver fault needing attention.
pub const DEFAULT_FATAL_XIDS: &[u32] = &[
    48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 94, 95, 119, 120,
];
fn d_xid_fail() -> Vec<u32> {
    DEFAULT_FATAL_XIDS.to_vec()
}
fn d_flaps() -> u32 {
    5
}
fn d_flap_window() -> f64 {
    24.0
}
fn d_mem_tol() -> f64 {
    5.0
}
fn d_disks() -> Vec<DiskExpect> {
    vec![DiskExpect {
        mount: "/".into(),
        min_free_gib: 1.0,
    }]
}

macro_rules! default_from_toml {
    ($t:ty) => {
        impl Default for $t {
            fn default() -> Self {
                toml::from_str("").expect("every field has a default")
            }
        }
    };
}
default_from_toml!(GpuExpect);
default_from_toml!(XidPolicy);
default_from_toml!(IbExpect);
default_from_toml!(HostExpect);
default_from_toml!(ActiveExpect);
default_from_toml!(ScratchExpect);

/// Names of the built-in profiles.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

/// A built-in profile, optionally with a user file's values laid over it.
pub fn load(name: &str, overrides: Option<&Path>) -> Result<Profile, ProfileError> {
    let text = BUILTIN
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
        .ok_or_else(|| ProfileError::Unknown {
            name: name.to_owned(),
            known: builtin_names().join(", "),
        })?;
    let mut value: toml::Table =
        text.parse()
            .map_err(|e: toml::de::Error| ProfileError::Invalid {
                origin: format!("built-in {name}"),
                message: e.to_string(),
            })?;
    let mut origin = format!("built-in {name}");
    if let Some(path) = overrides {
        let user = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let user: toml::Table =
            user.parse()
                .map_err(|e: toml::de::Error| ProfileError::Invalid {
                    origin: path.display().to_string(),
                    message: e.to_string(),
                })?;
        merge(&mut value, user);
        origin = format!("{} over built-in {name}", path.display());
    }
    let mut profile: Profile =
        toml::Value::Table(value)
            .try_into()
            .map_err(|e: toml::de::Error| ProfileError::Invalid {
                origin,
                message: e.to_string(),
            })?;
    profile.name = name.to_owned();
    Ok(profile)
}

/// Lays `over` onto `base`: tables merge key by key, anything else
/// (numbers, strings, arrays) is replaced.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// The built-in profile for an Azure `vmSize` (case-insensitive).
pub fn for_vm_size(vm_size: &str) -> Option<&'static str> {
    let want = vm_size.trim().to_ascii_lowercase();
    let want = want.strip_prefix("standard_").unwrap_or(&want);
    BUILTIN.iter().map(|(n, _)| *n).find(|n| *n == want)
}

/// The built-in profile for a node with `count` GPUs of model `model`
/// (NVML or sysfs name), if one matches.
pub fn for_gpus(model: &str, count: usize) -> Option<&'static str> {
    if count != 8 {
        return None;
    }
    let m = model.to_ascii_uppercase();
    if m.contains("A100") && m.contains("40GB") {
        Some("nd96asr_v4")
    } else if m.contains("A100") && m.contains("80GB") {
        Some("nd96amsr_a100_v4")
    } else if m.contains("H100") && m.contains("80GB") {
        Some("nd96isr_h100_v5")
    } else if m.contains("H200") {
        Some("nd96isr_h200_v5")
    } else {
        None
    }
}

impl keel_error::HasKind for ProfileError {
    fn kind(&self) -> keel_error::ErrorKind {
        match self {
            Self::Read { .. } => keel_error::ErrorKind::Io,
            _ => keel_error::ErrorKind::Usage,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_parses() {
        for name in builtin_names() {
            let p = load(name, None).expect(name);
            assert_eq!(p.name, name);
            assert_eq!(p.gpu.ecc_sram_corrected_fail, 10_000);
            assert_eq!(p.xid.fail, DEFAULT_FATAL_XIDS);
        }
        for name in builtin_names().into_iter().filter(|n| n.starts_with("nd")) {
            let p = load(name, None).expect(name);
            assert!(p.tune.env.len() >= 6, "{name}");
            for e in &p.tune.env {
                assert!(
                    !e.reason.is_empty() && !e.source.is_empty(),
                    "{name}: {e:?}"
                );
            }
            assert!(p.tune.nccl_topo_source.is_some(), "{name}");
            assert_eq!(p.scratch.mount, "/mnt/resource_nvme");
        }
        assert_eq!(
            load("nd96asr_v4", None).expect("ndv4").scratch.read_gbps,
            Some(8.0)
        );
        assert!(load("generic", None).expect("generic").tune.env.is_empty());
        let h100 = load("nd96isr_h100_v5", None).expect("h100 profile");
        assert_eq!(h100.gpu.nvlink_links, Some(18));
        assert_eq!(h100.infiniband.rate_gbps, Some(400.0));
        assert!(!h100.host.allow_swap);
    }

    #[test]
    fn user_file_overrides_any_value_and_unknown_keys_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("site.toml");
        std::fs::write(&f, "[gpu]\nnvlink_links = 16\n[xid]\nwindow_hours = 6.0\n").expect("write");
        let p = load("nd96isr_h100_v5", Some(&f)).expect("merged");
        assert_eq!(p.gpu.nvlink_links, Some(16));
        assert_eq!(p.gpu.count, Some(8));
        assert_eq!(p.xid.window_hours, 6.0);

        std::fs::write(&f, "[gpu]\nnvlink_lnks = 16\n").expect("write");
        let err = load("nd96isr_h100_v5", Some(&f)).expect_err("typo");
        assert!(err.to_string().contains("nvlink_lnks"), "{err}");
        assert!(matches!(
            load("nd96", None),
            Err(ProfileError::Unknown { .. })
        ));
    }

    #[test]
    fn tune_and_scratch_keys_are_documented() {
        let doc = include_str!("../../../docs/config.md");
        let scratch = serde_json::to_value(ScratchExpect::default()).expect("serialises");
        for k in scratch.as_object().expect("object").keys() {
            assert!(doc.contains(&format!("`scratch.{k}`")), "scratch.{k}");
        }
        let tune = serde_json::to_value(TuneProfile::default()).expect("serialises");
        for k in tune
            .as_object()
            .expect("object")
            .keys()
            .filter(|k| *k != "env")
        {
            assert!(doc.contains(&format!("`tune.{k}`")), "tune.{k}");
        }
        let env = EnvSetting {
            name: String::new(),
            value: String::new(),
            reason: String::new(),
            source: String::new(),
            launchers: vec![],
        };
        let row = doc
            .lines()
            .find(|l| l.starts_with("| `[[tune.env]]`"))
            .expect("[[tune.env]] row");
        for k in serde_json::to_value(env)
            .expect("serialises")
            .as_object()
            .expect("object")
            .keys()
        {
            assert!(row.contains(&format!("`{k}`")), "tune.env.{k}");
        }
    }

    #[test]
    fn sku_from_vm_size_and_gpus() {
        assert_eq!(for_vm_size("Standard_ND96asr_v4"), Some("nd96asr_v4"));
        assert_eq!(
            for_vm_size("standard_nd96isr_h200_v5\n"),
            Some("nd96isr_h200_v5")
        );
        assert_eq!(for_vm_size("Standard_D8s_v5"), None);
        assert_eq!(for_gpus("NVIDIA A100-SXM4-40GB", 8), Some("nd96asr_v4"));
        assert_eq!(
            for_gpus("NVIDIA H100 80GB HBM3", 8),
            Some("nd96isr_h100_v5")
        );
        assert_eq!(for_gpus("NVIDIA H200", 8), Some("nd96isr_h200_v5"));
        assert_eq!(for_gpus("NVIDIA H100 80GB HBM3", 4), None);
    }
}
