//! API keys: a JSON file of key records holding only SHA-256 hashes of the
//! secrets (`keel serve keys create|ls|revoke` edit it), and the `KeyRing`
//! that answers "whose secret is this?" and notices a changed file on the
//! very next request (through an inotify watch on its directory, or a
//! `stat` per request where that cannot work), so a revocation takes
//! effect immediately. On a network or cluster filesystem (NFS, Lustre,
//! GPFS, CephFS, SMB, FUSE...), where inotify never hears of a change made
//! on another host, it is a `stat` per request and a fresh read every
//! second.
//!
//! Secrets are random bytes handed in by the caller (the library does not
//! read the system's randomness or clock).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::auth::Identity;
use crate::error::GatewayError;

/// The key file's format version.
pub const KEY_FILE_VERSION: u32 = 1;
/// Every secret starts with this, so leaked ones are easy to find.
pub const SECRET_PREFIX: &str = "sk-keel-";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyFile {
    pub version: u32,
    pub keys: Vec<KeyRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    /// Hex SHA-256 of the secret.
    pub sha256: String,
    pub roles: Vec<String>,
    pub team: Option<String>,
    pub created_ms: u64,
    pub revoked_ms: Option<u64>,
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

pub fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0u8; bytes.len() * 2];
    crate::digits::hex_into(bytes, &mut out);
    String::from_utf8(out).unwrap_or_default()
}

/// 64 hex digits (either case) as 32 bytes.
fn unhex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = nibble(b[2 * i])? << 4 | nibble(b[2 * i + 1])?;
    }
    Some(out)
}

/// What a new key needs.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub name: String,
    pub roles: Vec<String>,
    pub team: Option<String>,
}

impl KeyFile {
    /// Reads the file; a missing file is an empty key set.
    pub fn load(path: &Path) -> Result<Self, GatewayError> {
        let text = keel_fs::read_optional(path)?;
        Self::parse(path, text.as_deref())
    }

