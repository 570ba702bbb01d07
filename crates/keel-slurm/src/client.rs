//! [`Slurm`]: the client that runs `scontrol` and `sinfo`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::node::{parse_scontrol_node, parse_sinfo};
use crate::run::{self, Output};
use crate::{Action, NodeInfo, SlurmError};

/// How to run Slurm's commands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmConfig {
    /// The directory holding `scontrol` and `sinfo`; `None` finds them on
    /// the inherited `PATH`.
    pub bin_dir: Option<PathBuf>,
    /// The longest one call ([`Slurm::node`], [`Slurm::drain`], ...) may
    /// take, all its commands together; past it the running command is
    /// killed and the call returns [`SlurmError::Timeout`].
    pub timeout: Duration,
    /// Variables added to the inherited environment of every command, such
    /// as `SLURM_CONF`. This crate reads no variables itself.
    pub env: Vec<(OsString, OsString)>,
}

impl Default for SlurmConfig {
    fn default() -> Self {
        Self {
            bin_dir: None,
            timeout: Duration::from_secs(10),
            env: Vec::new(),
        }
    }
}

/// Runs Slurm's client commands, each with a deadline.
///
/// Every call that changes a node first pings the controller and sends the
/// change only if the controller answered: a request sent to a hung
/// slurmctld waits in its socket backlog and would be carried out when it
/// wakes up, after keel has reported a timeout. (The window between the
/// ping and the change remains; it is milliseconds wide.)
#[derive(Debug, Clone, Default)]
pub struct Slurm {
    config: SlurmConfig,
}

impl Slurm {
    pub fn new(config: SlurmConfig) -> Self {
        Self { config }
    }

    pub fn config(&self) -> &SlurmConfig {
        &self.config
    }

    /// Whether a controller answers (`scontrol ping`). With a primary and a
    /// backup, one answering is enough.
    pub fn ping(&self) -> Result<(), SlurmError> {
        self.ping_by(self.deadline())
    }

    /// The node's state, flags, reason and Gres GPUs, from
    /// `sinfo -h -N -n NAME -o %N|%T|%G|%E`; a node sinfo does not list (one in
    /// no partition) is looked up with `scontrol show node -o NAME`.
    pub fn node(&self, name: &str) -> Result<NodeInfo, SlurmError> {
        check_name(name)?;
        let deadline = self.deadline();
        self.ping_by(deadline)?;
        let args = strings(&["-h", "-N", "-n", name, "-o", "%N|%T|%G|%E"]);
        let out = self.run_ok("sinfo", &args, deadline)?;
        let parse_error =
            |program: &str, args: &[String], out: &Output, reason: String| SlurmError::Parse {
                command: run::display(&self.program(program), args),
                output: out.stdout.clone(),
                reason,
            };
        match parse_sinfo(&out.stdout, name) {
            Ok(Some(node)) => return Ok(node),
            Ok(None) => {}
            Err(e) => return Err(parse_error("sinfo", &args, &out, e.0)),
        }
        let args = strings(&["show", "node", "-o", name]);
        let out = self.run("scontrol", &args, deadline)?;
        if !out.status.success() {
            if out.stderr.contains("not found") || out.stdout.contains("not found") {
                return Err(SlurmError::NoSuchNode {
                    name: name.to_owned(),
                });
            }
            return Err(self.failed("scontrol", &args, &out));
        }
        match parse_scontrol_node(&out.stdout, name) {
            Ok(Some(node)) => Ok(node),
            Ok(None) => Err(SlurmError::NoSuchNode {
                name: name.to_owned(),
            }),
            Err(e) => Err(parse_error("scontrol", &args, &out, e.0)),
        }
    }

    /// `scontrol update NodeName=NAME State=DRAIN Reason=REASON`. The reason
    /// is passed as one argument, never through a shell; it must be one
    /// non-empty line.
    pub fn drain(&self, name: &str, reason: &str) -> Result<(), SlurmError> {
        check_name(name)?;
        check_reason(reason)?;
        self.update(
            name,
            &["State=DRAIN".to_owned(), format!("Reason={reason}")],
        )
    }

    /// `scontrol update NodeName=NAME State=RESUME`. Slurm refuses to resume
    /// a node that is not drained or down ([`SlurmError::Failed`]).
    pub fn resume(&self, name: &str) -> Result<(), SlurmError> {
        check_name(name)?;
        self.update(name, &["State=RESUME".to_owned()])
    }

