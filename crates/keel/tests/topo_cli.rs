//! `keel topo` end to end on the machine fixtures under tests/fixtures:
//! every command's human and JSON output is a reviewed snapshot.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn keel(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .current_dir(workspace())
        .env_remove("KEEL_ROOT")
        .output()
        .expect("run keel");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The transcript of one command, as stored in a snapshot.
fn transcript(args: &[&str]) -> (i32, String) {
    let r = keel(args);
    let mut s = format!("$ keel {}\n[exit {}]\n{}", args.join(" "), r.code, r.stdout);
    if !r.stderr.is_empty() {
        s.push_str("[stderr]\n");
        s.push_str(&r.stderr);
    }
    (r.code, s)
}

fn fixture(name: &str) -> String {
    format!("tests/fixtures/{name}")
}

const MACHINES: &[&str] = &["nd96asr_v4", "nd96isr_h100_v5", "dgx-a100", "cpu-only"];

#[test]
fn show_every_fixture() {
    for m in MACHINES {
        let root = fixture(m);
        let (code, text) = transcript(&["--root", &root, "topo", "show"]);
        assert_eq!(code, 0, "{text}");
        insta::assert_snapshot!(format!("show-{m}"), text);
        let (code, json) = transcript(&["--root", &root, "--json", "topo", "show"]);
        assert_eq!(code, 0, "{json}");
        insta::assert_snapshot!(format!("show-{m}-json"), json);
    }
}

