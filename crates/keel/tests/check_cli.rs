//! `keel check` on the machine fixtures: every check passes on a healthy
//! node and fails (or warns) on its own fault, injected into a copy of the
//! fixture at the lowest boundary (a sysfs/procfs file, a kernel-log line,
//! a recorded NVML reading).

mod common;

use std::path::Path;

use common::{keel, results, workspace, Node};
use serde_json::{json, Value};

/// Other checks a fault legitimately affects: a GPU gone from PCI is also
/// missing from its NUMA node.
const ALSO: &[(&str, &[&str])] = &[
    ("GPU_MISSING", &["topology"]),
    ("IB_DRIVER_MISSING", &["topology"]),
    ("IB_HCA_MISSING", &["topology"]),
];

/// Asserts that check `id` has a result with `status` and `code`, and that
/// no other check is worse than pass/skip (the fault is the only finding).
fn assert_fault(report: &Value, id: &str, status: &str, code: &str) {
    let also: &[&str] = ALSO
        .iter()
        .find(|(c, _)| *c == code)
        .map_or(&[], |(_, a)| a);
    let rs = results(report, id);
    assert!(
        rs.iter()
            .any(|r| r["status"] == status && r["code"] == code),
        "{id}: no {status}/{code} in {}",
        serde_json::to_string_pretty(&rs).unwrap_or_default()
    );
    for r in report["results"].as_array().expect("results") {
        if r["id"] != id && !also.iter().any(|a| r["id"] == *a) {
            assert!(
                r["status"] == "pass" || r["status"] == "skip",
                "{id} fault also affected {r}"
            );
        }
    }
}

#[test]
fn healthy_fixtures_pass_every_check() {
    for (fixture, sku) in [
        ("nd96asr_v4", "nd96asr_v4"),
        ("nd96isr_h100_v5", "nd96isr_h100_v5"),
    ] {
        let n = Node::new(fixture, sku);
        let (code, report, stderr) = n.run(&[]);
        assert_eq!(code, 0, "{fixture}: {stderr}");
        assert_eq!(report["status"], "pass");
        for r in report["results"].as_array().expect("results") {
            assert!(
                r["status"] == "pass" || r["status"] == "skip",
                "{fixture}: {r}"
            );
        }
        // Every passive check that applies to a GPU node reads a value.
        for id in [
            "gpu.count",
            "gpu.ecc_errors",
            "gpu.row_remap",
            "gpu.xid",
            "gpu.throttle",
            "gpu.pcie_link",
            "gpu.pcie_replay",
            "gpu.nvlink",
            "gpu.clocks",
            "ib.ports",
            "ib.flaps",
            "ib.peermem",
            "topology",
            "host.cpu",
            "host.memory",
            "host.nvme",
        ] {
            let rs = results(&report, id);
            assert!(
                !rs.is_empty() && rs.iter().all(|r| r["status"] == "pass"),
                "{fixture}: {id} {rs:?}"
            );
        }
        assert_eq!(
            report["summary"],
            format!("{} | Healthy", report["host"].as_str().unwrap_or_default())
        );
    }
}

type Inject = fn(&mut Node);