    /// `scancel JOBID`: cancels a job (a number, or `<id>_<task>` of an
    /// array). Anything else is refused before a command runs.
    pub fn cancel(&self, job: &str) -> Result<(), SlurmError> {
        let ok = !job.is_empty()
            && job.len() <= 32
            && job.bytes().all(|b| b.is_ascii_digit() || b == b'_')
            && job.as_bytes()[0].is_ascii_digit();
        if !ok {
            return Err(SlurmError::Parse {
                command: "scancel".into(),
                output: job.chars().take(40).collect(),
                reason: "not a Slurm job id".into(),
            });
        }
        let deadline = self.deadline();
        self.ping_by(deadline)?;
        let args = vec![job.to_owned()];
        let out = self.run("scancel", &args, deadline)?;
        if out.status.success() {
            return Ok(());
        }
        Err(self.failed("scancel", &args, &out))
    }

    /// Carries out what [`crate::decide`] returned; `Nothing` runs nothing.
    pub fn apply(&self, name: &str, action: &Action) -> Result<(), SlurmError> {
        match action {
            Action::Drain { reason } => self.drain(name, reason),
            Action::Resume => self.resume(name),
            Action::Nothing { .. } => Ok(()),
        }
    }

    /// The state of a job and its reason (`squeue -h -j ID -o %T|%r`);
    /// `None` when squeue no longer lists it.
    pub fn job_state(&self, job: &str) -> Result<Option<JobStatus>, SlurmError> {
        check_job(job)?;
        let deadline = self.deadline();
        let args = strings(&["-h", "-j", job, "-o", "%T|%r"]);
        let out = self.run("squeue", &args, deadline)?;
        if !out.status.success() {
            if out.stderr.contains("Invalid job id") {
                return Ok(None);
            }
            return Err(self.failed("squeue", &args, &out));
        }
        Ok(out
            .stdout
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map(JobStatus::parse))
    }

    /// Requeues a job (the batch script starts again from the top with the
    /// same job id), keeping it off `exclude` as well as off the nodes it
    /// already excludes (the user's `--exclude`); returns the job's
    /// excluded nodes as Slurm stored them.
    ///
    /// Slurm changes `ExcNodeList` only on a pending job, and the value it
    /// is given replaces the list. So the job's list is read first and
    /// merged with `exclude`, then the job is requeued (`scontrol requeue`:
    /// pending at once, while its batch script, the caller, is still being
    /// ended) and the merged list is set (`scontrol update JobId=ID
    /// ExcNodeList=...`, retried until Slurm accepts it or the deadline)
    /// and read back. All of it runs in the caller's process: nothing is
    /// left to a helper that proctrack/cgroup would kill with the batch
    /// step, and nothing holds the job. Should the caller be killed between
    /// the requeue and the update, the job is requeued without the new
    /// exclusions (it can still run), never held.
    ///
    /// A list that does not read back as set (a site's job_submit plugin
    /// rewriting it) is [`SlurmError::NotExcluded`]: the job is requeued,
    /// and may run on the nodes named there.
    pub fn requeue(&self, job: &str, exclude: &[String]) -> Result<Vec<String>, SlurmError> {
        check_job(job)?;
        for n in exclude {
            check_name(n)?;
        }
        let deadline = self.deadline();
        self.ping_by(deadline)?;
        if exclude.is_empty() {
            let args = vec!["requeue".to_owned(), job.to_owned()];
            self.run_ok("scontrol", &args, deadline)?;
            return self.excluded_by(job, deadline);
        }
        let mut merged = self.excluded_by(job, deadline)?;
        merged.extend(exclude.iter().cloned());
        merged.sort();
        merged.dedup();
        let args = vec!["requeue".to_owned(), job.to_owned()];
        self.run_ok("scontrol", &args, deadline)?;
        let args = vec![
            "update".to_owned(),
            format!("JobId={job}"),
            format!("ExcNodeList={}", merged.join(",")),
        ];
        loop {
            let out = self.run("scontrol", &args, deadline)?;
            if out.status.success() {
                break;
            }
            // Right after the requeue the job is PENDING|COMPLETING, which
            // Slurm accepts; anything else (not pending yet on a slow
            // controller) is retried until the deadline.
            if Instant::now() + Duration::from_millis(200) >= deadline {
                return Err(self.failed("scontrol", &args, &out));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let now = self.excluded_by(job, deadline)?;
        let missing: Vec<String> = merged
            .iter()
            .filter(|n| !now.contains(n))
            .cloned()
            .collect();
        if missing.is_empty() {
            Ok(now)
        } else {
            Err(SlurmError::NotExcluded {
                job: job.to_owned(),
                missing,
            })
        }
    }

    /// The nodes a job excludes (`ExcNodeList` of `scontrol show job -o
    /// ID`, expanded), sorted; empty when it excludes none.
    pub fn excluded(&self, job: &str) -> Result<Vec<String>, SlurmError> {
        check_job(job)?;
        self.excluded_by(job, self.deadline())
    }

    fn excluded_by(&self, job: &str, deadline: Instant) -> Result<Vec<String>, SlurmError> {
        let args = strings(&["show", "job", "-o", job]);
        let out = self.run_ok("scontrol", &args, deadline)?;
        let unreadable = |reason: String| SlurmError::Parse {
            command: run::display(&self.program("scontrol"), &args),
            output: out.stdout.chars().take(200).collect(),
            reason,
        };
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with(&format!("JobId={job} ")))
            .ok_or_else(|| unreadable(format!("no record of job {job}")))?;
        let list = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("ExcNodeList="))
            .ok_or_else(|| unreadable("no ExcNodeList field".into()))?;
        if list == "(null)" || list.is_empty() {
            return Ok(Vec::new());
        }
        let mut nodes = crate::expand_hostlist(list).map_err(|e| unreadable(e.to_string()))?;
        nodes.sort();
        nodes.dedup();
        Ok(nodes)
    }

