//! `keel run` on one machine (no Slurm): the toy trainer in tests/run
//! against a file:// store, the real keel binary and, for Scheduled
//! Events, the fake IMDS over HTTP.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

use keel_testkit::imds::{scheduled_event, FakeImds, ImdsMode};

struct Job {
    tmp: tempfile::TempDir,
    store: String,
    ckpt: PathBuf,
    log: PathBuf,
    state: PathBuf,
}

fn trainer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/run/toy_trainer.py")
}

impl Job {
    fn new() -> Job {
        let tmp = tempfile::tempdir().expect("tempdir");
        Job {
            store: format!("file://{}/store", tmp.path().display()),
            ckpt: tmp.path().join("ckpt"),
            log: tmp.path().join("trained.log"),
            state: tmp.path().join("keel-run.json"),
            tmp,
        }
    }

    /// `keel run` with the store, the run, the directories and `extra`,
    /// running the toy trainer with `env`.
    fn command(&self, extra: &[&str], env: &[(&str, &str)]) -> Command {
        let t = trainer();
        let t = t.to_str().expect("utf-8");
        self.command_of(extra, env, &["python3", t])
    }

    /// Like `command`, with another trainer command line.
    fn command_of(&self, extra: &[&str], env: &[(&str, &str)], argv: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
        c.arg("run")
            .args(["--store", &self.store, "--run", "toy"])
            .arg("--ckpt-dir")
            .arg(&self.ckpt)
            .arg("--state")
            .arg(&self.state)
            .args(["--job", "7", "--watch-interval", "0.2", "--grace", "2"])
            .args(extra)
            .arg("--")
            .args(argv)
            .env("TOY_LOG", &self.log)
            .env_remove("SLURM_JOB_ID")
            .env_remove("KEEL_RUN_IMDS")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    fn run(&self, extra: &[&str], env: &[(&str, &str)]) -> Output {
        self.command(extra, env).output().expect("run keel")
    }

    fn log(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn state(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&self.state).expect("state")).expect("json")
    }

    fn latest_step(&self) -> Option<u64> {
        let o = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["--json", "ckpt", "latest", &self.store, "--run", "toy"])
            .output()
            .expect("keel ckpt latest");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        v["step"].as_u64()
    }
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn trained(log: &[String]) -> Vec<u64> {
    log.iter()
        .filter_map(|l| l.strip_prefix("trained "))
        .map(|n| n.parse().expect("step"))
        .collect()
}

#[test]
fn a_crash_is_recorded_and_the_next_attempt_resumes_from_the_last_commit() {
    let job = Job::new();
    let env = [
        ("TOY_STEPS", "20"),
        ("TOY_EVERY", "5"),
        ("TOY_STEP_SECS", "0.05"),
    ];
    let o = job.run(&[], &[env[0], env[1], env[2], ("TOY_MODE", "crash-at:13")]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("exit code 1"), "{}", stderr(&o));
    assert_eq!(job.latest_step(), Some(10));
    let s = job.state();
    assert_eq!(s["jobs"]["7"]["failures"][0]["cause"], "crash");
    assert_eq!(s["jobs"]["7"]["failures"][0]["count"], 1);

    let o = job.run(&[], &env);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("resuming from step 10"),
        "{}",
        stderr(&o)
    );
    let log = job.log();
    assert!(log.contains(&"resumed 10".to_owned()), "{log:?}");
    let steps = trained(&log);
    // Every step trained; only the ones after the last commit twice.
    for s in 1..=20 {
        let n = steps.iter().filter(|&&x| x == s).count();
        let expected = if (11..=12).contains(&s) { 2 } else { 1 };
        assert_eq!(n, expected, "step {s} in {steps:?}");
    }
    assert_eq!(job.latest_step(), Some(20));
    assert_eq!(
        job.state()["jobs"]["7"]["attempts"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    // A third attempt restores step 20 and removes the second's restore.
    let o = job.run(&[], &env);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("resuming from step 20"),
        "{}",
        stderr(&o)
    );
    let restores = std::fs::read_dir(job.ckpt.join(".keel-resume"))
        .expect("restores")
        .count();
    assert_eq!(restores, 1);

    let r = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["--json", "run", "report", "--state"])
        .arg(&job.state)
        .output()
        .expect("report");
    assert_eq!(code(&r), 0, "{}", stderr(&r));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).expect("json");
    let g = &v["jobs"][0]["goodput"];
    assert_eq!(g["attempts"], 3);
    assert!(g["lost_ms"].as_u64().expect("lost") > 0, "{g}");
    let ettr = g["ettr"].as_f64().expect("ettr");
    assert!(ettr > 0.0 && ettr < 1.0, "{g}");
    let r = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["run", "report", "--state"])
        .arg(&job.state)
        .output()
        .expect("report");
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(text.contains("effective training time ratio"), "{text}");
    assert!(text.contains("lost work"), "{text}");
}

