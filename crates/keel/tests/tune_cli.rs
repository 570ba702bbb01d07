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