    /// The controller's `KillWait` (`scontrol show config`): from the
    /// SIGTERM of a kill sequence to its SIGKILL.
    pub fn kill_wait(&self) -> Result<Duration, SlurmError> {
        let args = strings(&["show", "config"]);
        let out = self.run_ok("scontrol", &args, self.deadline())?;
        crate::parse_kill_wait(&out.stdout).ok_or_else(|| SlurmError::Parse {
            command: run::display(&self.program("scontrol"), &args),
            output: String::new(),
            reason: "no KillWait line".into(),
        })
    }

    /// The time left to a job's end (`squeue -h -j ID -o %L`); `None` for
    /// a job without a limit.
    pub fn time_left(&self, job: &str) -> Result<Option<Duration>, SlurmError> {
        check_job(job)?;
        let args = strings(&["-h", "-j", job, "-o", "%L"]);
        let out = self.run_ok("squeue", &args, self.deadline())?;
        Ok(out
            .stdout
            .lines()
            .find(|l| !l.trim().is_empty())
            .and_then(crate::parse_squeue_time))
    }

    /// A job's Comment, read unambiguously: `squeue -h -j ID -o %k` prints
    /// it raw, newlines included, as its whole output less the final
    /// newline (`scontrol show job` prints it raw among other raw fields,
    /// where a newline in it cannot be told from the next field). Empty
    /// when it has none. squeue prints `(null)` for no comment and for the
    /// comment `(null)` alike: scontrol's record tells them apart (no
    /// `Comment=` line at all), and anything else is a parse error.
    pub fn job_comment(&self, job: &str) -> Result<String, SlurmError> {
        check_job(job)?;
        self.job_comment_by(job, self.deadline())
    }

