//! Files keel rewrites in place (the gateway's key file, state files,
//! records beside checkpoints): every rewrite is a whole new file that
//! replaces the old one by `rename`, so a reader sees the old content or
//! the new, never a part; and read-modify-write cycles run under an
//! exclusive lock, so concurrent writers never undo each other.
//!
//! - The temporary file is `.<name>.tmp.<pid>.<n>` in the target's
//!   directory, created with `O_CREAT | O_EXCL` (a name that exists, a
//!   symbolic link included, is never opened or followed: the next name is
//!   tried), with the final mode from the start.
//! - The data is `fsync`ed before the rename and the directory after it,
//!   so after a crash the file is the old one or the new one.
//! - The lock is `flock(LOCK_EX)` on a sibling `.<name>.lock` (the target
//!   itself is replaced on every write, so it cannot carry the lock). It is
//!   advisory: every keel writer takes it; a reader needs none.
//!
//! What this crate does not do: locking across hosts on filesystems whose
//! `flock` is local only (some NFS set-ups); keel's shared-storage
//! protocols (checkpoints, the registry's claims) use the object store's
//! create-only writes for that.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot lock {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} has no file name")]
    NoFileName { path: PathBuf },
}

/// Counts temporary names within this process.
static NEXT: AtomicU64 = AtomicU64::new(0);

fn split(path: &Path) -> Result<(PathBuf, String), FsError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| FsError::NoFileName {
            path: path.to_owned(),
        })?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_owned();
    Ok((dir, name))
}

/// Replaces `path` with `bytes`: a new file of `mode` in the same
/// directory, synced, renamed over the old one, and the directory synced.
/// On any failure the old file is untouched and the temporary removed.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FsError> {
    let (dir, name) = split(path)?;
    let werr = |p: &Path| {
        let p = p.to_owned();
        move |source| FsError::Write { path: p, source }
    };
    let (tmp, mut f) = loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.tmp.{}.{n}", std::process::id()));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&tmp)
        {
            Ok(f) => break (tmp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(werr(&tmp)(e)),
        }
    };
    let written = f
        .write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(werr(&tmp))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(werr(path)));
    drop(f);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(&dir).map_err(werr(&dir))
}

/// `fsync` of a directory, so a rename or a create in it is durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// An exclusive lock on a file's sibling `.<name>.lock`, held until
/// dropped.
#[derive(Debug)]
pub struct Lock {
    _file: File,
}

/// The lock file of `path` (`.NAME.lock` beside it, mode 0600, never
/// through a symbolic link), open, and its path.
fn open_lock_file(path: &Path) -> Result<(std::fs::File, PathBuf), FsError> {
    let (dir, name) = split(path)?;
    let lock = dir.join(format!(".{name}.lock"));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&lock)
        .map_err(|source| FsError::Lock {
            path: lock.clone(),
            source,
        })?;
    Ok((file, lock))
}

impl Lock {
    /// Waits for the lock of `path` (creating the lock file, mode 0600).
    pub fn exclusive(path: &Path) -> Result<Self, FsError> {
        let (file, lock) = open_lock_file(path)?;
        let lerr = |source| FsError::Lock {
            path: lock.clone(),
            source,
        };
        loop {
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive) {
                Ok(()) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(lerr(e.into())),
            }
        }
        Ok(Self { _file: file })
    }

    /// Takes the lock of `path` if no one holds it (`None` when another
    /// open of the lock file, in this process or another, holds it).
    pub fn try_exclusive(path: &Path) -> Result<Option<Self>, FsError> {
        let (file, lock) = open_lock_file(path)?;
        let lerr = |source| FsError::Lock {
            path: lock.clone(),
            source,
        };
        loop {
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(Some(Self { _file: file })),
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::WOULDBLOCK) => return Ok(None),
                Err(e) => return Err(lerr(e.into())),
            }
        }
    }
}

/// The largest state file [`read_optional`] (and so [`update`]) reads:
/// a key file, a rollout's or a supervisor's state.
pub const MAX_STATE_BYTES: u64 = 64 * 1024 * 1024;

/// The largest configuration-sized file (TOML, PEM, a key or token file,
/// a JWKS) keel reads.
pub const MAX_CONFIG_BYTES: u64 = 16 * 1024 * 1024;

/// Reads a regular file of at most `max_bytes`, the one way keel reads a
/// file someone else named: a FIFO, a device (a link to `/dev/zero`), a
/// socket or a directory is refused without waiting or reading (it is
/// not opened at all; and should the path change in between, the open
/// does not block, `O_NONBLOCK`, and the open file's own type is checked
/// again), and a larger file after `max_bytes + 1` bytes. The errors
/// are `InvalidInput` ("not a regular file") and `InvalidData` ("larger
/// than N bytes"), each worth showing as it is.
pub fn read_regular(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    let f = open_regular(path)?;
    let meta = f.metadata()?;
    let mut bytes = Vec::with_capacity(meta.len().min(max_bytes) as usize);
    f.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        const MIB: u64 = 1024 * 1024;
        let bound = if max_bytes >= MIB && max_bytes.is_multiple_of(MIB) {
            format!("{} MiB", max_bytes / MIB)
        } else {
            format!("{max_bytes} bytes")
        };
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("larger than {bound}"),
        ));
    }
    Ok(bytes)
}

