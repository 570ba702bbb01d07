//! `keel tune clocks|reset` as a Slurm prolog/epilog runs them, on a
//! machine without NVML (the clock logic itself is tested in keel-tune
//! against in-memory GPUs; nothing here may change a real GPU).

mod common;

use common::keel;

fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn reset_without_a_state_file_changes_nothing_and_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let state = state.to_str().expect("utf-8");
    let (code, out, err) = keel(&args(&["tune", "reset", "--apply", "--state", state]), &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("no state file"), "{out}");
    assert!(!std::path::Path::new(state).exists());
}

#[test]
fn without_nvml_clocks_are_unknown_not_a_failure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let state = state.to_str().expect("utf-8");
    let (code, out, err) = keel(
        &args(&[
            "--json",
            "tune",
            "clocks",
            "--apply",
            "--state",
            state,
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ]),
        &[],
    );
    assert_eq!(code, 3, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["status"], "unknown");
    assert!(v["state"]
        .as_str()
        .unwrap_or_default()
        .contains("NVML is unavailable"));
    assert!(!std::path::Path::new(state).exists());
}

#[test]
fn a_damaged_state_file_is_a_data_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    std::fs::write(&state, "not json").expect("write");
    let state = state.to_str().expect("utf-8");
    let (code, _, err) = keel(
        &args(&[
            "tune",
            "reset",
            "--state",
            state,
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ]),
        &[],
    );
    assert_eq!(code, 65, "{err}");
    assert!(err.contains("not a keel clock state file"), "{err}");
}

fn fixture(name: &str) -> String {
    common::workspace()
        .join("tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn env_for_each_machine_fixture() {
    for (machine, code) in [
        ("nd96asr_v4", 0),
        ("nd96isr_h100_v5", 0),
        ("dgx-a100", 0),
        ("cpu-only", 3),
    ] {
        let root = fixture(machine);
        let (c, out, err) = keel(&args(&["--root", &root, "tune", "env"]), &[]);
        assert_eq!(c, code, "{machine}: {err}");
        insta::assert_snapshot!(format!("tune-env-sh-{machine}"), out);
    }
    let (c, out, err) = keel(
        &args(&[
            "--root",
            &fixture("cpu-only"),
            "tune",
            "env",
            "--format",
            "json",
        ]),
        &[],
    );
    assert_eq!(c, 3, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["status"], "unknown");
    assert!(v["reason"]
        .as_str()
        .unwrap_or_default()
        .contains("no NVIDIA GPU"));
    // A TaskProlog must not cancel tasks on a node without a GPU.
    let (c, out, _) = keel(
        &args(&[
            "--root",
            &fixture("cpu-only"),
            "tune",
            "env",
            "--format",
            "slurm",
        ]),
        &[],
    );
    assert_eq!((c, out.as_str()), (0, ""));
}

#[test]
fn env_json_names_every_variable_with_reason_and_source() {
    let (c, out, err) = keel(
        &args(&[
            "--root",
            &fixture("nd96isr_h100_v5"),
            "tune",
            "env",
            "--format",
            "json",
            "--launcher",
            "torchrun",
        ]),
        &[],
    );
    assert_eq!(c, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["sku"], "nd96isr_h100_v5");
    let vars = v["vars"].as_array().expect("vars");
    for var in vars {
        assert!(
            !var["reason"].as_str().unwrap_or_default().is_empty(),
            "{var}"
        );
        assert!(
            !var["source"].as_str().unwrap_or_default().is_empty(),
            "{var}"
        );
    }
    let names: Vec<&str> = vars.iter().filter_map(|x| x["name"].as_str()).collect();
    assert!(names.contains(&"UCX_TLS"), "{names:?}");
    // HCOLL is an Open MPI setting: not for torchrun.
    assert!(!names.contains(&"OMPI_MCA_coll_hcoll_enable"), "{names:?}");
    assert_eq!(v["ranks"].as_array().map(Vec::len), Some(8));
    // NCCL_IB_HCA once for the node (NVIDIA/nccl issue 1478); per rank
    // only UCX's devices.
    let hca = vars
        .iter()
        .find(|x| x["name"] == "NCCL_IB_HCA")
        .expect("NCCL_IB_HCA");
    assert_eq!(
        hca["value"],
        "=mlx5_ib0:1,mlx5_ib1:1,mlx5_ib2:1,mlx5_ib3:1,mlx5_ib4:1,mlx5_ib5:1,mlx5_ib6:1,mlx5_ib7:1"
    );
    for r in v["ranks"].as_array().expect("ranks") {
        let names: Vec<&str> = r["vars"]
            .as_array()
            .expect("vars")
            .iter()
            .filter_map(|x| x["name"].as_str())
            .collect();
        assert_eq!(names, ["UCX_NET_DEVICES"], "{r}");
    }
}

#[test]
fn env_sets_nccl_topo_file_when_the_image_ships_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = std::path::PathBuf::from(fixture("nd96asr_v4"));
    for d in ["sys", "proc", "dev"] {
        std::os::unix::fs::symlink(src.join(d), dir.path().join(d)).expect("link");
    }
    std::fs::create_dir_all(dir.path().join("opt/microsoft")).expect("mkdir");
    std::fs::write(
        dir.path().join("opt/microsoft/ndv4-topo.xml"),
        "<system/>\n",
    )
    .expect("write");
    let root = dir.path().display().to_string();
    let (c, out, err) = keel(&args(&["--root", &root, "tune", "env"]), &[]);
    assert_eq!(c, 0, "{err}");
    assert!(
        out.contains("export NCCL_TOPO_FILE=/opt/microsoft/ndv4-topo.xml\n"),
        "{out}"
    );
    assert!(!out.contains("NCCL_TOPO_FILE not set"), "{out}");

    // The TaskProlog form: the node's HCAs for NCCL, rank 3's for UCX, and
    // the user's own value kept.
    let (c, out, err) = keel(
        &args(&["--root", &root, "tune", "env", "--format", "slurm"]),
        &[("SLURM_LOCALID", "3"), ("UCX_TLS", "dc")],
    );
    assert_eq!(c, 0, "{err}");
    assert!(
        out.contains("export NCCL_IB_HCA==mlx5_ib0:1,mlx5_ib1:1,mlx5_ib2:1,mlx5_ib3:1,mlx5_ib4:1,mlx5_ib5:1,mlx5_ib6:1,mlx5_ib7:1\n"),
        "{out}"
    );
    assert!(out.contains("export UCX_NET_DEVICES=mlx5_ib3:1\n"), "{out}");
    assert!(
        out.contains("export NCCL_TOPO_FILE=/opt/microsoft/ndv4-topo.xml\n"),
        "{out}"
    );
    assert!(!out.contains("UCX_TLS"), "{out}");
    assert!(out.lines().all(|l| l.starts_with("export ")), "{out}");
}