    fn parse(path: &Path, text: Option<&[u8]>) -> Result<Self, GatewayError> {
        let Some(text) = text else {
            return Ok(Self {
                version: KEY_FILE_VERSION,
                keys: Vec::new(),
            });
        };
        let f: KeyFile = serde_json::from_slice(text).map_err(|e| GatewayError::Malformed {
            what: "key file",
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        if f.version != KEY_FILE_VERSION {
            return Err(GatewayError::Malformed {
                what: "key file",
                path: path.to_owned(),
                reason: format!("version {} (this keel reads {KEY_FILE_VERSION})", f.version),
            });
        }
        Ok(f)
    }

    fn text(&self) -> Vec<u8> {
        let mut text = serde_json::to_vec_pretty(self).expect("key file serialises");
        text.push(b'\n');
        text
    }

    /// Writes the file atomically (a unique temporary file in the same
    /// directory, synced and renamed over it, the directory synced),
    /// readable by its owner only. For a change to the keys that are
    /// there, use `update`: `store` alone would overwrite another
    /// writer's change.
    pub fn store(&self, path: &Path) -> Result<(), GatewayError> {
        Ok(keel_fs::write_atomic(path, &self.text(), 0o600)?)
    }

    /// Reads the file, applies `change` and writes the result, all under
    /// the key file's exclusive lock, so concurrent `keys create` and
    /// `keys revoke` never undo each other. An error from `change` leaves
    /// the file untouched.
    pub fn update<T>(
        path: &Path,
        change: impl FnOnce(&mut KeyFile) -> Result<T, GatewayError>,
    ) -> Result<T, GatewayError> {
        keel_fs::update(path, 0o600, |current| {
            let mut f = Self::parse(path, current)?;
            let out = change(&mut f)?;
            Ok((Some(f.text()), out))
        })
    }

    /// Adds a key made from 32 random bytes; returns its record and the
    /// secret, which is shown once and stored nowhere.
    pub fn create(&mut self, new: NewKey, random: [u8; 32], now_ms: u64) -> (KeyRecord, String) {
        let id = format!("key_{}", hex(&random[..5]));
        let secret = format!("{SECRET_PREFIX}{}", hex(&random[5..]));
        let rec = KeyRecord {
            id,
            name: new.name,
            sha256: sha256_hex(secret.as_bytes()),
            roles: new.roles,
            team: new.team,
            created_ms: now_ms,
            revoked_ms: None,
        };
        self.keys.push(rec.clone());
        (rec, secret)
    }

    /// Marks a key revoked (it stays listed, with when).
    pub fn revoke(&mut self, id: &str, now_ms: u64) -> Result<&KeyRecord, GatewayError> {
        let k = self
            .keys
            .iter_mut()
            .find(|k| k.id == id)
            .ok_or_else(|| GatewayError::NoSuchKey { id: id.to_owned() })?;
        if k.revoked_ms.is_none() {
            k.revoked_ms = Some(now_ms);
        }
        Ok(k)
    }
}

/// Inode, modification time and size.
type Stamp = Option<(u64, i64, i64, u64)>;

/// Live keys by the SHA-256 of their secret.
pub type KeyMap = HashMap<[u8; 32], Identity>;

/// The live key set, re-read whenever the file changes.
#[derive(Debug)]
pub struct KeyRing {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    watch: Watch,
    stamp: Stamp,
    map: Arc<KeyMap>,
    /// The last read failed: read again on every call until it works.
    failed: bool,
    /// When the file was last read.
    read_at: std::time::Instant,
}

/// In `stat` mode the file is read again at least this often even when its
/// `stat` looks the same: a network filesystem's client may cache
/// attributes (an `open` revalidates them), and an in-place write of the
/// same length within one timestamp tick leaves the `stat` unchanged.
const REREAD_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// How the ring learns that the file may have changed.
#[derive(Debug)]
enum Watch {
    /// inotify watches on the file's directory (for the file's name:
    /// created, replaced by a rename, removed) and on the file itself
    /// (written, through any of its links), read without blocking on every
    /// call. The kernel queues an event before the write or rename that
    /// caused it returns, so a change made before a request arrived is
    /// always seen by that request. An event about the file leads to a
    /// `stat` of it; writes to other files in the directory (an audit
    /// log, say) queue nothing, and names coming and going there cost one
    /// event each, read at most `MAX_EVENTS` per call.
    #[cfg(target_os = "linux")]
    Inotify {
        fd: rustix::fd::OwnedFd,
        dir: i32,
        name: std::ffi::OsString,
    },
    /// A `stat` of the file on every call, and a read every
    /// `REREAD_EVERY`: where inotify is unavailable, where a symbolic link
    /// on the path could change the file without an event about it, and on
    /// any filesystem not known to be local (inotify sees only this host's
    /// writes).
    Stat,
}

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.mtime(), m.mtime_nsec(), m.len()))
}

#[cfg(target_os = "linux")]
fn watch(path: &Path) -> Watch {
    use rustix::fs::inotify::{self, CreateFlags, WatchFlags};
    let Ok(abs) = std::path::absolute(path) else {
        return Watch::Stat;
    };
    let (Some(dir), Some(name)) = (abs.parent(), abs.file_name()) else {
        return Watch::Stat;
    };
    // Only a path without symbolic links (and without `.` or `..`) is
    // watched: a link swapped elsewhere changes the file silently here.
    let plain_dir = std::fs::canonicalize(dir).is_ok_and(|c| c == dir);
    let plain_file = match std::fs::symlink_metadata(&abs) {
        Ok(m) => !m.file_type().is_symlink(),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    };
    if !plain_dir || !plain_file || !local_fs(dir) {
        return Watch::Stat;
    }
    let Ok(fd) = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK) else {
        return Watch::Stat;
    };
    // Names coming and going only: writes to the file are seen by its own
    // watch (`follow`), and writes to other files in the directory (a log
    // next to the key file) then queue nothing.
    let mask = WatchFlags::MOVED_FROM
        | WatchFlags::MOVED_TO
        | WatchFlags::CREATE
        | WatchFlags::DELETE
        | WatchFlags::DELETE_SELF
        | WatchFlags::MOVE_SELF;
    let Ok(dir) = inotify::add_watch(&fd, dir, mask) else {
        return Watch::Stat;
    };
    let w = Watch::Inotify {
        fd,
        dir,
        name: name.to_owned(),
    };
    if w.follow(&abs) {
        w
    } else {
        Watch::Stat
    }
}

