//! `keel check --slurm` against the real Slurm test cluster
//! (`scripts/slurm-cluster`): a node is drained on an injected fault,
//! resumed once it is fixed, an administrator's drain is left alone, and a
//! hung controller does not hold the check beyond its timeout. States are
//! read back through Slurm itself (raw `sinfo`).
//!
//! `scripts/test` starts the cluster and runs these one at a time (nextest
//! group `slurm`).

mod common;

use std::time::{Duration, Instant};

use common::{keel, results, Node};
use keel_testkit::SlurmCluster;
use serde_json::{json, Value};

/// Runs `keel check --slurm` for `node` on the fixture copy `n`.
fn check_slurm(
    cluster: &SlurmCluster,
    n: &Node,
    node: &str,
    extra: &[&str],
) -> (i32, Value, String) {
    let mut with_slurm = vec!["--slurm", "--node", node];
    with_slurm.extend_from_slice(extra);
    let args = n.check_args(true, &with_slurm);
    let conf = cluster.conf().display().to_string();
    let (code, out, err) = keel(&args, &[("SLURM_CONF", &conf)]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    (code, v, err)
}

fn ecc_fault(n: &Node) {
    n.gpu(|v| v["gpus"][3]["ecc"]["volatile_dram_uncorrected"] = json!(2));
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_faulty_node_is_drained_and_resumed_once_fixed() {
    let cluster = SlurmCluster::get();
    let node = cluster.node(1).to_owned();
    let _restore = cluster.restore_on_drop(&node);
    let n = Node::ndv4();
    ecc_fault(&n);
    let (code, v, err) = check_slurm(&cluster, &n, &node, &[]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(v["slurm"]["action"], "drain", "{v}");
    let raw = cluster.raw_node(&node).expect("sinfo");
    assert!(raw.state.starts_with("drain"), "{raw:?}");
    assert_eq!(
        raw.reason,
        "keel: gpu.ecc_errors: GPU 3 (0004:00:00.0): 2 uncorrectable ECC errors since driver load"
    );

    // The same fault again: the identical reason is not rewritten.
    let before = cluster.raw_node(&node).expect("sinfo");
    std::thread::sleep(Duration::from_millis(1100));
    let (_, v, _) = check_slurm(&cluster, &n, &node, &[]);
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    assert_eq!(
        cluster.raw_node(&node).expect("sinfo").reason_time,
        before.reason_time
    );

    // The GPU is replaced: the next run resumes the node keel drained.
    let fixed = Node::ndv4();
    let (code, v, err) = check_slurm(&cluster, &fixed, &node, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["slurm"]["action"], "resume", "{v}");
    let raw = cluster.raw_node(&node).expect("sinfo");
    assert!(!raw.state.contains("drain"), "{raw:?}");
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_node_that_lost_a_gpu_is_judged_by_its_gres_count() {
    let cluster = SlurmCluster::get();
    // The cluster's last node has Gres=gpu:8 in slurm.conf; the others none.
    let node = cluster.node(2).to_owned();
    let plain = cluster.node(0).to_owned();
    let _restore = cluster.restore_on_drop(&node);
    // An A100 node off Azure (no IMDS, the generic profile) with one of
    // its eight GPUs gone from PCI and from NVML.
    let mut n = Node::ndv4();
    n.sku = "generic";
    n.lose_gpu("000e:00:00.0");
    let gpu_count = |v: &Value| {
        let r = results(v, "gpu.count")[0];
        (
            r["status"].as_str().unwrap_or_default().to_owned(),
            r["code"].as_str().unwrap_or_default().to_owned(),
        )
    };
    // Without a count from anywhere, seven GPUs look healthy.
    let (code, v, err) = n.run(&[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(gpu_count(&v).0, "pass", "{v}");
    // On a node whose Gres has no GPUs, the same.
    let (code, v, err) = check_slurm(&cluster, &n, &plain, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    // Slurm says the node has eight: the GPU is missing, and the node
    // is drained for it.
    let (code, v, err) = check_slurm(&cluster, &n, &node, &[]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(gpu_count(&v), ("fail".into(), "GPU_MISSING".into()), "{v}");
    assert_eq!(v["slurm"]["action"], "drain", "{v}");
    let raw = cluster.raw_node(&node).expect("sinfo");
    assert!(raw.state.starts_with("drain"), "{raw:?}");
    assert!(raw.reason.starts_with("keel: gpu.count: "), "{raw:?}");
    // check.gpus, where set, is the count: the next run resumes the node.
    let (code, v, err) = check_slurm(&cluster, &n, &node, &["--gpus", "7"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(gpu_count(&v).0, "pass", "{v}");
    assert_eq!(v["slurm"]["action"], "resume", "{v}");
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn an_administrators_drain_is_left_alone() {
    let cluster = SlurmCluster::get();
    let node = cluster.node(2).to_owned();
    let _restore = cluster.restore_on_drop(&node);
    cluster
        .admin_drain(&node, "maintenance: reseat DIMM B2")
        .expect("admin drain");
    // Healthy: keel does not resume a node it did not drain.
    let (code, v, _) = check_slurm(&cluster, &Node::ndv4(), &node, &[]);
    assert_eq!(code, 0);
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    // Faulty: keel does not overwrite someone else's reason.
    let n = Node::ndv4();
    ecc_fault(&n);
    let (code, v, _) = check_slurm(&cluster, &n, &node, &[]);
    assert_eq!(code, 2);
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    let raw = cluster.raw_node(&node).expect("sinfo");
    assert!(raw.state.starts_with("drain"), "{raw:?}");
    assert_eq!(raw.reason, "maintenance: reseat DIMM B2");
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_drain_by_a_check_that_did_not_run_is_kept() {
    let cluster = SlurmCluster::get();
    let node = cluster.node(1).to_owned();
    let _restore = cluster.restore_on_drop(&node);
    // As a validation job's `keel check --bench` leaves it: drained for a
    // GEMM mismatch, a check the passive health check does not run.
    let reason = "keel: bench.gemm: GEMM results differ from the reference";
    cluster.admin_drain(&node, reason).expect("drain");
    let (code, v, _) = check_slurm(&cluster, &Node::ndv4(), &node, &[]);
    assert_eq!(code, 0);
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    let raw = cluster.raw_node(&node).expect("sinfo");
    assert!(raw.state.starts_with("drain"), "{raw:?}");
    assert_eq!(raw.reason, reason);
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn unknown_never_drains_unless_fail_closed() {
    let cluster = SlurmCluster::get();
    let node = cluster.node(0).to_owned();
    let _restore = cluster.restore_on_drop(&node);
    let n = Node::ndv4();
    n.remove("dev/kmsg");
    let (code, v, _) = check_slurm(&cluster, &n, &node, &[]);
    assert_eq!(code, 3);
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    assert!(!cluster
        .raw_node(&node)
        .expect("sinfo")
        .state
        .contains("drain"));
    let (code, v, _) = check_slurm(&cluster, &n, &node, &["--fail-closed"]);
    assert_eq!(code, 3);
    assert_eq!(v["slurm"]["action"], "drain", "{v}");
    let raw = cluster.raw_node(&node).expect("sinfo");
    assert!(raw.reason.starts_with("keel: gpu.xid: "), "{raw:?}");
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_hung_controller_does_not_hold_the_check() {
    let cluster = SlurmCluster::get();
    let node = cluster.node(0).to_owned();
    let _restore = cluster.restore_on_drop(&node);
    let n = Node::ndv4();
    ecc_fault(&n);
    // Every call of Slurm's commands goes through a shim that logs it, so
    // the test counts the calls instead of timing them.
    let shim = tempfile::tempdir().expect("tempdir");
    let calls = shim.path().join("calls");
    for tool in ["scontrol", "sinfo"] {
        let real = cluster.command("sh", &["-c", &format!("command -v {tool}")]);
        let real = real.expect("which").trim().to_owned();
        let path = shim.path().join(tool);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"{tool} $*\" >> '{}'\nexec '{real}' \"$@\"\n",
                calls.display()
            ),
        )
        .expect("write shim");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
    }
    let path = format!(
        "{}:{}",
        shim.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let paused = cluster.pause_controller().expect("SIGSTOP slurmctld");
    let start = Instant::now();
    let args = ["--slurm", "--node", node.as_str(), "--slurm-timeout", "3"];
    let conf = cluster.conf().display().to_string();
    let (code, out, err) = keel(
        &n.check_args(true, &args),
        &[("SLURM_CONF", &conf), ("PATH", &path)],
    );
    let took = start.elapsed();
    paused.resume().expect("SIGCONT slurmctld");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(code, 2, "the check's own verdict stands: {err}");
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    assert!(
        v["slurm"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("did not finish"),
        "{v}"
    );
    // One call, timed out: the node is read before the checks, and a
    // read that timed out is not tried again after them.
    let log = std::fs::read_to_string(&calls).expect("calls");
    assert_eq!(log.lines().count(), 1, "{log}");
    // Bounded: the 3 s timeout and the checks, not the controller's hang.
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(err.contains("did nothing"), "{err}");
    // Nothing queued behind the stopped controller drains the node later.
    cluster
        .wait_until_idle(Duration::from_secs(30))
        .expect("cluster back");
    std::thread::sleep(Duration::from_secs(1));
    assert!(!cluster
        .raw_node(&node)
        .expect("sinfo")
        .state
        .contains("drain"));
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn without_a_controller_the_check_says_so_and_does_nothing() {
    let cluster = SlurmCluster::get();
    let node = cluster.node(0).to_owned();
    let n = Node::ndv4();
    ecc_fault(&n);
    let stopped = cluster.stop_controller().expect("stop slurmctld");
    let start = Instant::now();
    let (code, v, _) = check_slurm(&cluster, &n, &node, &["--slurm-timeout", "3"]);
    let took = start.elapsed();
    stopped.restart().expect("restart slurmctld");
    assert_eq!(code, 2);
    assert_eq!(v["slurm"]["action"], "nothing", "{v}");
    assert!(v["slurm"]["error"].is_string(), "{v}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
}