#[test]
fn every_check_fails_on_its_fault() {
    let cases: &[(&str, &str, &str, Inject)] = &[
        ("gpu.count", "fail", "GPU_MISSING", |n| {
            n.remove("sys/bus/pci/devices/000e:00:00.0")
        }),
        ("gpu.count", "fail", "GPU_MODEL_MISMATCH", |n| {
            n.profile("[gpu]\nmodel = \"H100\"\n[host]\ndisks = []\n")
        }),
        ("gpu.visible", "fail", "GPU_FELL_OFF_BUS", |n| {
            n.gpu(|v| {
                v["gpus"].as_array_mut().expect("gpus").pop();
            })
        }),
        ("gpu.persistence", "warn", "PERSISTENCE_OFF", |n| {
            n.gpu(|v| v["gpus"][2]["persistence_mode"] = json!(false))
        }),
        ("gpu.ecc_mode", "fail", "ECC_DISABLED", |n| {
            n.gpu(|v| v["gpus"][0]["ecc_enabled"] = json!(false))
        }),
        ("gpu.ecc_mode", "warn", "ECC_MODE_PENDING", |n| {
            n.gpu(|v| v["gpus"][0]["ecc_pending"] = json!(false))
        }),
        ("gpu.ecc_errors", "fail", "ECC_UNCORRECTABLE", |n| {
            n.gpu(|v| v["gpus"][3]["ecc"]["volatile_dram_uncorrected"] = json!(2))
        }),
        ("gpu.ecc_errors", "fail", "ECC_SRAM_CORRECTED", |n| {
            n.gpu(|v| v["gpus"][3]["ecc"]["aggregate_sram_corrected"] = json!(10_000))
        }),
        ("gpu.ecc_errors", "fail", "ECC_DRAM_AGGREGATE", |n| {
            n.gpu(|v| v["gpus"][3]["ecc"]["aggregate_dram_corrected"] = json!(20_000_000))
        }),
        ("gpu.row_remap", "fail", "ROW_REMAP_PENDING", |n| {
            n.gpu(|v| v["gpus"][5]["remapped_rows"]["pending"] = json!(true))
        }),
        ("gpu.row_remap", "fail", "ROW_REMAP_FAILURE", |n| {
            n.gpu(|v| v["gpus"][5]["remapped_rows"]["failure"] = json!(true))
        }),
        ("gpu.xid", "fail", "XID_FATAL", |n| {
            n.log(600.0, "NVRM: Xid (PCI:0003:00:00): 79, pid=4242, name=python, GPU has fallen off the bus.")
        }),
        ("gpu.xid", "warn", "XID", |n| {
            n.log(
                60.0,
                "NVRM: Xid (PCI:0003:00:00): 13, pid=4242, name=python, Graphics Exception",
            )
        }),
        ("gpu.throttle", "fail", "THROTTLE_HW", |n| {
            n.gpu(|v| v["gpus"][1]["throttle_reasons"] = json!(0x40))
        }),
        ("gpu.throttle", "warn", "THROTTLE_THERMAL", |n| {
            n.gpu(|v| v["gpus"][1]["throttle_reasons"] = json!(0x20))
        }),
        ("gpu.pcie_link", "fail", "PCIE_WIDTH_DEGRADED", |n| {
            n.gpu(|v| v["gpus"][4]["pcie"]["current_width"] = json!(8))
        }),
        ("gpu.pcie_link", "warn", "PCIE_GEN_DEGRADED", |n| {
            n.gpu(|v| {
                v["gpus"][4]["pcie"]["current_gen"] = json!(3);
                v["gpus"][4]["throttle_reasons"] = json!(0);
            })
        }),
        ("gpu.pcie_replay", "warn", "PCIE_REPLAY", |n| {
            n.gpu(|v| v["gpus"][6]["pcie"]["replay_counter"] = json!(500))
        }),
        ("gpu.nvlink", "fail", "NVLINK_DOWN", |n| {
            n.gpu(|v| v["gpus"][7]["nvlink_active"][4] = json!(false))
        }),
        ("gpu.nvlink", "unknown", "NVML_FIELD_UNREADABLE", |n| {
            n.gpu(|v| v["gpus"][7]["nvlink_active"] = json!(null))
        }),
        ("gpu.clocks", "warn", "CLOCKS_LEFT_SET", |n| {
            n.gpu(|v| v["gpus"][3]["clocks"]["app_graphics_mhz"] = json!(1410))
        }),
        ("gpu.clocks", "warn", "CLOCKS_LOWERED", |n| {
            n.gpu(|v| v["gpus"][3]["clocks"]["app_graphics_mhz"] = json!(900))
        }),
        ("gpu.clocks", "warn", "CLOCKS_LEFT_LOCKED", |n| {
            n.gpu(|v| v["gpus"][6]["clocks"]["graphics_mhz"] = json!(1410))
        }),
        ("gpu.clocks", "unknown", "NVML_FIELD_UNREADABLE", |n| {
            n.gpu(|v| v["gpus"][6]["clocks"] = json!(null))
        }),
        ("ib.ports", "fail", "IB_PORT_DOWN", |n| {
            n.write("sys/class/infiniband/mlx5_ib3/ports/1/state", "1: DOWN\n")
        }),
        ("ib.ports", "fail", "IB_RATE_LOW", |n| {
            n.write(
                "sys/class/infiniband/mlx5_ib3/ports/1/rate",
                "100 Gb/sec (4X EDR)\n",
            )
        }),
        ("ib.flaps", "fail", "IB_LINK_FLAPS", |n| {
            for i in 0..5 {
                n.log(
                    3600.0 * f64::from(i + 1),
                    "mlx5_core 0101:00:00.0 ib0: lost carrier",
                );
            }
        }),
        ("ib.peermem", "fail", "PEERMEM_MISSING", |n| {
            n.unload("nvidia_peermem");
        }),
        ("topology", "fail", "TOPOLOGY_MISMATCH", |n| {
            n.profile(
                "[[topology]]\nnuma_node = 0\ngpus = [\"0001:00:00.0\"]\n[host]\ndisks = []\n",
            )
        }),
        ("host.cpu", "fail", "CPU_MISMATCH", |n| {
            n.profile("[host]\ncores = 128\ndisks = []\n")
        }),
        ("host.memory", "fail", "MEMORY_LOW", |n| {
            n.profile("[host]\nmemory_gib = 1900\ndisks = []\n")
        }),
        ("host.swap", "warn", "SWAP_ENABLED", |n| {
            let m = std::fs::read_to_string(n.path("proc/meminfo")).expect("meminfo");
            n.write(
                "proc/meminfo",
                &m.replace("SwapTotal:             0 kB", "SwapTotal:       8388604 kB"),
            );
        }),
        ("host.disk", "fail", "DISK_FULL", |n| {
            n.profile("[host]\ndisks = [{ mount = \"/\", min_free_gib = 1e12 }]\n")
        }),
        // The recording's free space, whatever the disk it lies on has.
        ("host.disk", "fail", "DISK_FULL", |n| {
            n.profile("[host]\ndisks = [{ mount = \"/\", min_free_gib = 1 }]\n");
            n.write(
                "statvfs.json",
                r#"{"schema": 1, "free_bytes": {"/": 536870912}}"#,
            )
        }),
        ("host.disk", "unknown", "DISK_UNREADABLE", |n| {
            n.profile("[host]\ndisks = [{ mount = \"/\", min_free_gib = 1 }]\n");
            n.write("statvfs.json", r#"{"schema": 1, "free_bytes": {}}"#)
        }),
        ("host.nvme", "fail", "NVME_MISSING", |n| {
            n.remove("sys/class/nvme/nvme7")
        }),
    ];
    for (id, status, code, inject) in cases {
        let mut n = Node::ndv4();
        inject(&mut n);
        let (exit, report, stderr) = n.run(&[]);
        assert_fault(&report, id, status, code);
        let want = match *status {
            "fail" => 2,
            "unknown" => 3,
            _ => 1,
        };
        assert_eq!(exit, want, "{id}/{code}: {stderr}");
    }
}

#[test]
fn leftover_gpu_processes_fail_only_when_the_node_should_be_idle() {
    let n = Node::ndv4();
    n.gpu(|v| {
        v["gpus"][0]["processes"] = json!([{"pid": 4242, "used_memory_bytes": 1073741824u64}])
    });
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 0);
    assert_eq!(results(&report, "gpu.processes")[0]["status"], "skip");
    let (code, report, _) = n.run(&["--expect-idle"]);
    assert_eq!(code, 2);
    assert_fault(&report, "gpu.processes", "fail", "GPU_PROCESSES_LEFT");
}