/// Is `dir` on a filesystem that only this host writes to, so that inotify
/// sees every change? Known local filesystems only: anything else (NFS,
/// Lustre, GPFS, CephFS, BeeGFS, SMB, 9p, FUSE, or a type this list does
/// not know) is not.
#[cfg(target_os = "linux")]
// `f_type`'s integer type differs between targets.
#[allow(clippy::unnecessary_cast)]
fn local_fs(dir: &Path) -> bool {
    rustix::fs::statfs(dir).is_ok_and(|s| is_local_fs_type(s.f_type as i64))
}

/// Filesystem magic numbers (`statfs(2)`'s `f_type`) of local filesystems.
#[cfg(target_os = "linux")]
fn is_local_fs_type(t: i64) -> bool {
    const LOCAL: [i64; 10] = [
        0xEF53,      // ext2/3/4
        0x5846_5342, // xfs
        0x9123_683E, // btrfs
        0x0102_1994, // tmpfs
        0x8584_58F6, // ramfs
        0x794C_7630, // overlayfs
        0x2FC1_2FC1, // zfs
        0xF2F5_2010, // f2fs
        0x3153_464A, // jfs
        0x5265_4973, // reiserfs
    ];
    // The field is signed on some targets: compare the low 32 bits.
    LOCAL.contains(&(t & 0xFFFF_FFFF))
}

#[cfg(not(target_os = "linux"))]
fn watch(_: &Path) -> Watch {
    Watch::Stat
}

/// The most inotify events one call reads.
#[cfg(target_os = "linux")]
const MAX_EVENTS: usize = 64;

/// What the watch says since the last call.
enum Seen {
    Nothing,
    /// An event about the file: read it again.
    Changed,
    /// Perhaps: a `stat` settles it.
    Something,
    /// The directory's watch is gone (removed, moved, unmounted) or the
    /// watch cannot be read.
    WatchLost,
}

impl Watch {
    /// Watches the file now at `path` (after it was created or replaced);
    /// false if that failed for another reason than there being no file.
    fn follow(&self, path: &Path) -> bool {
        match self {
            #[cfg(target_os = "linux")]
            Watch::Inotify { fd, .. } => {
                use rustix::fs::inotify::{self, WatchFlags};
                let mask = WatchFlags::MODIFY | WatchFlags::ATTRIB | WatchFlags::CLOSE_WRITE;
                match inotify::add_watch(fd, path, mask) {
                    Ok(_) | Err(rustix::io::Errno::NOENT) => true,
                    Err(_) => false,
                }
            }
            Watch::Stat => true,
        }
    }

