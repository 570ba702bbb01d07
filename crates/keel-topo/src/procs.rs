//! Running processes as procfs shows them: CPU and memory affinity,
//! threads, launcher variables and the NVIDIA device files they hold.

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;

use serde::Serialize;

use crate::error::TopoError;
use crate::idset::{CpuSet, NodeSet};
use crate::machine::parse_list;
use crate::root::Root;

/// Environment variables keel reads from a process (and keeps in
/// snapshots); every other variable is ignored and never copied.
pub const KEPT_ENV: &[&str] = &[
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "LOCAL_RANK",
    "RANK",
    "SLURM_LOCALID",
    "SLURM_PROCID",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
];

/// Variables that give a process's local rank, in the order they are
/// trusted.
pub const LOCAL_RANK_VARS: &[&str] = &["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"];

#[derive(Debug, Clone, Serialize)]
pub struct Process {
    pub pid: u32,
    pub name: String,
    /// First command-line argument only: later ones may hold secrets.
    pub argv0: Option<String>,
    pub cpus_allowed: CpuSet,
    pub mems_allowed: Option<NodeSet>,
    /// The launcher variables of [`KEPT_ENV`] that are set; `None` when the
    /// environment could not be read (another user's process).
    pub env: Option<BTreeMap<String, String>>,
    pub threads: Vec<Thread>,
    /// Minor numbers of the `/dev/nvidiaN` files it holds open; `None` when
    /// its open files could not be listed.
    pub nvidia_minors: Option<Vec<u32>>,
}

impl Process {
    pub fn env_var(&self, key: &str) -> Option<&str> {
        self.env.as_ref()?.get(key).map(String::as_str)
    }

    /// The local rank from the launcher's variables.
    pub fn local_rank(&self) -> Option<u32> {
        LOCAL_RANK_VARS
            .iter()
            .find_map(|k| self.env_var(k)?.trim().parse().ok())
    }