/// Opens a regular file for reading, for a reader that streams it (an
/// audit log of any length): a FIFO, device, socket or directory is
/// refused without waiting (`InvalidInput`, "not a regular file").
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let not_regular =
        || std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
    // A device is not even opened (opening some has effects); the open
    // file's own type is checked again after, as the path may change.
    if !std::fs::metadata(path)?.is_file() {
        return Err(not_regular());
    }
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(not_regular());
    }
    // A regular file ignores O_NONBLOCK: reads are plain reads.
    Ok(f)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_to_string(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, max_bytes)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// Reads `path` (`None` when it does not exist): a regular file of at
/// most [`MAX_STATE_BYTES`] ([`read_regular`]).
pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, FsError> {
    match read_regular(path, MAX_STATE_BYTES) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(FsError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// A read-modify-write of `path` under its lock: `change` gets the
/// current content (`None` when there is no file) and returns the new
/// content (or `None` to leave the file as it is) and a value to return.
/// An error from `change` leaves the file untouched.
pub fn update<T, E: From<FsError>>(
    path: &Path,
    mode: u32,
    change: impl FnOnce(Option<&[u8]>) -> Result<(Option<Vec<u8>>, T), E>,
) -> Result<T, E> {
    let _lock = Lock::exclusive(path)?;
    let current = read_optional(path)?;
    let (new, out) = change(current.as_deref())?;
    if let Some(new) = new {
        write_atomic(path, &new, mode)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mkfifo(p: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .expect("mkfifo");
    }

    /// A FIFO no one writes, a link to /dev/zero, a directory and a file
    /// over the bound are each refused at once; a small regular file (or
    /// a link to one) is read.
    #[test]
    fn only_bounded_regular_files_are_read() {
        let d = tempfile::tempdir().expect("tempdir");
        let fifo = d.path().join("state.json");
        mkfifo(&fifo);
        let e = read_regular(&fifo, 1024).expect_err("fifo");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        let e = read_optional(&fifo).expect_err("fifo state");
        assert!(
            matches!(&e, FsError::Read { source, .. } if source.kind() == std::io::ErrorKind::InvalidInput),
            "{e:?}"
        );
        let zero = d.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).expect("symlink");
        let e = read_regular(&zero, 1024).expect_err("device");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        let e = read_regular(d.path(), 1024).expect_err("directory");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        let big = d.path().join("big");
        std::fs::write(&big, vec![b'x'; 1025]).expect("write");
        let e = read_regular(&big, 1024).expect_err("too big");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(e.to_string(), "larger than 1024 bytes");
        assert_eq!(read_regular(&big, 1025).expect("fits").len(), 1025);
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&big, &link).expect("symlink");
        assert_eq!(read_regular(&link, 2048).expect("link").len(), 1025);
        std::fs::write(&big, [0xff, 0xfe]).expect("write");
        let e = read_regular_to_string(&big, 1024).expect_err("not text");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(read_optional(&d.path().join("absent"))
            .expect("absent")
            .is_none());
    }

    #[test]
    fn a_held_lock_is_not_taken_until_it_is_dropped() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("rollouts.json");
        let held = Lock::try_exclusive(&p).expect("lock").expect("free");
        assert!(Lock::try_exclusive(&p).expect("lock").is_none());
        drop(held);
        let again = Lock::try_exclusive(&p).expect("lock");
        assert!(again.is_some());
    }

    #[test]
    fn replaces_with_the_mode_and_leaves_no_temporary() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("keys.json");
        write_atomic(&p, b"one", 0o600).expect("write");
        write_atomic(&p, b"two", 0o600).expect("write");
        assert_eq!(std::fs::read(&p).expect("read"), b"two");
        let mode = std::fs::metadata(&p).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(d.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("keys.json")]);
    }

    #[test]
    fn a_symlink_where_the_temporary_would_go_is_not_followed() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("keys.json");
        let victim = d.path().join("victim");
        std::fs::write(&victim, "keep").expect("write");
        // Every name this process would try next.
        let base = NEXT.load(Ordering::Relaxed);
        for n in base..base + 64 {
            std::os::unix::fs::symlink(
                &victim,
                d.path()
                    .join(format!(".keys.json.tmp.{}.{n}", std::process::id())),
            )
            .expect("symlink");
        }
        write_atomic(&p, b"new", 0o600).expect("write");
        assert_eq!(std::fs::read(&victim).expect("read"), b"keep");
        assert_eq!(std::fs::read(&p).expect("read"), b"new");
    }

    #[test]
    fn concurrent_updates_lose_nothing() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("counter");
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let p = p.clone();
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        update::<_, FsError>(&p, 0o600, |cur| {
                            let n: u64 = cur
                                .map(|b| String::from_utf8_lossy(b).trim().parse().expect("number"))
                                .unwrap_or(0);
                            Ok((Some(format!("{}\n", n + 1).into_bytes()), ()))
                        })
                        .expect("update");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("join");
        }
        assert_eq!(std::fs::read_to_string(&p).expect("read"), "400\n");
    }

    #[test]
    fn a_failed_change_leaves_the_file() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("f");
        std::fs::write(&p, "old").expect("write");
        #[derive(Debug)]
        struct No;
        impl From<FsError> for No {
            fn from(_: FsError) -> Self {
                No
            }
        }
        let r: Result<(), No> = update(&p, 0o600, |_| Err(No));
        assert!(r.is_err());
        assert_eq!(std::fs::read(&p).expect("read"), b"old");
    }
}
