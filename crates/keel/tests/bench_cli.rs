//! `keel bench` without a GPU: flag validation (exit 64) and the "CUDA is
//! not here" path (exit 3 with a message naming what is missing), end to
//! end through the binary. The GPU runs themselves are in
//! crates/keel-bench/tests/gpu.rs and scripts/gpu-verify.

/// keel with the launcher and bench variables of the test's own
/// environment removed (a test run under srun must not look like a rank).
fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_keel"));
    c.args(args).env("HOME", "/nonexistent");
    for var in [
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "KEEL_CUDA_LIB_DIR",
        "KEEL_RENDEZVOUS",
        "KEEL_CONFIG",
        "KEEL_ROOT",
    ] {
        c.env_remove(var);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run keel");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A directory whose libcuda.so.1 is not a library: whatever the machine
/// has installed, the driver named there cannot load.
fn broken_driver_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tempdir");
    std::fs::write(d.path().join("libcuda.so.1"), b"not a shared library").expect("write");
    d
}

#[test]
fn an_unloadable_driver_is_unavailable_exit_3() {
    let dir = broken_driver_dir();
    let path = dir.path().display().to_string();
    for args in [
        vec!["bench", "copy"],
        vec!["bench", "gemm", "--dtype", "fp16"],
        vec![
            "bench",
            "nccl",
            "all-reduce",
            "-b",
            "8",
            "-e",
            "1G",
            "-f",
            "2",
        ],
        vec!["--json", "bench", "copy"],
    ] {
        let (code, stdout, stderr) = run(&args, &[("KEEL_CUDA_LIB_DIR", &path)]);
        assert_eq!(code, 3, "{args:?}: {stderr}");
        assert_eq!(stdout, "", "{args:?}");
        assert!(
            stderr.starts_with(
                "keel: error: cannot run the benchmark: the CUDA driver (libcuda.so.1) is unavailable: "
            ),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(&format!("{path}/libcuda.so.1")), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // The flag wins over the environment.
    let (code, _, stderr) = run(
        &["bench", "copy", "--cuda-lib-dir", &path],
        &[("KEEL_CUDA_LIB_DIR", "/nonexistent")],
    );
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains(&format!("{path}/libcuda.so.1")), "{stderr}");
}

#[test]
fn no_driver_installed_is_unavailable_exit_3() {
    let has_driver = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so"))
        .unwrap_or(false);
    if has_driver {
        eprintln!("this machine has a CUDA driver: the no-driver path cannot be shown here");
        return;
    }
    let (code, stdout, stderr) = run(&["bench", "copy"], &[]);
    assert_eq!(code, 3, "{stderr}");
    assert_eq!(stdout, "");
    assert_eq!(
        stderr,
        "keel: error: cannot run the benchmark: the CUDA driver (libcuda.so.1) is unavailable: \
         libcuda.so.1 is not on the dynamic loader's path (is the NVIDIA driver installed? \
         KEEL_CUDA_LIB_DIR may name the directory that holds it)\n"
    );
}

#[test]
fn bad_flags_are_usage_errors_exit_64_before_cuda() {
    let dir = broken_driver_dir();
    let path = dir.path().display().to_string();
    for (args, message) in [
        (
            vec!["bench", "nccl", "all-reduce", "-b", "1G", "-e", "8"],
            "-b 1073741824 is larger than -e 8",
        ),
        (
            vec![
                "bench",
                "nccl",
                "all-reduce",
                "-b",
                "8",
                "-e",
                "1G",
                "-i",
                "0",
            ],
            "-i 0 with -f 1 never reaches -e",
        ),
        (
            vec!["bench", "nccl", "broadcast", "-r", "3", "-g", "2"],
            "-r 3 is not a rank: there are 2",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-o", "avg", "-d", "int32"],
            "-o avg needs a floating-point -d, not int32",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-n", "0"],
            "-n must be at least 1",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-b", "8X"],
            "-b: \"8X\" is not a size",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "--rendezvous", "nohost"],
            "--rendezvous \"nohost\" is not HOST:PORT",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "--rendezvous-timeout", "0"],
            "--rendezvous-timeout must be a positive number",
        ),
        (
            vec!["bench", "copy", "--size", "0"],
            "--size must be at least 1 byte",
        ),
        (
            vec!["bench", "copy", "--iters", "0"],
            "--iters must be at least 1",
        ),
        (vec!["bench", "copy", "--gpus", "0-x"], "--gpus \"0-x\""),
        (vec!["bench", "gemm", "--m", "0"], "--m 0 must be between 1"),
        (
            vec!["bench", "gemm", "--dtype", "fp8", "--k", "100"],
            "fp8 needs --m, --n and --k to be multiples of 16",
        ),
        (
            vec!["bench", "gemm", "--duration", "0"],
            "--duration 0 must be a positive number of seconds",
        ),
    ] {
        let (code, stdout, stderr) = run(&args, &[("KEEL_CUDA_LIB_DIR", &path)]);
        assert_eq!(code, 64, "{args:?}: {stderr}");
        assert_eq!(stdout, "");
        assert!(
            stderr.starts_with("keel: error: ") && stderr.contains(message),
            "{args:?}: {stderr}"
        );
    }
    // clap's own errors: unknown collective, type, op; out-of-range -c, -a.
    for (args, message) in [
        (
            vec!["bench", "nccl", "allsum"],
            "unknown collective \"allsum\"",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-d", "int4"],
            "unknown type \"int4\"",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-o", "xor"],
            "unknown op \"xor\"",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-c", "2"],
            "2 is not in 0..=1",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-a", "4"],
            "4 is not in 0..=3",
        ),
        (
            vec!["bench", "gemm", "--dtype", "int8"],
            "unknown GEMM type \"int8\"",
        ),
        (
            vec!["bench", "nccl", "all-reduce", "-g", "2", "--gpus", "0,1"],
            "cannot be used with",
        ),
    ] {
        let (code, _, stderr) = run(&args, &[]);
        assert_eq!(code, 64, "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

#[test]
fn slurm_ranks_need_a_rendezvous_and_one_gpu_each() {
    let (code, _, stderr) = run(
        &["bench", "nccl", "all-reduce"],
        &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")],
    );
    assert_eq!(code, 64, "{stderr}");
    assert!(stderr.contains("use --rendezvous HOST:PORT"), "{stderr}");
    let (code, _, stderr) = run(
        &["bench", "nccl", "all-reduce", "-g", "2"],
        &[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_NODELIST", "gpu[01-02]"),
        ],
    );
    assert_eq!(code, 64, "{stderr}");
    assert!(stderr.contains("each task is one rank"), "{stderr}");
    let (code, _, stderr) = run(
        &["bench", "nccl", "all-reduce"],
        &[("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")],
    );
    assert_eq!(code, 64, "{stderr}");
    assert!(
        stderr.contains("SLURM_PROCID=\"x\" is not a number"),
        "{stderr}"
    );
}

#[test]
fn nccl_help_lists_the_nccl_tests_flags() {
    let (code, stdout, _) = run(&["bench", "nccl", "--help"], &[]);
    assert_eq!(code, 0);
    for flag in [
        "-b, --minbytes",
        "-e, --maxbytes",
        "-f, --stepfactor",
        "-i, --stepbytes",
        "-n, --iters",
        "-w, --warmup_iters",
        "-c, --check",
        "-o, --op",
        "-d, --datatype",
        "-r, --root-rank",
        "-a, --average",
        "-g, --ngpus",
        "--rendezvous <HOST:PORT>",
        "--min-busbw <GB/s>",
    ] {
        assert!(stdout.contains(flag), "{flag} missing from:\n{stdout}");
    }
}

/// scripts/gpu-verify, the one-run check of every GPU path, ends on a
/// machine without a GPU too: every step runs or says why not, the
/// replayed checks agree with the live ones, the summary, report and
/// archive are written, the exporter it starts is gone afterwards, and
/// the exit code says a step could not run (2) unless a GPU answered.
#[test]
fn gpu_verify_runs_every_step_and_reports_without_a_gpu() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("results");
    let archive = tmp.path().join("results.tar.gz");
    let home = tmp.path().join("home");
    std::fs::create_dir(&home).expect("home");
    let mut c = std::process::Command::new(root.join("scripts/gpu-verify"));
    c.args(["--no-gpu-tests", "--deadline", "240", "--archive"])
        .arg(&archive)
        .arg(&out)
        .env("KEEL", env!("CARGO_BIN_EXE_keel"))
        .env("HOME", &home)
        .env("KEEL_IMDS_ENDPOINT", "127.0.0.1:1");
    for var in [
        "KEEL_CONFIG",
        "KEEL_ROOT",
        "KEEL_CUDA_LIB_DIR",
        "SLURM_PROCID",
        "SLURM_LOCALID",
    ] {
        c.env_remove(var);
    }
    let run = c.output().expect("run scripts/gpu-verify");
    let stderr = String::from_utf8_lossy(&run.stderr);
    let code = run.status.code().unwrap_or(-1);
    let read = |name: &str| {
        std::fs::read_to_string(out.join(name)).unwrap_or_else(|e| panic!("{name}: {e}\n{stderr}"))
    };
    let steps: Vec<String> = read("steps.tsv")
        .lines()
        .skip(1)
        .map(|l| l.split('\t').next().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        steps,
        [
            "nvidia-smi",
            "check-cold",
            "topo",
            "topo-json",
            "gpu-ids",
            "topo-snapshot",
            "check",
            "check-json",
            "check-record",
            "check-replayed",
            "tune-clocks",
            "tune-clocks-json",
            "tune-env",
            "tune-env-json",
            "exporter-scrape",
            "compare",
            "check-bench",
            "clock-decay",
        ],
        "{stderr}"
    );
    let agreement = read("check-agreement.txt");
    assert!(agreement.contains(", 0 differ"), "{agreement}");
    let summary = read("summary.txt");
    assert!(summary.contains("step"), "{summary}");
    assert!(read("report.md").starts_with("# GPU verification on "));
    let compare: serde_json::Value =
        serde_json::from_str(&read("compare.json")).expect("compare.json is JSON");
    assert_eq!(compare["finished"], true);
    assert_eq!(
        compare["rows"].as_array().map(Vec::len),
        Some(9),
        "{compare}"
    );
    assert!(std::fs::metadata(&archive).is_ok_and(|m| m.len() > 0));
    // The exporter it started no longer listens.
    let log = read("exporter.log");
    let port = log
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or_else(|| panic!("no address in exporter.log: {log}"));
    assert!(
        std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err(),
        "the exporter still listens on {port}"
    );
    let keel_measured = compare["rows"]
        .as_array()
        .is_some_and(|rows| rows.iter().any(|r| !r["keel"].is_null()));
    if !keel_measured {
        assert_eq!(code, 2, "{summary}\n{stderr}");
    }
    // A second run into the same directory is refused, not mixed in.
    let again = std::process::Command::new(root.join("scripts/gpu-verify"))
        .arg(&out)
        .output()
        .expect("run");
    assert_eq!(again.status.code(), Some(64));
}
