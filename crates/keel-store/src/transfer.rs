//! Parallel, verified transfers between local files and a [`Store`].
//!
//! - Upload: each file is read in parts on the blocking pool and hashed as
//!   it is read; parts go out as a multipart upload (Azure blocks, S3 parts)
//!   while the next part is read and hashed, so hashing overlaps I/O. Small
//!   files are one put. A file whose size changes while it is read is an
//!   error, not a manifest entry.
//! - Download: ranged reads of one file run in parallel but arrive in order
//!   (`buffered`), so the file is written and hashed front to back; size
//!   and digest are compared with the manifest entry before it counts.
//! - Verify: the same as download without the file.
//!
//! Memory is bounded by `files_in_parallel x (parts_in_flight + 1) x
//! part_size`. Every byte that moves asks the shared [`Limiter`] first.

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutPayload, WriteMultipart};

use crate::manifest::Hasher;
use crate::{Digest, FileEntry, Limiter, Store, StoreError};

/// Called with the number of bytes each time some move.
#[derive(Clone)]
pub struct Progress(pub Arc<dyn Fn(u64) + Send + Sync>);

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Progress")
    }
}

impl Progress {
    fn tick(p: &Option<Progress>, n: u64) {
        if let Some(p) = p {
            (p.0)(n);
        }
    }
}

#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Files moved at once.
    pub files_in_parallel: usize,
    /// Parts of one file in flight at once.
    pub parts_in_flight: usize,
    /// Part size; grown for very large files so that no file needs more
    /// than 9,000 parts (S3 allows 10,000, Azure 50,000 blocks).
    pub part_size: usize,
    /// Shared by every transfer of the process.
    pub limiter: Arc<Limiter>,
    pub progress: Option<Progress>,
}

impl Default for TransferOptions {
    fn default() -> Self {
        Self {
            files_in_parallel: 8,
            parts_in_flight: 4,
            part_size: 8 << 20,
            limiter: Arc::new(Limiter::unlimited()),
            progress: None,
        }
    }
}

impl TransferOptions {
    fn part_for(&self, size: u64) -> u64 {
        let min = self.part_size.max(1 << 16) as u64;
        min.max(size.div_ceil(9000))
    }
}

/// A local file to upload to `key`, recorded under `name`.
#[derive(Debug, Clone)]
pub struct Upload {
    pub local: PathBuf,
    pub key: String,
    pub name: String,
}

/// Uploads files in parallel; returns each file's entry (in input order).
/// Stops at the first error; parts already sent stay as uncommitted blocks
/// or unreferenced objects for the caller's garbage collection.
pub async fn upload_files(
    store: &Store,
    items: Vec<Upload>,
    opts: &TransferOptions,
) -> Result<Vec<FileEntry>, StoreError> {
    let n = opts.files_in_parallel.max(1);
    futures::stream::iter(items)
        .map(|u| upload_one(store, u, opts))
        .buffered(n)
        .try_collect()
        .await
}

fn join_err(e: tokio::task::JoinError) -> StoreError {
    StoreError::Task {
        message: e.to_string(),
    }
}

/// Reads up to `len` bytes (fewer only at end of file) and hashes them.
fn read_part(
    mut f: std::fs::File,
    mut h: Hasher,
    len: usize,
    path: &Path,
) -> Result<(std::fs::File, Hasher, Bytes), StoreError> {
    let mut buf = BytesMut::zeroed(len);
    let mut filled = 0;
    while filled < len {
        match f.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(k) => filled += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(StoreError::LocalRead {
                    path: path.to_owned(),
                    source,
                })
            }
        }
    }
    buf.truncate(filled);
    h.update(&buf);
    Ok((f, h, buf.freeze()))
}

