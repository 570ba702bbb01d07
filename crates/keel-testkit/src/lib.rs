//! Test support for keel (a dev-dependency only; it never ships in the
//! binary).
//!
//! [`SlurmCluster`] describes the real Slurm test cluster that
//! `scripts/slurm-cluster start` runs on this host, found from
//! `KEEL_TEST_SLURM_CONF` (its slurm.conf) and `KEEL_TEST_SLURM_NODES`
//! (`n1,n2,n3`). It hands out a configured [`keel_slurm::Slurm`], reads a
//! node's state and reason with its own raw `sinfo` call (so tests do not
//! check keel-slurm's parser with itself), and pauses, stops and restarts
//! slurmctld to simulate a hung or dead controller.
//!
//! [`objects`] finds the object-storage test services (Azurite, an S3
//! server) that `scripts/services/*` start.
//!
//! [`serve`] finds the gateway tests' services: Redis
//! (`KEEL_TEST_REDIS_URL`, from `scripts/services/redis start`), the Python
//! with the `openai` client (`KEEL_TEST_PYTHON`, from
//! `scripts/services/python-openai`), the test model backend
//! (`keel-testbackend`, started as a process, over HTTP or HTTPS), gateway
//! processes, and a small blocking HTTP/1.1 client ([`http`]).
//!
//! [`pg`] finds the PostgreSQL of `scripts/services/postgres` and makes a
//! throwaway database for each test.
//!
//! [`tls`] makes a throwaway PKI (CA, server and client certificates, with
//! rcgen) and holds a blocking HTTPS client.
//!
//! It does not start the cluster or the services: `scripts/test` does,
//! once, before the tests. Unlike the library crates it reads the process environment and
//! the clock: finding services is what it is for.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use keel_slurm::{Slurm, SlurmConfig};

pub mod http;
pub mod imds;
pub mod objects;
pub mod pg;
pub mod serve;
pub mod tls;

/// The variable naming the test cluster's slurm.conf.
pub const CONF_VAR: &str = "KEEL_TEST_SLURM_CONF";
/// The variable listing the test cluster's node names, comma-separated.
pub const NODES_VAR: &str = "KEEL_TEST_SLURM_NODES";

/// Why the test cluster cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error(
        "no Slurm test cluster: {var} is not set; run `eval \"$(scripts/slurm-cluster start)\"` \
         first, or run everything with scripts/test"
    )]
    NotConfigured { var: &'static str },
    #[error("failed to read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} sets no {key}")]
    MissingKey { path: PathBuf, key: &'static str },
    #[error("`{command}` failed: {message}")]
    Command { command: String, message: String },
    #[error("{what} within {seconds} s")]
    Timeout { what: String, seconds: u64 },
}

/// A node as raw `sinfo -h -N -n NODE -o %T|%H|%E` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawNode {
    /// `idle`, `drained`, `down*`...
    pub state: String,
    /// When the reason was set (`2026-01-01T12:00:00`, `Unknown` if none).
    pub reason_time: String,
    /// The reason, `none` if none.
    pub reason: String,
}

/// The running test cluster.
#[derive(Debug, Clone)]
pub struct SlurmCluster {
    conf: PathBuf,
    nodes: Vec<String>,
    controller_pid_file: PathBuf,
}

impl SlurmCluster {
    /// The cluster named by `KEEL_TEST_SLURM_CONF` and `KEEL_TEST_SLURM_NODES`.
    pub fn from_env() -> Result<Self, TestkitError> {
        Self::from_vars(|key| std::env::var_os(key))
    }

    /// The cluster named by the variables `get` returns.
    pub fn from_vars(get: impl Fn(&str) -> Option<OsString>) -> Result<Self, TestkitError> {
        let conf = get(CONF_VAR)
            .filter(|v| !v.is_empty())
            .ok_or(TestkitError::NotConfigured { var: CONF_VAR })?;
        let nodes = get(NODES_VAR)
            .filter(|v| !v.is_empty())
            .ok_or(TestkitError::NotConfigured { var: NODES_VAR })?;
        let conf = PathBuf::from(conf);
        let nodes = nodes
            .to_string_lossy()
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect();
        let text = std::fs::read_to_string(&conf).map_err(|source| TestkitError::Read {
            path: conf.clone(),
            source,
        })?;
        let controller_pid_file = conf_value(&text, "SlurmctldPidFile")
            .map(PathBuf::from)
            .ok_or_else(|| TestkitError::MissingKey {
                path: conf.clone(),
                key: "SlurmctldPidFile",
            })?;
        Ok(Self {
            conf,
            nodes,
            controller_pid_file,
        })
    }

    /// The cluster, or a panic telling how to start one: for tests.
    pub fn get() -> Self {
        match Self::from_env() {
            Ok(cluster) => cluster,
            Err(e) => panic!("{e}"),
        }
    }

