//! `keel run --slurm` with a real trainer on the production-like test
//! cluster (`scripts/slurm-cluster`: proctrack/cgroup, task/cgroup,
//! KillWait 30 s): `tests/run/ddp_trainer.py`, a small model trained with
//! PyTorch DDP over gloo on CPU, launched by `torchrun` (one agent per
//! node, c10d rendezvous) under `srun`, checkpointed with
//! torch.distributed.checkpoint into keel's layout. PyTorch comes from
//! `scripts/services/python-torch` (KEEL_TEST_TORCHRUN); `scripts/test`
//! installs it and starts the cluster, and these run one at a time with
//! the other Slurm tests (nextest group `slurm`).
//!
//! The scenarios of issue #47: a node failing mid-run (requeued without
//! it and without the user's excluded node, resumed from the last DCP
//! checkpoint, finishing with the parameters of an uninterrupted run), a
//! preemption notice naming a node that is not the batch host, the time
//! limit's warning under the fixed recipe, a hang of one rank, and
//! torchrun's agent living through a checkpoint request.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use common::Node;
use keel_testkit::imds::{scheduled_event, FakeImds};
use keel_testkit::SlurmCluster;
use serde_json::json;

/// The keel under test: this build's, or KEEL_TEST_KEEL_BIN's (to run
/// the scenarios against another build, e.g. the one before a fix).
fn keel() -> PathBuf {
    match std::env::var_os("KEEL_TEST_KEEL_BIN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_keel")),
    }
}

fn torchrun() -> PathBuf {
    match std::env::var_os("KEEL_TEST_TORCHRUN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => panic!(
            "KEEL_TEST_TORCHRUN is not set: run `eval \"$(scripts/services/python-torch)\"` (scripts/test does)"
        ),
    }
}

fn trainer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/run/ddp_trainer.py")
}

fn field<'a>(show: &'a str, key: &str) -> &'a str {
    show.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or("")
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

/// A batch job running `keel run --slurm` over the DDP trainer: torchrun
/// on every node of the allocation, rendezvous on a port of its own.
struct Job<'a> {
    cluster: &'a SlurmCluster,
    dir: tempfile::TempDir,
    id: String,
}

impl<'a> Job<'a> {
    fn submit(
        cluster: &'a SlurmCluster,
        env: &str,
        sbatch: &[&str],
        run_flags: impl FnOnce(&Path) -> String,
    ) -> Self {
        let launch = format!(
            "{torchrun} --nnodes=$SLURM_NNODES --nproc-per-node=1 --rdzv-backend=c10d \
             --rdzv-endpoint=127.0.0.1:$port --rdzv-id=$SLURM_JOB_ID --local-addr=127.0.0.1 \
             --max-restarts=0 {trainer}",
            torchrun = torchrun().display(),
            trainer = trainer().display(),
        );
        Self::submit_launching(cluster, env, sbatch, run_flags, &launch)
    }

    /// One trainer process on one node, started by srun without torchrun
    /// (its process is srun's task, and gets srun's signals itself).
    fn submit_plain(
        cluster: &'a SlurmCluster,
        env: &str,
        sbatch: &[&str],
        run_flags: impl FnOnce(&Path) -> String,
    ) -> Self {
        let python = torchrun().with_file_name("python3");
        let launch = format!(
            "env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 {} {}",
            python.display(),
            trainer().display()
        );
        Self::submit_launching(
            cluster,
            env,
            &[&["-N1"], sbatch].concat(),
            run_flags,
            &launch,
        )
    }