#[test]
fn a_hang_is_detected_from_stdout_heartbeats_within_twice_the_learned_timeout() {
    let job = Job::new();
    let started = Instant::now();
    let o = job.run(
        &[
            "--heartbeat-pattern",
            "loss",
            "--safety-factor",
            "2",
            "--startup-timeout",
            "30",
        ],
        &[
            ("TOY_STEP_SECS", "0.3"),
            ("TOY_MODE", "hang-at:8"),
            ("TOY_EVERY", "100"),
        ],
    );
    let took = started.elapsed();
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("the trainer is hung"), "{err}");
    // "no heartbeat for 1.1 s during training (timeout 1.0 s)": detected
    // within twice the learned timeout.
    let line = err
        .lines()
        .find(|l| l.contains("the trainer is hung"))
        .expect("hang line");
    let num = |after: &str| -> f64 {
        let rest = &line[line.find(after).expect("field") + after.len()..];
        rest.split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .expect("seconds")
    };
    let (silent, timeout) = (num("no heartbeat for "), num("(timeout "));
    assert!(line.contains("during training"), "{line}");
    assert!(
        timeout < 30.0,
        "learned, not the start-up allowance: {line}"
    );
    assert!(silent >= timeout && silent <= 2.0 * timeout, "{line}");
    // Learned: about 0.3 s x 2, at least the 1 s floor; seven steps take
    // about 2.1 s. Far below the 30 s start-up allowance.
    assert!(took < Duration::from_secs(15), "{took:?}\n{err}");
    assert_eq!(job.state()["jobs"]["7"]["failures"][0]["cause"], "hang");
}

#[test]
fn a_heartbeat_file_counts_and_a_fixed_timeout_applies() {
    let job = Job::new();
    let hb = job.tmp.path().join("heartbeat");
    let hb_s = hb.to_str().expect("utf-8").to_owned();
    let o = job.run(
        &["--heartbeat-file", &hb_s, "--hang-timeout", "2"],
        &[("TOY_STEPS", "10"), ("TOY_STEP_SECS", "0.1")],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(hb.exists());
    let o = job.run(
        &["--heartbeat-file", &hb_s, "--hang-timeout", "2"],
        &[("TOY_STEPS", "30"), ("TOY_MODE", "hang-at:12")],
    );
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("timeout 2.0 s"), "{}", stderr(&o));
}

