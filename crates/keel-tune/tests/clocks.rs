//! The clock prolog and epilog against in-memory GPUs that keep NVML's
//! rules (keel_tune::fake).

use std::path::Path;

use keel_gpu::clocks::{ClockPair, Lock, Range};
use keel_tune::clocks::{epilog, prolog, GpuStatus, Method, Options, StateFile};
use keel_tune::fake::{FakeControl, FakeGpu};

fn opts(state: &Path, apply: bool) -> Options {
    Options {
        state_file: state.to_owned(),
        apply,
        only: vec![],
    }
}

fn a100s(n: usize) -> FakeControl {
    FakeControl::new(
        (0..n)
            .map(|i| FakeGpu::a100(&format!("{:04x}:00:00.0", i + 1)))
            .collect(),
    )
}

#[test]
fn dry_run_changes_nothing_and_records_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let mut ctl = a100s(2);
    let before = ctl.gpus.clone();
    let r = prolog(&mut ctl, &opts(&state, false)).expect("prolog");
    assert_eq!(ctl.gpus, before);
    assert!(ctl.calls.is_empty());
    assert!(!state.exists());
    assert!(r.gpus.iter().all(|g| g.status == GpuStatus::Changed));
    let c = &r.gpus[0].changes[0];
    assert_eq!(c.what, "application clocks");
    assert_eq!(c.before, "1095/1215 MHz");
    assert_eq!(c.after, "1410/1215 MHz");
    assert_eq!((c.done, c.error.as_ref()), (None, None));
}

#[test]
fn application_clocks_round_trip_restores_the_exact_prior_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("keel/clocks.json");
    let mut ctl = a100s(4);
    // An operator's own (non-default) application clocks on GPU 2.
    ctl.gpus[2].applications = Some(ClockPair {
        graphics_mhz: 1200,
        memory_mhz: 1215,
    });
    let original = ctl.gpus.clone();
    ctl.require_file = Some(state.clone());

    let r = prolog(&mut ctl, &opts(&state, true)).expect("prolog");
    assert!(
        r.gpus.iter().all(|g| g.status == GpuStatus::Changed),
        "{r:?}"
    );
    for g in &ctl.gpus {
        assert_eq!(
            g.applications,
            Some(ClockPair {
                graphics_mhz: 1410,
                memory_mhz: 1215
            })
        );
        assert_eq!(g.locked_gpu, None, "application clocks only");
    }
    let mode = std::fs::metadata(&state).expect("state").permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600
    );

    let r = epilog(&mut ctl, &opts(&state, true)).expect("epilog");
    assert!(
        r.gpus.iter().all(|g| g.status == GpuStatus::Changed),
        "{r:?}"
    );
    assert_eq!(ctl.gpus, original);
    assert!(!state.exists(), "a full restore removes the state file");
    // Default clocks come back by a reset, an operator's own by a set.
    assert!(ctl
        .calls
        .contains(&(0, "nvmlDeviceResetApplicationsClocks")));
    assert!(ctl.calls.contains(&(2, "nvmlDeviceSetApplicationsClocks")));

    // Idempotent: a second epilog has nothing to restore and says so.
    let calls = ctl.calls.len();
    let r = epilog(&mut ctl, &opts(&state, true)).expect("epilog");
    assert!(r.gpus.is_empty());
    assert!(r.state.contains("no state file"), "{}", r.state);
    assert_eq!(ctl.calls.len(), calls);
    assert_eq!(ctl.gpus, original);
}

#[test]
fn locked_clocks_round_trip_on_gpus_without_application_clocks() {
    for readable in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("clocks.json");
        let mut ctl = FakeControl::new(vec![
            FakeGpu::lock_only("0001:00:00.0"),
            FakeGpu::lock_only("0002:00:00.0"),
        ]);
        ctl.locks_readable = readable;
        let original = ctl.gpus.clone();
        ctl.require_file = Some(state.clone());
        let r = prolog(&mut ctl, &opts(&state, true)).expect("prolog");
        assert!(r.gpus.iter().all(|g| g.method == Some(Method::Locked)));
        let max = Range {
            min_mhz: 1980,
            max_mhz: 1980,
        };
        assert_eq!(ctl.gpus[0].locked_gpu, Some(max));
        assert_eq!(
            ctl.gpus[0].locked_memory,
            Some(Range {
                min_mhz: 2619,
                max_mhz: 2619
            })
        );
        epilog(&mut ctl, &opts(&state, true)).expect("epilog");
        assert_eq!(ctl.gpus, original, "locks readable: {readable}");
        assert!(!state.exists());
    }
}

