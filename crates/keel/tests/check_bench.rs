//! `keel check --bench`: `keel bench --json` results judged against the
//! SKU profile (the active tier). The reports are built from keel-bench's
//! own types, so a renamed field breaks this test rather than the check.

mod common;

use common::{keel, results, Node};
use keel_bench::copy::{CopyReport, GpuCopy, PeerCopy};
use keel_bench::gemm::{GemmReport, GpuGemm, SmallCheck};
use keel_bench::nccl::{Placement, Row};
use keel_bench::stats::Summary;
use serde_json::{json, Value};

fn summary(v: f64) -> Summary {
    Summary::of(&[v * 0.99, v, v * 1.01]).expect("summary")
}

fn envelope(command: &str, body: Value) -> Value {
    let mut doc = json!({"version": 1, "command": command});
    for (k, v) in body.as_object().expect("object") {
        doc[k] = v.clone();
    }
    doc
}

/// A copy report for the 8 H100s of the fixture, GPU 5 at `h2d_5` GB/s.
fn copy(h2d_5: f64) -> Value {
    let gpus = (0..8)
        .map(|g| GpuCopy {
            gpu: g,
            name: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: format!("{:04x}:00:00.0", g + 1),
            numa_node: Some(if g < 4 { 0 } else { 1 }),
            cpus: Some(if g < 4 { "0-47" } else { "48-95" }.into()),
            pinned: true,
            note: None,
            h2d_gbs: summary(if g == 5 { h2d_5 } else { 53.0 }),
            d2h_gbs: summary(52.5),
            d2d_gbs: summary(2950.0),
        })
        .collect();
    let peer = vec![PeerCopy {
        src: 0,
        dst: 1,
        p2p: true,
        gbs: summary(370.0),
    }];
    let r = CopyReport {
        bytes: 1 << 30,
        iters: 20,
        warmup: 3,
        gpus,
        peer,
    };
    envelope("bench copy", serde_json::to_value(r).expect("json"))
}

fn gemm(mismatched: usize) -> Value {
    let gpus = (0..8)
        .map(|g| GpuGemm {
            gpu: g,
            name: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: format!("{:04x}:00:00.0", g + 1),
            cublas_version: 120_900,
            tflops: summary(760.0),
            peak_tflops: Some(989.0),
            fraction_of_peak: Some(0.77),
            repetitions: 50,
            products_per_repetition: 1,
            mismatched_repetitions: if g == 2 { mismatched } else { 0 },
            check: SmallCheck {
                m: 96,
                n: 80,
                k: 112,
                relative_error: 2e-3,
                tolerance: 1e-2,
                passed: true,
            },
            seconds: 10.0,
            passed: mismatched == 0 || g != 2,
        })
        .collect();
    let r = GemmReport {
        dtype: "bf16",
        m: 8192,
        n: 8192,
        k: 8192,
        gpus,
    };
    envelope("bench gemm", serde_json::to_value(r).expect("json"))
}

fn allreduce(busbw: f64) -> Value {
    let place = Placement {
        time_us: 21495.0,
        algbw: busbw / 1.75,
        busbw,
        wrong: Some(0),
    };
    let row = Row {
        bytes: 2_147_483_648,
        count: 536_870_912,
        dtype: "float",
        redop: "sum",
        root: -1,
        out_of_place: place,
        in_place: place,
    };
    json!({"version": 1, "command": "bench nccl", "collective": "all-reduce", "ranks": 8, "out_of_bounds": 0,
           "rows": [serde_json::to_value(row).expect("json")]})
}

fn run(n: &Node, docs: &[Value]) -> (i32, Value) {
    let dir = n.root.with_file_name("bench");
    std::fs::create_dir_all(&dir).expect("mkdir");
    for (i, d) in docs.iter().enumerate() {
        std::fs::write(dir.join(format!("{i}.json")), d.to_string()).expect("write");
    }
    let d = dir.display().to_string();
    let (code, out, err) = keel(&n.check_args(true, &["--bench", &d]), &[]);
    (
        code,
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}")),
    )
}

#[test]
fn healthy_bench_results_pass_with_values() {
    let n = Node::new("nd96isr_h100_v5", "nd96isr_h100_v5");
    let (code, report) = run(&n, &[copy(53.0), gemm(0), allreduce(490.0)]);
    assert_eq!(code, 0, "{}", report["summary"]);
    for id in [
        "bench.h2d",
        "bench.d2h",
        "bench.hbm",
        "bench.peer",
        "bench.gemm",
        "bench.nccl",
    ] {
        let rs = results(&report, id);
        assert!(
            !rs.is_empty()
                && rs
                    .iter()
                    .all(|r| r["status"] == "pass" && r["tier"] == "active"),
            "{id}: {rs:?}"
        );
    }
    assert_eq!(results(&report, "bench.h2d").len(), 8);
    assert_eq!(results(&report, "bench.hbm")[0]["value"], 2.95);
}

#[test]
fn slow_copies_corruption_and_low_busbw_fail_against_the_profile() {
    let n = Node::new("nd96isr_h100_v5", "nd96isr_h100_v5");
    let (code, report) = run(&n, &[copy(40.0)]);
    assert_eq!(code, 2);
    let slow: Vec<&Value> = results(&report, "bench.h2d")
        .into_iter()
        .filter(|r| r["status"] == "fail")
        .collect();
    assert_eq!(slow.len(), 1);
    assert_eq!(slow[0]["device"]["gpu"], 5);
    assert_eq!(slow[0]["code"], "BENCH_BELOW_THRESHOLD");
    assert_eq!(slow[0]["threshold"], ">= 48");

    let (code, report) = run(&n, &[copy(49.0)]);
    assert_eq!(code, 1, "within 5% of the floor warns");
    assert!(results(&report, "bench.h2d")
        .iter()
        .any(|r| r["code"] == "BENCH_NEAR_THRESHOLD"));

    let (code, report) = run(&n, &[gemm(3)]);
    assert_eq!(code, 2);
    let bad = results(&report, "bench.gemm")
        .into_iter()
        .find(|r| r["status"] == "fail")
        .expect("fail");
    assert_eq!(bad["code"], "GEMM_MISMATCH");
    assert_eq!(bad["device"]["gpu"], 2);

    let (code, report) = run(&n, &[allreduce(400.0)]);
    assert_eq!(code, 2);
    assert!(
        report["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("bench.nccl"),
        "{}",
        report["summary"]
    );
}

#[test]
fn a_file_that_is_not_a_bench_report_is_an_error() {
    let n = Node::new("nd96isr_h100_v5", "nd96isr_h100_v5");
    let dir = n.root.with_file_name("bench");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(
        dir.join("x.json"),
        r#"{"version": 1, "command": "topo show"}"#,
    )
    .expect("write");
    let d = dir.display().to_string();
    let (code, _, err) = keel(&n.check_args(true, &["--bench", &d]), &[]);
    assert_eq!(code, 65, "{err}");
    assert!(
        err.contains("x.json is not `keel bench --json` output"),
        "{err}"
    );
}