async fn upload_one(
    store: &Store,
    u: Upload,
    opts: &TransferOptions,
) -> Result<FileEntry, StoreError> {
    let local = u.local.clone();
    let (file, size) = tokio::task::spawn_blocking(move || {
        let f = std::fs::File::open(&local).map_err(|source| StoreError::LocalRead {
            path: local.clone(),
            source,
        })?;
        let size = f
            .metadata()
            .map_err(|source| StoreError::LocalRead {
                path: local.clone(),
                source,
            })?
            .len();
        Ok::<_, StoreError>((f, size))
    })
    .await
    .map_err(join_err)??;
    let part = opts.part_for(size).max(store.min_part_size());
    let path = store.path(&u.key)?;
    let changed = |after: u64| StoreError::Changed {
        path: u.local.clone(),
        before: size,
        after,
    };
    let mut file = file;
    let mut hasher = Hasher::new();
    if size < part {
        // One put; read one byte more than expected to notice growth.
        let local = u.local.clone();
        let (_, h, data) =
            tokio::task::spawn_blocking(move || read_part(file, hasher, size as usize + 1, &local))
                .await
                .map_err(join_err)??;
        if data.len() as u64 != size {
            return Err(changed(data.len() as u64));
        }
        opts.limiter.acquire(size).await;
        store
            .raw()
            .put(&path, PutPayload::from(data))
            .await
            .map_err(|e| store.err("upload", &u.key, e))?;
        Progress::tick(&opts.progress, size);
        return Ok(FileEntry {
            name: u.name,
            size,
            sha256: h.finish(),
        });
    }
    let upload = store
        .raw()
        .put_multipart(&path)
        .await
        .map_err(|e| store.err("upload", &u.key, e))?;
    let mut w = WriteMultipart::new_with_chunk_size(upload, part as usize);
    let mut total = 0u64;
    let result: Result<Hasher, StoreError> = async {
        loop {
            let local = u.local.clone();
            let (f, h, chunk) =
                tokio::task::spawn_blocking(move || read_part(file, hasher, part as usize, &local))
                    .await
                    .map_err(join_err)??;
            file = f;
            hasher = h;
            if chunk.is_empty() {
                return Ok(hasher);
            }
            let len = chunk.len() as u64;
            total += len;
            if total > size {
                return Err(changed(total));
            }
            opts.limiter.acquire(len).await;
            w.wait_for_capacity(opts.parts_in_flight.max(1))
                .await
                .map_err(|e| store.err("upload", &u.key, e))?;
            w.put(chunk);
            Progress::tick(&opts.progress, len);
        }
    }
    .await;
    let hasher = match result {
        Ok(h) => h,
        Err(e) => {
            let _ = w.abort().await;
            return Err(e);
        }
    };
    if total != size {
        let _ = w.abort().await;
        return Err(changed(total));
    }
    w.finish()
        .await
        .map_err(|e| store.err("upload", &u.key, e))?;
    Ok(FileEntry {
        name: u.name,
        size,
        sha256: hasher.finish(),
    })
}

/// An object to fetch and check against `expected`; written to `local`
/// when given, only hashed otherwise.
#[derive(Debug, Clone)]
pub struct Fetch {
    pub key: String,
    pub expected: FileEntry,
    pub local: Option<PathBuf>,
}