    /// `launch`: what srun starts on each node (`$port` is the job's).
    fn submit_launching(
        cluster: &'a SlurmCluster,
        env: &str,
        sbatch: &[&str],
        run_flags: impl FnOnce(&Path) -> String,
        launch: &str,
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let run_flags = run_flags(d);
        let script = d.join("job.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/bash\n\
                 export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 DDP_LOG={d}/trained.log DDP_RESULT={d}/result.json {env}\n\
                 port=$((29500 + SLURM_JOB_ID % 400))\n\
                 exec {keel} run --slurm --store file://{d}/store --run ddp --ckpt-dir {d}/ckpt \
                 --state {d}/keel-run.json --watch-interval 0.2 --grace 10 --startup-timeout 120 {run_flags} \
                 -- srun --kill-on-bad-exit=1 --ntasks-per-node=1 {launch}\n",
                d = d.display(),
                keel = keel().display(),
            ),
        )
        .expect("write job");
        let out = Command::new("sbatch")
            .args(["--parsable", "--requeue", "--open-mode=append"])
            .args(sbatch)
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
        let id = String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap_or("")
            .to_owned();
        Job { cluster, dir, id }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn out(&self) -> String {
        std::fs::read_to_string(self.path("job.out")).unwrap_or_default()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("trained.log")).unwrap_or_default()
    }

    fn show(&self) -> String {
        self.cluster
            .command("scontrol", &["show", "job", "-o", &self.id])
            .unwrap_or_default()
    }

    fn wait(&self, what: &str, secs: u64, mut f: impl FnMut(&str) -> bool) -> String {
        let until = Instant::now() + Duration::from_secs(secs);
        loop {
            let show = self.show();
            if f(&show) {
                return show;
            }
            assert!(
                !matches!(field(&show, "JobState"), "FAILED" | "CANCELLED" | "TIMEOUT"),
                "{what}: {show}\n{}",
                self.out()
            );
            assert!(Instant::now() < until, "{what}: {show}\n{}", self.out());
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Waits until the trainer logged `trained N` (rank 0).
    fn wait_trained(&self, n: u64, secs: u64) {
        let until = Instant::now() + Duration::from_secs(secs);
        let line = format!("trained {n} ");
        while !self.log().contains(&line) {
            assert!(
                Instant::now() < until,
                "no step {n}: {}\n{}",
                self.show(),
                self.out()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Makes the requeued job eligible now instead of after Slurm's
    /// requeue delay (waiting for the next second: a launch with a
    /// credential of the second the requeue revoked is refused).
    fn skip_requeue_delay(&self) {
        std::thread::sleep(Duration::from_millis(1500));
        let _ = self.cluster.command(
            "scontrol",
            &["update", &format!("JobId={}", self.id), "StartTime=now"],
        );
    }

    fn result(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.path("result.json")).expect("result"))
            .expect("json")
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        let _ = self.cluster.command("scancel", &[&self.id]);
    }
}

/// The parameters an uninterrupted run of `steps` steps ends with:
/// the same trainer under torchrun on one node, outside Slurm.
fn reference(steps: u64, every: u64) -> serde_json::Value {
    let d = tempfile::tempdir().expect("tempdir");
    let port = 29_000 + (std::process::id() % 400);
    let out = Command::new(torchrun())
        .args(["--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d"])
        .arg(format!("--rdzv-endpoint=127.0.0.1:{port}"))
        .args(["--rdzv-id=reference", "--local-addr=127.0.0.1"])
        .arg(trainer())
        .env("GLOO_SOCKET_IFNAME", "lo")
        .env("OMP_NUM_THREADS", "1")
        .env("KEEL_CKPT_DIR", d.path().join("ckpt"))
        .env("DDP_STEPS", steps.to_string())
        .env("DDP_EVERY", every.to_string())
        .env("DDP_STEP_SECS", "0")
        .env("DDP_RESULT", d.path().join("result.json"))
        .env_remove("SLURM_CONF")
        .output()
        .expect("torchrun");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(d.path().join("result.json")).expect("result"))
        .expect("json")
}

/// Every parameter of `got` within `tol` (relative, at least absolute)
/// of `want`'s; returns the largest difference.
fn assert_close(got: &serde_json::Value, want: &serde_json::Value, tol: f64) -> f64 {
    let hex = |v: &serde_json::Value| -> f64 {
        let s = v.as_str().expect("hex float");
        hexf(s)
    };
    let mut worst = 0.0f64;
    let (g, w) = (&got["params"], &want["params"]);
    let keys: Vec<&String> = w.as_object().expect("params").keys().collect();
    assert!(!keys.is_empty());
    for k in keys {
        let (ga, wa) = (g[k].as_array().expect(k), w[k].as_array().expect(k));
        assert_eq!(ga.len(), wa.len(), "{k}");
        for (a, b) in ga.iter().zip(wa) {
            let (a, b) = (hex(a), hex(b));
            let diff = (a - b).abs();
            assert!(diff <= tol * b.abs().max(1.0), "{k}: {a} vs {b}");
            worst = worst.max(diff);
        }
    }
    worst
}

/// Python's `float.hex()` (`-0x1.78d18a10996dbp-2`, `0x0.0p+0`) read back.
fn hexf(s: &str) -> f64 {
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s),
    };
    let s = s.strip_prefix("0x").expect("0x");
    let (mant, exp) = s.split_once('p').expect("p");
    let (int, frac) = mant.split_once('.').unwrap_or((mant, ""));
    let mut v = f64::from(u8::from_str_radix(int, 16).expect("int"));
    let mut scale = 1.0 / 16.0;
    for c in frac.chars() {
        v += f64::from(c.to_digit(16).expect("hex digit")) * scale;
        scale /= 16.0;
    }
    let v = v * 2f64.powi(exp.parse::<i32>().expect("exp"));
    if neg {
        -v
    } else {
        v
    }
}

