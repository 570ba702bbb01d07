//! Which Slurm job holds each GPU. Sources: the GPU's processes (their
//! cgroup path names the job: `job_<id>` under cgroup v2's
//! `slurmstepd.scope` or v1's `slurm/uid_<uid>/`; else `SLURM_JOB_ID` in
//! their environment), the processes holding a GPU's device file, and
//! dcgm-exporter's job-mapping directory (a file per GPU, one job id per
//! line, written by a Slurm prolog). Read under a machine root, so fixtures
//! stand in for `/proc`.
//!
//! Everything is keyed by NVML index in the end. Device files are named by
//! the GPU's minor number, and the mapping directory by Slurm's GPU ids,
//! which are minors under gres.conf `File=` lines: both go through
//! keel-topo's [`GpuIds`], never taken as indices.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use keel_gpu::GpuSnapshot;
use keel_topo::{GpuIds, IdKind, Root};

use crate::readings::Job;

/// The job id in a `/proc/<pid>/cgroup` file: the last `job_<digits>`
/// component of any line's path.
pub fn job_of_cgroup(text: &str) -> Option<String> {
    let mut found = None;
    for line in text.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        for part in path.split('/') {
            if let Some(id) = part.strip_prefix("job_") {
                if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) {
                    found = Some(id.to_owned());
                }
            }
        }
    }
    found
}

/// `SLURM_JOB_ID`, `SLURM_JOB_USER` and `SLURM_JOB_PARTITION` in a
/// `/proc/<pid>/environ` file.
pub fn job_of_environ(environ: &[u8]) -> (Option<String>, Option<String>, Option<String>) {
    let mut id = None;
    let mut user = None;
    let mut partition = None;
    for var in environ.split(|b| *b == 0) {
        let var = String::from_utf8_lossy(var);
        if let Some(v) = var.strip_prefix("SLURM_JOB_ID=") {
            if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                id = Some(v.to_owned());
            }
        } else if let Some(v) = var.strip_prefix("SLURM_JOB_USER=") {
            if !v.is_empty() && v.len() <= 64 {
                user = Some(v.to_owned());
            }
        } else if let Some(v) = var.strip_prefix("SLURM_JOB_PARTITION=") {
            if !v.is_empty() && v.len() <= 64 {
                partition = Some(v.to_owned());
            }
        }
    }
    (id, user, partition)
}

/// The real uid in a `/proc/<pid>/status` file.
pub fn uid_of_status(text: &str) -> Option<u32> {
    let line = text.lines().find(|l| l.starts_with("Uid:"))?;
    line["Uid:".len()..].split_whitespace().next()?.parse().ok()
}

/// uid -> name from an `/etc/passwd` file.
pub fn passwd_names(text: &str) -> BTreeMap<u32, String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let uid = f.nth(1)?.parse().ok()?;
            Some((uid, name.to_owned()))
        })
        .collect()
}

/// The job of one process, from its cgroup, else its environment.
pub fn job_of_pid(root: &Root, pid: u32, users: &BTreeMap<u32, String>) -> Option<Job> {
    let dir = Path::new("proc").join(pid.to_string());
    let cgroup = root.read_opt(dir.join("cgroup")).ok().flatten();
    let mut id = cgroup.as_deref().and_then(job_of_cgroup);
    let mut user = None;
    let mut partition = None;
    if let Ok(env) = std::fs::read(root.path(dir.join("environ"))) {
        let (env_id, env_user, env_partition) = job_of_environ(&env);
        // The environment's user and partition belong to its job only.
        if id.is_none() || id == env_id {
            user = env_user;
            partition = env_partition;
        }
        id = id.or(env_id);
    }
    let id = id?;
    if user.is_none() {
        let uid = root
            .read_opt(dir.join("status"))
            .ok()
            .flatten()
            .as_deref()
            .and_then(uid_of_status);
        user = uid.map(|u| users.get(&u).cloned().unwrap_or_else(|| u.to_string()));
    }
    Some(Job {
        id,
        user,
        partition,
    })
}

