//! The supervisor's Slurm side: marking the job, the pre-flight and
//! post-failure node checks (srun, then each node read back), whether Slurm
//! is already ending the job, what Slurm allows before its SIGKILL, and
//! srun's failure lines.

use super::*;

/// What Slurm allows from a signal to its SIGKILL (see
/// [`crate::budget::until_kill`]): KillWait after SIGTERM, the job's
/// time left and KillWait after the warning signal. `None` outside Slurm
/// or when it cannot be read.
pub(super) fn slurm_until_kill(
    sh: &Shell,
    plan: &Plan,
    sigterm: bool,
    kill_wait: Option<Duration>,
) -> Option<Duration> {
    let m = plan.slurm.as_ref()?;
    let time_left = if sigterm {
        None
    } else {
        let job = plan.slurm_job_id();
        match m.client.time_left(&job) {
            Ok(t) => t,
            Err(e) => {
                sh.say(&format!("cannot read the job's time left ({e})"));
                None
            }
        }
    };
    crate::budget::until_kill(sigterm, kill_wait, time_left)
}

/// Runs the health check on every node of the allocation (one task per
/// node) and reads each node from Slurm afterwards: a node drained with
/// keel's prefix failed its check, and one Slurm reports down or not
/// responding is a suspect the check could not reach (decided in
/// [`crate::decide`]). A check that cannot run changes nothing (fail
/// open).
pub(super) fn check_nodes(sh: &Shell, m: &SlurmMode) -> Vec<crate::NodeReport> {
    let n = m.nodes.len().to_string();
    let mut cmd = Command::new("srun");
    cmd.args(["--nodes", &n, "--ntasks", &n, "--ntasks-per-node=1"])
        .args(["--kill-on-bad-exit=0", "--job-name=keel-check"])
        .args(&m.check)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    match cmd.spawn() {
        Ok(mut c) => {
            let until = sh.instant() + m.check_timeout;
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if sh.instant() < until => {
                        sh.sleep(Duration::from_millis(100));
                    }
                    _ => {
                        sh.say("the node checks did not finish in time; stopping them");
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
        Err(e) => sh.say(&format!("cannot run the node checks with srun: {e}")),
    }
    let policy = keel_slurm::Policy::default();
    let mut reports = Vec::new();
    for node in &m.nodes {
        match m.client.node(node) {
            Ok(info) => {
                let verdict = match info.reason.as_deref() {
                    Some(r) if info.is_drained() && policy.owns(r) => crate::Verdict::Unhealthy {
                        reason: r.to_owned(),
                    },
                    _ => crate::Verdict::Healthy { passed: Vec::new() },
                };
                reports.push(crate::NodeReport { info, verdict });
            }
            Err(e) => sh.say(&format!("cannot read node {node} from Slurm: {e}")),
        }
    }
    reports
}

/// A node's state as Slurm's long form writes it: `down`,
/// `allocated+not_responding`.
pub(super) fn slurm_state(info: &keel_slurm::NodeInfo) -> String {
    if info.flags.not_responding {
        format!("{}+not_responding", info.state)
    } else {
        info.state.to_string()
    }
}

/// Adds keel run's marker to the job's Comment, so that Slurm accounting
/// (with `AccountingStoreFlags=job_comment`) records the job as run under
/// keel run: `keel cost` counts such jobs as requeue-safe. A job that
/// cannot be marked is still run; the warning says what keel cost will
/// miss.
pub(super) fn mark_job(sh: &Shell, plan: &Plan, m: &SlurmMode) {
    let job = plan.slurm_job_id();
    match m.client.mark_job(&job, keel_slurm::RUN_MARKER) {
        Ok(true) => sh.say(&format!(
            "marked job {job} as run under keel run (`{}` in its Comment)",
            keel_slurm::RUN_MARKER
        )),
        // Marked before this attempt: a requeued job.
        Ok(false) => {}
        Err(e) => sh.say(&format!(
            "warning: cannot add `{}` to job {job}'s Comment ({e}); keel cost will not know it ran under keel run",
            keel_slurm::RUN_MARKER
        )),
    }
}

/// Under Slurm, whether Slurm is already ending the job (`COMPLETING` or
/// `CANCELLED` while its batch script still runs): a user's `scancel`, or
/// a preemption Slurm carries out itself. keel neither checkpoints nor
/// requeues such a job; a preemption in `PreemptMode=REQUEUE` is requeued
/// by Slurm. (Slurm's warning signal, `--signal=B:USR1@...`, and
/// `scancel --batch --signal=TERM` leave the job running, and the time
/// limit's kill is `COMPLETING` with reason `TimeLimit`: those are
/// checkpointed and requeued.)
pub(super) fn cancelled_by_user(plan: &Plan) -> bool {
    let Some(m) = &plan.slurm else {
        return false;
    };
    let job = plan.slurm_job_id();
    matches!(m.client.job_state(&job), Ok(Some(s)) if s.cancelled())
}

/// The node of a line where srun reports a failed task.
pub(super) fn srun_failed_node(line: &str) -> Option<String> {
    let rest = line.trim().strip_prefix("srun: error: ")?;
    let (node, rest) = rest.split_once(": ")?;
    let failed = rest.starts_with("task")
        && (rest.contains("Exited with exit code")
            || rest.contains("Killed")
            || rest.contains("Terminated"));
    (failed && keel_slurm::check_node_name(node).is_ok()).then(|| node.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn srun_failure_lines_name_the_node() {
        assert_eq!(
            srun_failed_node("srun: error: n2: task 1: Exited with exit code 1\n"),
            Some("n2".to_owned())
        );
        assert_eq!(
            srun_failed_node("srun: error: gpu-07: tasks 8-15: Killed"),
            Some("gpu-07".to_owned())
        );
        assert_eq!(
            srun_failed_node("srun: error: Timed out waiting for job step"),
            None
        );
        assert_eq!(srun_failed_node("step 3 loss 0.1"), None);
    }
}