#[test]
fn old_xids_age_out_so_a_fixed_node_comes_back_healthy() {
    let n = Node::ndv4();
    n.log(1800.0, "NVRM: Xid (PCI:000b:00:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error");
    n.log(1700.0, "NVRM: Xid (PCI:000b:00:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error");
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 2);
    let xids = results(&report, "gpu.xid");
    assert_eq!(xids.len(), 1, "duplicates are merged: {xids:?}");
    assert_eq!(xids[0]["device"]["gpu"], 4);
    assert!(xids[0]["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("2 time(s)"));
    // Three hours later, with the GPU replaced, the window has passed.
    let up = n.uptime() + 3.0 * 3600.0;
    n.write("proc/uptime", &format!("{up:.2} 0.00\n"));
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 0, "{}", report["summary"]);
}

#[test]
fn checks_that_cannot_run_are_unknown_never_fail() {
    let n = Node::ndv4();
    n.remove("dev/kmsg");
    n.remove("proc/modules");
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 3);
    assert_eq!(results(&report, "gpu.xid")[0]["status"], "unknown");
    assert_eq!(results(&report, "ib.flaps")[0]["status"], "unknown");
    assert_eq!(results(&report, "ib.peermem")[0]["status"], "unknown");
    assert!(
        report["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("| UNKNOWN: gpu.xid:"),
        "{}",
        report["summary"]
    );

    let root_without_snapshot = n;
    // NVML counted a GPU it may not open (no permission, a job's device
    // cgroup): the GPU missing from its list is unknown, not fallen off the
    // bus. A lost GPU still fails.
    let n = Node::ndv4();
    n.gpu(|v| {
        v["gpus"].as_array_mut().expect("gpus").pop();
        v["unopened"] = json!([{"index": 7, "lost": false, "error": "Insufficient Permissions"}]);
    });
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 3, "{report}");
    assert_fault(&report, "gpu.visible", "unknown", "GPU_NOT_OPENED");
    n.gpu(|v| v["unopened"][0]["lost"] = json!(true));
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 2, "{report}");
    assert_fault(&report, "gpu.visible", "fail", "GPU_FELL_OFF_BUS");

    // Unreadable CPU topology is no count at all, not 0 sockets.
    let n = Node::ndv4();
    for cpu in 0..96 {
        n.remove(&format!(
            "sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"
        ));
    }
    let (_, report, _) = n.run(&[]);
    assert_fault(&report, "host.cpu", "unknown", "SYSFS_UNREADABLE");

    // No HCA in sysfs and no InfiniBand driver: cannot tell missing
    // hardware from a missing driver.
    let n = Node::ndv4();
    n.remove("sys/class/infiniband");
    let m = n.unload("ib_core");
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 3, "{report}");
    assert_fault(&report, "ib.ports", "unknown", "IB_DRIVER_MISSING");
    // With the driver loaded, no HCA is a failure.
    n.write("proc/modules", &m);
    let (code, report, _) = n.run(&[]);
    assert_eq!(code, 2, "{report}");
    assert_fault(&report, "ib.ports", "fail", "IB_HCA_MISSING");

    let n = root_without_snapshot;
    // A root without a GPU snapshot: NVML would describe this machine, not
    // the root's, so GPU readings are unknown and say why.
    let args: Vec<String> = [
        "--root",
        &n.root.display().to_string(),
        "--json",
        "check",
        "--sku",
        "nd96asr_v4",
        "--imds-endpoint",
        "127.0.0.1:1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (code, out, _) = keel(&args, &[]);
    assert_eq!(code, 3);
    let report: Value = serde_json::from_str(&out).expect("json");
    assert!(
        results(&report, "gpu.driver")[0]["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("pass --gpu-snapshot"),
        "{report}"
    );

    // The live machine with no NVML library: the GPU readings are unknown,
    // naming the library, and none of them fails.
    let args: Vec<String> = [
        "--json",
        "check",
        "--sku",
        "generic",
        "--imds-endpoint",
        "127.0.0.1:1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let fake_gpu = [("KEEL_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")];
    let (_, out, _) = keel(&args, &fake_gpu);
    let report: Value = serde_json::from_str(&out).expect("json");
    let driver = results(&report, "gpu.driver");
    // This machine may have no GPU at all: then there is nothing to read.
    if driver[0]["status"] != "skip" {
        assert_eq!(driver[0]["code"], "NVML_UNAVAILABLE", "{report}");
        assert!(driver[0]["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("/nonexistent/libnvidia-ml.so.1"));
        for r in report["results"].as_array().expect("results") {
            if r["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("gpu.") && id != "gpu.count")
            {
                assert_ne!(r["status"], "fail", "{r}");
            }
        }
    }
}

/// A GPU used alone (one H100 SXM in a VM, no NVSwitch) has every NVLink
/// link down: not a fault when the profile gives no link count. On a node
/// of several GPUs it is (a fabric down), and wherever the profile expects
/// links.
#[test]
fn nvlink_down_on_the_only_gpu_of_a_node_is_not_a_fault_without_a_count() {
    let all_down = |n: &Node| {
        n.gpu(|v| {
            for g in v["gpus"].as_array_mut().expect("gpus") {
                for l in g["nvlink_active"].as_array_mut().expect("links") {
                    *l = json!(false);
                }
            }
        })
    };
    let nvlink = |n: &Node| {
        let (_, report, stderr) = n.run(&[]);
        let rs: Vec<Value> = results(&report, "gpu.nvlink")
            .into_iter()
            .cloned()
            .collect();
        assert!(!rs.is_empty(), "{stderr}");
        rs
    };
    // Eight GPUs, generic profile, every link down: a fault.
    let n = Node::new("nd96isr_h100_v5", "generic");
    all_down(&n);
    assert!(nvlink(&n)
        .iter()
        .all(|r| r["status"] == "fail" && r["code"] == "NVLINK_DOWN"));
    // The same node's GPU 0 alone (the others gone from PCI and NVML).
    for i in 2..=8 {
        n.lose_gpu(&format!("000{i}:00:00.0"));
    }
    let rs = nvlink(&n);
    assert_eq!(rs.len(), 1, "{rs:?}");
    assert_eq!(rs[0]["status"], "skip", "{rs:?}");
    assert!(rs[0]["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("only GPU has none of its 18 NVLink links active"));
    // Some of its links up and some down is still a fault.
    n.gpu(|v| v["gpus"][0]["nvlink_active"][0] = json!(true));
    assert_eq!(nvlink(&n)[0]["code"], "NVLINK_DOWN");
    // A profile that expects 18 links fails the lone GPU with none.
    let mut n = Node::new("nd96isr_h100_v5", "generic");
    all_down(&n);
    for i in 2..=8 {
        n.lose_gpu(&format!("000{i}:00:00.0"));
    }
    n.profile("[host]\ndisks = []\n[gpu]\nnvlink_links = 18\n");
    assert_eq!(nvlink(&n)[0]["code"], "NVLINK_DOWN");
}

#[test]
fn replay_growth_uses_the_state_of_the_previous_run() {
    let n = Node::ndv4();
    n.gpu(|v| v["gpus"][6]["pcie"]["replay_counter"] = json!(500));
    let state = n.root.with_file_name("state");
    let s = state.display().to_string();
    let (code, _, _) = n.run(&["--state-dir", &s]);
    assert_eq!(code, 1, "500 replays since driver load warn");
    let (code, report, _) = n.run(&["--state-dir", &s]);
    assert_eq!(
        code, 0,
        "no growth since the last run: {}",
        report["summary"]
    );
    n.gpu(|v| v["gpus"][6]["pcie"]["replay_counter"] = json!(700));
    let (code, report, _) = n.run(&["--state-dir", &s]);
    assert_eq!(code, 1);
    assert_fault(&report, "gpu.pcie_replay", "warn", "PCIE_REPLAY");
}

fn redact(s: &str) -> String {
    s.lines()
        .map(|l| match l.find(" results in ") {
            Some(i) => format!("{} results in <ms>", &l[..i]),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn human_summary_json_and_prometheus_outputs() {
    let n = Node::ndv4();
    n.gpu(|v| v["gpus"][3]["ecc"]["volatile_dram_uncorrected"] = json!(2));
    n.log(600.0, "NVRM: Xid (PCI:0004:00:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error");
    let prom = n.root.with_file_name("keel.prom");
    let base = |json: bool, extra: &[&str]| n.check_args(json, extra);
    let (code, text, _) = keel(&base(false, &[]), &[]);
    assert_eq!(code, 2);
    insta::assert_snapshot!("check-human-failing", redact(&text));
    let (_, text, _) = keel(&base(false, &["--verbose"]), &[]);
    assert!(
        text.lines()
            .filter(|l| l.starts_with("gpu.ecc_errors"))
            .count()
            == 8,
        "{text}"
    );
    let (code, text, _) = keel(&base(false, &["--summary"]), &[]);
    assert_eq!(code, 2);
    assert_eq!(
        text,
        "ndv4-0001 | ERROR: gpu.ecc_errors: GPU 3 (0004:00:00.0): 2 uncorrectable ECC errors since driver load (+1 more)\n"
    );
    let (_, json, _) = keel(
        &base(
            true,
            &["--prometheus-textfile", &prom.display().to_string()],
        ),
        &[],
    );
    let mut v: Value = serde_json::from_str(&json).expect("json");
    assert_eq!(v["version"], 1);
    v["duration_ms"] = json!(0);
    for r in v["results"].as_array_mut().expect("results") {
        r["duration_ms"] = json!(0);
    }
    let failing: Vec<&Value> = v["results"]
        .as_array()
        .expect("r")
        .iter()
        .filter(|r| r["status"] != "pass" && r["status"] != "skip")
        .collect();
    insta::assert_snapshot!(
        "check-json-failing-results",
        serde_json::to_string_pretty(&failing).expect("json")
    );
    let prom = std::fs::read_to_string(&prom).expect("textfile written");
    assert!(prom.contains("keel_check_status{check=\"gpu.ecc_errors\",host=\"ndv4-0001\",device=\"GPU 3 (0004:00:00.0)\",code=\"ECC_UNCORRECTABLE\"} 2"), "{prom}");
    assert!(
        prom.contains("keel_check_overall{host=\"ndv4-0001\",sku=\"nd96asr_v4\"} 2"),
        "{prom}"
    );
    assert!(!prom.contains("NaN"));
}

#[test]
fn healthy_human_output() {
    for (fixture, sku) in [
        ("nd96asr_v4", "nd96asr_v4"),
        ("nd96isr_h100_v5", "nd96isr_h100_v5"),
        ("cpu-only", "generic"),
    ] {
        let n = Node::new(fixture, sku);
        let args = n.check_args(false, &[]);
        let (code, text, err) = keel(&args, &[]);
        assert_eq!(code, 0, "{err}");
        insta::assert_snapshot!(format!("check-human-{fixture}"), redact(&text));
    }
}

#[test]
fn sku_selection_flag_imds_gpus_generic() {
    let n = Node::ndv4();
    let pf = n.root.with_file_name("profile.toml");
    std::fs::write(&pf, &n.profile).expect("profile");
    let root = n.root.display().to_string();
    let pf = pf.display().to_string();
    let run = |extra: &[&str]| {
        let a = n.bare_check_args(true, &[&["--profile-file", &pf][..], extra].concat());
        let (_, out, err) = keel(&a, &[]);
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {err}"));
        (
            v["sku"].as_str().unwrap_or_default().to_owned(),
            v["sku_source"].as_str().unwrap_or_default().to_owned(),
        )
    };
    // A local IMDS answering with a vmSize.
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let server = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = [0u8; 2048];
        let _ = s.read(&mut buf);
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nStandard_ND96asr_v4");
    });
    assert_eq!(
        run(&["--imds-endpoint", &addr]),
        ("nd96asr_v4".into(), "imds (Standard_ND96asr_v4)".into())
    );
    server.join().expect("imds server");
    assert_eq!(run(&["--imds-endpoint", "127.0.0.1:1"]).0, "nd96asr_v4");
    assert!(run(&["--imds-endpoint", "127.0.0.1:1"])
        .1
        .starts_with("gpus (8x NVIDIA A100-SXM4-40GB)"));
    assert_eq!(
        run(&["--sku", "generic", "--imds-endpoint", "127.0.0.1:1"]),
        ("generic".into(), "flag".into())
    );
    let (code, _, err) = keel(
        &[
            "--root".into(),
            root.clone(),
            "check".into(),
            "--sku".into(),
            "nd96".into(),
        ],
        &[],
    );
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("unknown SKU \"nd96\""), "{err}");
    // A --node Slurm would read as several nodes is refused before any check.
    for bad in ["n[1-2]", "n1,n2", "-n1", ""] {
        let (code, _, err) = keel(
            &[
                "--root".into(),
                root.clone(),
                "check".into(),
                "--slurm".into(),
                format!("--node={bad}"),
            ],
            &[],
        );
        assert_eq!(code, 64, "{bad:?}: {err}");
        assert!(err.contains("invalid node name"), "{bad:?}: {err}");
    }
}

#[test]
fn config_precedence_defaults_file_env_flags() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cfg = tmp.path().join("keel.toml");
    std::fs::write(
        &cfg,
        "[check]\nsku = \"nd96asr_v4\"\nslurm_timeout_s = 4.0\nimds_timeout_ms = 250\n",
    )
    .expect("write");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = vec!["--json".into(), "check".into(), "--print-config".into()];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let c = cfg.display().to_string();
    let (_, out, _) = keel(&args(&["--config", &c]), &[]);
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["check"]["sku"], "nd96asr_v4");
    assert_eq!(v["check"]["imds_timeout_ms"], 250);
    assert_eq!(v["check"]["read_timeout_s"], 10.0);
    let (_, out, _) = keel(
        &args(&[]),
        &[("KEEL_CONFIG", &c), ("KEEL_SKU", "nd96isr_h100_v5")],
    );
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["check"]["sku"], "nd96isr_h100_v5");
    assert_eq!(v["check"]["slurm_timeout_s"], 4.0);
    let (_, out, _) = keel(
        &args(&["--sku", "generic"]),
        &[("KEEL_CONFIG", &c), ("KEEL_SKU", "nd96isr_h100_v5")],
    );
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["check"]["sku"], "generic");
    std::fs::write(&cfg, "[check]\nsku = 3\n").expect("write");
    let (code, _, err) = keel(&args(&["--config", &c]), &[]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("invalid config file"), "{err}");
}

#[test]
fn profiles_list_and_record_without_nvml() {
    let (code, out, _) = keel(&["check".into(), "profiles".into()], &[]);
    assert_eq!(code, 0);
    insta::assert_snapshot!("check-profiles", out);
    let (code, out, _) = keel(
        &["check".into(), "profiles".into(), "nd96isr_h100_v5".into()],
        &[],
    );
    assert_eq!(code, 0);
    assert!(out.contains("nvlink_links = 18"), "{out}");
    let (code, out, _) = keel(&["check".into(), "list".into()], &[]);
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 24, "{out}");
    let tmp = tempfile::tempdir().expect("tempdir");
    let f = tmp.path().join("snap.json").display().to_string();
    let (code, _, err) = keel(
        &["check".into(), "record".into(), "--out".into(), f.clone()],
        &[("KEEL_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")],
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("NVML is unavailable"), "{err}");
    assert!(!Path::new(&f).exists(), "nothing half-written");
}

#[test]
fn fleet_merge_flags_failing_nodes_and_outliers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("reports");
    std::fs::create_dir(&dir).expect("mkdir");
    // Three healthy nodes and one with a GPU fault; node b's memory sits
    // below the fleet's.
    for (name, mem, fault) in [
        ("a", None, false),
        ("b", Some(860), false),
        ("c", None, false),
        ("d", None, true),
    ] {
        let n = Node::ndv4();
        n.write("proc/sys/kernel/hostname", &format!("node-{name}\n"));
        if let Some(gib) = mem {
            let m = std::fs::read_to_string(n.path("proc/meminfo")).expect("meminfo");
            let total = m.lines().next().expect("line").to_owned();
            n.write(
                "proc/meminfo",
                &m.replace(&total, &format!("MemTotal:       {} kB", gib * 1024 * 1024)),
            );
        }
        if fault {
            n.gpu(|v| v["gpus"][1]["remapped_rows"]["failure"] = json!(true));
        }
        let (_, report, _) = n.run(&[]);
        std::fs::write(dir.join(format!("{name}.json")), report.to_string()).expect("write");
    }
    let (code, out, err) = keel(
        &[
            "check".into(),
            "merge".into(),
            "--outlier-pct".into(),
            "3".into(),
            dir.display().to_string(),
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    insta::assert_snapshot!("check-merge", out);
    std::fs::write(dir.join("junk.json"), "{}").expect("write");
    let (code, _, err) = keel(
        &["check".into(), "merge".into(), dir.display().to_string()],
        &[],
    );
    assert_eq!(code, 65, "{err}");
    assert!(
        err.contains("junk.json is not a keel check --json report"),
        "{err}"
    );
}

#[test]
fn a_file_that_cannot_be_written_does_not_hide_the_report() {
    // /proc refuses new files: the state file and the Prometheus textfile
    // cannot be written. The report is still printed (and a Slurm step
    // would still run); the error follows, and a failed node stays failed.
    let n = Node::ndv4();
    let (code, report, err) = n.run(&["--state-dir", "/proc/keel-no-such-dir"]);
    assert_eq!(code, 74, "{err}");
    assert_eq!(report["status"], "pass", "{report}");
    assert!(err.contains("cannot write the state file"), "{err}");

    n.remove("sys/bus/pci/devices/000e:00:00.0");
    let (code, report, err) = n.run(&["--prometheus-textfile", "/proc/keel.prom"]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(report["status"], "fail", "{report}");
    assert!(
        err.contains("cannot write the Prometheus textfile"),
        "{err}"
    );
}

#[test]
fn a_node_that_lost_a_gpu_from_the_bus_fails_once_its_gpu_count_is_configured() {
    // One of the eight A100s is gone from PCI and from NVML: counted from
    // what the node shows, the node looks like a healthy 7-GPU machine.
    let mut n = Node::ndv4();
    n.profile("[host]\ndisks = []\n");
    n.lose_gpu("000e:00:00.0");
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let a = n.bare_check_args(
            true,
            &[&["--imds-endpoint", "127.0.0.1:1"][..], extra].concat(),
        );
        keel(&a, env)
    };
    let judged = |out: &(i32, String, String)| {
        let v: Value =
            serde_json::from_str(&out.1).unwrap_or_else(|e| panic!("{e}: {} {}", out.1, out.2));
        let count = results(&v, "gpu.count")[0].clone();
        (
            v["sku"].as_str().unwrap_or_default().to_owned(),
            v["sku_source"].as_str().unwrap_or_default().to_owned(),
            count["status"].as_str().unwrap_or_default().to_owned(),
            count["code"].as_str().unwrap_or_default().to_owned(),
        )
    };
    let snap_gpus: Value =
        serde_json::from_str(&std::fs::read_to_string(n.path("gpu.json")).expect("read"))
            .expect("json");
    assert_eq!(snap_gpus["gpus"].as_array().map(Vec::len), Some(7));

    let (sku, _, status, _) = judged(&run(&[], &[]));
    assert_eq!((sku.as_str(), status.as_str()), ("generic", "pass"));

    let out = run(&["--gpus", "8"], &[]);
    let (sku, source, status, code) = judged(&out);
    assert_eq!(sku, "nd96asr_v4", "{source}");
    assert!(source.contains("7 found, check.gpus = 8"), "{source}");
    assert_eq!((status.as_str(), code.as_str()), ("fail", "GPU_MISSING"));
    assert_eq!(out.0, 2, "{}", out.2);

    // The same from the environment, and with the generic profile.
    let (_, _, status, code) = judged(&run(&["--sku", "generic"], &[("KEEL_GPUS", "8")]));
    assert_eq!((status.as_str(), code.as_str()), ("fail", "GPU_MISSING"));

    for (extra, env) in [
        (&["--gpus", "eight"][..], &[][..]),
        (&["--gpus=-1"][..], &[][..]),
        (&[][..], &[("KEEL_GPUS", "100000")][..]),
    ] {
        let (code, out, err) = run(extra, env);
        assert_eq!(code, 64, "{extra:?} {env:?}: {out} {err}");
        assert!(err.contains("whole number of GPUs"), "{err}");
    }
}

/// keel check on a recorded real machine gives the verdicts it gave there,
/// live: every fixture imported with `scripts/import-fixture` (it has a
/// `check-live.json`) is replayed, and so is the machine the tests run on,
/// recorded and imported the same way first.
#[test]
fn recorded_machines_check_as_they_did_live() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let no_imds = ("KEEL_IMDS_ENDPOINT", "127.0.0.1:1");
    let tmp = tempfile::tempdir().expect("tempdir");
    let rec = tmp.path().join("recording");
    let snap = rec.join("snap");
    let (code, _, err) = keel(
        &s(&["topo", "snapshot", "--out", &snap.to_string_lossy()]),
        &[],
    );
    assert_eq!(code, 0, "{err}");
    // On a GPU machine the snapshot holds the processes that have a GPU
    // open, their fd/ links absolute (as recorded on an H200).
    let fd = snap.join("proc/4242/fd");
    std::fs::create_dir_all(&fd).expect("mkdir");
    std::os::unix::fs::symlink("/dev/nvidia0", fd.join("3")).expect("symlink");
    // A GPU machine's GPUs too; none here is fine (exit 3, no NVML).
    let (code, _, err) = keel(
        &s(&[
            "check",
            "record",
            "--out",
            &snap.join("gpu.json").to_string_lossy(),
        ]),
        &[],
    );
    assert!(code == 0 || code == 3, "{err}");
    let (_, live, err) = keel(&s(&["--json", "check"]), &[no_imds]);
    assert!(live.contains("\"results\""), "{err}");
    std::fs::write(rec.join("check.json"), &live).expect("write");
    let into = tmp.path().join("fixtures");
    std::fs::create_dir(&into).expect("mkdir");
    let out = std::process::Command::new(workspace().join("scripts/import-fixture"))
        .arg("--into")
        .arg(&into)
        .arg(&snap)
        .arg(rec.join("check.json"))
        .arg("this-machine")
        .arg("The machine the tests run on.")
        .output()
        .expect("run scripts/import-fixture");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut machines = vec![into.join("this-machine")];
    for e in std::fs::read_dir(workspace().join("tests/fixtures")).expect("fixtures") {
        let dir = e.expect("entry").path();
        if dir.join("check-live.json").is_file() {
            machines.push(dir);
        }
    }
    let verdicts = |report: &Value| -> Vec<(String, String)> {
        report["results"]
            .as_array()
            .expect("results")
            .iter()
            .map(|r| {
                let f = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
                (f("id"), f("status"))
            })
            .collect()
    };
    for dir in machines {
        let live: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("check-live.json")).expect("check-live.json"),
        )
        .expect("check-live.json is JSON");
        let root = dir.to_string_lossy().into_owned();
        let sku = live["sku"].as_str().expect("sku").to_owned();
        let mut args = s(&["--json", "check", "--root", &root, "--sku", &sku]);
        let gpu = dir.join("gpu.json");
        if gpu.is_file() {
            args.extend(s(&["--gpu-snapshot", &gpu.to_string_lossy()]));
        }
        let (_, out, err) = keel(&args, &[no_imds]);
        let replayed: Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{root}: {e}: {out}{err}"));
        assert_eq!(
            verdicts(&replayed),
            verdicts(&live),
            "{root}: replayed (left) against live (right)"
        );
        assert_eq!(replayed["host"], live["host"], "{root}: host name");
        for r in live["results"].as_array().expect("results") {
            if let Some(serial) = r["device"]["serial"].as_str() {
                assert!(
                    serial.starts_with("redacted-"),
                    "{root}: a GPU serial number kept: {serial}"
                );
            }
        }
    }
}
