//! Reading files under a machine root.
//!
//! Every file keel-topo reads goes through [`Root`], which joins a path
//! relative to the root (`sys/devices/system/cpu/online`) onto the root
//! directory (`/` on a live machine, a fixture or a snapshot otherwise), and
//! can record what was read so that `keel topo snapshot` copies exactly that.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::TopoError;

/// Files under sysfs and procfs are small; anything larger than this is not
/// what we expect to read and is cut off rather than loaded whole.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// What a recording root saw, relative to the root.
#[derive(Debug, Default, Clone)]
pub struct Recorded {
    /// Files whose contents were read.
    pub files: BTreeSet<PathBuf>,
    /// Symbolic links whose targets were read (and not followed).
    pub links: BTreeSet<PathBuf>,
    /// Directories whose entries were listed.
    pub dirs: BTreeSet<PathBuf>,
}

/// A machine root: `/` for the running machine, or any directory holding a
/// `sys/` and `proc/` tree.
#[derive(Debug)]
pub struct Root {
    base: PathBuf,
    recorder: Option<Mutex<Recorded>>,
}

impl Root {
    /// A root that reads under `base`.
    pub fn new(base: impl Into<PathBuf>) -> Self {
        Self {
            base: base.into(),
            recorder: None,
        }
    }

    /// A root that also records every path it reads.
    pub fn recording(base: impl Into<PathBuf>) -> Self {
        Self {
            base: base.into(),
            recorder: Some(Mutex::new(Recorded::default())),
        }
    }

    /// The root directory itself.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// The absolute path of `rel` under this root.
    pub fn path(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.base.join(rel)
    }

    /// What was recorded so far (empty for a non-recording root).
    pub fn recorded(&self) -> Recorded {
        self.recorder
            .as_ref()
            .map(|r| r.lock().map(|g| g.clone()).unwrap_or_default())
            .unwrap_or_default()
    }

    fn note(&self, f: impl FnOnce(&mut Recorded)) {
        if let Some(r) = &self.recorder {
            if let Ok(mut g) = r.lock() {
                f(&mut g);
            }
        }
    }

    /// Records a symbolic link that was read with [`Root::read_link_quiet`]
    /// and turned out to matter.
    pub fn note_link(&self, rel: impl AsRef<Path>) {
        let rel = rel.as_ref().to_path_buf();
        self.note(|r| {
            r.links.insert(rel);
        });
    }

    /// Reads a file that may be absent: `Ok(None)` when it does not exist,
    /// an error naming the file for any other failure.
    pub fn read_opt(&self, rel: impl AsRef<Path>) -> Result<Option<String>, TopoError> {
        let rel = rel.as_ref();
        let path = self.path(rel);
        match read_limited(&path) {
            Ok(s) => {
                self.note(|r| {
                    r.files.insert(rel.to_path_buf());
                });
                Ok(Some(s))
            }
            Err(e) if is_absent(&e) => Ok(None),
            Err(source) => Err(TopoError::Read { path, source }),
        }
    }

    /// Reads a device attribute the kernel may refuse to read (EINVAL for
    /// the link of a device whose config space does not answer, for the
    /// rate of a port with an invalid width): `Ok(None)` when it is absent
    /// or refused, so one bad attribute leaves one value absent instead of
    /// failing the whole machine.
    pub fn read_attr(&self, rel: impl AsRef<Path>) -> Result<Option<String>, TopoError> {
        match self.read_opt(rel) {
            Err(TopoError::Read { .. }) => Ok(None),
            other => other,
        }
    }

    /// Reads a file that must exist.
    pub fn read(&self, rel: impl AsRef<Path>) -> Result<String, TopoError> {
        let rel = rel.as_ref();
        self.read_opt(rel)?.ok_or_else(|| TopoError::Missing {
            path: self.path(rel),
        })
    }

    /// Reads the target of a symbolic link, `Ok(None)` when there is none.
    pub fn read_link(&self, rel: impl AsRef<Path>) -> Result<Option<PathBuf>, TopoError> {
        let rel = rel.as_ref();
        let target = self.read_link_quiet(rel)?;
        if target.is_some() {
            self.note_link(rel);
        }
        Ok(target)
    }

    /// Like [`Root::read_link`], without recording: for scans over many
    /// links of which only a few matter (a process's open files).
    pub fn read_link_quiet(&self, rel: impl AsRef<Path>) -> Result<Option<PathBuf>, TopoError> {
        let path = self.path(rel.as_ref());
        match fs::read_link(&path) {
            Ok(t) => Ok(Some(t)),
            Err(e) if is_absent(&e) || e.kind() == io::ErrorKind::InvalidInput => Ok(None),
            Err(source) => Err(TopoError::Read { path, source }),
        }
    }

    /// The names in a directory, sorted; empty when the directory does not
    /// exist.
    pub fn list(&self, rel: impl AsRef<Path>) -> Result<Vec<String>, TopoError> {
        let rel = rel.as_ref();
        let path = self.path(rel);
        let entries = match fs::read_dir(&path) {
            Ok(e) => e,
            Err(e) if is_absent(&e) => return Ok(Vec::new()),
            Err(source) => return Err(TopoError::Read { path, source }),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| TopoError::Read {
                path: path.clone(),
                source,
            })?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        self.note(|r| {
            r.dirs.insert(rel.to_path_buf());
        });
        Ok(names)
    }

    /// Whether `rel` exists (following links).
    pub fn exists(&self, rel: impl AsRef<Path>) -> bool {
        self.path(rel).exists()
    }

    /// Whether `rel` is itself a symbolic link.
    pub fn is_link(&self, rel: impl AsRef<Path>) -> bool {
        fs::symlink_metadata(self.path(rel))
            .map(|m| m.file_type().is_symlink())
            .unwrap_or(false)
    }

    /// The fully resolved location of `rel`, relative to the resolved root,
    /// e.g. `sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0`. `Ok(None)`
    /// when it does not exist. Links on the way are recorded.
    pub fn resolve(&self, rel: impl AsRef<Path>) -> Result<Option<PathBuf>, TopoError> {
        let rel = rel.as_ref();
        let path = self.path(rel);
        let canon = match fs::canonicalize(&path) {
            Ok(c) => c,
            Err(e) if is_absent(&e) => return Ok(None),
            Err(source) => return Err(TopoError::Read { path, source }),
        };
        self.note_link(rel);
        // The top-level trees may themselves be links (a fixture sharing
        // another's `sys`), so each is its own anchor.
        let mut anchors = Vec::new();
        for top in ["sys", "proc", "dev"] {
            if let Ok(c) = fs::canonicalize(self.base.join(top)) {
                anchors.push((PathBuf::from(top), c));
            }
        }
        let base = fs::canonicalize(&self.base).map_err(|source| TopoError::Read {
            path: self.base.clone(),
            source,
        })?;
        anchors.push((PathBuf::new(), base));
        for (prefix, anchor) in anchors {
            if let Ok(r) = canon.strip_prefix(&anchor) {
                return Ok(Some(prefix.join(r)));
            }
        }
        // A link that leaves the root (an absolute link in a copied tree)
        // cannot be interpreted under it.
        Err(TopoError::OutsideRoot {
            path,
            target: canon,
        })
    }
}

fn is_absent(e: &io::Error) -> bool {
    // ENOENT, and ESRCH for a process that exited while being read.
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(3)
}

fn read_limited(path: &Path) -> io::Result<String> {
    let file = fs::File::open(path)?;
    let mut buf = Vec::new();
    file.take(MAX_FILE_BYTES).read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}