/// Scenario 1: n2 fails mid-run (its rank crashes and its health check,
/// the real `keel check --slurm` on a fixture with an ECC fault, fails):
/// the job is requeued excluding n2 and the user's n3, resumes from the
/// last DCP checkpoint on n1 alone, and ends with the parameters of an
/// uninterrupted run (float64; world size 2 then 1, so equal up to
/// rounding: within 1e-9 relative).
#[test]
#[ignore = "needs Slurm and PyTorch: scripts/test starts and installs them"]
fn a_failed_node_is_excluded_and_training_resumes_from_dcp_with_the_same_result() {
    let cluster = SlurmCluster::get();
    let nodes = cluster.nodes().to_vec();
    let (n1, n2, n3) = (nodes[0].clone(), nodes[1].clone(), nodes[2].clone());
    let _r2 = cluster.restore_on_drop(&n2);
    let keel = keel();
    let keel = keel.display();
    let healthy = Node::ndv4();
    let faulty = Node::ndv4();
    faulty.gpu(|v| v["gpus"][3]["ecc"]["volatile_dram_uncorrected"] = json!(2));
    let args = |n: &Node| n.check_args(false, &["--slurm"]).join(" ");
    // A range of nodes starts on what is free: wait until the jobs of the
    // tests before have ended (a cancelled job keeps its node while it
    // completes, up to KillWait).
    cluster
        .wait_until_idle(Duration::from_secs(90))
        .expect("every node idle");
    let job = Job::submit(
        &cluster,
        &format!(
            "DDP_STEPS=25 DDP_EVERY=5 DDP_STEP_SECS=0.3 DDP_MODE=crash-at:13 DDP_FAULT_NODE={n2}"
        ),
        // A range: two nodes (exclusive: Slurm gives the most it can),
        // one once n2 is excluded as well as the user's n3.
        &["--nodes=1-2", "--exclusive", &format!("--exclude={n3}")],
        |d| {
            let check = d.join("check.sh");
            std::fs::write(
                &check,
                format!(
                    "#!/bin/sh\nif [ \"$SLURMD_NODENAME\" = {n2} ] && [ -e {fault} ]; then\n  exec {keel} {bad} --node \"$SLURMD_NODENAME\"\nfi\nexec {keel} {good} --node \"$SLURMD_NODENAME\"\n",
                    fault = d.join("fault").display(),
                    bad = args(&faulty),
                    good = args(&healthy),
                ),
            )
            .expect("write check");
            format!("--check-command 'sh {}'", check.display())
        },
    );
    let show = job.wait("running on two nodes", 120, |s| {
        field(s, "JobState") == "RUNNING"
    });
    assert_eq!(field(&show, "NodeList"), "n[1-2]", "{show}");
    job.wait_trained(3, 180);
    // The GPU goes bad on n2; the trainer's rank there crashes at 13.
    std::fs::write(job.path("fault"), b"").expect("fault");
    let show = job.wait("requeued without n2 and n3", 180, |s| {
        field(s, "Restarts") == "1"
            && field(s, "JobState") == "PENDING"
            && excluded(s) == [n2.clone(), n3.clone()]
    });
    assert_ne!(field(&show, "Priority"), "0", "held: {show}");
    job.skip_requeue_delay();
    let show = job.wait("completed", 300, |s| field(s, "JobState") == "COMPLETED");
    assert_eq!(field(&show, "NodeList"), n1, "{show}");
    let out = job.out();
    assert!(out.contains("resuming from step 10"), "{out}");
    assert!(job.log().contains("resumed 10 "), "{}", job.log());
    let got = job.result();
    assert_eq!(got["step"], 25);
    assert_eq!(got["world"], 1, "resumed on n1 alone");
    let want = reference(25, 5);
    let worst = assert_close(&got, &want, 1e-9);
    eprintln!("largest parameter difference from the uninterrupted run: {worst:e}");
}

