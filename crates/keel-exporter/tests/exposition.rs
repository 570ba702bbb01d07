//! The exposition of the recorded machines (tests/fixtures): what a
//! Prometheus scrape of those nodes returns, GPU readings from their
//! recorded NVML snapshot and the rest read under their machine root.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_exporter::readings::{GpuState, Readings};
use keel_exporter::{expose, host, jobs};
use keel_topo::Root;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The readings a scrape takes from a fixture, with the probe's answer
/// fresh (age 0).
fn readings(name: &str) -> Readings {
    let root = fixture(name);
    let snap = keel_gpu::recorded::load(&root.join("gpu.json")).ok();
    let r = Root::new(&root);
    let jobs = snap
        .as_ref()
        .map(|s| jobs::from_processes(&r, s))
        .unwrap_or_default();
    Readings {
        gpu: GpuState {
            age_s: snap.as_ref().map(|_| 0.0),
            snapshot: snap.map(Arc::new),
            stale: false,
            error: None,
        },
        hca_ports: host::hca_ports(&r),
        xids: host::XidTail::new(&root).poll(),
        check: None,
        jobs,
        idle: Vec::new(),
        hostname: "node-1".into(),
    }
}

#[test]
fn ndv4_exposition() {
    insta::assert_snapshot!("nd96asr_v4", expose::render(&readings("nd96asr_v4")));
}

#[test]
fn h100_exposition() {
    insta::assert_snapshot!(
        "nd96isr_h100_v5",
        expose::render(&readings("nd96isr_h100_v5"))
    );
}

#[test]
fn a_gpu_less_node_exports_host_metrics_and_no_gpu_series() {
    let mut r = readings("cpu-only");
    r.gpu.error = Some(keel_exporter::readings::ProbeFailure::Unavailable);
    let text = expose::render(&r);
    assert!(text.contains("keel_exporter_gpu_up 0\n"), "{text}");
    assert!(
        text.contains("keel_exporter_gpu_probe_error{reason=\"unavailable\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("keel_exporter_hca_readable 1\n"), "{text}");
    assert!(!text.contains("keel_gpu_"), "{text}");
}

#[test]
fn unreadable_values_are_absent_not_zero() {
    let mut r = readings("nd96isr_h100_v5");
    let mut snap = (*r.gpu.snapshot.take().expect("snapshot")).clone();
    snap.gpus[3].temperature_c = None;
    snap.gpus[3].power_w = None;
    snap.gpus[3].ecc = Default::default();
    r.gpu.snapshot = Some(Arc::new(snap));
    let text = expose::render(&r);
    let gpu3 = |name: &str| {
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains("gpu=\"3\""))
            .count()
    };
    assert_eq!(gpu3("keel_gpu_temperature_celsius{"), 0);
    assert_eq!(gpu3("keel_gpu_power_watts{"), 0);
    assert_eq!(gpu3("keel_gpu_ecc_errors_total{"), 0);
    assert_eq!(gpu3("keel_gpu_memory_total_bytes{"), 1);
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("keel_gpu_temperature_celsius{"))
            .count(),
        7
    );
}

#[test]
fn unreadable_sysfs_files_leave_their_readings_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = dir.path().join("sys/class/infiniband/mlx5_0/ports/1");
    std::fs::create_dir_all(port.join("counters")).expect("mkdir");
    std::fs::write(port.join("state"), "4: ACTIVE\n").expect("write");
    // A directory where a file should be: reading it fails.
    std::fs::create_dir_all(port.join("rate")).expect("mkdir");
    std::fs::write(port.join("counters/symbol_error"), "not a number\n").expect("write");
    std::fs::write(port.join("counters/link_downed"), "3\n").expect("write");
    let ports = host::hca_ports(&Root::new(dir.path())).expect("listed");
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].state.as_deref(), Some("ACTIVE"));
    assert_eq!(ports[0].rate_gbps, None);
    assert_eq!(ports[0].counters, vec![("link_downed".to_owned(), 3)]);
}

#[test]
fn xids_are_counted_by_gpu_and_code_as_the_log_grows() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("dev")).expect("mkdir");
    let log = dir.path().join("dev/kmsg");
    std::fs::write(&log, "3,100,5000,-;NVRM: Xid (PCI:0001:00:00): 79, pid=1, GPU has fallen off the bus.\n6,101,5001,-;eth0: up\n").expect("write");
    let mut tail = host::XidTail::new(dir.path());
    let first = tail.poll().expect("readable");
    assert_eq!(first.len(), 1);
    assert_eq!(
        (first[0].pci.as_str(), first[0].code, first[0].count),
        ("0001:00:00", 79, 1)
    );
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&log)
        .expect("open");
    f.write_all(b"3,102,6000,-;NVRM: Xid (PCI:0001:00:00): 79, pid=1, again\n3,103,6001,-;NVRM: Xid (PCI:0002:00:00): 48, DBE\n")
        .expect("append");
    let next = tail.poll().expect("readable");
    let counts: Vec<_> = next
        .iter()
        .map(|x| (x.pci.as_str(), x.code, x.count))
        .collect();
    assert_eq!(counts, vec![("0001:00:00", 79, 2), ("0002:00:00", 48, 1)]);

    let mut r = readings("nd96asr_v4");
    r.xids = Some(next);
    let text = expose::render(&r);
    assert!(
        text.contains("keel_gpu_xid_errors_total{gpu=\"0\",uuid=\"GPU-c32a35fe-9e40-50a0-a66a-4332f1a9a583\",pci=\"0001:00:00\",xid=\"79\"} 2\n"),
        "{text}"
    );
    assert!(host::XidTail::new(Path::new("/nonexistent"))
        .poll()
        .is_none());
}

#[test]
fn keel_check_lines_pass_through_and_nothing_else() {
    let mut r = readings("nd96asr_v4");
    r.check = Some(Ok("# HELP keel_check_overall x\n# TYPE keel_check_overall gauge\nkeel_check_overall{host=\"n\",sku=\"s\"} 2\nother_metric 1\n# HELP other y\n".into()));
    let text = expose::render(&r);
    assert!(
        text.contains("keel_exporter_check_readable 1\n# HELP keel_check_overall"),
        "{text}"
    );
    assert!(text.contains("keel_check_overall{host=\"n\",sku=\"s\"} 2\n"));
    assert!(
        !text.contains("other_metric") && !text.contains("# HELP other "),
        "{text}"
    );
    r.check = Some(Err("cannot read /x".into()));
    assert!(expose::render(&r).contains("keel_exporter_check_readable 0\n"));
}