    /// Whether this looks like a rank of a distributed job.
    pub fn has_rank_vars(&self) -> bool {
        LOCAL_RANK_VARS.iter().any(|k| self.env_var(k).is_some())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Thread {
    pub tid: u32,
    /// `R` running, `S` sleeping, `D` uninterruptible...
    pub state: Option<char>,
    /// The CPU it last ran on.
    pub last_cpu: Option<u32>,
    /// Its own affinity when it differs from the process's.
    pub cpus_allowed: Option<CpuSet>,
}

/// Which processes to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Every process.
    All,
    /// These pids; a missing one is an error.
    Pids(Vec<u32>),
}

/// Reads processes under `root/proc`. Processes that exit while being read
/// are skipped.
pub fn read_processes(root: &Root, selection: &Selection) -> Result<Vec<Process>, TopoError> {
    let pids: Vec<u32> = match selection {
        Selection::All => root
            .list("proc")?
            .iter()
            .filter_map(|n| n.parse().ok())
            .collect(),
        Selection::Pids(p) => p.clone(),
    };
    let mut out = Vec::new();
    for pid in pids {
        match read_process(root, pid)? {
            Some(p) => out.push(p),
            None if matches!(selection, Selection::Pids(_)) => {
                return Err(TopoError::NoSuchProcess {
                    pid,
                    path: root.path(format!("proc/{pid}")),
                })
            }
            None => {}
        }
    }
    out.sort_by_key(|p| p.pid);
    Ok(out)
}

/// Reads one process; `Ok(None)` if it does not exist (or just exited).
pub fn read_process(root: &Root, pid: u32) -> Result<Option<Process>, TopoError> {
    let dir = PathBuf::from(format!("proc/{pid}"));
    let Some(status) = root.read_opt(dir.join("status"))? else {
        return Ok(None);
    };
    let status_path = dir.join("status");
    let fields = status_fields(&status);
    let name = fields.get("Name").cloned().unwrap_or_default();
    let cpus_allowed = match fields.get("Cpus_allowed_list") {
        Some(v) => parse_list(root, &status_path, v)?,
        None => {
            return Err(TopoError::parse(
                root.path(&status_path),
                "",
                "no Cpus_allowed_list line",
            ));
        }
    };
    let mems_allowed = match fields.get("Mems_allowed_list") {
        Some(v) => Some(parse_list(root, &status_path, v)?),
        None => None,
    };

    let argv0 = match root.read_opt(dir.join("cmdline")) {
        Ok(Some(s)) => s
            .split('\0')
            .next()
            .filter(|a| !a.is_empty())
            .map(str::to_owned),
        Ok(None) | Err(_) => None,
    };

    let env = match root.read_opt(dir.join("environ")) {
        Ok(Some(s)) => Some(parse_environ(&s)),
        Ok(None) => None,
        Err(TopoError::Read { source, .. }) if denied(&source) => None,
        Err(e) => return Err(e),
    };

    let mut threads = Vec::new();
    for t in root.list(dir.join("task")).or_else(skip_denied)? {
        let Ok(tid) = t.parse::<u32>() else { continue };
        let tdir = dir.join("task").join(&t);
        let (state, last_cpu) = match root.read_opt(tdir.join("stat")).or_else(skip_denied)? {
            Some(stat) => parse_stat(&stat).ok_or_else(|| {
                TopoError::parse(
                    root.path(tdir.join("stat")),
                    &stat,
                    "expected the kernel's stat line",
                )
            })?,
            None => (None, None),
        };
        let cpus = match root.read_opt(tdir.join("status")).or_else(skip_denied)? {
            Some(s) => match status_fields(&s).get("Cpus_allowed_list") {
                Some(v) => Some(parse_list(root, tdir.join("status"), v)?),
                None => None,
            },
            None => None,
        };
        let cpus_allowed = cpus.filter(|c| *c != cpus_allowed);
        threads.push(Thread {
            tid,
            state,
            last_cpu,
            cpus_allowed,
        });
    }
    threads.sort_by_key(|t| t.tid);

    let nvidia_minors = read_nvidia_fds(root, &dir)?;

    Ok(Some(Process {
        pid,
        name,
        argv0,
        cpus_allowed,
        mems_allowed,
        env,
        threads,
        nvidia_minors,
    }))
}

fn read_nvidia_fds(root: &Root, dir: &std::path::Path) -> Result<Option<Vec<u32>>, TopoError> {
    let fd_dir = dir.join("fd");
    let names = match root.list(&fd_dir) {
        Ok(n) => n,
        Err(TopoError::Read { source, .. }) if denied(&source) => return Ok(None),
        Err(e) => return Err(e),
    };
    if names.is_empty() && !root.exists(&fd_dir) {
        return Ok(None);
    }
    let mut minors = Vec::new();
    for n in names {
        let link = fd_dir.join(&n);
        let Some(target) = root.read_link_quiet(&link).or_else(skip_denied)? else {
            continue;
        };
        let t = target.to_string_lossy();
        if let Some(minor) = t
            .strip_prefix("/dev/nvidia")
            .and_then(|m| m.parse::<u32>().ok())
        {
            root.note_link(&link);
            if !minors.contains(&minor) {
                minors.push(minor);
            }
        }
    }
    minors.sort_unstable();
    Ok(Some(minors))
}

fn denied(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::PermissionDenied
}

fn skip_denied<T: Default>(e: TopoError) -> Result<T, TopoError> {
    match e {
        TopoError::Read { ref source, .. } if denied(source) => Ok(T::default()),
        other => Err(other),
    }
}

/// `Key:\tvalue` lines of a procfs status file.
pub fn status_fields(s: &str) -> BTreeMap<String, String> {
    s.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// The launcher variables of a NUL-separated environment block.
pub fn parse_environ(s: &str) -> BTreeMap<String, String> {
    s.split('\0')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| KEPT_ENV.contains(k))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// State (field 3) and last CPU (field 39) of a `stat` line. The command
/// name (field 2) is in parentheses and may itself contain spaces and
/// parentheses, so fields are counted after the last `)`.
pub fn parse_stat(s: &str) -> Option<(Option<char>, Option<u32>)> {
    let close = s.rfind(')')?;
    let rest: Vec<&str> = s[close + 1..].split_whitespace().collect();
    // rest[0] is field 3 (state); field 39 is rest[36].
    let state = rest.first()?.chars().next();
    let cpu = rest.get(36).and_then(|c| c.parse().ok());
    Some((state, cpu))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stat_with_awkward_command_name() {
        let mut fields = vec![
            "41001".to_owned(),
            "(pt main) x)".to_owned(),
            "R".to_owned(),
        ];
        for i in 4..=52 {
            fields.push(if i == 39 {
                "30".to_owned()
            } else {
                "0".to_owned()
            });
        }
        assert_eq!(parse_stat(&fields.join(" ")), Some((Some('R'), Some(30))));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) S 0"), Some((Some('S'), None)));
    }

    #[test]
    fn environ_keeps_only_launcher_variables() {
        let env = parse_environ(
            "PATH=/bin\0LOCAL_RANK=3\0HF_TOKEN=hf_secret\0CUDA_VISIBLE_DEVICES=2,3\0",
        );
        assert_eq!(env.len(), 2);
        assert_eq!(env["LOCAL_RANK"], "3");
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "2,3");
    }

    proptest! {
        #[test]
        fn stat_parser_never_panics(s in ".{0,200}") {
            let _ = parse_stat(&s);
        }
    }
}