    /// Adds `marker` to a job's Comment (`scontrol update JobId=ID
    /// Comment=...`, the comment as one argument), keeping what the comment
    /// holds; a job's owner may change it. Returns whether the comment
    /// changed: `false` when it already had the marker (a requeued job).
    pub fn mark_job(&self, job: &str, marker: &str) -> Result<bool, SlurmError> {
        check_job(job)?;
        if marker.is_empty() || marker.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(SlurmError::Invalid {
                what: "job comment marker",
                value: marker.to_owned(),
                problem: "empty or not one word",
            });
        }
        let deadline = self.deadline();
        self.ping_by(deadline)?;
        let comment = self.job_comment_by(job, deadline)?;
        let Some(marked) = crate::with_marker(&comment, marker) else {
            return Ok(false);
        };
        let args = vec![
            "update".to_owned(),
            format!("JobId={job}"),
            format!("Comment={marked}"),
        ];
        self.run_ok("scontrol", &args, deadline)?;
        Ok(true)
    }

    fn job_comment_by(&self, job: &str, deadline: Instant) -> Result<String, SlurmError> {
        let unreadable = |args: &[String], out: &Output, reason: &str| SlurmError::Parse {
            command: run::display(&self.program("squeue"), args),
            output: out.stdout.chars().take(200).collect(),
            reason: reason.to_owned(),
        };
        // One record, or the comments of several (an array's tasks) would
        // run together.
        let args = strings(&["-h", "-j", job, "-o", "%i"]);
        let out = self.run_ok("squeue", &args, deadline)?;
        if out.stdout.lines().filter(|l| !l.trim().is_empty()).count() != 1 {
            return Err(unreadable(&args, &out, "not exactly one job listed"));
        }
        let args = strings(&["-h", "-j", job, "-o", "%k"]);
        let out = self.run_ok("squeue", &args, deadline)?;
        let Some(comment) = out.stdout.strip_suffix('\n') else {
            return Err(unreadable(&args, &out, "no final newline"));
        };
        if comment != "(null)" {
            return Ok(comment.to_owned());
        }
        let show = strings(&["show", "job", job]);
        let rec = self.run_ok("scontrol", &show, deadline)?;
        if rec.stdout.lines().any(|l| l.contains("Comment=")) {
            return Err(SlurmError::Parse {
                command: run::display(&self.program("scontrol"), &show),
                output: rec.stdout.chars().take(200).collect(),
                reason: "squeue shows the comment as (null) but the record has a Comment=".into(),
            });
        }
        Ok(String::new())
    }

    fn update(&self, name: &str, changes: &[String]) -> Result<(), SlurmError> {
        let deadline = self.deadline();
        self.ping_by(deadline)?;
        let mut args = vec!["update".to_owned(), format!("NodeName={name}")];
        args.extend_from_slice(changes);
        let out = self.run("scontrol", &args, deadline)?;
        if out.status.success() {
            return Ok(());
        }
        if out.stderr.contains("Invalid node name") {
            return Err(SlurmError::NoSuchNode {
                name: name.to_owned(),
            });
        }
        Err(self.failed("scontrol", &args, &out))
    }

    fn ping_by(&self, deadline: Instant) -> Result<(), SlurmError> {
        let args = strings(&["ping"]);
        let out = self.run("scontrol", &args, deadline)?;
        // "Slurmctld(primary) at HOST is UP"; scontrol exits 1 when any
        // controller, a backup too, is down.
        let up = out.stdout.lines().any(|l| l.trim_end().ends_with(" is UP"));
        let down = out.stdout.contains(" is DOWN");
        if up || (out.status.success() && !down) {
            Ok(())
        } else {
            Err(self.failed("scontrol", &args, &out))
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.timeout
    }

    fn program(&self, name: &str) -> PathBuf {
        match &self.config.bin_dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        }
    }

    fn run(&self, program: &str, args: &[String], deadline: Instant) -> Result<Output, SlurmError> {
        run::run(
            &self.program(program),
            args,
            &self.config.env,
            deadline,
            self.config.timeout,
        )
    }

    /// Runs the command and turns a non-zero exit into [`SlurmError::Failed`].
    fn run_ok(
        &self,
        program: &str,
        args: &[String],
        deadline: Instant,
    ) -> Result<Output, SlurmError> {
        let out = self.run(program, args, deadline)?;
        if out.status.success() {
            Ok(out)
        } else {
            Err(self.failed(program, args, &out))
        }
    }

    fn failed(&self, program: &str, args: &[String], out: &Output) -> SlurmError {
        let text = if out.stderr.trim().is_empty() {
            &out.stdout
        } else {
            &out.stderr
        };
        SlurmError::Failed {
            command: run::display(&self.program(program), args),
            status: out.status,
            stderr: text.trim().to_owned(),
        }
    }
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// A job id: digits, optionally `_` and an array index.
fn check_job(job: &str) -> Result<(), SlurmError> {
    let ok = !job.is_empty()
        && job.len() <= 32
        && job.chars().all(|c| c.is_ascii_digit() || c == '_')
        && job.starts_with(|c: char| c.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(SlurmError::BadJob {
            job: job.chars().take(40).collect(),
        })
    }
}

