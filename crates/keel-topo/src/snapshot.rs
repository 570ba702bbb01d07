//! Copying the files keel reads into a directory that reproduces the
//! machine under `--root`.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use crate::error::TopoError;
use crate::procs::parse_environ;
use crate::root::{Recorded, Root};

/// Files larger than this are never copied: everything keel reads is a
/// small text file.
const MAX_COPY_BYTES: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    Read(#[from] TopoError),
    #[error("{path} already exists and is not empty; choose a new directory")]
    NotEmpty { path: PathBuf },
    #[error("failed to write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotSummary {
    pub out: PathBuf,
    pub files: usize,
    pub links: usize,
    pub dirs: usize,
    pub bytes: u64,
    /// Files left out because they were larger than the limit.
    pub skipped: Vec<PathBuf>,
}

/// The host files `keel check` reads besides the topology (memory and swap,
/// loaded modules, host name, boot id and uptime, mounts, swaps, software
/// RAID): read through the recording root so that a snapshot taken with
/// [`read_host_files`] reproduces the node's checks too.
pub const HOST_FILES: &[&str] = &[
    "proc/meminfo",
    "proc/modules",
    "proc/sys/kernel/hostname",
    "proc/sys/kernel/random/boot_id",
    "proc/uptime",
    "proc/mounts",
    "proc/swaps",
    "proc/mdstat",
];

/// Reads [`HOST_FILES`] through `root` (a recording root records the ones
/// that exist). A file that exists but cannot be read is an error naming
/// it.
pub fn read_host_files(root: &Root) -> Result<(), TopoError> {
    for f in HOST_FILES {
        root.read_opt(f)?;
    }
    Ok(())
}

/// Copies what `root` recorded into `out`, which must not exist or be
/// empty. The copy is made in a sibling directory and renamed into place,
/// so `out` never holds half a snapshot.
///
/// `extra` are files read some other way (the kernel log's relevant
/// records as `dev/kmsg`), written at their path relative to the root.
pub fn write_snapshot(
    root: &Root,
    recorded: &Recorded,
    extra: &[(PathBuf, Vec<u8>)],
    out: &Path,
) -> Result<SnapshotSummary, SnapshotError> {
    if let Ok(mut entries) = fs::read_dir(out) {
        if entries.next().is_some() {
            return Err(SnapshotError::NotEmpty {
                path: out.to_path_buf(),
            });
        }
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "snapshot".into());
    let staging = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let werr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::Write { path, source }
    };
    fs::create_dir_all(&staging).map_err(werr(&staging))?;

    let result = copy_all(root, recorded, &staging).and_then(|mut s| {
        for (rel, content) in extra {
            let safe = rel.components().all(|c| matches!(c, Component::Normal(_)));
            if !safe {
                continue;
            }
            let d = staging.join(rel);
            if let Some(p) = d.parent() {
                fs::create_dir_all(p).map_err(werr(p))?;
            }
            fs::write(&d, content).map_err(werr(&d))?;
            s.files += 1;
            s.bytes += content.len() as u64;
        }
        Ok(s)
    });
    let summary = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    if out.exists() {
        fs::remove_dir(out).map_err(werr(out))?;
    }
    fs::rename(&staging, out).map_err(werr(out))?;
    Ok(SnapshotSummary {
        out: out.to_path_buf(),
        ..summary
    })
}

fn copy_all(
    root: &Root,
    recorded: &Recorded,
    dst: &Path,
) -> Result<SnapshotSummary, SnapshotError> {
    let mut made_links = BTreeSet::new();
    let mut summary = SnapshotSummary {
        out: dst.to_path_buf(),
        files: 0,
        links: 0,
        dirs: 0,
        bytes: 0,
        skipped: Vec::new(),
    };
    for dir in &recorded.dirs {
        if let Some(real) = replicate_path(root, dst, dir, &mut made_links)? {
            let d = dst.join(&real);
            if root.path(&real).is_dir() {
                fs::create_dir_all(&d).map_err(|source| SnapshotError::Write {
                    path: d.clone(),
                    source,
                })?;
                summary.dirs += 1;
            }
        }
    }
    for link in &recorded.links {
        replicate_path(root, dst, link, &mut made_links)?;
    }
    for file in &recorded.files {
        let Some(real) = replicate_path(root, dst, file, &mut made_links)? else {
            continue;
        };
        let src = root.path(&real);
        let meta = match fs::metadata(&src) {
            Ok(m) => m,
            Err(_) => continue,
        };
        // sysfs reports 4096 for every attribute; read it to know.
        let content = match fs::read(&src) {
            Ok(c) => c,
            // Gone or unreadable since it was read: leave it out.
            Err(_) => continue,
        };
        if content.len() as u64 > MAX_COPY_BYTES && meta.len() > MAX_COPY_BYTES {
            summary.skipped.push(file.clone());
            continue;
        }
        let content = filter(&real, content);
        let d = dst.join(&real);
        if let Some(p) = d.parent() {
            fs::create_dir_all(p).map_err(|source| SnapshotError::Write {
                path: p.to_path_buf(),
                source,
            })?;
        }
        fs::write(&d, &content).map_err(|source| SnapshotError::Write {
            path: d.clone(),
            source,
        })?;
        summary.files += 1;
        summary.bytes += content.len() as u64;
    }
    summary.links = made_links.len();
    Ok(summary)
}