/// Jobs per GPU index from the GPUs' compute processes.
pub fn from_processes(root: &Root, snap: &GpuSnapshot) -> BTreeMap<u32, Vec<Job>> {
    let users = root
        .read_opt("etc/passwd")
        .ok()
        .flatten()
        .map(|t| passwd_names(&t))
        .unwrap_or_default();
    let mut out = BTreeMap::new();
    for g in &snap.gpus {
        let mut jobs = BTreeSet::new();
        for p in g.processes.iter().flatten() {
            if let Some(j) = job_of_pid(root, p.pid, &users) {
                jobs.insert(j);
            }
        }
        if !jobs.is_empty() {
            out.insert(g.index, jobs.into_iter().collect());
        }
    }
    out
}

/// The node's GPUs by NVML index, device minor and PCI address: NVML's
/// snapshot (its minor numbers) with the driver's procfs under `root`
/// filling in; without a snapshot, procfs alone (NVML numbers GPUs in PCI
/// bus order).
pub fn gpu_ids(root: &Root, snap: Option<&GpuSnapshot>) -> GpuIds {
    let procfs = keel_topo::gpu_ids::read_procfs_minors(root).unwrap_or_default();
    match snap {
        Some(s) => GpuIds::new(
            s.gpus
                .iter()
                .map(|g| (g.index, g.pci_bus_id.clone(), g.minor_number)),
            &procfs,
        ),
        None => GpuIds::new(
            procfs
                .iter()
                .enumerate()
                .map(|(i, (pci, minor))| (i as u32, pci.to_string(), Some(*minor))),
            &BTreeMap::new(),
        ),
    }
}

/// The device file of each GPU: `pattern` with `{}` replaced by the GPU's
/// device minor (`/dev/nvidia{}`), mapped to its NVML index. A GPU whose
/// minor is unknown has no file here.
pub fn device_files(pattern: &str, ids: &GpuIds) -> BTreeMap<String, u32> {
    ids.gpus()
        .iter()
        .filter_map(|g| Some((pattern.replace("{}", &g.minor?.to_string()), g.index)))
        .collect()
}

/// Jobs keyed by Slurm GPU ids (`kind`: device minors or NVML indices) to
/// jobs keyed by NVML index. Ids that name no GPU of this node are left
/// out: a stale file from before a GPU was lost must not be charged to
/// another GPU.
pub fn to_indices(
    by_id: BTreeMap<u32, Vec<Job>>,
    ids: &GpuIds,
    kind: IdKind,
) -> BTreeMap<u32, Vec<Job>> {
    let mut out: BTreeMap<u32, Vec<Job>> = BTreeMap::new();
    for (id, list) in by_id {
        if let Ok([index]) = ids.to_indices(&[id], kind).as_deref() {
            out.entry(*index).or_default().extend(list);
        }
    }
    out
}

/// Jobs per GPU index from the processes that hold a GPU's device file
/// open (`/proc/<pid>/fd/*` links to one of `devices`, keyed by path), as
/// `fuser` finds them. Processes that cannot be inspected are skipped.
pub fn from_device_files(root: &Root, devices: &BTreeMap<String, u32>) -> BTreeMap<u32, Vec<Job>> {
    let users = root
        .read_opt("etc/passwd")
        .ok()
        .flatten()
        .map(|t| passwd_names(&t))
        .unwrap_or_default();
    let mut out: BTreeMap<u32, BTreeSet<Job>> = BTreeMap::new();
    if devices.is_empty() {
        return BTreeMap::new();
    }
    for pid in root.list("proc").unwrap_or_default() {
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        let fd_dir = Path::new("proc").join(pid.to_string()).join("fd");
        let mut held = BTreeSet::new();
        for fd in root.list(&fd_dir).unwrap_or_default() {
            if let Ok(Some(target)) = root.read_link_quiet(fd_dir.join(&fd)) {
                if let Some(gpu) = target.to_str().and_then(|t| devices.get(t)) {
                    held.insert(*gpu);
                }
            }
        }
        if held.is_empty() {
            continue;
        }
        if let Some(job) = job_of_pid(root, pid, &users) {
            for gpu in held {
                out.entry(gpu).or_default().insert(job.clone());
            }
        }
    }
    out.into_iter()
        .map(|(g, j)| (g, j.into_iter().collect()))
        .collect()
}

