//! `keel run --slurm` against the real Slurm test cluster
//! (`scripts/slurm-cluster`, by default under proctrack/cgroup as
//! production clusters run): a batch job whose trainer crashes on n2,
//! whose node check (the real `keel check --slurm` on a fixture machine
//! with an injected ECC fault) then fails there: n2 is drained by the
//! check, the job is requeued excluding n2 as well as the nodes its user
//! excluded, and resumes from the last committed step on another node.
//!
//! `scripts/test` starts the cluster and runs these one at a time (nextest
//! group `slurm`).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::Node;
use keel_testkit::SlurmCluster;
use serde_json::json;

fn scontrol_job(cluster: &SlurmCluster, job: &str) -> String {
    cluster
        .command("scontrol", &["show", "job", "-o", job])
        .unwrap_or_default()
}

fn field<'a>(show: &'a str, key: &str) -> &'a str {
    show.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or("")
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_crash_on_n2_drains_it_requeues_without_it_and_resumes_from_the_last_commit() {
    let cluster = SlurmCluster::get();
    let nodes = cluster.nodes().to_vec();
    assert!(nodes.len() >= 3, "{nodes:?}");
    let (n1, n2, n3) = (nodes[0].clone(), nodes[1].clone(), nodes[2].clone());
    let _r2 = cluster.restore_on_drop(&n2);

    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let keel = env!("CARGO_BIN_EXE_keel");
    // The node check: the real keel check --slurm on fixture machines, one
    // with an uncorrectable ECC error on n2 once `fault` exists.
    let healthy = Node::ndv4();
    let faulty = Node::ndv4();
    faulty.gpu(|v| v["gpus"][3]["ecc"]["volatile_dram_uncorrected"] = json!(2));
    let args = |n: &Node| n.check_args(false, &["--slurm"]).join(" ");
    let check = dir.join("check.sh");
    std::fs::write(
        &check,
        format!(
            "#!/bin/sh\nif [ \"$SLURMD_NODENAME\" = {n2} ] && [ -e {fault} ]; then\n  exec {keel} {bad} --node \"$SLURMD_NODENAME\"\nfi\nexec {keel} {good} --node \"$SLURMD_NODENAME\"\n",
            fault = dir.join("fault").display(),
            bad = args(&faulty),
            good = args(&healthy),
        ),
    )
    .expect("write check");
    let trainer = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/run/toy_trainer.py");
    let log = dir.join("trained.log");
    let script = dir.join("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\nexport TOY_STEPS=20 TOY_EVERY=5 TOY_STEP_SECS=0.3 TOY_MODE=crash-at:13 TOY_CRASH_NODE={n2} TOY_LOG={log}\n\
             exec {keel} run --slurm --check-command 'sh {check}' --store file://{d}/store --run toy \
             --ckpt-dir {d}/ckpt --state {d}/keel-run.json --watch-interval 0.2 --grace 2 \
             -- srun --kill-on-bad-exit=1 python3 {trainer}\n",
            log = log.display(),
            check = check.display(),
            d = dir.display(),
            trainer = trainer.display(),
        ),
    )
    .expect("write job");
    let conf = cluster.conf().display().to_string();
    let out = Command::new("sbatch")
        .args(["--parsable", "-N1", "--requeue", "--open-mode=append"])
        // The user's own exclusion: Slurm places the job on n2, and the
        // requeue must keep n1 off as well as n2.
        .arg(format!("--exclude={n1}"))
        .arg(format!("--output={}/job.out", dir.display()))
        .arg(&script)
        .env("SLURM_CONF", &conf)
        .output()
        .expect("sbatch");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let job = String::from_utf8_lossy(&out.stdout)
        .trim()
        .split(';')
        .next()
        .unwrap_or("")
        .to_owned();
    let _cancel = Cancel(&cluster, job.clone());

    // Training starts on n2; the GPU goes bad there.
    let until = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("trained 3")
    {
        assert!(
            Instant::now() < until,
            "no training: {}",
            std::fs::read_to_string(dir.join("job.out")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::fs::write(dir.join("fault"), b"").expect("fault");

    // The crash at step 13, the check drains n2 and the job is requeued
    // excluding n2 and the user's n1; never held (under proctrack/cgroup
    // nothing outlives the batch step to release it).
    let until = Instant::now() + Duration::from_secs(90);
    loop {
        let show = scontrol_job(&cluster, &job);
        if excluded(&show) == [n1.clone(), n2.clone()]
            && field(&show, "JobState") == "PENDING"
            && field(&show, "Restarts") == "1"
        {
            assert_ne!(field(&show, "Priority"), "0", "held: {show}");
            assert_ne!(
                field(&show, "Reason"),
                "job_requeued_in_held_state",
                "{show}"
            );
            break;
        }
        assert!(
            Instant::now() < until,
            "not requeued without {n2}: {show}\n{}",
            std::fs::read_to_string(dir.join("job.out")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let raw = cluster.raw_node(&n2).expect("sinfo");
    assert!(raw.state.starts_with("drain"), "{raw:?}");
    assert!(raw.reason.starts_with("keel: gpu.ecc_errors"), "{raw:?}");
    // Skip Slurm's requeue delay.
    skip_requeue_delay(&cluster, &job);

    let until = Instant::now() + Duration::from_secs(150);
    loop {
        let show = scontrol_job(&cluster, &job);
        let state = field(&show, "JobState");
        if state == "COMPLETED" {
            assert_eq!(field(&show, "NodeList"), n3, "{show}");
            break;
        }
        assert!(
            !matches!(state, "FAILED" | "CANCELLED" | "TIMEOUT"),
            "{show}\n{}",
            std::fs::read_to_string(dir.join("job.out")).unwrap_or_default()
        );
        assert!(
            Instant::now() < until,
            "did not complete: {show}\n{}",
            std::fs::read_to_string(dir.join("job.out")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let out = std::fs::read_to_string(dir.join("job.out")).unwrap_or_default();
    assert!(out.contains("resuming from step 10"), "{out}");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.contains("resumed 10"), "{text}");
    let trained: Vec<u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix("trained "))
        .map(|n| n.parse().expect("step"))
        .collect();
    for s in 1..=20u64 {
        let n = trained.iter().filter(|&&x| x == s).count();
        let most = if (11..=12).contains(&s) { 2 } else { 1 };
        assert!(
            n >= 1 && n <= most,
            "step {s} trained {n} times: {trained:?}"
        );
    }
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("keel-run.json")).expect("state"))
            .expect("json");
    let failures = &state["jobs"][job.as_str()]["failures"];
    assert!(
        failures
            .as_array()
            .expect("failures")
            .iter()
            .any(|f| f["node"] == n2.as_str() && f["cause"] == "crash"),
        "{state}"
    );
}

/// A job's `ExcNodeList`, expanded and sorted.
fn excluded(show: &str) -> Vec<String> {
    let list = field(show, "ExcNodeList");
    if list.is_empty() || list == "(null)" {
        return Vec::new();
    }
    let mut v = keel_slurm::expand_hostlist(list).expect("hostlist");
    v.sort();
    v
}

/// Cancels the job when the test ends, however it ends.
struct Cancel<'a>(&'a SlurmCluster, String);

impl Drop for Cancel<'_> {
    fn drop(&mut self) {
        let _ = self.0.command("scancel", &[&self.1]);
    }
}

/// A batch job running `keel run --slurm` over the toy trainer with `env`
/// on one node (`extra` sbatch flags), in its own directory.
struct Submitted<'a> {
    cluster: &'a SlurmCluster,
    dir: tempfile::TempDir,
    job: String,
}

impl<'a> Submitted<'a> {
    fn new(cluster: &'a SlurmCluster, env: &str, run_flags: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let trainer = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/run/toy_trainer.py");
        let script = d.join("job.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/bash\nexport TOY_LOG={d}/trained.log {env}\n\
                 exec {keel} run --slurm --check-command true --store file://{d}/store --run toy \
                 --ckpt-dir {d}/ckpt --state {d}/keel-run.json --watch-interval 0.2 --grace 2 {run_flags} \
                 -- srun --kill-on-bad-exit=1 python3 {trainer}\n",
                d = d.display(),
                keel = env!("CARGO_BIN_EXE_keel"),
                trainer = trainer.display(),
            ),
        )
        .expect("write job");
        let out = Command::new("sbatch")
            .args(["--parsable", "-N1", "--requeue", "--open-mode=append"])
            .args(extra)
            .arg(format!("--output={}/job.out", d.display()))
            .arg(&script)
            .env("SLURM_CONF", cluster.conf())
            .output()
            .expect("sbatch");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let job = String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap_or("")
            .to_owned();
        Submitted { cluster, dir, job }
    }

    fn out(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("job.out")).unwrap_or_default()
    }

    fn show(&self) -> String {
        scontrol_job(self.cluster, &self.job)
    }

    fn wait(&self, what: &str, secs: u64, mut f: impl FnMut(&str) -> bool) -> String {
        let until = Instant::now() + Duration::from_secs(secs);
        loop {
            let show = self.show();
            if f(&show) {
                return show;
            }
            assert!(Instant::now() < until, "{what}: {show}\n{}", self.out());
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn trained(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("trained.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("trained "))
            .count()
    }

    fn state(&self) -> serde_json::Value {
        serde_json::from_slice(
            &std::fs::read(self.dir.path().join("keel-run.json")).expect("state"),
        )
        .expect("json")
    }
}

impl Drop for Submitted<'_> {
    fn drop(&mut self) {
        let _ = self.cluster.command("scancel", &[&self.job]);
    }
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_start_up_failure_loop_is_stopped_by_the_retry_budget() {
    let cluster = SlurmCluster::get();
    let s = Submitted::new(
        &cluster,
        "TOY_MODE=startup-fail",
        "--startup-retries 2",
        &[],
    );
    // The first failure requeues (no node to exclude: plain requeue).
    let requeued = s.wait("requeued", 60, |show| field(show, "Restarts") == "1");
    // Until slurmctld has moved the requeued job back to pending, it may
    // still show the first attempt's end (COMPLETED, exit 0): the stop
    // that counts is the second attempt's, which has its own start time.
    let first_start = field(&requeued, "StartTime").to_owned();
    skip_requeue_delay(&cluster, &s.job);
    let show = s.wait("stopped", 90, |show| {
        field(show, "StartTime") != first_start
            && matches!(field(show, "JobState"), "FAILED" | "COMPLETED")
    });
    assert_eq!(field(&show, "JobState"), "FAILED", "{show}");
    assert_eq!(field(&show, "ExitCode"), "93:0", "{show}");
    assert_eq!(field(&show, "Restarts"), "1", "{show}");
    assert!(
        s.out()
            .contains("failed at start-up 2 times in a row (last: exit code 3)"),
        "{}",
        s.out()
    );
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn slurms_sigterm_commits_a_checkpoint_and_requeues() {
    let cluster = SlurmCluster::get();
    let s = Submitted::new(
        &cluster,
        "TOY_STEPS=100000 TOY_EVERY=1000000 TOY_STEP_SECS=0.1",
        "",
        &[],
    );
    s.wait("training", 60, |_| s.trained() >= 5);
    // What preemption and the time limit send the batch shell.
    cluster
        .command("scancel", &["--batch", "--signal=TERM", &s.job])
        .expect("scancel --signal");
    s.wait("requeued", 60, |show| field(show, "Restarts") == "1");
    let out = s.out();
    assert!(out.contains("the checkpoint is committed"), "{out}");
    assert!(out.contains("committed step"), "{out}");
    assert_eq!(
        s.state()["jobs"][s.job.as_str()]["attempts"][0]["ended"],
        "preempted"
    );
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_job_the_user_cancels_is_not_checkpointed_or_requeued() {
    let cluster = SlurmCluster::get();
    let s = Submitted::new(
        &cluster,
        "TOY_STEPS=100000 TOY_EVERY=1000000 TOY_STEP_SECS=0.1",
        "",
        &[],
    );
    s.wait("training", 60, |_| s.trained() >= 3);
    cluster.command("scancel", &[&s.job]).expect("scancel");
    let until = Instant::now() + Duration::from_secs(30);
    while !s.out().contains("the job was cancelled") || !s.out().contains("cancelled by the user") {
        assert!(Instant::now() < until, "{}", s.out());
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(3));
    let show = s.show();
    assert!(field(&show, "JobState").starts_with("CANCELLED"), "{show}");
    assert_eq!(field(&show, "Restarts"), "0", "{show}");
    assert!(!s.out().contains("requeued job"), "{}", s.out());
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_black_hole_node_is_excluded_after_two_failures_though_its_checks_pass() {
    let cluster = SlurmCluster::get();
    let nodes = cluster.nodes().to_vec();
    let (n1, n2, n3) = (nodes[0].clone(), nodes[1].clone(), nodes[2].clone());
    let _r2 = cluster.restore_on_drop(&n2);
    // Placed on n2 first (the user excludes n1); the trainer crashes
    // there every time, and the node check (`true`) always passes.
    let s = Submitted::new(
        &cluster,
        &format!(
            "TOY_STEPS=12 TOY_EVERY=5 TOY_STEP_SECS=0.1 TOY_MODE=crash-at:8 TOY_CRASH_NODE={n2}"
        ),
        "",
        &[&format!("--exclude={n1}")],
    );
    // First failure: requeued as it was (one failure excludes nothing).
    let show = s.wait("first requeue", 60, |show| field(show, "Restarts") == "1");
    assert_eq!(excluded(&show), std::slice::from_ref(&n1), "{show}");
    skip_requeue_delay(&cluster, &s.job);
    // Second failure on n2: excluded now, beside the user's n1.
    s.wait("second requeue without n2", 90, |show| {
        field(show, "Restarts") == "2"
            && excluded(show) == [n1.clone(), n2.clone()]
            && field(show, "JobState") == "PENDING"
            && field(show, "Priority") != "0"
    });
    skip_requeue_delay(&cluster, &s.job);
    let show = s.wait("completed elsewhere", 90, |show| {
        field(show, "JobState") == "COMPLETED"
    });
    assert_eq!(field(&show, "NodeList"), n3, "{show}");
    let raw = cluster.raw_node(&n2).expect("sinfo");
    assert!(
        !raw.state.contains("drain"),
        "checks passed: not drained: {raw:?}"
    );
    let st = s.state();
    let f = &st["jobs"][s.job.as_str()]["failures"];
    assert_eq!(f[0]["node"], n2.as_str(), "{st}");
    assert_eq!(f[0]["count"], 2, "{st}");
    assert!(s.out().contains("resuming from step 5"), "{}", s.out());
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_hang_is_detected_the_step_ended_and_the_job_requeued() {
    let cluster = SlurmCluster::get();
    let s = Submitted::new(
        &cluster,
        "TOY_STEPS=100 TOY_EVERY=5 TOY_STEP_SECS=0.3 TOY_MODE=hang-at:9",
        "--heartbeat-pattern loss --safety-factor 2 --startup-timeout 60",
        &[],
    );
    s.wait("requeued after the hang", 60, |show| {
        field(show, "Restarts") == "1"
    });
    let out = s.out();
    assert!(out.contains("the trainer is hung"), "{out}");
    assert!(out.contains("committed step 5"), "{out}");
    let st = s.state();
    assert_eq!(
        st["jobs"][s.job.as_str()]["attempts"][0]["ended"],
        "failed",
        "{st}"
    );
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_node_that_stops_reporting_is_blamed_for_the_hang() {
    let cluster = SlurmCluster::get();
    let nodes = cluster.nodes().to_vec();
    let (n2, n3) = (nodes[1].clone(), nodes[2].clone());
    let hb = tempfile::tempdir().expect("tempdir");
    let s = Submitted::new(
        &cluster,
        &format!("TOY_STEPS=1000 TOY_EVERY=100000 TOY_STEP_SECS=0.2 TOY_MODE=hang-at:10 TOY_HANG_NODE={n2}"),
        &format!("--heartbeat-dir {} --safety-factor 2", hb.path().display()),
        &["-N2", "--ntasks-per-node=1", &format!("--exclude={n3}")],
    );
    s.wait("requeued after the hang", 60, |show| {
        field(show, "Restarts") == "1"
    });
    let out = s.out();
    assert!(
        out.contains(&format!("no heartbeat from {n2} for")),
        "{out}"
    );
    let st = s.state();
    let f = &st["jobs"][s.job.as_str()]["failures"][0];
    assert_eq!(f["node"], n2.as_str(), "{st}");
    assert_eq!(f["cause"], "hang", "{st}");
}

/// keel run marks its job in the job's Comment; where Slurm refuses the
/// change (here a comment already at Slurm's 1024 characters) the job runs
/// all the same, after a warning.
#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_job_that_cannot_be_marked_runs_after_a_warning() {
    let cluster = SlurmCluster::get();
    let full = "x".repeat(1020);
    let comment = format!("--comment={full}");
    let s = Submitted::new(&cluster, "TOY_STEPS=5", "", &[comment.as_str()]);
    let show = s.wait("ended", 60, |show| {
        matches!(field(show, "JobState"), "COMPLETED" | "FAILED")
    });
    assert_eq!(field(&show, "JobState"), "COMPLETED", "{show}\n{}", s.out());
    let out = s.out();
    assert!(
        out.contains(&format!(
            "keel run: warning: cannot add `keel-run` to job {}'s Comment",
            s.job
        )),
        "{out}"
    );
    assert_eq!(s.trained(), 5, "{out}");
    assert_eq!(field(&show, "Comment"), full);

    // A comment with room: marked once, after what it held.
    let s = Submitted::new(&cluster, "TOY_STEPS=5", "", &["--comment=team=ml"]);
    let show = s.wait("ended", 60, |show| {
        matches!(field(show, "JobState"), "COMPLETED" | "FAILED")
    });
    assert_eq!(field(&show, "JobState"), "COMPLETED", "{show}\n{}", s.out());
    assert!(
        s.out().contains(&format!(
            "keel run: marked job {} as run under keel run",
            s.job
        )),
        "{}",
        s.out()
    );
    assert!(show.contains("Comment=team=ml keel-run "), "{show}");
}

/// Makes a requeued job eligible now instead of after Slurm's requeue
/// delay. The requeue revoked the job's credential on its node to the
/// second; a launch whose new credential is dated the same second is
/// refused ("Job credential revoked") and the job fails with exit code 1.
/// So the new start waits for the next second first.
fn skip_requeue_delay(cluster: &SlurmCluster, job: &str) {
    std::thread::sleep(Duration::from_millis(1500));
    let _ = cluster.command(
        "scontrol",
        &["update", &format!("JobId={job}"), "StartTime=now"],
    );
}