/// Scenario 2: a Preempt event through the fake IMDS naming n2, which is
/// not the batch host (n1): the checkpoint is committed, the event is
/// acknowledged after the commit (it names only the job's VMs), the job is
/// requeued and resumes.
#[test]
#[ignore = "needs Slurm and PyTorch: scripts/test starts and installs them"]
fn a_preemption_notice_for_another_node_of_the_job_checkpoints_acks_and_requeues() {
    let cluster = SlurmCluster::get();
    let n3 = cluster.nodes()[2].clone();
    let imds = FakeImds::start("n1").expect("fake imds");
    let job = Job::submit(
        &cluster,
        // Enough steps that a loaded machine's checkpoint, acknowledgement
        // and requeue (tens of seconds) come before the last step.
        "DDP_STEPS=150 DDP_EVERY=1000 DDP_STEP_SECS=0.3",
        &["-N2", &format!("--exclude={n3}")],
        |_| format!("--check-command true --imds {} --imds-ack", imds.base_url()),
    );
    job.wait_trained(4, 180);
    imds.set_events(vec![scheduled_event(
        "evict-n2",
        "Preempt",
        &["n2"],
        SystemTime::now() + Duration::from_secs(60),
    )]);
    job.wait("requeued", 120, |s| field(s, "Restarts") == "1");
    let out = job.out();
    let commit = out.find("committed step").expect(&out);
    let ack = out
        .find("acknowledged scheduled event evict-n2")
        .unwrap_or_else(|| panic!("not acknowledged: {out}"));
    assert!(commit < ack, "acknowledged before the commit: {out}");
    assert_eq!(imds.acks(), ["evict-n2"]);
    imds.set_events(Vec::new());
    job.skip_requeue_delay();
    job.wait("completed", 300, |s| field(s, "JobState") == "COMPLETED");
    assert!(job.out().contains("resuming from step"), "{}", job.out());
}

/// Scenario 3: the time limit's warning under the fixed recipe
/// (`--signal=B:USR1@60`, enough for keel run's waits less KillWait): the
/// checkpoint is committed and the job requeued before Slurm's kill.
#[test]
#[ignore = "needs Slurm and PyTorch: scripts/test starts and installs them"]
fn the_time_limits_warning_commits_a_checkpoint_before_slurms_kill() {
    let cluster = SlurmCluster::get();
    let job = Job::submit(
        &cluster,
        "DDP_STEPS=100000 DDP_EVERY=1000000 DDP_STEP_SECS=0.3",
        &["-N1", "--time=2", "--signal=B:USR1@60"],
        |_| "--check-command true --checkpoint-deadline 40".to_owned(),
    );
    let show = job.wait("requeued at the warning", 200, |s| {
        field(s, "Restarts") == "1"
    });
    let out = job.out();
    assert!(
        out.contains("SIGUSR1: asking the trainer to checkpoint now"),
        "{out}"
    );
    assert!(out.contains("the checkpoint is committed"), "{out}\n{show}");
    assert!(out.contains("committed step"), "{out}");
    assert!(
        !out.contains("DUE TO TIME LIMIT"),
        "killed by the limit: {out}"
    );
}

