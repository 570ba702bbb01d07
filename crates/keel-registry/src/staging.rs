//! Private scratch copies of a registry (a backup on its way out, a
//! restore on its way in): a file in a directory of its own, its owner's
//! only, removed with SQLite's side files when dropped.

use std::path::{Path, PathBuf};

use rand_core::RngCore as _;

use crate::error::RegistryError;

/// A path for a copy of a registry, in a new owner-only (0700) directory,
/// removed (with `-wal`, `-shm`, `-journal` and the directory) on drop.
#[derive(Debug)]
pub struct Staged {
    path: PathBuf,
    dir: PathBuf,
}

impl Staged {
    /// A new staging directory under `base` (beside a SQLite database, so
    /// on its file system; the system's temporary directory otherwise).
    pub fn under(base: &Path) -> Result<Self, RegistryError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = base.join(format!(
            ".keel-registry-{}-{:016x}",
            std::process::id(),
            rand_core::OsRng.next_u64()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|source| RegistryError::Io {
                op: "create the staging directory",
                path: dir.clone(),
                source,
            })?;
        Ok(Staged {
            path: dir.join("registry.db"),
            dir,
        })
    }

    /// Where the copy goes (nothing is there yet).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(PathBuf::from(p));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_directory_is_the_owners_only_and_goes_with_the_copy() {
        let base = tempfile::tempdir().expect("test setup");
        let staged = Staged::under(base.path()).expect("test setup");
        let dir = staged.path().parent().expect("test setup").to_owned();
        let mode = std::fs::metadata(&dir)
            .expect("test setup")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::write(staged.path(), b"x").expect("test setup");
        let mut wal = staged.path().as_os_str().to_owned();
        wal.push("-wal");
        std::fs::write(PathBuf::from(wal), b"x").expect("test setup");
        let other = Staged::under(base.path()).expect("test setup");
        assert_ne!(other.path(), staged.path());
        drop(staged);
        assert!(!dir.exists());
        drop(other);
        assert_eq!(
            std::fs::read_dir(base.path()).expect("test setup").count(),
            0
        );
    }
}