#[test]
fn a_lock_set_before_the_prolog_comes_back_when_nvml_can_read_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let mut ctl = FakeControl::new(vec![FakeGpu::lock_only("0001:00:00.0")]);
    ctl.locks_readable = true;
    let prior = Range {
        min_mhz: 1400,
        max_mhz: 1400,
    };
    ctl.gpus[0].locked_gpu = Some(prior);
    prolog(&mut ctl, &opts(&state, true)).expect("prolog");
    let rec = StateFile::load(&state).expect("load").expect("state");
    assert_eq!(rec.gpus[0].prior.locked_gpu, Lock::Locked(prior));
    epilog(&mut ctl, &opts(&state, true)).expect("epilog");
    assert_eq!(ctl.gpus[0].locked_gpu, Some(prior));
    assert_eq!(ctl.gpus[0].locked_memory, None);
}

#[test]
fn a_crash_between_changes_leaves_a_state_the_epilog_restores() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let mut ctl = a100s(8);
    let original = ctl.gpus.clone();
    ctl.require_file = Some(state.clone());
    // The prolog dies after three GPUs were changed.
    ctl.die_after = Some(3);
    let r = prolog(&mut ctl, &opts(&state, true)).expect("prolog");
    assert!(r.any(GpuStatus::Failed));
    assert_eq!(r.gpus[2].changes[0].done, Some(true));
    assert_eq!(r.gpus[3].changes[0].done, Some(false));
    assert!(r.gpus[3].changes[0]
        .error
        .as_deref()
        .unwrap_or_default()
        .contains("died"));
    assert_ne!(ctl.gpus, original);
    let rec = StateFile::load(&state).expect("load").expect("recorded");
    assert_eq!(
        rec.gpus.len(),
        8,
        "every GPU was recorded before any change"
    );

    ctl.die_after = None;
    epilog(&mut ctl, &opts(&state, true)).expect("epilog");
    assert_eq!(ctl.gpus, original);
    assert!(!state.exists());
}

#[test]
fn a_second_prolog_keeps_the_recorded_original() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let mut ctl = a100s(2);
    let original = ctl.gpus.clone();
    prolog(&mut ctl, &opts(&state, true)).expect("prolog");
    let first = std::fs::read(&state).expect("state");
    // Something lowers GPU 1 between jobs; a second prolog runs.
    ctl.gpus[1].applications = Some(ClockPair {
        graphics_mhz: 1005,
        memory_mhz: 1215,
    });
    let r = prolog(&mut ctl, &opts(&state, true)).expect("second prolog");
    assert_eq!(r.gpus[0].status, GpuStatus::Unchanged);
    assert_eq!(r.gpus[1].status, GpuStatus::Changed);
    assert_eq!(std::fs::read(&state).expect("state"), first);
    epilog(&mut ctl, &opts(&state, true)).expect("epilog");
    assert_eq!(ctl.gpus, original, "the first prolog's record wins");
}

#[test]
fn no_permission_and_unsupported_are_unknown_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let mut ctl = a100s(2);
    ctl.root = false;
    let original = ctl.gpus.clone();
    let r = prolog(&mut ctl, &opts(&state, true)).expect("prolog");
    assert!(
        r.gpus.iter().all(|g| g.status == GpuStatus::Unknown),
        "{r:?}"
    );
    assert!(
        r.gpus[0].detail.contains("needs root"),
        "{}",
        r.gpus[0].detail
    );
    assert_eq!(ctl.gpus, original);
    // The record stays (harmless: it equals the current state).
    let r = epilog(&mut ctl, &opts(&state, true)).expect("epilog");
    assert!(r.gpus.iter().all(|g| g.status == GpuStatus::Unchanged));

    let mut old = a100s(1);
    old.gpus[0].caps.applications = false;
    old.gpus[0].caps.lock_gpu = false;
    let r = prolog(&mut old, &opts(&dir.path().join("other.json"), true)).expect("prolog");
    assert_eq!(r.gpus[0].status, GpuStatus::Unknown);
    assert!(old.calls.is_empty());
}