/// R3: Slurm's SIGTERM meets a checkpoint slower than `KillWait` (here
/// the time limit's kill, no warning signal; the trainer, started by srun
/// itself, takes SIGTERM as "checkpoint and exit", as many do, and its
/// save takes 120 s). keel run's stop must fit in KillWait (30 s): it
/// gives up the checkpoint wait, stops the trainer and requeues the job
/// before Slurm's SIGKILL, so the run goes on from its last commit. (A
/// stop that waits the configured 120 s for the commit is killed first,
/// and the job ends in TIMEOUT, never requeued.)
#[test]
#[ignore = "needs Slurm and PyTorch: scripts/test starts and installs them"]
fn a_sigterm_with_a_checkpoint_slower_than_killwait_is_requeued_before_the_kill() {
    let cluster = SlurmCluster::get();
    let job = Job::submit_plain(
        &cluster,
        "DDP_STEPS=100000 DDP_EVERY=1000000 DDP_STEP_SECS=0.3 DDP_ON_SIGNAL=1 DDP_CKPT_SECS=120",
        &["--time=1"],
        |_| "--check-command true".to_owned(),
    );
    job.wait_trained(3, 180);
    let show = job.wait("requeued at the time limit", 240, |s| {
        field(s, "Restarts") == "1"
    });
    let out = job.out();
    assert!(out.contains("DUE TO TIME LIMIT"), "{out}\n{show}");
    assert!(
        out.contains("SIGTERM: asking the trainer to checkpoint now"),
        "{out}"
    );
    assert!(out.contains("the stop must fit in 30.0 s"), "{out}");
    assert!(
        out.contains("no checkpoint was committed before the deadline"),
        "{out}"
    );
    assert!(out.contains("requeued job"), "{out}");
}

/// Scenario 4: one rank hangs (its node's heartbeat stops while the
/// other's goes on until it blocks in the all-reduce): the hang is found,
/// n2 is blamed and the job requeued without it.
#[test]
#[ignore = "needs Slurm and PyTorch: scripts/test starts and installs them"]
fn a_hung_rank_is_blamed_on_its_node_and_the_job_requeued_without_it() {
    let cluster = SlurmCluster::get();
    let n2 = cluster.nodes()[1].clone();
    let n3 = cluster.nodes()[2].clone();
    let hb = tempfile::tempdir().expect("tempdir");
    let job = Job::submit(
        &cluster,
        &format!(
            "DDP_STEPS=1000 DDP_EVERY=5 DDP_STEP_SECS=1 DDP_MODE=hang-at:18 DDP_FAULT_NODE={n2}"
        ),
        &["-N2", &format!("--exclude={n3}")],
        |_| {
            format!(
                "--check-command true --heartbeat-dir {} --hang-timeout 4 --exclude-after 1",
                hb.path().display()
            )
        },
    );
    // Requeued (Restarts=1 as soon as `scontrol requeue` ran), then its
    // ExcNodeList set.
    let show = job.wait("requeued without n2", 240, |s| {
        field(s, "Restarts") == "1" && excluded(s) == [n2.clone(), n3.clone()]
    });
    assert_ne!(field(&show, "Priority"), "0", "held: {show}");
    let out = job.out();
    assert!(
        out.contains(&format!("no heartbeat from {n2} for")),
        "{out}"
    );
    let st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(job.path("keel-run.json")).expect("state"))
            .expect("json");
    let f = &st["jobs"][job.id.as_str()]["failures"];
    assert_eq!(f[0]["node"], n2.as_str(), "{st}");
    assert_eq!(f[0]["cause"], "hang", "{st}");
    assert_eq!(f.as_array().map(Vec::len), Some(1), "only n2 blamed: {st}");
}

/// Scenario 5: a checkpoint request reaches the workers through the
/// request file and torchrun's agent goes on: the commit is of a step no
/// interval would have saved, and the trainer was stopped by keel after
/// it, not killed by the request. (The old default, USR1 to the trainer's
/// process group, reaches the agent through srun, and the agent does not
/// handle USR1: it dies of it.)
#[test]
#[ignore = "needs Slurm and PyTorch: scripts/test starts and installs them"]
fn torchruns_agent_survives_a_checkpoint_request() {
    let cluster = SlurmCluster::get();
    let job = Job::submit(
        &cluster,
        "DDP_STEPS=100000 DDP_EVERY=1000000 DDP_STEP_SECS=0.3",
        &["-N1"],
        |_| "--check-command true".to_owned(),
    );
    job.wait_trained(3, 180);
    cluster
        .command("scancel", &["--batch", "--signal=USR2", &job.id])
        .expect("scancel --signal");
    job.wait("requeued", 120, |s| field(s, "Restarts") == "1");
    let out = job.out();
    assert!(
        out.contains("SIGUSR2: asking the trainer to checkpoint now"),
        "{out}"
    );
    assert!(out.contains("the checkpoint is committed"), "{out}");
    assert!(
        !out.contains("Received Signals.SIGUSR"),
        "the agent got a signal: {out}"
    );
    assert!(!out.contains("death signal"), "{out}");
}