#[test]
fn show_json_is_versioned_and_parses() {
    let r = keel(&["--root", &fixture("nd96asr_v4"), "--json", "topo", "show"]);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("valid JSON");
    assert_eq!(v["version"], 1);
    assert_eq!(v["command"], "topo show");
    assert_eq!(v["machine"]["gpus"].as_array().map(Vec::len), Some(8));
    // The seed's table: NUMA 0 -> GPUs 2,3; 1 -> 0,1; 2 -> 6,7; 3 -> 4,5.
    let numa: Vec<u64> = v["machine"]["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| g["numa_node"].as_u64().expect("numa node"))
        .collect();
    assert_eq!(numa, [1, 1, 0, 0, 3, 3, 2, 2]);
}

#[test]
fn plan_reproduces_the_ndv4_tuning_notes() {
    let r = keel(&[
        "--root",
        &fixture("nd96asr_v4"),
        "topo",
        "plan",
        "--launcher",
        "srun",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let expected = "srun --ntasks-per-node=8 --cpu-bind=mask_cpu:ffffff000000,ffffff000000,ffffff,ffffff,\
                    ffffff000000000000000000,ffffff000000000000000000,ffffff000000000000,ffffff000000000000";
    assert!(r.stdout.lines().any(|l| l == expected), "{}", r.stdout);

    let r = keel(&[
        "--root",
        &fixture("nd96asr_v4"),
        "topo",
        "plan",
        "--launcher",
        "mpirun",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains(
            "mpirun -x CUDA_VISIBLE_DEVICES=2,3,0,1,6,7,4,5 --map-by ppr:2:numa --bind-to core"
        ),
        "{}",
        r.stdout
    );
}

#[test]
fn plan_every_launcher_on_every_gpu_fixture() {
    for m in ["nd96asr_v4", "nd96isr_h100_v5", "dgx-a100"] {
        let root = fixture(m);
        for launcher in ["srun", "mpirun", "torchrun", "numactl"] {
            let (_, text) = transcript(&["--root", &root, "topo", "plan", "--launcher", launcher]);
            insta::assert_snapshot!(format!("plan-{m}-{launcher}"), text);
        }
    }
}

/// Splits a command line of the cases below into arguments.
fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

#[test]
fn plan_variants() {
    let cases = [
        ("ndv4-srun-explain", "--root tests/fixtures/nd96asr_v4 topo plan --launcher srun --explain"),
        ("ndv4-srun-12cpus", "--root tests/fixtures/nd96asr_v4 topo plan --launcher srun --cpus-per-rank 12"),
        ("ndv4-mpirun-pe", "--root tests/fixtures/nd96asr_v4 topo plan --launcher mpirun --cpus-per-rank 12 --explain"),
        ("ndv4-4ranks", "--root tests/fixtures/nd96asr_v4 topo plan --launcher srun --ranks-per-node 4"),
        ("ndv4-16ranks", "--root tests/fixtures/nd96asr_v4 topo plan --launcher srun --ranks-per-node 16 --cpus-per-rank 6"),
        ("dgx-smt-torchrun", "--root tests/fixtures/dgx-a100 topo plan --launcher torchrun --cpus-per-rank 6 --explain"),
        ("h100-json", "--root tests/fixtures/nd96isr_h100_v5 --json topo plan --launcher srun --cpus-per-rank 12"),
    ];
    for (name, line) in cases {
        let (code, text) = transcript(&words(line));
        assert_eq!(code, 0, "{text}");
        insta::assert_snapshot!(format!("plan-{name}"), text);
    }
}

#[test]
fn plan_refuses_without_guessing() {
    let cases = [
        (
            "no-gpu",
            "--root tests/fixtures/cpu-only topo plan --launcher srun",
            3,
        ),
        (
            "more-ranks-than-cpus",
            "--root tests/fixtures/nd96asr_v4 topo plan --launcher srun --ranks-per-node 128",
            64,
        ),
        (
            "too-many-cpus",
            "--root tests/fixtures/nd96asr_v4 topo plan --launcher srun --cpus-per-rank 13",
            64,
        ),
        (
            "uneven",
            "--root tests/fixtures/nd96asr_v4 topo plan --launcher srun --ranks-per-node 3",
            64,
        ),
        (
            "mpirun-gpu-less-numa",
            "--root tests/fixtures/dgx-a100 topo plan --launcher mpirun",
            64,
        ),
        (
            "bad-launcher",
            "--root tests/fixtures/nd96asr_v4 topo plan --launcher pdsh",
            64,
        ),
    ];
    for (name, line, expected) in cases {
        let (code, text) = transcript(&words(line));
        assert_eq!(code, expected, "{text}");
        insta::assert_snapshot!(format!("plan-refuses-{name}"), text);
    }
}

#[test]
fn verify_fixtures() {
    let cases = [
        (
            "ndv4-healthy",
            "--root tests/fixtures/nd96asr_v4 topo verify",
            0,
        ),
        (
            "ndv4-misbound",
            "--root tests/fixtures/nd96asr_v4-misbound topo verify",
            2,
        ),
        (
            "ndv4-misbound-json",
            "--root tests/fixtures/nd96asr_v4-misbound --json topo verify",
            2,
        ),
        (
            "ndv4-misbound-pid",
            "--root tests/fixtures/nd96asr_v4-misbound topo verify --pid 52005 52006",
            1,
        ),
        (
            "h100-healthy",
            "--root tests/fixtures/nd96isr_h100_v5 topo verify --all",
            0,
        ),
        (
            "cpu-only-nothing",
            "--root tests/fixtures/cpu-only topo verify",
            3,
        ),
        (
            "no-such-pid",
            "--root tests/fixtures/cpu-only topo verify --pid 4242",
            64,
        ),
    ];
    for (name, line, expected) in cases {
        let (code, text) = transcript(&words(line));
        assert_eq!(code, expected, "{text}");
        insta::assert_snapshot!(format!("verify-{name}"), text);
    }
}

#[test]
fn snapshot_reproduces_the_machine_and_strips_secrets() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for m in ["nd96asr_v4", "nd96asr_v4-misbound", "dgx-a100", "cpu-only"] {
        let out = tmp.path().join(m);
        let out_s = out.to_string_lossy().into_owned();
        let r = keel(&["--root", &fixture(m), "topo", "snapshot", "--out", &out_s]);
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        for cmd in [
            &["topo", "show"][..],
            &["topo", "verify"],
            &["topo", "plan", "--launcher", "numactl"],
        ] {
            let mut a: Vec<&str> = vec!["--json", "--root"];
            let original = fixture(m);
            a.push(&original);
            a.extend_from_slice(cmd);
            let before = keel(&a);
            a[2] = &out_s;
            let after = keel(&a);
            let strip = |s: &str, root: &str| s.replace(root, "<root>");
            assert_eq!(before.code, after.code, "{m} {cmd:?}");
            let (b, a) = (
                strip(&before.stdout, &original),
                strip(&after.stdout, &out_s),
            );
            if let Some((x, y)) = b.lines().zip(a.lines()).find(|(x, y)| x != y) {
                panic!("{m} {cmd:?}: the snapshot differs from the original:\n  original: {x}\n  snapshot: {y}");
            }
            assert_eq!(b.lines().count(), a.lines().count(), "{m} {cmd:?}");
        }
        // keel check reads the snapshot as it reads the machine: the same
        // verdicts and details (host files included), the GPUs from the
        // fixture's recorded NVML readings where it has them.
        let checks = |root: &str| {
            let gpu = Path::new(&fixture(m)).join("gpu.json");
            let gpu = gpu.to_string_lossy().into_owned();
            let mut a = vec!["--json", "check", "--root", root, "--sku", "generic"];
            if Path::new(&gpu).is_file() {
                a.extend(["--gpu-snapshot", &gpu]);
            }
            let r = keel(&a);
            let doc: serde_json::Value = serde_json::from_str(&r.stdout)
                .unwrap_or_else(|e| panic!("{m}: {e}: {}{}", r.stdout, r.stderr));
            let results: Vec<(String, String, String)> = doc["results"]
                .as_array()
                .expect("results")
                .iter()
                .map(|c| {
                    let s = |k: &str| c[k].as_str().unwrap_or_default().replace(root, "<root>");
                    // Free space is the file system the root is on, not a
                    // recorded value: the status only.
                    let detail = if s("id") == "host.disk" {
                        String::new()
                    } else {
                        s("detail")
                    };
                    (s("id"), s("status"), detail)
                })
                .collect();
            (r.code, doc["host"].clone(), results)
        };
        let (original, snapshot) = (checks(&fixture(m)), checks(&out_s));
        assert_eq!(original.0, snapshot.0, "{m}: exit codes");
        assert_eq!(original.1, snapshot.1, "{m}: host name");
        for (x, y) in original.2.iter().zip(&snapshot.2) {
            assert_eq!(x, y, "{m}: a check differs on the snapshot");
        }
        assert_eq!(original.2.len(), snapshot.2.len(), "{m}");
        // Only the launcher variables and argv[0] are copied.
        for entry in walk(&out) {
            let Ok(bytes) = std::fs::read(&entry) else {
                continue;
            };
            let text = String::from_utf8_lossy(&bytes);
            for secret in ["WANDB_API_KEY", "HF_TOKEN", "--lr", "PATH="] {
                assert!(!text.contains(secret), "{} leaks {secret}", entry.display());
            }
        }
    }
    // A second snapshot into the same directory is refused, not mixed in.
    let out = tmp.path().join("cpu-only");
    let r = keel(&[
        "--root",
        &fixture("cpu-only"),
        "topo",
        "snapshot",
        "--out",
        &out.to_string_lossy(),
    ]);
    assert_eq!(r.code, 64, "{}", r.stderr);
    assert!(
        r.stderr.contains("already exists and is not empty"),
        "{}",
        r.stderr
    );
}

/// The machine the tests run on, snapshotted: keel check on the snapshot
/// gives the verdicts it gives on the machine itself (the GPU-less side:
/// NVML is not asked under --root, and no GPU is expected).
#[test]
fn a_snapshot_of_this_machine_checks_as_the_machine() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let snap = tmp.path().join("snap");
    let snap_s = snap.to_string_lossy().into_owned();
    let r = keel(&["--root", "/", "topo", "snapshot", "--out", &snap_s]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    // Free space is no file: the snapshot records what statvfs said.
    let disks: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(snap.join("statvfs.json")).expect("statvfs.json"),
    )
    .expect("statvfs.json is JSON");
    assert!(disks["free_bytes"]["/"].is_u64(), "{disks}");
    let verdicts = |root: &str| {
        let r = keel(&[
            "--json", "check", "--root", root, "--sku", "generic", "--gpus", "0",
        ]);
        let doc: serde_json::Value = serde_json::from_str(&r.stdout)
            .unwrap_or_else(|e| panic!("{root}: {e}: {}{}", r.stdout, r.stderr));
        let v: Vec<(String, String)> = doc["results"]
            .as_array()
            .expect("results")
            .iter()
            .map(|c| {
                let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
                (s("id"), s("status"))
            })
            .filter(|(id, _)| !id.starts_with("gpu."))
            .collect();
        (r.code, v)
    };
    let (live, replayed) = (verdicts("/"), verdicts(&snap_s));
    assert!(!live.1.is_empty());
    assert_eq!(live, replayed);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if meta.is_dir() {
            out.extend(walk(&p));
        } else if meta.is_file() {
            out.push(p);
        }
    }
    out
}

#[test]
fn show_on_this_machine() {
    // The real host: whatever it is, keel reads it without error and sees at
    // least one CPU in at least one NUMA node.
    let r = keel(&["--json", "topo", "show"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("valid JSON");
    let cpus = v["machine"]["cpus"].as_str().expect("cpu list");
    assert!(!cpus.is_empty());
    assert!(!v["machine"]["numa_nodes"]
        .as_array()
        .expect("nodes")
        .is_empty());
    let r = keel(&["topo", "show"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn root_from_environment_and_usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["topo", "show"])
        .current_dir(workspace())
        .env("KEEL_ROOT", "tests/fixtures/cpu-only")
        .output()
        .expect("run keel");
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 socket, 1 NUMA node, 8 CPUs"));

    let (code, text) = transcript(&["topo", "frobnicate"]);
    assert_eq!(code, 64, "{text}");
    let (code, _) = transcript(&["--help"]);
    assert_eq!(code, 0);
}

#[test]
fn missing_root_is_a_clear_error() {
    let (code, text) = transcript(&["--root", "tests/fixtures/does-not-exist", "topo", "show"]);
    assert_eq!(code, 65, "{text}");
    assert!(
        text.contains("tests/fixtures/does-not-exist/sys/devices/system/cpu/online is missing"),
        "{text}"
    );
}
