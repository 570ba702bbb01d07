//! keel-slurm against a real Slurm: the cluster `scripts/slurm-cluster`
//! runs on this host (three nodes). `scripts/test` starts it and runs these;
//! by hand: `eval "$(scripts/slurm-cluster start)"` then
//! `cargo nextest run -p keel-slurm --run-ignored all`.
//!
//! The tests share the cluster: nextest runs them one at a time (test
//! group `slurm`), and each one resumes the nodes it touched, even when it
//! fails (guards).

use std::thread;
use std::time::{Duration, Instant};

use keel_slurm::{decide, expand_hostlist, Action, NodeState, Policy, SlurmError, Verdict};
use keel_testkit::SlurmCluster;

const TIMEOUT: Duration = Duration::from_secs(10);

fn unhealthy(reason: &str) -> Verdict {
    Verdict::Unhealthy {
        reason: reason.into(),
    }
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn reads_the_state_of_every_node() {
    let cluster = SlurmCluster::get();
    let slurm = cluster.slurm(TIMEOUT);
    assert!(!cluster.nodes().is_empty());
    for name in cluster.nodes() {
        let node = slurm.node(name).expect("reads the node");
        assert_eq!(node.name, *name);
        assert_eq!(node.state, NodeState::Idle, "{node:?}");
        assert!(!node.is_drained());
        assert_eq!(node.reason, None);
        assert!(!node.flags.not_responding && !node.flags.power_or_reboot());
    }
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn an_unknown_node_is_no_such_node() {
    let cluster = SlurmCluster::get();
    let slurm = cluster.slurm(TIMEOUT);
    for result in [
        slurm.node("keel-no-such-node").map(drop),
        slurm.drain("keel-no-such-node", "keel: test"),
        slurm.resume("keel-no-such-node"),
    ] {
        match result {
            Err(SlurmError::NoSuchNode { name }) => assert_eq!(name, "keel-no-such-node"),
            other => panic!("expected NoSuchNode, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_drain_reason_reads_back_through_sinfo_and_resume_clears_it() {
    let cluster = SlurmCluster::get();
    let name = cluster.node(0);
    let _restore = cluster.restore_on_drop(name);
    let slurm = cluster.slurm(TIMEOUT);
    let reason = r#"keel: test: "quoted" | piped, with = signs and 'apostrophes'"#;

    slurm.drain(name, reason).expect("drains");
    let raw = cluster.raw_node(name).expect("sinfo");
    assert_eq!(raw.state, "drained");
    assert_eq!(raw.reason, reason);
    let node = slurm.node(name).expect("reads the node");
    assert_eq!(node.state, NodeState::Drained);
    assert_eq!(node.reason.as_deref(), Some(reason));

    slurm.resume(name).expect("resumes");
    // `idle*` until the controller has pinged the node, then `idle`.
    let raw = cluster.raw_node(name).expect("sinfo");
    assert!(raw.state.starts_with("idle"), "{raw:?}");
    assert_eq!(raw.reason, "none");
    let node = slurm.node(name).expect("reads the node");
    assert_eq!((node.state, node.reason), (NodeState::Idle, None));
    cluster
        .wait_for_state(name, "idle", TIMEOUT)
        .expect("back in service");

    // Slurm refuses to resume a node in service: an error, not a no-op.
    assert!(matches!(slurm.resume(name), Err(SlurmError::Failed { .. })));
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn an_administrators_drain_is_left_alone() {
    let cluster = SlurmCluster::get();
    let name = cluster.node(1);
    let _restore = cluster.restore_on_drop(name);
    let slurm = cluster.slurm(TIMEOUT);
    let policy = Policy::default();
    let admin = "admin: replacing a fan";
    cluster.admin_drain(name, admin).expect("admin drain");
    let before = cluster.raw_node(name).expect("sinfo");

    for verdict in [
        Verdict::Healthy {
            passed: vec!["gpu".into()],
        },
        unhealthy("keel: gpu: xid 79"),
        Verdict::Unknown {
            reason: "keel: nvml: timeout".into(),
        },
    ] {
        let node = slurm.node(name).expect("reads the node");
        let action = decide(&node, verdict.clone(), &policy);
        assert!(
            matches!(&action, Action::Nothing { .. }),
            "{verdict:?}: {action:?}"
        );
        slurm.apply(name, &action).expect("applies");
    }
    // Fail-closed does not take over someone else's drain either.
    let node = slurm.node(name).expect("reads the node");
    let closed = Policy {
        fail_closed: true,
        ..Policy::default()
    };
    let action = decide(
        &node,
        Verdict::Unknown {
            reason: "keel: x".into(),
        },
        &closed,
    );
    slurm.apply(name, &action).expect("applies");
    assert_eq!(cluster.raw_node(name).expect("sinfo"), before);
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_node_keel_drained_is_resumed_when_healthy() {
    let cluster = SlurmCluster::get();
    let name = cluster.node(2);
    let _restore = cluster.restore_on_drop(name);
    let slurm = cluster.slurm(TIMEOUT);
    let policy = Policy::default();

    let node = slurm.node(name).expect("reads the node");
    let action = decide(&node, unhealthy("keel: gpu: xid 79"), &policy);
    assert_eq!(
        action,
        Action::Drain {
            reason: "keel: gpu: xid 79".into()
        }
    );
    slurm.apply(name, &action).expect("drains");
    assert_eq!(cluster.raw_node(name).expect("sinfo").state, "drained");

    let node = slurm.node(name).expect("reads the node");
    let action = decide(&node, Verdict::Healthy { passed: vec![] }, &policy);
    assert!(matches!(action, Action::Nothing { .. }), "{action:?}");
    let healthy = Verdict::Healthy {
        passed: vec!["gpu".into()],
    };
    let action = decide(&node, healthy, &policy);
    assert_eq!(action, Action::Resume);
    slurm.apply(name, &action).expect("resumes");
    let raw = cluster
        .wait_for_state(name, "idle", TIMEOUT)
        .expect("back in service");
    assert_eq!(raw.reason, "none");
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn an_identical_reason_is_not_rewritten_and_a_new_one_is() {
    let cluster = SlurmCluster::get();
    let name = cluster.node(0);
    let _restore = cluster.restore_on_drop(name);
    let slurm = cluster.slurm(TIMEOUT);
    let policy = Policy::default();
    slurm
        .drain(name, "keel: ecc: 2 uncorrectable")
        .expect("drains");
    let before = cluster.raw_node(name).expect("sinfo");

    // Slurm stamps the reason to the second: a rewrite would show.
    thread::sleep(Duration::from_millis(1100));
    let node = slurm.node(name).expect("reads the node");
    let action = decide(&node, unhealthy("keel: ecc: 2 uncorrectable"), &policy);
    assert!(matches!(action, Action::Nothing { .. }), "{action:?}");
    slurm.apply(name, &action).expect("applies");
    assert_eq!(cluster.raw_node(name).expect("sinfo"), before);

    let action = decide(&node, unhealthy("keel: ecc: 3 uncorrectable"), &policy);
    slurm.apply(name, &action).expect("applies");
    let after = cluster.raw_node(name).expect("sinfo");
    assert_eq!(after.state, "drained");
    assert_eq!(after.reason, "keel: ecc: 3 uncorrectable");
    assert_ne!(after.reason_time, before.reason_time);
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn unknown_drains_only_when_fail_closed() {
    let cluster = SlurmCluster::get();
    let name = cluster.node(1);
    let _restore = cluster.restore_on_drop(name);
    let slurm = cluster.slurm(TIMEOUT);
    let unknown = || Verdict::Unknown {
        reason: "nvml: timeout".into(),
    };

    let node = slurm.node(name).expect("reads the node");
    let action = decide(&node, unknown(), &Policy::default());
    slurm.apply(name, &action).expect("applies");
    assert_eq!(cluster.raw_node(name).expect("sinfo").state, "idle");

    let closed = Policy {
        fail_closed: true,
        ..Policy::default()
    };
    let action = decide(&node, unknown(), &closed);
    slurm.apply(name, &action).expect("applies");
    let raw = cluster.raw_node(name).expect("sinfo");
    assert_eq!(raw.state, "drained");
    assert_eq!(raw.reason, "keel: nvml: timeout");
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_hung_controller_times_out_and_the_node_is_untouched() {
    let cluster = SlurmCluster::get();
    let name = cluster.node(2);
    let _restore = cluster.restore_on_drop(name);
    let timeout = Duration::from_secs(1);
    let slurm = cluster.slurm(timeout);
    let before = cluster.raw_node(name).expect("sinfo");

    let paused = cluster.pause_controller().expect("SIGSTOP slurmctld");
    for call in ["drain", "node", "resume"] {
        let started = Instant::now();
        let result = match call {
            "drain" => slurm.drain(name, "keel: test: controller hung"),
            "node" => slurm.node(name).map(drop),
            _ => slurm.resume(name),
        };
        let took = started.elapsed();
        assert!(
            matches!(&result, Err(SlurmError::Timeout { seconds, .. }) if *seconds == timeout.as_secs_f64()),
            "{call}: {result:?}"
        );
        assert!(
            took < timeout + Duration::from_secs(1),
            "{call} took {took:?}"
        );
    }
    paused.resume().expect("SIGCONT slurmctld");

    // Whatever reached the controller's backlog is processed now: the
    // drain must not be among it.
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        assert_eq!(cluster.raw_node(name).expect("sinfo"), before);
        thread::sleep(Duration::from_millis(250));
    }
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_dead_controller_is_an_error_not_a_hang() {
    let cluster = SlurmCluster::get();
    let name = cluster.node(0);
    let timeout = Duration::from_secs(5);
    let slurm = cluster.slurm(timeout);

    let stopped = cluster.stop_controller().expect("stop slurmctld");
    for call in ["node", "drain"] {
        let started = Instant::now();
        let result = match call {
            "node" => slurm.node(name).map(drop),
            _ => slurm.drain(name, "keel: test: controller dead"),
        };
        let took = started.elapsed();
        assert!(
            matches!(&result, Err(SlurmError::Failed { command, .. }) if command == "scontrol ping"),
            "{call}: {result:?}"
        );
        assert!(took < timeout, "{call} took {took:?}");
    }
    stopped.restart().expect("restart slurmctld");
    let node = slurm.node(name).expect("reads the node again");
    assert_eq!((node.state, node.reason), (NodeState::Idle, None));
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn hostlists_expand_like_scontrol_show_hostnames() {
    let cluster = SlurmCluster::get();
    for list in [
        "n[1-3,5],gpu01",
        "gpu[08-11]",
        "gpu[098-101]",
        "r[1-2]n[1-2]",
        "n[9-10],n[01-3],n[1-03]",
        " a , ,b",
    ] {
        let slurm: Vec<String> = cluster
            .command("scontrol", &["show", "hostnames", list])
            .expect("scontrol show hostnames")
            .lines()
            .map(str::to_owned)
            .collect();
        assert_eq!(expand_hostlist(list).expect("expands"), slurm, "{list}");
    }
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn a_jobs_comment_is_marked_once_and_read_back() {
    let cluster = SlurmCluster::get();
    let slurm = cluster.slurm(TIMEOUT);
    let out = cluster
        .command(
            "sbatch",
            &[
                "--parsable",
                "-o",
                "/dev/null",
                "-J",
                "keel-comment",
                "--comment",
                "team=ml  a|b",
                "--wrap",
                "sleep 30",
            ],
        )
        .expect("sbatch");
    let job = out.trim().split(';').next().unwrap_or("").to_owned();
    struct Cancel<'a>(&'a SlurmCluster, String);
    impl Drop for Cancel<'_> {
        fn drop(&mut self) {
            let _ = self.0.command("scancel", &[&self.1]);
        }
    }
    let _cancel = Cancel(&cluster, job.clone());
    assert_eq!(slurm.job_comment(&job).expect("reads"), "team=ml  a|b");
    assert!(slurm.mark_job(&job, keel_slurm::RUN_MARKER).expect("marks"));
    assert_eq!(
        slurm.job_comment(&job).expect("reads"),
        "team=ml  a|b keel-run"
    );
    assert!(!slurm.mark_job(&job, keel_slurm::RUN_MARKER).expect("marks"));
    assert_eq!(
        slurm.job_comment(&job).expect("reads"),
        "team=ml  a|b keel-run"
    );
    // A job Slurm does not know.
    assert!(matches!(
        slurm.mark_job("999999", keel_slurm::RUN_MARKER),
        Err(SlurmError::Failed { .. })
    ));

    // A comment of several lines (scontrol prints it raw, a newline
    // looking like the end of the field) is kept whole.
    let comment = "team=ml\nproject=x\n\nSubmitLine=y";
    let out = cluster
        .command(
            "sbatch",
            &[
                "--parsable",
                "-o",
                "/dev/null",
                "-J",
                "keel-comment",
                "--comment",
                comment,
                "--wrap",
                "sleep 30",
            ],
        )
        .expect("sbatch");
    let job = out.trim().split(';').next().unwrap_or("").to_owned();
    let _cancel = Cancel(&cluster, job.clone());
    assert_eq!(slurm.job_comment(&job).expect("reads"), comment);
    assert!(slurm.mark_job(&job, keel_slurm::RUN_MARKER).expect("marks"));
    assert_eq!(
        slurm.job_comment(&job).expect("reads"),
        format!("{comment} keel-run")
    );
}