/// A node name scontrol and sinfo read as exactly one node.
pub fn check_name(name: &str) -> Result<(), SlurmError> {
    let problem = if name.is_empty() {
        Some("empty")
    } else if name.starts_with('-') {
        Some("starts with '-'")
    } else if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("contains whitespace")
    } else if name.contains(['=', ',', '[', ']']) {
        Some("contains '=', ',' or brackets: one node name expected")
    } else {
        None
    };
    match problem {
        Some(problem) => Err(SlurmError::Invalid {
            what: "node name",
            value: name.to_owned(),
            problem,
        }),
        None => Ok(()),
    }
}

/// A drain reason Slurm stores and sinfo prints back on one line.
fn check_reason(reason: &str) -> Result<(), SlurmError> {
    let problem = if reason.trim().is_empty() {
        Some("empty: Slurm requires a reason to drain")
    } else if reason.chars().any(char::is_control) {
        Some("contains a line break or control character")
    } else {
        None
    };
    match problem {
        Some(problem) => Err(SlurmError::Invalid {
            what: "drain reason",
            value: reason.to_owned(),
            problem,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_reasons_are_checked_before_running_anything() {
        // No Slurm is needed: validation fails first.
        let slurm = Slurm::new(SlurmConfig {
            bin_dir: Some("/nonexistent".into()),
            ..SlurmConfig::default()
        });
        for name in ["", "-h", "n1 n2", "n1,n2", "n[1-2]", "NodeName=n1", "n1\n"] {
            assert!(
                matches!(
                    slurm.drain(name, "keel: x"),
                    Err(SlurmError::Invalid {
                        what: "node name",
                        ..
                    })
                ),
                "{name:?}"
            );
            assert!(matches!(slurm.node(name), Err(SlurmError::Invalid { .. })));
        }
        for reason in ["", "  ", "keel: a\nb", "keel: \t"] {
            assert!(
                matches!(
                    slurm.drain("n1", reason),
                    Err(SlurmError::Invalid {
                        what: "drain reason",
                        ..
                    })
                ),
                "{reason:?}"
            );
        }
    }

    /// A client whose `scontrol` and `sinfo` are these shell scripts.
    fn fake(scontrol: &str, sinfo: &str) -> (tempfile::TempDir, Slurm) {
        fake3(scontrol, sinfo, "exit 2")
    }

    /// A client whose `scontrol`, `sinfo` and `squeue` are these scripts.
    fn fake3(scontrol: &str, sinfo: &str, squeue: &str) -> (tempfile::TempDir, Slurm) {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        for (name, body) in [("scontrol", scontrol), ("sinfo", sinfo), ("squeue", squeue)] {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        let slurm = Slurm::new(SlurmConfig {
            bin_dir: Some(dir.path().to_owned()),
            timeout: Duration::from_secs(10),
            env: vec![("KEEL_FAKE".into(), "n1".into())],
        });
        (dir, slurm)
    }

    const PING_UP: &str = r#"[ "$1" = ping ] && { echo "Slurmctld(primary) at a is UP"; exit 0; }"#;

    #[test]
    fn one_controller_up_is_enough() {
        let (_dir, slurm) = fake(
            "echo 'Slurmctld(primary) at a is UP'; echo 'Slurmctld(backup) at b is DOWN'; exit 1",
            "",
        );
        assert!(slurm.ping().is_ok());
        let (_dir, slurm) = fake("echo 'Slurmctld(primary) at a is DOWN'; exit 1", "");
        match slurm.ping() {
            Err(SlurmError::Failed {
                command, stderr, ..
            }) => {
                assert_eq!(command, "scontrol ping");
                assert_eq!(stderr, "Slurmctld(primary) at a is DOWN");
            }
            other => panic!("expected Failed, got {other:?}"),
        }
    }

    #[test]
    fn node_reads_sinfo_with_the_configured_environment() {
        let (_dir, slurm) = fake(
            PING_UP,
            r#"echo "$KEEL_FAKE|draining@|gpu:h100:8(S:0-1)|keel: x""#,
        );
        let node = slurm.node("n1").expect("reads");
        assert_eq!(node.state, crate::NodeState::Draining);
        assert!(node.flags.reboot_pending);
        assert_eq!(node.reason.as_deref(), Some("keel: x"));
        assert_eq!(node.gpus, Some(8));
    }

    #[test]
    fn a_node_sinfo_does_not_list_is_looked_up_with_scontrol() {
        let show = r#"[ "$2" = node ] && [ "$4" = n9 ] && { echo "NodeName=n9 State=DOWN+NOT_RESPONDING Reason=gone [root@2025-01-01T00:00:00]"; exit 0; }"#;
        let missing = r#"echo "Node $4 not found"; exit 1"#;
        let (_dir, slurm) = fake(&format!("{PING_UP}\n{show}\n{missing}"), "exit 0");
        let node = slurm.node("n9").expect("reads");
        assert_eq!(node.state, crate::NodeState::Down);
        assert_eq!(node.reason.as_deref(), Some("gone"));
        assert!(matches!(
            slurm.node("n8"),
            Err(SlurmError::NoSuchNode { name }) if name == "n8"
        ));
    }

    #[test]
    fn unreadable_sinfo_output_is_a_parse_error() {
        let (_dir, slurm) = fake(PING_UP, "echo 'n1 idle none'");
        assert!(matches!(
            slurm.node("n1"),
            Err(SlurmError::Parse { command, .. }) if command == "sinfo -h -N -n n1 -o '%N|%T|%G|%E'"
        ));
    }

    #[test]
    fn a_refused_update_is_failed_with_stderr() {
        let update = r#"echo "slurm_update error: Invalid node state specified" >&2; exit 1"#;
        let (_dir, slurm) = fake(&format!("{PING_UP}\n{update}"), "");
        match slurm.resume("n1") {
            Err(SlurmError::Failed {
                command, stderr, ..
            }) => {
                assert_eq!(command, "scontrol update NodeName=n1 State=RESUME");
                assert_eq!(stderr, "slurm_update error: Invalid node state specified");
            }
            other => panic!("expected Failed, got {other:?}"),
        }
    }

    #[test]
    fn one_deadline_covers_the_ping_and_the_update() {
        let (_dir, mut slurm) = fake(
            r#"[ "$1" = ping ] && { sleep 0.4; echo "x is UP"; exit 0; }; sleep 5"#,
            "",
        );
        slurm.config.timeout = Duration::from_millis(800);
        let started = std::time::Instant::now();
        let result = slurm.drain("n1", "keel: x");
        assert!(
            matches!(result, Err(SlurmError::Timeout { .. })),
            "{result:?}"
        );
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "{:?}",
            started.elapsed()
        );
    }

    /// An `scontrol` that keeps job 42's comment in a file beside it, shows
    /// it raw as Slurm 22.05 does (after a raw `SubmitLine=`, as Slurm
    /// 25.11 prints it), and logs each update's arguments; an `squeue`
    /// that prints it raw (`(null)` when there is none).
    fn comment_fake(comment: Option<&str>, update: &str) -> (tempfile::TempDir, Slurm) {
        let script = format!(
            r#"{PING_UP}
d=$(dirname "$0")
if [ "$1" = show ] && [ "$2" = job ]; then
  [ "$3" = 42 ] || {{ echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }}
  echo "JobId=42 JobName=train"
  echo "   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A"
  echo "   WorkDir=/home/alice"
  printf '   SubmitLine=sbatch --comment=%s train.sh\n' "$(cat "$d/comment" 2>/dev/null)"
  [ -f "$d/comment" ] && printf '   Comment=%s \n' "$(cat "$d/comment")"
  echo "   StdErr=/home/alice/slurm-42.out"
  echo "   Power="
  echo
  exit 0
fi
if [ "$1" = update ]; then
  printf '%s\n' "$@" >>"$d/updates"
  {update}
  printf '%s' "${{3#Comment=}}" >"$d/comment"
  exit 0
fi
exit 2"#
        );
        let squeue = r#"d=$(dirname "$0")
case "$3" in 42|42_*) ;; *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;; esac
[ "$3" = 42_1 ] && { printf '42_1\n42_2\n'; exit 0; }
if [ "$5" = %i ]; then echo 42; exit 0; fi
if [ -f "$d/comment" ]; then cat "$d/comment"; echo; else echo '(null)'; fi"#;
        let (dir, slurm) = fake3(&script, "", squeue);
        if let Some(c) = comment {
            std::fs::write(dir.path().join("comment"), c).expect("comment");
        }
        (dir, slurm)
    }

    #[test]
    fn a_comment_of_several_lines_is_kept_whole() {
        let updates = |dir: &tempfile::TempDir| {
            std::fs::read_to_string(dir.path().join("updates")).unwrap_or_default()
        };
        // Each line is kept, blank ones and a final newline too.
        for comment in [
            "team=ml\nproject=x",
            "a\n\nb",
            "a\n\nSubmitLine=x\n",
            "(null)x",
        ] {
            let (dir, slurm) = comment_fake(Some(comment), "");
            assert_eq!(slurm.job_comment("42").expect("reads"), comment);
            assert!(slurm.mark_job("42", crate::RUN_MARKER).expect("marks"));
            let sep = if comment.ends_with('\n') { "" } else { " " };
            assert_eq!(
                updates(&dir),
                format!("update\nJobId=42\nComment={comment}{sep}keel-run\n")
            );
        }
        // The comment `(null)` cannot be told from none by squeue: not
        // marked rather than overwritten.
        let (dir, slurm) = comment_fake(Some("(null)"), "");
        assert!(matches!(
            slurm.mark_job("42", crate::RUN_MARKER),
            Err(SlurmError::Parse { .. })
        ));
        assert_eq!(updates(&dir), "");
    }

    #[test]
    fn a_job_is_marked_once_keeping_its_comment() {
        let updates = |dir: &tempfile::TempDir| {
            std::fs::read_to_string(dir.path().join("updates")).unwrap_or_default()
        };
        // No comment: the marker alone.
        let (dir, slurm) = comment_fake(None, "");
        assert_eq!(slurm.job_comment("42").expect("reads"), "");
        assert!(slurm.mark_job("42", crate::RUN_MARKER).expect("marks"));
        assert_eq!(updates(&dir), "update\nJobId=42\nComment=keel-run\n");
        assert_eq!(slurm.job_comment("42").expect("reads"), "keel-run");
        // Marked already (the job was requeued): nothing is updated.
        assert!(!slurm.mark_job("42", crate::RUN_MARKER).expect("marks"));
        assert_eq!(updates(&dir).lines().count(), 3);

        // A user's comment, spaces and `|` included, is kept as one
        // argument.
        let (dir, slurm) = comment_fake(Some("team=ml  a|b"), "");
        assert_eq!(slurm.job_comment("42").expect("reads"), "team=ml  a|b");
        assert!(slurm.mark_job("42", crate::RUN_MARKER).expect("marks"));
        assert_eq!(
            updates(&dir),
            "update\nJobId=42\nComment=team=ml  a|b keel-run\n"
        );
        let (dir, slurm) = comment_fake(Some("keel-run;team=ml"), "");
        assert!(!slurm.mark_job("42", crate::RUN_MARKER).expect("marks"));
        assert_eq!(updates(&dir), "");
    }

    #[test]
    fn a_job_that_cannot_be_marked_is_an_error() {
        let refused = r#"echo "slurm_update error: Access/permission denied" >&2; exit 1"#;
        let (_dir, slurm) = comment_fake(None, refused);
        match slurm.mark_job("42", crate::RUN_MARKER) {
            Err(SlurmError::Failed {
                command, stderr, ..
            }) => {
                assert_eq!(command, "scontrol update JobId=42 Comment=keel-run");
                assert_eq!(stderr, "slurm_update error: Access/permission denied");
            }
            other => panic!("expected Failed, got {other:?}"),
        }
        // A job Slurm does not know.
        assert!(matches!(
            slurm.mark_job("7", crate::RUN_MARKER),
            Err(SlurmError::Failed { .. })
        ));
        for (job, marker) in [("x", "keel-run"), ("42", ""), ("42", "two words")] {
            assert!(
                matches!(
                    slurm.mark_job(job, marker),
                    Err(SlurmError::BadJob { .. } | SlurmError::Invalid { .. })
                ),
                "{job} {marker}"
            );
        }
        // Several records (an array's tasks) are not one comment.
        assert!(matches!(
            slurm.mark_job("42_1", crate::RUN_MARKER),
            Err(SlurmError::Parse { .. })
        ));
    }

    /// An `scontrol` for job 42 that keeps its ExcNodeList in a file
    /// (`n3`, the user's, at first), accepts an update only after the
    /// requeue (`not pending` before, as Slurm answers a running job),
    /// and logs every call; `rewrite` makes the update store only `n3`
    /// (a site plugin rewriting the list).
    fn requeue_fake(rewrite: bool) -> (tempfile::TempDir, Slurm) {
        let store = if rewrite {
            "printf 'n3' >\"$d/exc\""
        } else {
            "printf '%s' \"${3#ExcNodeList=}\" >\"$d/exc\""
        };
        let script = format!(
            r#"{PING_UP}
d=$(dirname "$0")
echo "$@" >>"$d/calls"
[ -f "$d/exc" ] || printf 'n3' >"$d/exc"
case "$1" in
  show) echo "JobId=42 JobName=train JobState=RUNNING ExcNodeList=$(cat "$d/exc") NodeList=n2"; exit 0;;
  requeue) touch "$d/requeued"; exit 0;;
  update) [ -f "$d/requeued" ] || {{ echo "Job is no longer pending execution" >&2; exit 1; }}; {store}; exit 0;;
esac
exit 2"#
        );
        fake(&script, "")
    }

    #[test]
    fn a_requeue_excludes_the_new_nodes_and_keeps_the_users() {
        let (dir, slurm) = requeue_fake(false);
        let kept = slurm
            .requeue("42", &["n2".to_owned(), "n1".to_owned()])
            .expect("requeues");
        assert_eq!(kept, ["n1", "n2", "n3"]);
        let calls = std::fs::read_to_string(dir.path().join("calls")).expect("calls");
        // Read, requeue, then the merged list (never before the
        // requeue: Slurm refuses it on a running job), read back.
        assert_eq!(
            calls,
            "show job -o 42\nrequeue 42\nupdate JobId=42 ExcNodeList=n1,n2,n3\nshow job -o 42\n"
        );
        assert!(!calls.contains("requeuehold") && !calls.contains("release"));
    }

    #[test]
    fn a_list_that_does_not_read_back_is_not_excluded() {
        let (_dir, slurm) = requeue_fake(true);
        match slurm.requeue("42", &["n2".to_owned()]) {
            Err(SlurmError::NotExcluded { job, missing }) => {
                assert_eq!(job, "42");
                assert_eq!(missing, ["n2"]);
            }
            other => panic!("expected NotExcluded, got {other:?}"),
        }
    }

    #[test]
    fn missing_commands_are_not_installed() {
        let slurm = Slurm::new(SlurmConfig {
            bin_dir: Some("/nonexistent/slurm/bin".into()),
            ..SlurmConfig::default()
        });
        match slurm.node("n1") {
            Err(SlurmError::NotInstalled { program }) => {
                assert_eq!(program, PathBuf::from("/nonexistent/slurm/bin/scontrol"));
            }
            other => panic!("expected NotInstalled, got {other:?}"),
        }
        assert!(matches!(
            slurm.apply("n1", &Action::Resume),
            Err(SlurmError::NotInstalled { .. })
        ));
        // Nothing runs nothing, so it cannot fail.
        assert!(slurm
            .apply("n1", &Action::Nothing { why: "fine".into() })
            .is_ok());
    }
}