    pub fn conf(&self) -> &Path {
        &self.conf
    }

    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The `n`th node's name (0-based), panicking if the cluster is smaller.
    pub fn node(&self, n: usize) -> &str {
        match self.nodes.get(n) {
            Some(name) => name,
            None => panic!(
                "the test cluster has {} nodes, not {}",
                self.nodes.len(),
                n + 1
            ),
        }
    }

    /// A client for this cluster (`SLURM_CONF` passed explicitly).
    pub fn slurm(&self, timeout: Duration) -> Slurm {
        Slurm::new(SlurmConfig {
            bin_dir: None,
            timeout,
            env: vec![("SLURM_CONF".into(), self.conf.clone().into_os_string())],
        })
    }

    /// Runs a Slurm command against this cluster (10 s at most) and returns
    /// its standard output.
    pub fn command(&self, program: &str, args: &[&str]) -> Result<String, TestkitError> {
        let line = format!("{program} {}", args.join(" "));
        let mut child = Command::new(program)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| TestkitError::Command {
                command: line.clone(),
                message: e.to_string(),
            })?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(TestkitError::Timeout {
                    what: format!("`{line}` did not finish"),
                    seconds: 10,
                });
            }
            thread::sleep(Duration::from_millis(10));
        }
        let out = child
            .wait_with_output()
            .map_err(|e| TestkitError::Command {
                command: line.clone(),
                message: e.to_string(),
            })?;
        if !out.status.success() {
            return Err(TestkitError::Command {
                command: line,
                message: format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The node as raw sinfo prints it.
    pub fn raw_node(&self, node: &str) -> Result<RawNode, TestkitError> {
        let out = self.command("sinfo", &["-h", "-N", "-n", node, "-o", "%T|%H|%E"])?;
        let line = out.lines().next().unwrap_or_default();
        let mut fields = line.splitn(3, '|');
        match (fields.next(), fields.next(), fields.next()) {
            (Some(state), Some(time), Some(reason)) => Ok(RawNode {
                state: state.to_owned(),
                reason_time: time.to_owned(),
                reason: reason.to_owned(),
            }),
            _ => Err(TestkitError::Command {
                command: format!("sinfo -n {node}"),
                message: format!("unexpected output {out:?}"),
            }),
        }
    }

    /// Drains a node the way an administrator would, with raw scontrol.
    pub fn admin_drain(&self, node: &str, reason: &str) -> Result<(), TestkitError> {
        let name = format!("NodeName={node}");
        let why = format!("Reason={reason}");
        self.command("scontrol", &["update", &name, "State=DRAIN", &why])
            .map(drop)
    }

    /// Resumes the node if it is drained or down and waits (10 s at most)
    /// until it is plain `idle`; errors are ignored (a node that is already
    /// in service cannot be resumed).
    pub fn restore(&self, node: &str) {
        let name = format!("NodeName={node}");
        let _ = self.command("scontrol", &["update", &name, "State=RESUME"]);
        let _ = self.wait_for_state(node, "idle", Duration::from_secs(10));
    }

    /// Waits until raw sinfo shows the node in exactly `state`. Right after
    /// a resume Slurm shows `idle*` (not responding) until it has pinged
    /// the node, which takes about a second.
    pub fn wait_for_state(
        &self,
        node: &str,
        state: &str,
        timeout: Duration,
    ) -> Result<RawNode, TestkitError> {
        let deadline = Instant::now() + timeout;
        loop {
            let raw = self.raw_node(node)?;
            if raw.state == state {
                return Ok(raw);
            }
            if Instant::now() > deadline {
                return Err(TestkitError::Timeout {
                    what: format!("node {node} is {}, not {state},", raw.state),
                    seconds: timeout.as_secs(),
                });
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Restores the node (see [`Self::restore`]) when the guard drops, so a
    /// failing test leaves the cluster as it found it.
    pub fn restore_on_drop<'a>(&'a self, node: &'a str) -> Restore<'a> {
        Restore {
            cluster: self,
            node,
        }
    }

    /// Waits until every node is plainly `idle` (not drained, not `idle*`).
    pub fn wait_until_idle(&self, timeout: Duration) -> Result<(), TestkitError> {
        let deadline = Instant::now() + timeout;
        loop {
            let idle = self
                .command("sinfo", &["-h", "-N", "-o", "%N %T"])
                .map(|out| {
                    // Plain `idle`: `sinfo -t idle` would count drained nodes.
                    let mut names: Vec<&str> = out
                        .lines()
                        .filter_map(|l| l.split_once(' '))
                        .filter(|(_, state)| state.trim() == "idle")
                        .map(|(name, _)| name)
                        .collect();
                    names.sort_unstable();
                    names.dedup();
                    names.len()
                })
                .unwrap_or(0);
            if idle == self.nodes.len() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(TestkitError::Timeout {
                    what: format!("{} of {} nodes idle", idle, self.nodes.len()),
                    seconds: timeout.as_secs(),
                });
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// slurmctld's pid, if it runs (a zombie does not count).
    pub fn controller_pid(&self) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(&self.controller_pid_file)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let state = stat.rsplit_once(") ")?.1.chars().next()?;
        (state != 'Z' && state != 'X').then_some(pid)
    }

    /// Stops slurmctld with SIGSTOP until the guard drops (or
    /// [`Paused::resume`]): a hung controller that still holds its port.
    pub fn pause_controller(&self) -> Result<Paused, TestkitError> {
        let pid = self.running_controller()?;
        signal("STOP", pid)?;
        Ok(Paused { pid, done: false })
    }

    /// Stops slurmctld (SIGTERM) and waits until it is gone. The guard
    /// starts it again when dropped (or [`Stopped::restart`]).
    pub fn stop_controller(&self) -> Result<Stopped<'_>, TestkitError> {
        let pid = self.running_controller()?;
        signal("TERM", pid)?;
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.controller_pid() == Some(pid) {
            if Instant::now() > deadline {
                return Err(TestkitError::Timeout {
                    what: format!("slurmctld ({pid}) did not stop"),
                    seconds: 15,
                });
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(Stopped {
            cluster: self,
            done: false,
        })
    }

    /// Starts slurmctld if it is not running (as scripts/slurm-cluster does)
    /// and waits until every node is idle.
    pub fn start_controller(&self) -> Result<(), TestkitError> {
        if self.controller_pid().is_none() {
            let program = if Path::new("/usr/sbin/slurmctld").exists() {
                "/usr/sbin/slurmctld"
            } else {
                "slurmctld"
            };
            let line = format!("{program} -i -f {}", self.conf.display());
            // It daemonizes: the daemon must not inherit our pipes.
            let status = Command::new(program)
                .arg("-i")
                .arg("-f")
                .arg(&self.conf)
                .env("SLURM_CONF", &self.conf)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map_err(|e| TestkitError::Command {
                    command: line.clone(),
                    message: e.to_string(),
                })?;
            if !status.success() {
                return Err(TestkitError::Command {
                    command: line,
                    message: status.to_string(),
                });
            }
        }
        self.wait_until_idle(Duration::from_secs(60))
    }

    fn running_controller(&self) -> Result<u32, TestkitError> {
        self.controller_pid().ok_or_else(|| TestkitError::Command {
            command: format!("read {}", self.controller_pid_file.display()),
            message: "slurmctld is not running".into(),
        })
    }
}

/// Resumes a node when dropped.
#[derive(Debug)]
pub struct Restore<'a> {
    cluster: &'a SlurmCluster,
    node: &'a str,
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        self.cluster.restore(self.node);
    }
}

/// A stopped (terminated) slurmctld; started again when dropped.
#[derive(Debug)]
pub struct Stopped<'a> {
    cluster: &'a SlurmCluster,
    done: bool,
}

impl Stopped<'_> {
    /// Starts slurmctld and waits until every node is idle.
    pub fn restart(mut self) -> Result<(), TestkitError> {
        self.done = true;
        self.cluster.start_controller()
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cluster.start_controller();
        }
    }
}

/// A paused (SIGSTOP) slurmctld; continued when dropped.
#[derive(Debug)]
pub struct Paused {
    pid: u32,
    done: bool,
}

impl Paused {
    /// Continues slurmctld (SIGCONT).
    pub fn resume(mut self) -> Result<(), TestkitError> {
        self.done = true;
        signal("CONT", self.pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if !self.done {
            let _ = signal("CONT", self.pid);
        }
    }
}

fn signal(name: &str, pid: u32) -> Result<(), TestkitError> {
    let line = format!("kill -{name} {pid}");
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .map_err(|e| TestkitError::Command {
            command: line.clone(),
            message: e.to_string(),
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(TestkitError::Command {
            command: line,
            message: status.to_string(),
        })
    }
}

/// The value of `key` in slurm.conf text (keys are case-insensitive).
fn conf_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case(key))
        .map(|(_, v)| v.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_variables_it_says_how_to_start_a_cluster() {
        let err = SlurmCluster::from_vars(|_| None).expect_err("not configured");
        let message = err.to_string();
        assert!(message.contains("KEEL_TEST_SLURM_CONF"), "{message}");
        assert!(message.contains("scripts/slurm-cluster start"), "{message}");
    }

    #[test]
    fn reads_the_pid_file_from_the_conf() {
        let text =
            "# comment\nslurmctldpidfile = /tmp/x/run/slurmctld.pid # trailing\nNodeName=n1\n";
        assert_eq!(
            conf_value(text, "SlurmctldPidFile"),
            Some("/tmp/x/run/slurmctld.pid")
        );
        assert_eq!(conf_value(text, "SlurmdPidFile"), None);
    }
}