/// Jobs per Slurm GPU id from a dcgm-exporter job-mapping directory: files
/// named `<gpu>` (or `<gpu>.<gpu instance>`, counted for the GPU), each
/// line a job id. Unreadable files and other names are skipped. The ids
/// are whatever the prolog wrote (keel's prolog: Slurm's); [`to_indices`]
/// turns them into NVML indices.
pub fn from_mapping_dir(dir: &Path) -> BTreeMap<u32, Vec<Job>> {
    let mut out: BTreeMap<u32, BTreeSet<Job>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    for entry in entries.flatten().take(4096) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let gpu = name.split_once('.').map_or(name.as_str(), |(g, _)| g);
        let Ok(gpu) = gpu.parse::<u32>() else {
            continue;
        };
        if name
            .split_once('.')
            .is_some_and(|(_, gi)| gi.parse::<u32>().is_err())
        {
            continue;
        }
        let Ok(text) = crate::host::check_textfile(&entry.path()) else {
            continue;
        };
        for line in text.lines() {
            let id = line.split_whitespace().next().unwrap_or("");
            if !id.is_empty()
                && id.len() <= 64
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            {
                out.entry(gpu).or_default().insert(Job {
                    id: id.to_owned(),
                    ..Job::default()
                });
            }
        }
    }
    out.into_iter()
        .map(|(g, j)| (g, j.into_iter().collect()))
        .collect()
}

/// Adds `more` to `jobs` (a job already there keeps its user).
pub fn merge(jobs: &mut BTreeMap<u32, Vec<Job>>, more: BTreeMap<u32, Vec<Job>>) {
    for (gpu, list) in more {
        let have = jobs.entry(gpu).or_default();
        for j in list {
            if !have.iter().any(|h| h.id == j.id) {
                have.push(j);
            }
        }
        have.sort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_paths() {
        for (text, want) in [
            ("0::/system.slice/slurmstepd.scope/job_1392969/step_0/user/task_0\n", Some("1392969")),
            ("12:devices:/slurm/uid_1000/job_42/step_batch/task_0\n11:cpu:/slurm/uid_1000/job_42/step_batch\n", Some("42")),
            ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
            ("0::/system.slice/slurmstepd.scope/job_/step_0\n", None),
            ("0::/system.slice/slurmstepd.scope/job_12x/step_0\n", None),
            ("", None),
        ] {
            assert_eq!(job_of_cgroup(text).as_deref(), want, "{text}");
        }
    }

    #[test]
    fn environ_and_status() {
        let env = b"PATH=/bin\0SLURM_JOB_ID=77\0SLURM_JOB_USER=alice\0";
        assert_eq!(
            job_of_environ(env),
            (Some("77".into()), Some("alice".into()), None)
        );
        assert_eq!(job_of_environ(b"SLURM_JOB_ID=7;rm\0"), (None, None, None));
        assert_eq!(
            job_of_environ(b"SLURM_JOB_PARTITION=gpu\0").2.as_deref(),
            Some("gpu")
        );
        assert_eq!(
            uid_of_status("Name:\tpython\nUid:\t1001\t1001\t1001\t1001\n"),
            Some(1001)
        );
        assert_eq!(
            passwd_names("root:x:0:0::/root:/bin/sh\nalice:x:1001:1001::/home/alice:/bin/sh\n")
                .get(&1001)
                .map(String::as_str),
            Some("alice")
        );
    }
}