/// Downloads (or only verifies) objects in parallel. Returns one result per
/// item, in input order, so a caller can report every bad file; with
/// `fail_fast`, the first failure ends the whole call instead.
pub async fn fetch_files(
    store: &Store,
    items: Vec<Fetch>,
    opts: &TransferOptions,
    fail_fast: bool,
) -> Result<Vec<(Fetch, Result<(), StoreError>)>, StoreError> {
    let n = opts.files_in_parallel.max(1);
    // With fail_fast, the first failure stops new files from starting, and
    // the files already in flight are drained before returning: their
    // blocking file work must be over before the caller removes the
    // directory they write into.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let stop = &stop;
    let mut s = futures::stream::iter(items)
        .map(|f| async move {
            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                return (f, None);
            }
            let r = fetch_one(store, &f, opts).await;
            (f, Some(r))
        })
        .buffered(n);
    let mut out = Vec::new();
    let mut first_error = None;
    while let Some((f, r)) = s.next().await {
        let Some(r) = r else { continue };
        if fail_fast {
            match r {
                Err(e) if first_error.is_none() => {
                    stop.store(true, std::sync::atomic::Ordering::SeqCst);
                    first_error = Some(e);
                }
                Err(_) => {}
                Ok(()) => out.push((f, Ok(()))),
            }
        } else {
            out.push((f, r));
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

async fn fetch_one(store: &Store, f: &Fetch, opts: &TransferOptions) -> Result<(), StoreError> {
    let path = store.path(&f.key)?;
    let expected = &f.expected;
    let head = store
        .raw()
        .head(&path)
        .await
        .map_err(|e| store.err("get", &f.key, e))?;
    if head.size != expected.size {
        return Err(StoreError::SizeMismatch {
            key: f.key.clone(),
            expected: expected.size,
            actual: head.size,
        });
    }
    let mut sink = match &f.local {
        Some(local) => {
            let local = local.clone();
            Some(
                tokio::task::spawn_blocking(move || {
                    if let Some(parent) = local.parent() {
                        std::fs::create_dir_all(parent).map_err(|source| {
                            StoreError::LocalWrite {
                                path: parent.to_owned(),
                                source,
                            }
                        })?;
                    }
                    std::fs::File::create(&local).map_err(|source| StoreError::LocalWrite {
                        path: local,
                        source,
                    })
                })
                .await
                .map_err(join_err)??,
            )
        }
        None => None,
    };
    let part = opts.part_for(expected.size);
    let ranges: Vec<std::ops::Range<u64>> = (0..expected.size.div_ceil(part))
        .map(|i| i * part..((i + 1) * part).min(expected.size))
        .collect();
    let mut parts = futures::stream::iter(ranges)
        .map(|r| {
            let path = path.clone();
            async move {
                opts.limiter.acquire(r.end - r.start).await;
                store
                    .raw()
                    .get_range(&path, r.clone())
                    .await
                    .map(|b| (r, b))
                    .map_err(|e| store.err("get", &f.key, e))
            }
        })
        .buffered(opts.parts_in_flight.max(1));
    let mut hasher = Hasher::new();
    let mut total = 0u64;
    while let Some(next) = parts.next().await {
        let (r, data) = next?;
        if data.len() as u64 != r.end - r.start {
            return Err(StoreError::SizeMismatch {
                key: f.key.clone(),
                expected: expected.size,
                actual: total + data.len() as u64,
            });
        }
        total += data.len() as u64;
        let local = f.local.clone();
        let s = sink.take();
        let (s, h) = tokio::task::spawn_blocking(move || {
            hasher.update(&data);
            let s = match (s, local) {
                (Some(mut file), Some(local)) => {
                    file.write_all(&data)
                        .map_err(|source| StoreError::LocalWrite {
                            path: local,
                            source,
                        })?;
                    Some(file)
                }
                (s, _) => s,
            };
            Ok::<_, StoreError>((s, hasher))
        })
        .await
        .map_err(join_err)??;
        sink = s;
        hasher = h;
        Progress::tick(&opts.progress, r.end - r.start);
    }
    let actual: Digest = hasher.finish();
    if actual != expected.sha256 {
        return Err(StoreError::DigestMismatch {
            key: f.key.clone(),
            expected: expected.sha256.hex(),
            actual: actual.hex(),
        });
    }
    if let (Some(file), Some(local)) = (sink, &f.local) {
        let local = local.clone();
        tokio::task::spawn_blocking(move || {
            file.sync_all().map_err(|source| StoreError::LocalWrite {
                path: local,
                source,
            })
        })
        .await
        .map_err(join_err)??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[tokio::test]
    async fn upload_download_verify_roundtrip_with_small_parts() {
        let dir = tempfile::tempdir().expect("tmp");
        let sizes = [0usize, 1, 65_535, 65_536, 65_537, 300_000];
        let mut items = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            let p = dir.path().join(format!("f{i}"));
            std::fs::write(&p, data(*n, i as u8)).expect("write");
            items.push(Upload {
                local: p,
                key: format!("obj/f{i}"),
                name: format!("f{i}"),
            });
        }
        let store = Store::memory();
        let moved = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let m2 = moved.clone();
        let opts = TransferOptions {
            part_size: 65_536,
            files_in_parallel: 3,
            parts_in_flight: 2,
            progress: Some(Progress(Arc::new(move |n| {
                m2.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            }))),
            ..Default::default()
        };
        let entries = upload_files(&store, items, &opts).await.expect("upload");
        let total: u64 = sizes.iter().map(|n| *n as u64).sum();
        assert_eq!(moved.load(std::sync::atomic::Ordering::Relaxed), total);
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(e.size, sizes[i] as u64);
            assert_eq!(e.sha256, Digest::of(&data(sizes[i], i as u8)));
            assert_eq!(
                store.get(&format!("obj/f{i}")).await.expect("get").len(),
                sizes[i]
            );
        }
        let out = tempfile::tempdir().expect("tmp");
        let fetches: Vec<Fetch> = entries
            .iter()
            .map(|e| Fetch {
                key: format!("obj/{}", e.name),
                expected: e.clone(),
                local: Some(out.path().join("x").join(&e.name)),
            })
            .collect();
        fetch_files(&store, fetches.clone(), &opts, true)
            .await
            .expect("download");
        for (i, n) in sizes.iter().enumerate() {
            assert_eq!(
                std::fs::read(out.path().join(format!("x/f{i}"))).expect("read"),
                data(*n, i as u8)
            );
        }
        // One flipped byte in the middle of a multi-part object.
        let mut bad = data(300_000, 5);
        bad[150_000] ^= 1;
        store.put("obj/f5", Bytes::from(bad)).await.expect("put");
        let verify: Vec<Fetch> = fetches
            .into_iter()
            .map(|f| Fetch { local: None, ..f })
            .collect();
        let results = fetch_files(&store, verify, &opts, false)
            .await
            .expect("verify");
        for (f, r) in &results {
            if f.key == "obj/f5" {
                let e = r.as_ref().expect_err("corrupt");
                assert!(e.is_integrity(), "{e}");
                assert!(e.to_string().contains("SHA-256"), "{e}");
            } else {
                assert!(r.is_ok(), "{}: {r:?}", f.key);
            }
        }
        // A truncated object is a size mismatch.
        store
            .put("obj/f4", Bytes::from_static(b"short"))
            .await
            .expect("put");
        let e = fetch_one(
            &store,
            &Fetch {
                key: "obj/f4".into(),
                expected: entries[4].clone(),
                local: None,
            },
            &opts,
        )
        .await
        .expect_err("short");
        assert!(matches!(e, StoreError::SizeMismatch { .. }), "{e}");
    }

    #[tokio::test]
    async fn missing_local_file_is_a_read_error() {
        let store = Store::memory();
        let e = upload_files(
            &store,
            vec![Upload {
                local: "/nonexistent/keel/x".into(),
                key: "k".into(),
                name: "x".into(),
            }],
            &TransferOptions::default(),
        )
        .await
        .expect_err("missing");
        assert!(matches!(e, StoreError::LocalRead { .. }), "{e}");
        assert!(store.list("").await.expect("list").is_empty());
    }
}
