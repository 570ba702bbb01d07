//! The failure history of a run: for each Slurm job (or single-machine run)
//! which node failed it, for which cause and how many times, how many
//! start-ups failed in a row, and the times of each attempt for goodput.
//!
//! It lives in a JSON state file beside the checkpoints and is changed
//! only through [`keel_fs::update`] (under a lock, replaced atomically). A
//! file that does not parse is an error that names it; it is never
//! overwritten, so nothing recorded is lost.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::goodput::AttemptTimes;

/// The state file's format version.
pub const VERSION: u32 = 1;

/// Why a node is blamed for a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cause {
    /// A task on the node exited non-zero or was killed by a signal.
    Crash,
    /// The node stopped reporting heartbeats.
    Hang,
    /// Slurm reported the node not responding.
    NotResponding,
    /// The pre-flight or post-failure health check failed on the node.
    Check,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Crash => "crash",
            Cause::Hang => "hang",
            Cause::NotResponding => "not-responding",
            Cause::Check => "check",
        }
    }
}

/// How many times a node failed a job for one cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailureRecord {
    pub node: String,
    pub cause: Cause,
    pub count: u32,
}

/// One job's history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobHistory {
    #[serde(default)]
    pub failures: Vec<FailureRecord>,
    /// Start-up failures since the last attempt that reached training.
    #[serde(default)]
    pub startup_failures: u32,
    /// Every attempt, in order.
    #[serde(default)]
    pub attempts: Vec<AttemptTimes>,
}

impl JobHistory {
    /// Counts one failure of `node` for `cause`.
    pub fn record_failure(&mut self, node: &str, cause: Cause) {
        match self
            .failures
            .iter_mut()
            .find(|r| r.node == node && r.cause == cause)
        {
            Some(r) => r.count = r.count.saturating_add(1),
            None => self.failures.push(FailureRecord {
                node: node.to_owned(),
                cause,
                count: 1,
            }),
        }
    }

    /// How many times `node` failed this job, all causes together.
    pub fn failures_of(&self, node: &str) -> u32 {
        self.failures
            .iter()
            .filter(|r| r.node == node)
            .fold(0u32, |n, r| n.saturating_add(r.count))
    }
}

/// The whole state file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct History {
    pub version: u32,
    #[serde(default)]
    pub jobs: BTreeMap<String, JobHistory>,
}

impl Default for History {
    fn default() -> Self {
        Self {
            version: VERSION,
            jobs: BTreeMap::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error(transparent)]
    Fs(#[from] keel_fs::FsError),
    #[error("the run state file {path} is not valid (left as it is; move it away to start a new history)")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("the run state file {path} has version {found}, this keel reads version {VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("failed to encode the run state")]
    Encode(#[source] serde_json::Error),
}

fn parse(path: &Path, bytes: Option<&[u8]>) -> Result<History, HistoryError> {
    let Some(bytes) = bytes else {
        return Ok(History::default());
    };
    let h: History = serde_json::from_slice(bytes).map_err(|source| HistoryError::Corrupt {
        path: path.to_owned(),
        source,
    })?;
    if h.version != VERSION {
        return Err(HistoryError::Version {
            path: path.to_owned(),
            found: h.version,
        });
    }
    Ok(h)
}

impl History {
    /// Reads the state file (an empty history when there is none).
    pub fn load(path: &Path) -> Result<Self, HistoryError> {
        let bytes = keel_fs::read_optional(path)?;
        parse(path, bytes.as_deref())
    }

    /// Changes the state file under its lock: `change` gets the current
    /// history and its result is written back atomically. A file that does
    /// not parse is left untouched and reported.
    pub fn update<T>(
        path: &Path,
        change: impl FnOnce(&mut History) -> T,
    ) -> Result<T, HistoryError> {
        keel_fs::update(path, 0o644, |current| {
            let mut h = parse(path, current)?;
            let out = change(&mut h);
            let mut bytes = serde_json::to_vec_pretty(&h).map_err(HistoryError::Encode)?;
            bytes.push(b'\n');
            Ok((Some(bytes), out))
        })
    }

    /// One job's history (empty when unknown).
    pub fn job(&self, job: &str) -> JobHistory {
        self.jobs.get(job).cloned().unwrap_or_default()
    }
}

impl keel_error::HasKind for HistoryError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Fs(_) => K::Io,
            Self::Corrupt { .. } | Self::Version { .. } | Self::Encode(_) => K::Input,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_accumulate_per_node_and_cause() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("keel-run.json");
        for cause in [Cause::Crash, Cause::Crash, Cause::Hang] {
            History::update(&p, |h| {
                h.jobs
                    .entry("42".into())
                    .or_default()
                    .record_failure("n2", cause)
            })
            .expect("update");
        }
        let h = History::load(&p).expect("load");
        let j = h.job("42");
        assert_eq!(j.failures_of("n2"), 3);
        assert_eq!(j.failures_of("n1"), 0);
        assert_eq!(
            j.failures,
            vec![
                FailureRecord {
                    node: "n2".into(),
                    cause: Cause::Crash,
                    count: 2
                },
                FailureRecord {
                    node: "n2".into(),
                    cause: Cause::Hang,
                    count: 1
                }
            ]
        );
        assert_eq!(h.job("7"), JobHistory::default());
    }

    #[test]
    fn a_corrupt_file_is_an_error_and_is_not_overwritten() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("keel-run.json");
        std::fs::write(&p, b"{\"version\":1,\"jobs\":{\"42\":").expect("write");
        let err = History::update(&p, |h| h.jobs.clear()).expect_err("corrupt");
        assert!(matches!(err, HistoryError::Corrupt { .. }), "{err:?}");
        assert!(err.to_string().contains("keel-run.json"), "{err}");
        assert_eq!(
            std::fs::read(&p).expect("read"),
            b"{\"version\":1,\"jobs\":{\"42\":"
        );
        assert!(matches!(
            History::load(&p),
            Err(HistoryError::Corrupt { .. })
        ));
    }

    #[test]
    fn another_version_is_refused() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("keel-run.json");
        std::fs::write(&p, br#"{"version":9,"jobs":{}}"#).expect("write");
        assert!(matches!(
            History::load(&p),
            Err(HistoryError::Version { found: 9, .. })
        ));
    }
}