    fn poll(&self) -> Seen {
        match self {
            #[cfg(target_os = "linux")]
            Watch::Inotify { fd, dir, name } => {
                use rustix::fs::inotify::{ReadFlags, Reader};
                use rustix::io::Errno;
                use std::os::unix::ffi::OsStrExt;
                let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 1024];
                let mut r = Reader::new(fd, &mut buf);
                let mut seen = Seen::Nothing;
                let mut n = 0;
                loop {
                    // Bounded work per call: past MAX_EVENTS (other files
                    // created and removed in a burst) the answer is
                    // "something", which a `stat` settles, and the rest
                    // waits for the next call.
                    n += 1;
                    if n > MAX_EVENTS {
                        return match seen {
                            Seen::Changed => Seen::Changed,
                            _ => Seen::Something,
                        };
                    }
                    match r.next() {
                        Ok(e) if e.wd() == *dir => {
                            let gone = ReadFlags::IGNORED
                                | ReadFlags::DELETE_SELF
                                | ReadFlags::MOVE_SELF
                                | ReadFlags::UNMOUNT;
                            if e.events().intersects(gone) {
                                return Seen::WatchLost;
                            }
                            if e.file_name()
                                .is_some_and(|n| n.to_bytes() == name.as_bytes())
                            {
                                seen = Seen::Changed;
                            }
                        }
                        // The file's own watch, or events lost to a full
                        // queue (wd -1).
                        Ok(_) => seen = Seen::Changed,
                        Err(Errno::WOULDBLOCK) => return seen,
                        Err(Errno::INTR) => continue,
                        Err(_) => return Seen::WatchLost,
                    }
                }
            }
            Watch::Stat => Seen::Something,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            #[cfg(target_os = "linux")]
            Watch::Inotify { .. } => "inotify",
            Watch::Stat => "stat",
        }
    }
}

impl KeyRing {
    pub fn open(path: &Path) -> Result<Self, GatewayError> {
        // The watch first: a change between it and the read below is then
        // seen by the first call.
        let watch = watch(path);
        let st = stamp(path);
        let map = Self::read(path)?;
        Ok(Self {
            path: path.to_owned(),
            state: Mutex::new(State {
                watch,
                stamp: st,
                map: Arc::new(map),
                failed: false,
                read_at: std::time::Instant::now(),
            }),
        })
    }

    fn read(path: &Path) -> Result<KeyMap, GatewayError> {
        let f = KeyFile::load(path)?;
        Ok(f.keys
            .into_iter()
            .filter(|k| k.revoked_ms.is_none())
            // A digest that is not 64 hex digits matches no secret.
            .filter_map(|k| Some((unhex32(&k.sha256)?, k)))
            .map(|(digest, k)| {
                (
                    digest,
                    Identity::new(Arc::from(k.id), k.team.map(Arc::from), Arc::from(k.roles)),
                )
            })
            .collect())
    }