fn sigterm(child: &Child) {
    let pid = rustix::process::Pid::from_raw(i32::try_from(child.id()).expect("pid")).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("kill");
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_to_the_supervisor_checkpoints_commits_and_exits_for_requeue() {
    let job = Job::new();
    let child = job
        .command(
            &[],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "1000000"),
                ("TOY_STEP_SECS", "0.05"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("training", Duration::from_secs(20), || {
        trained(&job.log()).len() >= 5
    });
    sigterm(&child);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the checkpoint is committed"),
        "{}",
        stderr(&o)
    );
    let committed = job.latest_step().expect("a committed checkpoint");
    assert!(committed >= 5, "{committed}");
    assert_eq!(
        job.state()["jobs"]["7"]["attempts"][0]["ended"],
        "preempted"
    );
}

#[test]
fn a_trainer_ignoring_the_signal_is_killed_at_the_deadline() {
    let job = Job::new();
    let child = job
        .command(
            &["--checkpoint-deadline", "1"],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "1000000"),
                ("TOY_MODE", "ignore-signals"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("training", Duration::from_secs(20), || {
        trained(&job.log()).len() >= 3
    });
    sigterm(&child);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("no checkpoint was committed before the deadline"),
        "{err}"
    );
    assert!(err.contains("SIGKILL"), "{err}");
    assert_eq!(job.latest_step(), None);
}

#[test]
fn start_up_failures_stop_after_the_retry_budget() {
    let job = Job::new();
    let args = ["--startup-retries", "3"];
    for _ in 0..2 {
        let o = job.run(&args, &[("TOY_MODE", "startup-fail")]);
        assert_eq!(code(&o), 2, "{}", stderr(&o));
    }
    let o = job.run(&args, &[("TOY_MODE", "startup-fail")]);
    assert_eq!(code(&o), 93, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("failed at start-up 3 times in a row (last: exit code 3)"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_preempt_for_this_vm_leads_to_a_committed_checkpoint_and_an_acknowledged_exit() {
    let imds = FakeImds::start("vm-1").expect("fake imds");
    let job = Job::new();
    let url = imds.base_url();
    let child = job
        .command(
            &["--imds", &url, "--imds-ack"],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "1000000"),
                ("TOY_STEP_SECS", "0.05"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("training", Duration::from_secs(20), || {
        trained(&job.log()).len() >= 3
    });
    let now = SystemTime::now();
    imds.set_events(vec![
        scheduled_event("other", "Preempt", &["vm-2"], now + Duration::from_secs(30)),
        scheduled_event("mine", "Preempt", &["vm-1"], now + Duration::from_secs(30)),
    ]);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    // NotBefore has whole seconds: 28 to 30 s left when it was seen.
    let err = stderr(&o);
    assert!(
        ["30", "29", "28"]
            .iter()
            .any(|n| err.contains(&format!("Preempt (mine) for vm-1, {n} s notice"))),
        "{err}"
    );
    assert!(job.latest_step().is_some());
    assert_eq!(imds.acks(), ["mine"]);
}

#[test]
fn a_short_notice_caps_the_wait_for_a_trainer_that_ignores_the_signal() {
    let imds = FakeImds::start("vm-1").expect("fake imds");
    let job = Job::new();
    let url = imds.base_url();
    let child = job
        .command(
            &["--imds", &url, "--checkpoint-deadline", "120"],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "1000000"),
                ("TOY_MODE", "ignore-signals"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("training", Duration::from_secs(20), || {
        trained(&job.log()).len() >= 3
    });
    let started = Instant::now();
    imds.set_events(vec![scheduled_event(
        "soon",
        "Preempt",
        &["vm-1"],
        SystemTime::now() + Duration::from_secs(4),
    )]);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert!(
        stderr(&o).contains("no checkpoint was committed before the deadline"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn other_vms_events_and_a_broken_imds_never_stop_training() {
    let imds = FakeImds::start("vm-1").expect("fake imds");
    let job = Job::new();
    let url = imds.base_url();
    let child = job
        .command(
            &["--imds", &url],
            &[
                ("TOY_STEPS", "60"),
                ("TOY_EVERY", "20"),
                ("TOY_STEP_SECS", "0.05"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("training", Duration::from_secs(20), || {
        trained(&job.log()).len() >= 2
    });
    imds.set_events(vec![scheduled_event(
        "other",
        "Preempt",
        &["vm-2"],
        SystemTime::now() + Duration::from_secs(30),
    )]);
    std::thread::sleep(Duration::from_millis(1200));
    imds.set_mode(ImdsMode::Garbage);
    std::thread::sleep(Duration::from_millis(1200));
    imds.set_mode(ImdsMode::Down);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("training continues"), "{}", stderr(&o));
    assert_eq!(job.latest_step(), Some(60));
    assert!(imds.requests() >= 3);
}

#[test]
fn a_checkpoint_that_fails_verification_is_skipped_on_resume() {
    let job = Job::new();
    let o = job.run(
        &[],
        &[
            ("TOY_STEPS", "10"),
            ("TOY_EVERY", "5"),
            ("TOY_STEP_SECS", "0.02"),
        ],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // Damage every data file of step 10 in the store.
    let root = PathBuf::from(job.store.trim_start_matches("file://"));
    let mut damaged = 0;
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("ls").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().contains("/00000000000000000010/")
                && p.ends_with("__0_0.distcp")
            {
                std::fs::write(&p, b"step 10 damaged").expect("damage");
                damaged += 1;
            }
        }
    }
    assert!(damaged > 0, "found the data of step 10");
    std::fs::remove_dir_all(&job.ckpt).expect("clean local checkpoints");
    let o = job.run(
        &[],
        &[
            ("TOY_STEPS", "12"),
            ("TOY_EVERY", "5"),
            ("TOY_STEP_SECS", "0.02"),
        ],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("step 10 failed verification"), "{err}");
    assert!(err.contains("resuming from step 5"), "{err}");
}

/// `keel run --slurm` with scripts on PATH standing in for Slurm's
/// clients (`scontrol`, `sinfo`, `squeue`, `srun`), each recording its
/// arguments: after the trainer fails, a node Slurm reports not responding
/// (`allocated*`) and one that is down (an administrator's) are recorded
/// as not responding and excluded from the requeue, and neither is
/// drained nor resumed.
#[test]
fn under_slurm_nodes_down_or_not_responding_are_excluded_and_left_alone() {
    use std::os::unix::fs::PermissionsExt;
    let job = Job::new();
    let bin = job.tmp.path().join("bin");
    std::fs::create_dir(&bin).expect("mkdir");
    let calls = job.tmp.path().join("calls");
    let script = |name: &str, body: &str| {
        let path = bin.join(name);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"{name} $*\" >>'{}'\n{body}",
                calls.display()
            ),
        )
        .expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    };
    // The job's ExcNodeList lives in a file beside the scripts; `show
    // config` fails (KillWait unknown: the configured waits apply).
    let exc = job.tmp.path().join("exc");
    script(
        "scontrol",
        &format!(
            "case \"$1 $2\" in\n  ping*) echo 'Slurmctld(primary) at ctl is UP' ;;\n  'show job') echo \"JobId=4242 JobName=train JobState=RUNNING ExcNodeList=$(cat '{exc}' 2>/dev/null || echo '(null)') NodeList=n[1-3]\" ;;\n  update*) case \"$3\" in ExcNodeList=*) echo \"${{3#ExcNodeList=}}\" >'{exc}' ;; esac ;;\n  show*) exit 1 ;;\nesac\n",
            exc = exc.display()
        ),
    );
    script(
        "sinfo",
        "case \"$*\" in\n  *' -n n1 '*) echo 'n1|allocated|gpu:8|none' ;;\n  *' -n n2 '*) echo 'n2|allocated*|gpu:8|none' ;;\n  *' -n n3 '*) echo 'n3|down|gpu:8|ops: replacing a PSU' ;;\nesac\n",
    );
    script("squeue", "echo RUNNING\n");
    script("srun", "exit 0\n");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = job
        .command_of(
            &["--slurm", "--check-command", "true"],
            &[
                ("PATH", &path),
                ("SLURM_JOB_ID", "4242"),
                ("SLURM_JOB_NODELIST", "n[1-3]"),
            ],
            &["sh", "-c", "exit 1"],
        )
        .output()
        .expect("run keel");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("node n2 is allocated+not_responding in Slurm"),
        "{err}"
    );
    assert!(err.contains("node n3 is down in Slurm"), "{err}");
    assert!(err.contains("requeued job 4242 excluding n2,n3"), "{err}");
    let s = job.state();
    let failures = s["jobs"]["7"]["failures"].as_array().expect("failures");
    let mut blamed: Vec<(&str, &str)> = failures
        .iter()
        .map(|f| {
            (
                f["node"].as_str().unwrap_or(""),
                f["cause"].as_str().unwrap_or(""),
            )
        })
        .collect();
    blamed.sort_unstable();
    assert_eq!(blamed, [("n2", "not-responding"), ("n3", "not-responding")]);
    // keel itself requeues and then sets ExcNodeList (nothing held,
    // nothing left to a helper).
    let log = std::fs::read_to_string(&calls).unwrap_or_default();
    let requeue = log.find("scontrol requeue 4242\n").expect(&log);
    let update = log
        .find("scontrol update JobId=4242 ExcNodeList=n2,n3\n")
        .expect(&log);
    assert!(requeue < update, "{log}");
    assert!(
        !log.contains("requeuehold") && !log.contains("release"),
        "{log}"
    );
    assert!(
        !log.contains("NodeName="),
        "no node is drained or resumed: {log}"
    );
}

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let job = Job::new();
    let o = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["run", "--no-such-flag", "--", "true"])
        .output()
        .expect("keel");
    assert_eq!(code(&o), 64);
    let o = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["run", "--store", &job.store, "--run", "toy", "--ckpt-dir"])
        .arg(&job.ckpt)
        .args(["--", "/no/such/trainer"])
        .output()
        .expect("keel");
    assert_eq!(code(&o), 64, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot start the trainer \"/no/such/trainer\""),
        "{}",
        stderr(&o)
    );
    let o = job.run(&["--checkpoint-signal", "BOGUS"], &[]);
    assert_eq!(code(&o), 64, "{}", stderr(&o));

    // A corrupt state file: a clear error, nothing run, nothing lost.
    std::fs::write(&job.state, b"{\"version\": 1, \"jobs\": {").expect("write");
    let o = job.run(&[], &[]);
    assert_eq!(code(&o), 65, "{}", stderr(&o));
    assert!(stderr(&o).contains("is not valid"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(&job.state).expect("read"),
        b"{\"version\": 1, \"jobs\": {"
    );
    assert!(job.log().is_empty(), "the trainer did not start");

    // An unreachable store.
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    let o = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "run",
            "--store",
            "s3://keel-test/x",
            "--run",
            "toy",
            "--ckpt-dir",
        ])
        .arg(&job.ckpt)
        .arg("--state")
        .arg(job.tmp.path().join("other.json"))
        .args(["--", "true"])
        // Both spellings: the test services export AWS_ENDPOINT_URL for
        // the live S3 server.
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "y")
        .env("AWS_REGION", "us-east-1")
        .output()
        .expect("keel");
    assert_eq!(code(&o), 74, "{}", stderr(&o));
}

#[test]
fn the_supervisor_serves_prometheus_metrics() {
    let job = Job::new();
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    let listen = addr.to_string();
    let child = job
        .command(
            &["--metrics-listen", &listen, "--heartbeat-pattern", "loss"],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "5"),
                ("TOY_STEP_SECS", "0.05"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("a commit", Duration::from_secs(20), || {
        job.latest_step().is_some()
    });
    let mut text = String::new();
    wait_for("metrics", Duration::from_secs(10), || {
        text = keel_testkit::http::request(addr, "GET", "/metrics", &[], b"")
            .map(|r| r.text())
            .unwrap_or_default();
        text.contains("keel_run_last_commit_step")
    });
    assert!(
        text.contains("keel_run_phase{job=\"7\",phase=\"training\"} 1"),
        "{text}"
    );
    let beats: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("keel_run_heartbeats_total{job=\"7\"} "))
        .and_then(|v| v.parse().ok())
        .expect("heartbeats");
    assert!(beats > 0, "{text}");
    let r = keel_testkit::http::request(addr, "GET", "/other", &[], b"").expect("get");
    assert_eq!(r.status, 404);
    sigterm(&child);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
}

/// The metrics endpoint of a training node's supervisor: a client that
/// trickles a request head does not hold up scrapes, a head over 8 KiB is
/// refused (431) instead of buffered, and with a token's hash configured
/// only a scrape with the token is answered.
#[test]
fn the_metrics_endpoint_bounds_heads_serves_scrapes_beside_slow_clients_and_checks_a_token() {
    use std::io::{Read, Write};
    let job = Job::new();
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    let listen = addr.to_string();
    let token = "run-metrics-token-for-tests";
    let sha = sha256_hex_of(token);
    let child = job
        .command(
            &["--metrics-listen", &listen, "--heartbeat-pattern", "loss"],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "5"),
                ("TOY_STEP_SECS", "0.05"),
                ("KEEL_RUN_METRICS_TOKEN_SHA256", sha.as_str()),
            ],
        )
        .spawn()
        .expect("spawn");
    let auth = format!("Bearer {token}");
    wait_for("metrics", Duration::from_secs(20), || {
        keel_testkit::http::request(addr, "GET", "/metrics", &[("authorization", &auth)], b"")
            .is_ok_and(|r| r.status == 200)
    });
    // Without the token, or with another: 401.
    for h in [vec![], vec![("authorization", "Bearer nope")]] {
        let r = keel_testkit::http::request(addr, "GET", "/metrics", &h, b"").expect("get");
        assert_eq!(r.status, 401, "{}", r.text());
    }
    // A client that sends its head a byte at a time, for longer than the
    // scrape below may wait.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickle = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            for b in b"GET /metrics HTTP/1.1\r\nX-Slow: "
                .iter()
                .chain(b"a".repeat(400).iter())
            {
                if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let r = keel_testkit::http::request(addr, "GET", "/metrics", &[("authorization", &auth)], b"")
        .expect("a scrape beside the slow client");
    assert_eq!(r.status, 200);
    assert!(r.text().contains("keel_run_phase"), "{}", r.text());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // A head of 64 KiB without a line end: refused, not buffered.
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = s.write_all(&b"G".repeat(64 << 10));
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    trickle.join().expect("trickle");
    sigterm(&child);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
}