#[test]
fn at_maximum_already_nothing_is_recorded_or_changed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let mut ctl = a100s(1);
    ctl.gpus[0].caps.default_applications = Some(ClockPair {
        graphics_mhz: 1410,
        memory_mhz: 1215,
    });
    ctl.gpus[0].applications = ctl.gpus[0].caps.default_applications;
    let r = prolog(&mut ctl, &opts(&state, true)).expect("prolog");
    assert_eq!(r.gpus[0].status, GpuStatus::Unchanged);
    assert!(!state.exists());
    assert!(ctl.calls.is_empty());
}

#[test]
fn a_damaged_state_file_is_an_error_and_nothing_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    std::fs::write(&state, b"{\"version\": 1, \"gpus\": [").expect("write");
    let mut ctl = a100s(1);
    let err = epilog(&mut ctl, &opts(&state, true)).expect_err("damaged");
    assert!(
        err.to_string().contains("not a keel clock state file"),
        "{err}"
    );
    let err = prolog(&mut ctl, &opts(&state, true)).expect_err("damaged");
    assert!(err.to_string().contains("clocks.json"), "{err}");
    assert!(ctl.calls.is_empty());
}

/// The fixtures' recorded NVML snapshots (tests/fixtures/*/gpu.json) as
/// in-memory GPUs.
fn recorded(machine: &str) -> FakeControl {
    use keel_gpu::GpuProbe;
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(machine)
        .join("gpu.json");
    let snap = keel_gpu::recorded::RecordedProbe::new(&path)
        .snapshot()
        .expect("snapshot");
    FakeControl::new(
        snap.gpus
            .iter()
            .map(|g| FakeGpu::from_reading(g).expect("clocks recorded"))
            .collect(),
    )
}

#[test]
fn recorded_machines_plan_by_their_clocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    // A100-SXM4-40GB: default application clocks 1095/1215, max 1410.
    let mut ndv4 = recorded("nd96asr_v4");
    assert_eq!(ndv4.gpus.len(), 8);
    let original = ndv4.gpus.clone();
    let r = prolog(&mut ndv4, &opts(&state, true)).expect("prolog");
    for g in &r.gpus {
        assert_eq!(g.status, GpuStatus::Changed);
        assert_eq!(g.changes[0].before, "1095/1215 MHz");
        assert_eq!(g.changes[0].after, "1410/1215 MHz");
    }
    epilog(&mut ndv4, &opts(&state, true)).expect("epilog");
    assert_eq!(ndv4.gpus, original);

    // H100: the default application clocks are the maxima already.
    let mut ndv5 = recorded("nd96isr_h100_v5");
    let r = prolog(&mut ndv5, &opts(&state, true)).expect("prolog");
    assert!(
        r.gpus.iter().all(|g| g.status == GpuStatus::Unchanged),
        "{r:?}"
    );
    assert!(ndv5.calls.is_empty());
    assert!(!state.exists());
}

/// `--slurm-gpus "$SLURM_JOB_GPUS"` on NDv4, whose device minors are not
/// its NVML indices: Slurm's GPU 0 (gres.conf `File=/dev/nvidia0`) is NVML's
/// GPU 3, and only it is raised.
#[test]
fn slurm_gpu_ids_are_device_minors_not_nvml_indices() {
    use keel_topo::IdKind;
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("clocks.json");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/nd96asr_v4");
    let procfs =
        keel_topo::gpu_ids::read_procfs_minors(&keel_topo::Root::new(&root)).expect("procfs");
    let mut ndv4 = recorded("nd96asr_v4");
    assert_eq!(
        keel_tune::clocks::slurm_gpus(&ndv4, &procfs, &[0, 4], IdKind::Minor).expect("ids"),
        [3, 7]
    );
    assert_eq!(
        keel_tune::clocks::slurm_gpus(&ndv4, &procfs, &[0, 4], IdKind::Index).expect("ids"),
        [0, 4]
    );
    let err = keel_tune::clocks::slurm_gpus(&ndv4, &procfs, &[8], IdKind::Minor)
        .expect_err("no /dev/nvidia8");
    assert!(err.to_string().contains("device minor 8"), "{err}");
    let mut o = opts(&state, true);
    o.only = keel_tune::clocks::slurm_gpus(&ndv4, &procfs, &[0], IdKind::Minor).expect("ids");
    let report = prolog(&mut ndv4, &o).expect("prolog");
    let changed: Vec<&str> = report.gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
    assert_eq!(changed, ["0004:00:00.0"], "{report:?}");
}
