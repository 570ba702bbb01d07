//! The recorded GPU snapshots under `tests/fixtures/*/gpu.json` (written by
//! `tests/fixtures/generate.py`): they parse, they are exactly what keel's
//! serialiser writes, they describe the healthy node they claim to, and they
//! agree with the same fixture's sysfs and procfs trees.

use std::path::{Path, PathBuf};

use keel_gpu::recorded::{self, RecordedProbe};
use keel_gpu::{throttle, GpuProbe, GpuSnapshot, RemappedRows};

fn fixture(machine: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(machine)
}

fn load(machine: &str) -> (GpuSnapshot, String) {
    let path = fixture(machine).join("gpu.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    match RecordedProbe::new(&path).snapshot() {
        Ok(snap) => (snap, text),
        Err(e) => panic!("{e}"),
    }
}

struct Healthy<'a> {
    name: &'a str,
    pci: &'a [&'a str],
    pcie_gen: u32,
    nvlinks: usize,
    memory_bytes: u64,
    /// Default application (graphics, memory) and maximum (graphics,
    /// memory) clocks.
    clocks: ((u32, u32), (u32, u32)),
}

fn check(machine: &str, expected: Healthy<'_>) {
    let (snap, text) = load(machine);
    assert_eq!(
        recorded::to_json(&snap),
        text,
        "{machine}/gpu.json is not in the form keel writes"
    );
    assert!(snap
        .description
        .as_deref()
        .is_some_and(|d| d.contains("illustrative")));
    assert!(snap
        .driver_version
        .as_deref()
        .is_some_and(|v| v.starts_with("535.")));
    assert!(snap.nvml_version.is_some() && snap.cuda_driver_version.is_some());
    let pci: Vec<&str> = snap.gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
    assert_eq!(pci, expected.pci);
    for (i, gpu) in snap.gpus.iter().enumerate() {
        let at = format!("{machine} GPU {i}");
        assert_eq!(gpu.index as usize, i);
        assert_eq!(gpu.name.as_deref(), Some(expected.name), "{at}");
        assert_eq!(gpu.persistence_mode, Some(true), "{at}");
        assert_eq!(
            (gpu.ecc_enabled, gpu.ecc_pending),
            (Some(true), Some(true)),
            "{at}"
        );
        let ecc = &gpu.ecc;
        for count in [
            ecc.volatile_sram_uncorrected,
            ecc.volatile_dram_uncorrected,
            ecc.volatile_sram_corrected,
            ecc.volatile_dram_corrected,
            ecc.aggregate_sram_uncorrected,
            ecc.aggregate_dram_uncorrected,
            ecc.aggregate_sram_corrected,
            ecc.aggregate_dram_corrected,
        ] {
            assert_eq!(count, Some(0), "{at}: {ecc:?}");
        }
        assert_eq!(
            gpu.retired_pages_pending, None,
            "{at}: row remapping replaces page retirement"
        );
        assert_eq!(gpu.remapped_rows, Some(RemappedRows::default()), "{at}");
        assert_eq!(gpu.throttle_reasons, Some(throttle::GPU_IDLE), "{at}");
        let pcie = gpu.pcie;
        assert_eq!(
            (pcie.current_gen, pcie.max_gen),
            (Some(expected.pcie_gen), Some(expected.pcie_gen)),
            "{at}"
        );
        assert_eq!(
            (pcie.current_width, pcie.max_width),
            (Some(16), Some(16)),
            "{at}"
        );
        assert_eq!(pcie.replay_counter, Some(0), "{at}");
        let c = gpu.clocks.unwrap_or_else(|| panic!("{at}: no clocks"));
        let ((dg, dm), (mg, mm)) = expected.clocks;
        assert_eq!(
            (c.default_app_graphics_mhz, c.default_app_memory_mhz),
            (Some(dg), Some(dm)),
            "{at}"
        );
        assert_eq!(
            (c.app_graphics_mhz, c.app_memory_mhz),
            (Some(dg), Some(dm)),
            "{at}: application clocks at their defaults"
        );
        assert_eq!(
            (c.max_graphics_mhz, c.max_memory_mhz),
            (Some(mg), Some(mm)),
            "{at}"
        );
        assert!(c.graphics_mhz.is_some_and(|g| g < dg), "{at}: idle");
        assert_eq!(
            gpu.nvlink_active,
            Some(vec![true; expected.nvlinks]),
            "{at}"
        );
        assert!(
            gpu.temperature_c.is_some_and(|t| (30..=40).contains(&t)),
            "{at}"
        );
        assert!(gpu.power_w.is_some_and(|w| w > 0.0), "{at}");
        assert_eq!(gpu.memory_total_bytes, Some(expected.memory_bytes), "{at}");
        assert_eq!(gpu.processes, Some(vec![]), "{at}");
        assert!(gpu.serial.as_deref().is_some_and(|s| s.len() == 13), "{at}");

        // The same GPU in the fixture's sysfs and procfs trees.
        let root = fixture(machine);
        let device = root.join("sys/bus/pci/devices").join(&gpu.pci_bus_id);
        assert!(device.exists(), "{at}: {} missing", device.display());
        let info_path = root
            .join("proc/driver/nvidia/gpus")
            .join(&gpu.pci_bus_id)
            .join("information");
        let info = std::fs::read_to_string(&info_path)
            .unwrap_or_else(|e| panic!("{}: {e}", info_path.display()));
        let uuid = gpu
            .uuid
            .as_deref()
            .unwrap_or_else(|| panic!("{at}: no uuid"));
        assert!(
            info.contains(&format!("GPU UUID: \t {uuid}\n")),
            "{at}: {uuid} not in {}",
            info_path.display()
        );
        // NVML's minor number is the driver's Device Minor (not the index:
        // on nd96asr_v4 they are a permutation of each other).
        let minor = gpu
            .minor_number
            .unwrap_or_else(|| panic!("{at}: no minor number"));
        assert!(
            info.contains(&format!("Device Minor: \t {minor}\n")),
            "{at}"
        );
        assert!(
            info.contains(&format!("Model: \t\t {}\n", expected.name)),
            "{at}"
        );
    }
    let mut uuids: Vec<_> = snap.gpus.iter().map(|g| &g.uuid).collect();
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), snap.gpus.len(), "{machine}: UUIDs repeat");
}

#[test]
fn nd96asr_v4_is_a_healthy_a100_node() {
    check(
        "nd96asr_v4",
        Healthy {
            name: "NVIDIA A100-SXM4-40GB",
            pci: &[
                "0001:00:00.0",
                "0002:00:00.0",
                "0003:00:00.0",
                "0004:00:00.0",
                "000b:00:00.0",
                "000c:00:00.0",
                "000d:00:00.0",
                "000e:00:00.0",
            ],
            pcie_gen: 4,
            nvlinks: 12,
            memory_bytes: 40960 << 20,
            clocks: ((1095, 1215), (1410, 1215)),
        },
    );
}

#[test]
fn nd96isr_h100_v5_is_a_healthy_h100_node() {
    check(
        "nd96isr_h100_v5",
        Healthy {
            name: "NVIDIA H100 80GB HBM3",
            pci: &[
                "0001:00:00.0",
                "0002:00:00.0",
                "0003:00:00.0",
                "0004:00:00.0",
                "0005:00:00.0",
                "0006:00:00.0",
                "0007:00:00.0",
                "0008:00:00.0",
            ],
            pcie_gen: 5,
            nvlinks: 18,
            memory_bytes: 81559 << 20,
            clocks: ((1980, 2619), (1980, 2619)),
        },
    );
}