/// SHA-256 of a token, hex: what `keel serve token` prints beside it.
fn sha256_hex_of(token: &str) -> String {
    let o = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(token.as_bytes())?;
            c.wait_with_output()
        })
        .expect("sha256sum");
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .expect("digest")
        .to_owned()
}

#[test]
fn a_slow_checkpoint_save_gets_its_allowance() {
    let job = Job::new();
    let env = [
        ("TOY_STEPS", "22"),
        ("TOY_EVERY", "10"),
        ("TOY_STEP_SECS", "0.1"),
        ("TOY_SAVE_SECS", "2.5"),
    ];
    let args = ["--heartbeat-pattern", "loss", "--hang-timeout", "1"];
    let mut with = args.to_vec();
    with.extend(["--save-allowance", "5"]);
    let o = job.run(&with, &env);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(job.latest_step(), Some(20));

    let job = Job::new();
    let mut without = args.to_vec();
    without.extend(["--save-allowance", "0"]);
    let o = job.run(&without, &env);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("during checkpoint save"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_node_that_stops_while_the_others_report_is_named() {
    let job = Job::new();
    let hb = job.tmp.path().join("hb");
    let hb_s = hb.to_str().expect("utf-8").to_owned();
    let t = trainer();
    let script = format!(
        "SLURMD_NODENAME=node-a python3 {t} & SLURMD_NODENAME=node-b SLURM_PROCID=1 python3 {t}; wait",
        t = t.display()
    );
    let o = job
        .command_of(
            &["--heartbeat-dir", &hb_s, "--safety-factor", "2"],
            &[
                ("TOY_STEPS", "200"),
                ("TOY_EVERY", "1000"),
                ("TOY_STEP_SECS", "0.1"),
                ("TOY_MODE", "hang-at:10"),
                ("TOY_HANG_NODE", "node-b"),
            ],
            &["sh", "-c", &script],
        )
        .output()
        .expect("run");
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("no heartbeat from node-b for"), "{err}");
    assert!(hb.join("node-a").exists() && hb.join("node-b").exists());
}

#[test]
fn an_aws_spot_notice_leads_to_a_committed_checkpoint() {
    let imds = FakeImds::start("vm-1").expect("fake imds");
    let job = Job::new();
    let url = imds.base_url();
    let child = job
        .command(
            &["--aws-imds", &url],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "1000000"),
                ("TOY_STEP_SECS", "0.05"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("training", Duration::from_secs(20), || {
        trained(&job.log()).len() >= 3
    });
    imds.set_aws_action(Some(
        serde_json::json!({"action": "terminate", "time": "2099-01-01T00:00:00Z"}),
    ));
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    assert!(stderr(&o).contains("AWS Spot terminate"), "{}", stderr(&o));
    assert!(job.latest_step().is_some());
}

#[test]
fn a_gcp_preemption_leads_to_a_committed_checkpoint() {
    let imds = FakeImds::start("vm-1").expect("fake metadata");
    let job = Job::new();
    let url = imds.base_url();
    let child = job
        .command(
            &["--gcp-metadata", &url],
            &[
                ("TOY_STEPS", "100000"),
                ("TOY_EVERY", "1000000"),
                ("TOY_STEP_SECS", "0.05"),
            ],
        )
        .spawn()
        .expect("spawn");
    wait_for("training", Duration::from_secs(20), || {
        trained(&job.log()).len() >= 3
    });
    imds.set_gcp_preempted(true);
    let o = child.wait_with_output().expect("wait");
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    assert!(stderr(&o).contains("GCP preemption"), "{}", stderr(&o));
    assert!(job.latest_step().is_some());
}
