//! Tests against a real NVIDIA GPU (the `gpu` test binary; run on a GPU
//! machine with `cargo nextest run -p keel-gpu --test gpu --run-ignored all`).
//!
//! They assert only what every datacenter GPU reports. NVLink, row remapping
//! on older GPUs and the process list's contents depend on the part and the
//! moment, so they are checked for shape, not presence.

use std::path::Path;
use std::time::Duration;

use keel_gpu::{record, recorded, GpuProbe, GpuReading, GpuSnapshot, NvmlProbe, SNAPSHOT_VERSION};

fn snapshot() -> GpuSnapshot {
    // Generous: without persistence mode, NVML initialises every GPU first.
    let probe = NvmlProbe::new().with_timeout(Duration::from_secs(60));
    match probe.snapshot() {
        Ok(snap) => snap,
        Err(e) => panic!("no NVML snapshot on a GPU machine: {e}"),
    }
}

fn is_sysfs_pci_address(id: &str) -> bool {
    let parts: Vec<&str> = id.split([':', '.']).collect();
    parts.len() == 4
        && parts[0].len() >= 4
        && [2, 2, 1]
            .iter()
            .zip(&parts[1..])
            .all(|(n, p)| p.len() == *n)
        && id
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f' | b':' | b'.'))
}

fn check_reading(gpu: &GpuReading) {
    let at = format!("GPU {} ({})", gpu.index, gpu.pci_bus_id);
    assert!(
        is_sysfs_pci_address(&gpu.pci_bus_id),
        "{at}: PCI address not in sysfs form"
    );
    let sysfs = Path::new("/sys/bus/pci/devices").join(&gpu.pci_bus_id);
    if Path::new("/sys/bus/pci/devices").is_dir() {
        assert!(sysfs.exists(), "{at}: {} does not exist", sysfs.display());
    }
    assert!(
        gpu.uuid.as_deref().is_some_and(|u| u.starts_with("GPU-")),
        "{at}: uuid {:?}",
        gpu.uuid
    );
    assert!(
        gpu.name.as_deref().is_some_and(|n| !n.is_empty()),
        "{at}: no name"
    );
    assert!(gpu.serial.is_some(), "{at}: no serial");
    assert!(gpu.persistence_mode.is_some(), "{at}: no persistence mode");
    assert!(
        gpu.ecc_enabled.is_some() && gpu.ecc_pending.is_some(),
        "{at}: no ECC mode"
    );
    if gpu.ecc_enabled == Some(true) {
        let ecc = &gpu.ecc;
        assert!(ecc.volatile_dram_uncorrected.is_some(), "{at}: {ecc:?}");
        assert!(ecc.volatile_dram_corrected.is_some(), "{at}: {ecc:?}");
        assert!(ecc.aggregate_dram_uncorrected.is_some(), "{at}: {ecc:?}");
        assert!(ecc.aggregate_dram_corrected.is_some(), "{at}: {ecc:?}");
    }
    let name = gpu.name.as_deref().unwrap_or_default();
    if ["A100", "H100", "H200", "B200", "GH200"]
        .iter()
        .any(|n| name.contains(n))
    {
        assert!(
            gpu.remapped_rows.is_some(),
            "{at}: {name} has row remapping"
        );
    }
    assert!(
        gpu.throttle_reasons.is_some(),
        "{at}: no clocks-event reasons"
    );
    let pcie = &gpu.pcie;
    for (what, value) in [
        ("current gen", pcie.current_gen),
        ("max gen", pcie.max_gen),
        ("current width", pcie.current_width),
        ("max width", pcie.max_width),
    ] {
        assert!(value.is_some_and(|v| v > 0), "{at}: PCIe {what} {value:?}");
    }
    assert!(
        pcie.replay_counter.is_some(),
        "{at}: no PCIe replay counter"
    );
    if let Some(links) = &gpu.nvlink_active {
        assert!(
            !links.is_empty() && links.len() <= 18,
            "{at}: {} NVLink links",
            links.len()
        );
    }
    assert!(
        gpu.temperature_c.is_some_and(|t| (1..=120).contains(&t)),
        "{at}: temperature {:?}",
        gpu.temperature_c
    );
    assert!(
        gpu.power_w.is_some_and(|w| w > 0.0 && w < 2000.0),
        "{at}: power {:?}",
        gpu.power_w
    );
    assert!(
        gpu.memory_total_bytes.is_some_and(|b| b >= 1 << 30),
        "{at}: memory {:?}",
        gpu.memory_total_bytes
    );
    assert!(gpu.processes.is_some(), "{at}: no process list");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn nvml_snapshot_has_what_every_datacenter_gpu_reports() {
    let snap = snapshot();
    assert_eq!(snap.version, SNAPSHOT_VERSION);
    assert!(snap.driver_version.is_some(), "no driver version");
    assert!(snap.nvml_version.is_some(), "no NVML version");
    assert!(
        snap.cuda_driver_version.is_some_and(|v| v >= 11000),
        "{:?}",
        snap.cuda_driver_version
    );
    assert!(!snap.gpus.is_empty(), "NVML sees no GPU");
    for (i, gpu) in snap.gpus.iter().enumerate() {
        assert_eq!(
            gpu.index as usize, i,
            "GPUs in NVML index order, none left out"
        );
        check_reading(gpu);
    }
    println!("{}", recorded::to_json(&snap));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn recorded_snapshot_parses_back() {
    let probe = NvmlProbe::new().with_timeout(Duration::from_secs(60));
    let snap = match record(&probe, Some("gpu test".into())) {
        Ok(snap) => snap,
        Err(e) => panic!("cannot record: {e}"),
    };
    assert_eq!(snap.description.as_deref(), Some("gpu test"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("gpu.json");
    std::fs::write(&path, recorded::to_json(&snap)).expect("write the snapshot");
    match recorded::RecordedProbe::new(&path).snapshot() {
        Ok(back) => assert_eq!(back, snap),
        Err(e) => panic!("recorded snapshot does not parse back: {e}"),
    }
}