/// Strips what must not leave the machine: every environment variable but
/// the launcher's, every command-line argument but the first.
fn filter(rel: &Path, content: Vec<u8>) -> Vec<u8> {
    let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let in_proc = rel.starts_with("proc");
    match name {
        "environ" if in_proc => {
            let env = parse_environ(&String::from_utf8_lossy(&content));
            let mut out = Vec::new();
            for (k, v) in env {
                out.extend_from_slice(format!("{k}={v}\0").as_bytes());
            }
            out
        }
        "cmdline" if in_proc => {
            let first = content.split(|b| *b == 0).next().unwrap_or_default();
            let mut out = first.to_vec();
            out.push(0);
            out
        }
        _ => content,
    }
}

/// Re-creates in `dst` every symbolic link met on the way to `rel` under
/// `root` and returns the link-free path of `rel` (relative to the root),
/// or `None` if it leads outside the root or does not exist.
fn replicate_path(
    root: &Root,
    dst: &Path,
    rel: &Path,
    made: &mut BTreeSet<PathBuf>,
) -> Result<Option<PathBuf>, SnapshotError> {
    let mut pending: Vec<PathBuf> = rel
        .components()
        .rev()
        .map(|c| PathBuf::from(c.as_os_str()))
        .collect();
    let mut cur = PathBuf::new();
    let mut hops = 0;
    while let Some(comp) = pending.pop() {
        match comp.components().next() {
            Some(Component::ParentDir) => {
                if !cur.pop() {
                    return Ok(None);
                }
                continue;
            }
            Some(Component::CurDir) => continue,
            _ => {}
        }
        let next = cur.join(&comp);
        let src = root.path(&next);
        let meta = match fs::symlink_metadata(&src) {
            Ok(m) => m,
            Err(_) => return Ok(None),
        };
        // A top-level tree that is a link (`sys -> ../other/sys`) is copied
        // as a real directory.
        if !meta.file_type().is_symlink() || cur.as_os_str().is_empty() {
            cur = next;
            continue;
        }
        let target = fs::read_link(&src).map_err(|source| {
            SnapshotError::Read(TopoError::Read {
                path: src.clone(),
                source,
            })
        })?;
        if made.insert(next.clone()) {
            let d = dst.join(&next);
            if let Some(p) = d.parent() {
                fs::create_dir_all(p).map_err(|source| SnapshotError::Write {
                    path: p.to_path_buf(),
                    source,
                })?;
            }
            make_symlink(&target, &d)?;
        }
        // Links out of the root (`/dev/nvidia0` from a process's fd) are
        // copied as they are and not followed.
        if target.is_absolute() {
            return Ok(if pending.is_empty() { Some(next) } else { None });
        }
        hops += 1;
        if hops > 64 {
            return Ok(None);
        }
        for c in target.components().rev() {
            pending.push(PathBuf::from(c.as_os_str()));
        }
        // The link is relative to its directory, `cur`, which is link-free.
    }
    Ok(Some(cur))
}

#[cfg(unix)]
fn make_symlink(target: &Path, at: &Path) -> Result<(), SnapshotError> {
    match std::os::unix::fs::symlink(target, at) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(SnapshotError::Write {
            path: at.to_path_buf(),
            source,
        }),
    }
}

impl keel_error::HasKind for SnapshotError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Read(t) => keel_error::HasKind::kind(t),
            Self::NotEmpty { .. } => K::Usage,
            Self::Write { .. } => K::Io,
        }
    }
}
