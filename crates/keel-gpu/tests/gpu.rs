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

/// What `nvidia-smi`, NVML's own command-line reader, says of a field of
/// a GPU: the independent reading keel's is checked against.
#[derive(Debug, PartialEq)]
enum Smi {
    /// No nvidia-smi to ask.
    Absent,
    /// `[N/A]`, `[Not Supported]`: NVML does not give it here.
    NotAvailable,
    Value(String),
}

fn smi(index: u32, field: &str) -> Smi {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            &format!("--query-gpu={field}"),
            "--format=csv,noheader,nounits",
            "-i",
            &index.to_string(),
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let v = String::from_utf8_lossy(&o.stdout).trim().to_owned();
            if v.starts_with('[') || v.is_empty() || v == "N/A" {
                Smi::NotAvailable
            } else {
                Smi::Value(v)
            }
        }
        _ => Smi::Absent,
    }
}

/// Whether keel must have a reading: yes unless nvidia-smi says NVML does
/// not give it on this GPU (a VM's virtual PCIe port, say).
fn required(index: u32, field: &str) -> bool {
    smi(index, field) != Smi::NotAvailable
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
    assert!(
        gpu.serial.is_some() || !required(gpu.index, "serial"),
        "{at}: no serial"
    );
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
    for (what, value, field) in [
        ("current gen", pcie.current_gen, "pcie.link.gen.current"),
        ("max gen", pcie.max_gen, "pcie.link.gen.max"),
        (
            "current width",
            pcie.current_width,
            "pcie.link.width.current",
        ),
        ("max width", pcie.max_width, "pcie.link.width.max"),
    ] {
        assert!(
            value.is_some_and(|v| v > 0) || !required(gpu.index, field),
            "{at}: PCIe {what} {value:?}"
        );
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

/// keel's readings are nvidia-smi's, field by field, for what does not
/// change from one moment to the next; where nvidia-smi has no value,
/// keel has none either (absent, never 0).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn nvml_readings_agree_with_nvidia_smi() {
    let snap = snapshot();
    assert!(
        smi(0, "name") != Smi::Absent,
        "nvidia-smi is not on PATH: nothing to compare with"
    );
    for gpu in &snap.gpus {
        let i = gpu.index;
        let at = format!("GPU {i} ({})", gpu.pci_bus_id);
        let same = |field: &str, keel: Option<String>| match smi(i, field) {
            Smi::Value(v) => assert_eq!(keel.as_deref(), Some(v.as_str()), "{at}: {field}"),
            Smi::NotAvailable => assert_eq!(keel, None, "{at}: {field}: nvidia-smi has none"),
            Smi::Absent => panic!("nvidia-smi stopped answering"),
        };
        same("name", gpu.name.clone());
        same("uuid", gpu.uuid.clone());
        same("serial", gpu.serial.clone());
        same("pcie.link.gen.max", gpu.pcie.max_gen.map(|v| v.to_string()));
        same(
            "pcie.link.width.max",
            gpu.pcie.max_width.map(|v| v.to_string()),
        );
        if let Smi::Value(v) = smi(i, "memory.total") {
            let mib: f64 = v.parse().expect("memory.total in MiB");
            let keel = gpu
                .memory_total_bytes
                .unwrap_or_else(|| panic!("{at}: no memory total"));
            let ours = keel as f64 / f64::from(1 << 20);
            assert!(
                (ours - mib).abs() <= mib * 0.01,
                "{at}: memory {ours} MiB, nvidia-smi {mib} MiB"
            );
        }
        let on_off = |b: Option<bool>| b.map(|b| if b { "Enabled" } else { "Disabled" }.to_owned());
        same("persistence_mode", on_off(gpu.persistence_mode));
        same("ecc.mode.current", on_off(gpu.ecc_enabled));
        if let Smi::Value(v) = smi(i, "enforced.power.limit") {
            let w: f64 = v.parse().expect("enforced.power.limit in W");
            let keel = gpu
                .power_limit_w
                .unwrap_or_else(|| panic!("{at}: no power limit"));
            assert!(
                (keel - w).abs() < 1.0,
                "{at}: power limit {keel} W, nvidia-smi {w} W"
            );
        }
        match (
            smi(i, "pci.bus_id"),
            keel_gpu::nvml::normalize_pci_bus_id(&gpu.pci_bus_id),
        ) {
            (Smi::Value(v), Some(ours)) => assert_eq!(
                keel_gpu::nvml::normalize_pci_bus_id(&v).as_deref(),
                Some(ours.as_str()),
                "{at}: PCI address"
            ),
            other => panic!("{at}: PCI address {other:?}"),
        }
    }
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