    /// How changes to the file are noticed: `inotify` or `stat`.
    pub fn watch_kind(&self) -> &'static str {
        self.lock().watch.name()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The keys as of now: every call asks whether the file changed (a
    /// non-blocking read of an inotify watch, or a `stat`) and re-reads it
    /// when it did. A file that cannot be read or parsed after a change
    /// leaves no key valid (fail closed) until it is fixed.
    pub fn current(&self) -> Result<Arc<KeyMap>, GatewayError> {
        let mut g = self.lock();
        let changed = match g.watch.poll() {
            Seen::Nothing if !g.failed => return Ok(g.map.clone()),
            Seen::Changed => true,
            Seen::WatchLost => {
                g.watch = Watch::Stat;
                false
            }
            Seen::Nothing | Seen::Something => false,
        };
        let st = stamp(&self.path);
        let stale = matches!(g.watch, Watch::Stat) && g.read_at.elapsed() >= REREAD_EVERY;
        if st == g.stamp && !g.failed && !changed && !stale {
            return Ok(g.map.clone());
        }
        if st.map(|s| s.0) != g.stamp.map(|s| s.0) && !g.watch.follow(&self.path) {
            // A new file that cannot be watched.
            g.watch = Watch::Stat;
        }
        g.read_at = std::time::Instant::now();
        match Self::read(&self.path) {
            Ok(map) => {
                g.stamp = st;
                g.map = Arc::new(map);
                g.failed = false;
                Ok(g.map.clone())
            }
            Err(e) => {
                g.stamp = None;
                g.map = Arc::new(HashMap::new());
                g.failed = true;
                Err(e)
            }
        }
    }

    /// The live key whose secret this is.
    pub fn lookup(&self, secret: &str) -> Result<Option<Identity>, GatewayError> {
        let map = self.current()?;
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        Ok(map.get(&digest).cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn create_lookup_revoke() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keys.json");
        let mut f = KeyFile::load(&path).expect("empty");
        let (rec, secret) = f.create(
            NewKey {
                name: "alice".into(),
                roles: vec!["user".into()],
                team: Some("ml".into()),
            },
            [7; 32],
            1000,
        );
        assert!(secret.starts_with(SECRET_PREFIX));
        assert!(!serde_json::to_string(&f).expect("json").contains(&secret));
        f.store(&path).expect("store");
        let ring = KeyRing::open(&path).expect("ring");
        let k = ring.lookup(&secret).expect("ok").expect("found");
        assert_eq!(&*k.id, rec.id.as_str());
        assert!(ring.lookup("sk-keel-wrong").expect("ok").is_none());

        let mut f = KeyFile::load(&path).expect("load");
        f.revoke(&rec.id, 2000).expect("revoke");
        f.store(&path).expect("store");
        assert!(
            ring.lookup(&secret).expect("ok").is_none(),
            "revoked at once"
        );
        assert!(matches!(
            f.revoke("key_nope", 1),
            Err(GatewayError::NoSuchKey { .. })
        ));

        std::fs::write(&path, "not json").expect("write");
        assert!(ring.lookup(&secret).is_err());
    }

    /// A temporary directory (kept while the first value lives) and its
    /// path without symbolic links, which inotify mode requires.
    fn plain_tempdir() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().expect("tempdir");
        let p = std::fs::canonicalize(d.path()).expect("canonical");
        (d, p)
    }

    fn file_with_key(path: &Path, name: &str) -> (KeyFile, KeyRecord, String) {
        let mut f = KeyFile::load(path).expect("load");
        let (rec, secret) = f.create(
            NewKey {
                name: name.into(),
                roles: vec!["user".into()],
                team: None,
            },
            [name.len() as u8; 32],
            1000,
        );
        f.store(path).expect("store");
        (f, rec, secret)
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_plain_path_is_watched_and_every_kind_of_change_is_seen_at_once() {
        let (_keep, dir) = plain_tempdir();
        let path = dir.join("keys.json");
        let (mut f, rec, secret) = file_with_key(&path, "alice");
        let ring = KeyRing::open(&path).expect("ring");
        assert_eq!(ring.watch_kind(), "inotify");
        assert!(ring.lookup(&secret).expect("ok").is_some());
        // Other files in the directory change nothing.
        std::fs::write(dir.join("audit.jsonl"), "x\n").expect("write");
        assert!(ring.lookup(&secret).expect("ok").is_some());
        // Replaced by rename (what `keys revoke` does).
        f.revoke(&rec.id, 2000).expect("revoke");
        f.store(&path).expect("store");
        assert!(ring.lookup(&secret).expect("ok").is_none());
        // Written in place, with the same length and within the same
        // second as before.
        let (_, _, bob) = file_with_key(&path, "bob");
        assert!(ring.lookup(&bob).expect("ok").is_some());
        let text = std::fs::read_to_string(&path).expect("read");
        std::fs::write(
            &path,
            text.replace("\"revoked_ms\": null", "\"revoked_ms\": 1234"),
        )
        .expect("write in place");
        assert!(
            ring.lookup(&bob).expect("ok").is_none(),
            "in-place edit seen"
        );
        // Removed: no key is valid; back: valid again.
        let saved = std::fs::read_to_string(&path).expect("read");
        std::fs::remove_file(&path).expect("rm");
        assert!(ring.lookup(&bob).expect("ok").is_none());
        std::fs::write(&path, saved.replace("1234", "null")).expect("restore");
        assert!(ring.lookup(&bob).expect("ok").is_some());
        // Broken: refused with the error on every call until fixed.
        std::fs::write(&path, "not json").expect("break");
        assert!(ring.lookup(&bob).is_err());
        assert!(ring.lookup(&bob).is_err(), "still refused, no new event");
        std::fs::write(&path, saved.replace("1234", "null")).expect("fix");
        assert!(ring.lookup(&bob).expect("ok").is_some());
        // Written through a hard link in another directory.
        let elsewhere = tempfile::tempdir().expect("tempdir");
        let link = elsewhere.path().join("link.json");
        std::fs::hard_link(&path, &link).expect("ln");
        assert!(ring.lookup(&bob).expect("ok").is_some());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&link)
            .and_then(|mut f| f.write_all(saved.as_bytes()))
            .expect("write through the link");
        assert!(
            ring.lookup(&bob).expect("ok").is_none(),
            "write through a link seen"
        );
        assert_eq!(ring.watch_kind(), "inotify");
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_burst_of_other_files_is_read_a_bounded_batch_at_a_time() {
        let (_keep, dir) = plain_tempdir();
        let path = dir.join("keys.json");
        let (mut f, rec, secret) = file_with_key(&path, "alice");
        let ring = KeyRing::open(&path).expect("ring");
        // Writes to another file queue nothing.
        for i in 0..200 {
            std::fs::write(dir.join("audit.jsonl"), format!("{i}\n")).expect("write");
        }
        assert!(matches!(ring.lock().watch.poll(), Seen::Nothing));
        // 400 names come and go: 800 events, read MAX_EVENTS at a time.
        let churn = |prefix: &str| {
            for i in 0..400 {
                let p = dir.join(format!("{prefix}{i}"));
                std::fs::write(&p, "x").expect("create");
                std::fs::remove_file(&p).expect("rm");
            }
        };
        churn("tmp");
        let mut calls = 0;
        while !matches!(ring.lock().watch.poll(), Seen::Nothing) {
            calls += 1;
            assert!(calls < 100, "the queue drains");
        }
        assert!(calls >= 800 / MAX_EVENTS, "{calls} calls for 800 events");
        // Keys still answer, and a change after the burst is seen at once.
        churn("again");
        assert!(ring.lookup(&secret).expect("ok").is_some());
        f.revoke(&rec.id, 2000).expect("revoke");
        f.store(&path).expect("store");
        assert!(ring.lookup(&secret).expect("ok").is_none());
        assert_eq!(ring.watch_kind(), "inotify");
    }

    /// Rewrites the file in place with its one key's digest changed (same
    /// length, same inode) and puts its modification time back, so that
    /// its `stat` is what it was.
    fn rewrite_in_place_unchanged_stat(path: &Path) {
        let before = std::fs::metadata(path).expect("stat");
        let text = std::fs::read_to_string(path).expect("read");
        let mut f = KeyFile::load(path).expect("load");
        let old = f.keys[0].sha256.clone();
        f.keys[0].sha256 = "0".repeat(64);
        let new = text.replace(&old, &f.keys[0].sha256);
        assert_eq!(new.len(), text.len());
        std::fs::write(path, new).expect("write");
        std::fs::File::options()
            .write(true)
            .open(path)
            .expect("open")
            .set_modified(before.modified().expect("mtime"))
            .expect("set mtime");
        assert_eq!(stamp(path), {
            use std::os::unix::fs::MetadataExt;
            Some((
                before.ino(),
                before.mtime(),
                before.mtime_nsec(),
                before.len(),
            ))
        });
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn an_in_place_write_that_leaves_the_stat_unchanged_is_seen() {
        // Watched: the write's event is enough, at once.
        let (_keep, dir) = plain_tempdir();
        let path = dir.join("keys.json");
        let (_, _, secret) = file_with_key(&path, "alice");
        let ring = KeyRing::open(&path).expect("ring");
        assert_eq!(ring.watch_kind(), "inotify");
        assert!(ring.lookup(&secret).expect("ok").is_some());
        rewrite_in_place_unchanged_stat(&path);
        assert!(ring.lookup(&secret).expect("ok").is_none());

        // Checked by stat (through a symbolic link): read again within
        // REREAD_EVERY.
        let link = dir.join("link.json");
        let (_, _, bob) = file_with_key(&dir.join("bob.json"), "bob");
        std::os::unix::fs::symlink(dir.join("bob.json"), &link).expect("link");
        let ring = KeyRing::open(&link).expect("ring");
        assert_eq!(ring.watch_kind(), "stat");
        assert!(ring.lookup(&bob).expect("ok").is_some());
        rewrite_in_place_unchanged_stat(&dir.join("bob.json"));
        std::thread::sleep(REREAD_EVERY + std::time::Duration::from_millis(100));
        assert!(ring.lookup(&bob).expect("ok").is_none());
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn only_local_filesystems_are_trusted_to_inotify() {
        // statfs(2) magic numbers; some are negative as a signed 32-bit
        // f_type and arrive sign-extended.
        for (t, local) in [
            (0xEF53_i64, true),                     // ext4
            (0x9123_683E_u32 as i32 as i64, true),  // btrfs, sign-extended
            (0x794C_7630, true),                    // overlayfs
            (0x6969, false),                        // NFS
            (0x0BD0_0BD0, false),                   // Lustre
            (0x4750_4653, false),                   // GPFS
            (0x00C3_6400, false),                   // CephFS
            (0xFF53_4D42_u32 as i32 as i64, false), // CIFS
            (0x6573_5546, false),                   // FUSE
            (0x0102_1997, false),                   // 9p
            (0, false),
        ] {
            assert_eq!(is_local_fs_type(t), local, "{t:#x}");
        }
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_moved_directory_falls_back_to_stat() {
        let (_keep, top) = plain_tempdir();
        let dir = top.join("conf");
        std::fs::create_dir(&dir).expect("mkdir");
        let path = dir.join("keys.json");
        let (_, _, secret) = file_with_key(&path, "alice");
        let ring = KeyRing::open(&path).expect("ring");
        assert_eq!(ring.watch_kind(), "inotify");
        std::fs::rename(&dir, top.join("old")).expect("mv");
        assert!(ring.lookup(&secret).expect("ok").is_none(), "file gone");
        assert_eq!(ring.watch_kind(), "stat");
        // A new directory at the old path is followed by stat.
        std::fs::create_dir(&dir).expect("mkdir");
        let (_, _, bob) = file_with_key(&path, "bob");
        assert!(ring.lookup(&bob).expect("ok").is_some());
    }

    #[test]
    fn a_symlinked_file_is_checked_by_stat_and_a_swapped_link_is_seen() {
        // The layout of a Kubernetes secret volume: the file is a link
        // through a `..data` link that an update swaps.
        let (_keep, top) = plain_tempdir();
        let (v1, v2) = (top.join("v1"), top.join("v2"));
        std::fs::create_dir(&v1).expect("mkdir");
        std::fs::create_dir(&v2).expect("mkdir");
        let (mut f, rec, secret) = file_with_key(&v1.join("keys.json"), "alice");
        f.revoke(&rec.id, 2000).expect("revoke");
        f.store(&v2.join("keys.json")).expect("store v2");
        std::os::unix::fs::symlink("v1", top.join("..data")).expect("link");
        let path = top.join("keys.json");
        std::os::unix::fs::symlink("..data/keys.json", &path).expect("link");
        let ring = KeyRing::open(&path).expect("ring");
        assert_eq!(ring.watch_kind(), "stat");
        assert!(ring.lookup(&secret).expect("ok").is_some());
        std::os::unix::fs::symlink("v2", top.join("..data_tmp")).expect("link");
        std::fs::rename(top.join("..data_tmp"), top.join("..data")).expect("swap");
        assert!(ring.lookup(&secret).expect("ok").is_none(), "revoked in v2");
    }

    #[test]
    fn digests_in_either_case_match_and_malformed_ones_match_nothing() {
        let d = sha256_hex(b"s");
        assert_eq!(unhex32(&d), unhex32(&d.to_ascii_uppercase()));
        assert_eq!(unhex32(&d).map(|b| hex(&b)), Some(d.clone()), "round trip");
        assert_eq!(unhex32(&d[..63]), None);
        assert_eq!(unhex32(&format!("{}g", &d[..63])), None);
        assert_eq!(unhex32(&format!("{d}00")), None);
    }
}