/// A job's state and the reason squeue gives for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStatus {
    /// `RUNNING`, `COMPLETING`, `CANCELLED`, ...
    pub state: String,
    /// `None`, `TimeLimit`, `BeginTime`, ...
    pub reason: String,
}

impl JobStatus {
    /// One line of `squeue -o %T|%r`.
    pub fn parse(line: &str) -> JobStatus {
        let (state, reason) = line.trim().split_once('|').unwrap_or((line.trim(), ""));
        JobStatus {
            state: state.to_owned(),
            reason: reason.to_owned(),
        }
    }

    /// Whether Slurm is ending the job for good: cancelled (`scancel`,
    /// which shows as `COMPLETING` with reason `None` while its steps are
    /// killed). A job killed at its time limit is `COMPLETING` with reason
    /// `TimeLimit`: not cancelled, it may be requeued to go on (Slurm
    /// accepts the requeue of a completing job).
    pub fn cancelled(&self) -> bool {
        self.state.starts_with("CANCELLED")
            || (self.state.starts_with("COMPLETING") && self.reason != "TimeLimit")
    }
}

#[cfg(test)]
mod job_status_tests {
    use super::JobStatus;

    #[test]
    fn a_time_limit_is_not_a_cancellation() {
        // As squeue printed them on the test cluster during the kill.
        let cancelled = |l: &str| JobStatus::parse(l).cancelled();
        assert!(cancelled("COMPLETING|None"), "scancel");
        assert!(cancelled("CANCELLED|None"));
        assert!(!cancelled("COMPLETING|TimeLimit"), "the time limit");
        assert!(!cancelled("RUNNING|None"));
        assert!(!cancelled("PENDING|BeginTime"));
        assert_eq!(
            JobStatus::parse("RUNNING"),
            JobStatus {
                state: "RUNNING".into(),
                reason: String::new()
            }
        );
    }
}
