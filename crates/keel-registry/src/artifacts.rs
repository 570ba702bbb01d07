//! A version's files in object storage (any keel-store URL): upload a
//! local directory with its manifest, read a manifest that is already
//! there, check stored objects, and pull them to a directory, verified.
//!
//! Layout under a version's artifact URL: `.keel-claim` (who is writing
//! there, created only if absent, before anything else), the files under
//! their names, and `manifest.json` (keel-store's statement), written last
//! and only if absent. A URL that already holds a claim or a manifest is
//! another upload's, and no upload writes there.

use std::path::{Path, PathBuf};

use bytes::Bytes;

use keel_store::transfer::{self, Fetch, Upload};
use keel_store::{CreateOutcome, FileEntry, Manifest, Store, StoreError, TransferOptions};

/// The manifest's key under an artifact URL.
pub const MANIFEST_KEY: &str = "manifest.json";

/// The key an upload creates (only if absent) before it writes any file:
/// of two uploads into one URL, only the one that created it writes.
pub const CLAIM_KEY: &str = ".keel-claim";

/// What can go wrong moving artifacts.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot read the directory {path}")]
    ReadDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is a symbolic link; keel registers regular files only")]
    Symlink { path: PathBuf },
    #[error("{path} has no files to register")]
    Empty { path: PathBuf },
    #[error("{path}: file name {name:?} cannot be stored: {reason}")]
    BadName {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("the manifest at {url}/{MANIFEST_KEY} is not usable: {source}")]
    Manifest {
        url: String,
        #[source]
        source: keel_store::ManifestError,
    },
    #[error("no manifest at {url}/{MANIFEST_KEY}")]
    NoManifest { url: String },
    #[error("{url} already holds a version ({url}/{MANIFEST_KEY} exists); a version's files are never written over")]
    VersionExists { url: String },
    #[error("another upload claimed {url} ({url}/{CLAIM_KEY} exists: {claim}); a version's files are never written over")]
    Claimed { url: String, claim: String },
    #[error("{target} already exists and is not an empty directory")]
    TargetNotEmpty { target: PathBuf },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} stored file(s) do not match the version's digests: {}", bad.len(), bad.iter().map(|b| b.to_string()).collect::<Vec<_>>().join("; "))]
    Corrupt { bad: Vec<BadObject> },
}

/// A stored file that failed verification.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BadObject {
    pub name: String,
    pub reason: String,
}

impl std::fmt::Display for BadObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.name, self.reason)
    }
}

/// The regular files under `dir`, as `(relative name, path)`, sorted. A
/// top-level `model.sig` (a signature pulled beside the files) is left
/// out. Symbolic links are refused.
pub fn list_dir(dir: &Path) -> Result<Vec<(String, PathBuf)>, ArtifactError> {
    fn walk(root: &Path, rel: &str, out: &mut Vec<(String, PathBuf)>) -> Result<(), ArtifactError> {
        let here = if rel.is_empty() {
            root.to_owned()
        } else {
            root.join(rel)
        };
        let rd = std::fs::read_dir(&here).map_err(|source| ArtifactError::ReadDir {
            path: here.clone(),
            source,
        })?;
        for entry in rd {
            let entry = entry.map_err(|source| ArtifactError::ReadDir {
                path: here.clone(),
                source,
            })?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let child = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let ft = entry.file_type().map_err(|source| ArtifactError::ReadDir {
                path: path.clone(),
                source,
            })?;
            if ft.is_symlink() {
                return Err(ArtifactError::Symlink { path });
            } else if ft.is_dir() {
                walk(root, &child, out)?;
            } else if ft.is_file() {
                if child == "model.sig" {
                    continue;
                }
                if child == MANIFEST_KEY || child == CLAIM_KEY {
                    return Err(ArtifactError::BadName {
                        path: path.clone(),
                        name: child,
                        reason: "keel writes the version's own file under this name at the top \
                                 level; move it into a subdirectory or rename it"
                            .into(),
                    });
                }
                keel_store::manifest::check_name(&child).map_err(|reason| {
                    ArtifactError::BadName {
                        path: path.clone(),
                        name: child.clone(),
                        reason,
                    }
                })?;
                out.push((child, path));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, "", &mut out)?;
    out.sort();
    if out.is_empty() {
        return Err(ArtifactError::Empty {
            path: dir.to_owned(),
        });
    }
    Ok(out)
}

/// Uploads a directory's files (hashed while they go) and then its
/// manifest, create-only. A store that already holds a manifest holds a
/// version: it is refused before anything is written
/// ([`ArtifactError::VersionExists`]). Before any file is written the
/// upload creates [`CLAIM_KEY`] holding `claim` (who is uploading; make
/// it unique to this upload, a claim already holding the same bytes is
/// taken as this upload's own), only if absent: of two uploads into one URL at once, the second is refused
/// ([`ArtifactError::Claimed`]) without writing a byte. The claim stays
/// after the upload, finished or failed, so the URL is never written
/// twice.
pub async fn upload_dir(
    store: &Store,
    dir: &Path,
    name: &str,
    claim: &str,
    opts: &TransferOptions,
) -> Result<Manifest, ArtifactError> {
    let url = || store.url().to_string();
    if store.head(MANIFEST_KEY).await?.is_some() {
        return Err(ArtifactError::VersionExists { url: url() });
    }
    let items: Vec<Upload> = list_dir(dir)?
        .into_iter()
        .map(|(name, local)| Upload {
            local,
            key: name.clone(),
            name,
        })
        .collect();
    if let CreateOutcome::AlreadyExists = store
        .create(CLAIM_KEY, Bytes::copy_from_slice(claim.as_bytes()))
        .await?
    {
        let stored = match store.get_opt(CLAIM_KEY).await {
            Ok(Some(b)) => b,
            Ok(None) => Bytes::from_static(b"(not readable yet: being written)"),
            Err(e) => Bytes::from(format!("(unreadable: {e})")),
        };
        // The store may retry a create whose first attempt landed: a claim
        // holding exactly these bytes is this upload's own.
        if stored != claim.as_bytes() {
            let claim = String::from_utf8_lossy(&stored).trim().to_owned();
            return Err(ArtifactError::Claimed { url: url(), claim });
        }
    }
    let entries = transfer::upload_files(store, items, opts).await?;
    let manifest = Manifest::new(name, entries, Default::default())
        .map_err(|source| ArtifactError::Manifest { url: url(), source })?;
    match store
        .create(MANIFEST_KEY, Bytes::from(manifest.to_json()))
        .await?
    {
        CreateOutcome::Created => Ok(manifest),
        CreateOutcome::AlreadyExists => Err(ArtifactError::VersionExists { url: url() }),
    }
}

/// Reads and checks the manifest stored under a URL.
pub async fn read_manifest(store: &Store, url: &str) -> Result<Manifest, ArtifactError> {
    let bytes = store
        .get_opt(MANIFEST_KEY)
        .await?
        .ok_or_else(|| ArtifactError::NoManifest {
            url: url.to_owned(),
        })?;
    Manifest::from_json(&bytes).map_err(|source| ArtifactError::Manifest {
        url: url.to_owned(),
        source,
    })
}

/// Reads every stored file and checks its size and SHA-256; returns the
/// ones that fail (empty: all good).
pub async fn check_stored(
    store: &Store,
    files: &[FileEntry],
    opts: &TransferOptions,
) -> Result<Vec<BadObject>, ArtifactError> {
    let items = files
        .iter()
        .map(|f| Fetch {
            key: f.name.clone(),
            expected: f.clone(),
            local: None,
        })
        .collect();
    let results = transfer::fetch_files(store, items, opts, false).await?;
    Ok(results
        .into_iter()
        .filter_map(|(f, r)| {
            r.err().map(|e| BadObject {
                name: f.expected.name,
                reason: match e {
                    StoreError::DigestMismatch { .. } => "content changed (SHA-256 differs)".into(),
                    StoreError::SizeMismatch {
                        expected, actual, ..
                    } => format!("{actual} bytes, the version has {expected}"),
                    e if e.is_not_found() => "missing from storage".into(),
                    e => e.to_string(),
                },
            })
        })
        .collect())
}

/// Downloads a version's files into `target` (absent or empty), verifying
/// every byte; on any failure nothing is left at `target`. Files arrive in
/// a sibling directory that is renamed into place at the end.
pub async fn pull(
    store: &Store,
    files: &[FileEntry],
    target: &Path,
    extra: &[(&str, &[u8])],
    opts: &TransferOptions,
) -> Result<(), ArtifactError> {
    if let Ok(mut rd) = std::fs::read_dir(target) {
        if rd.next().is_some() {
            return Err(ArtifactError::TargetNotEmpty {
                target: target.to_owned(),
            });
        }
    } else if target.exists() {
        return Err(ArtifactError::TargetNotEmpty {
            target: target.to_owned(),
        });
    }
    let parent = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|source| ArtifactError::Write {
        path: parent.to_owned(),
        source,
    })?;
    let staging = parent.join(format!(
        ".{}.keel-pull-{}",
        target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|source| ArtifactError::Write {
        path: staging.clone(),
        source,
    })?;
    let result = async {
        let items = files
            .iter()
            .map(|f| Fetch {
                key: f.name.clone(),
                expected: f.clone(),
                local: Some(staging.join(&f.name)),
            })
            .collect();
        let results = transfer::fetch_files(store, items, opts, false).await?;
        let bad: Vec<BadObject> = results
            .into_iter()
            .filter_map(|(f, r)| {
                r.err().map(|e| BadObject {
                    name: f.expected.name,
                    reason: match e {
                        StoreError::DigestMismatch { .. } => {
                            "content changed (SHA-256 differs)".into()
                        }
                        e if e.is_not_found() => "missing from storage".into(),
                        e => e.to_string(),
                    },
                })
            })
            .collect();
        if !bad.is_empty() {
            return Err(ArtifactError::Corrupt { bad });
        }
        for (name, data) in extra {
            let p = staging.join(name);
            std::fs::write(&p, data).map_err(|source| ArtifactError::Write { path: p, source })?;
        }
        if target.exists() {
            std::fs::remove_dir(target).map_err(|source| ArtifactError::Write {
                path: target.to_owned(),
                source,
            })?;
        }
        std::fs::rename(&staging, target).map_err(|source| ArtifactError::Write {
            path: target.to_owned(),
            source,
        })
    }
    .await;
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

impl keel_error::HasKind for ArtifactError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Store(s) => keel_error::HasKind::kind(s),
            Self::Corrupt { .. } => K::Failed,
            Self::Manifest { .. } => K::Input,
            Self::NoManifest { .. }
            | Self::VersionExists { .. }
            | Self::Claimed { .. }
            | Self::Empty { .. }
            | Self::Symlink { .. }
            | Self::BadName { .. }
            | Self::TargetNotEmpty { .. } => K::Usage,
            Self::ReadDir { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                K::Usage
            }
            Self::ReadDir { .. } | Self::Write { .. } => K::Io,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_store::{StoreOptions, StoreUrl};
    use std::collections::BTreeMap;

    fn write(dir: &Path, files: &[(&str, &[u8])]) {
        for (name, data) in files {
            let p = dir.join(name);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, data).expect("write");
        }
    }

    /// Every file under `dir` with its bytes, by relative path.
    fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        fn walk(root: &Path, here: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
            for e in std::fs::read_dir(here).expect("read_dir") {
                let p = e.expect("entry").path();
                if p.is_dir() {
                    walk(root, &p, out);
                } else {
                    let rel = p.strip_prefix(root).expect("under root");
                    out.insert(rel.display().to_string(), std::fs::read(&p).expect("read"));
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(dir, dir, &mut out);
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_version_into_one_prefix_is_refused_and_changes_nothing() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (store, dest) = file_store(tmp.path());
        let url = store.url().clone();
        let first = tmp.path().join("first");
        write(
            &first,
            &[("weights.bin", b"first weights"), ("cfg/model.json", b"{}")],
        );
        let opts = TransferOptions::default();
        let m1 = upload_dir(&store, &first, "m:1", "m:1 by test", &opts)
            .await
            .expect("first upload");
        let before = snapshot(&dest);
        assert_eq!(before["weights.bin"], b"first weights");
        assert_eq!(before[MANIFEST_KEY], m1.to_json());

        let second = tmp.path().join("second");
        write(
            &second,
            &[("weights.bin", b"second weights"), ("extra.bin", b"new")],
        );
        let e = upload_dir(&store, &second, "m:1", "m:1 again", &opts)
            .await
            .expect_err("the prefix already holds a version");
        match &e {
            ArtifactError::VersionExists { url: u } => assert_eq!(u, &url.to_string()),
            other => panic!("expected VersionExists, got {other:?}"),
        }
        assert!(e.to_string().contains(&url.to_string()), "{e}");
        assert_eq!(snapshot(&dest), before, "the first version is untouched");
        let m = read_manifest(&store, &url.to_string())
            .await
            .expect("manifest");
        assert_eq!(m.to_json(), m1.to_json());
    }

    fn file_store(tmp: &Path) -> (Store, PathBuf) {
        let dest = tmp.join("store/m/v1");
        let url = StoreUrl::parse(&format!("file://{}", dest.display())).expect("url");
        let store = Store::open(
            &url,
            &StoreOptions {
                create_root: true,
                ..Default::default()
            },
        )
        .expect("open");
        (store, dest)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_into_a_claimed_prefix_writes_nothing() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (store, dest) = file_store(tmp.path());
        // Another upload has claimed the prefix and is still writing (no
        // manifest yet).
        store
            .create(
                CLAIM_KEY,
                Bytes::from_static(b"m:1 by alice on node-a, pid 7"),
            )
            .await
            .expect("claim");
        let dir = tmp.path().join("second");
        write(&dir, &[("weights.bin", b"second weights")]);
        let e = upload_dir(
            &store,
            &dir,
            "m:1",
            "m:1 by bob",
            &TransferOptions::default(),
        )
        .await
        .expect_err("the prefix is claimed");
        assert!(matches!(e, ArtifactError::Claimed { .. }), "{e:?}");
        assert!(
            e.to_string().contains("m:1 by alice on node-a, pid 7"),
            "{e}"
        );
        let stored = snapshot(&dest);
        assert_eq!(
            stored.keys().collect::<Vec<_>>(),
            vec![CLAIM_KEY],
            "nothing but the first claim is stored"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_with_this_upload_s_own_bytes_is_its_own() {
        // As a store's retried create leaves it: the first attempt landed.
        let tmp = tempfile::tempdir().expect("tmp");
        let (store, dest) = file_store(tmp.path());
        let claim = "m:1 by bob on node-b, pid 9, at 1790000000000000000";
        store
            .create(CLAIM_KEY, Bytes::copy_from_slice(claim.as_bytes()))
            .await
            .expect("claim");
        let dir = tmp.path().join("src");
        write(&dir, &[("weights.bin", b"w")]);
        upload_dir(&store, &dir, "m:1", claim, &TransferOptions::default())
            .await
            .expect("its own claim");
        let stored = snapshot(&dest);
        assert_eq!(stored[CLAIM_KEY], claim.as_bytes());
        assert_eq!(stored["weights.bin"], b"w");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn of_concurrent_uploads_into_one_prefix_one_writes_and_its_files_are_whole() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (store, _dest) = file_store(tmp.path());
        let store = std::sync::Arc::new(store);
        let mut tasks = Vec::new();
        for i in 0..6u8 {
            let dir = tmp.path().join(format!("src{i}"));
            let big = vec![i; 3 << 20];
            write(&dir, &[("weights.bin", &big), ("cfg.json", &[b'0' + i])]);
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                upload_dir(
                    &store,
                    &dir,
                    "m:1",
                    &format!("uploader {i}"),
                    &TransferOptions::default(),
                )
                .await
            }));
        }
        let mut won = Vec::new();
        for t in tasks {
            match t.await.expect("join") {
                Ok(m) => won.push(m),
                Err(ArtifactError::Claimed { .. } | ArtifactError::VersionExists { .. }) => {}
                Err(e) => panic!("unexpected error: {e:?}"),
            }
        }
        assert_eq!(won.len(), 1, "exactly one upload writes the version");
        let stored = read_manifest(&store, &store.url().to_string())
            .await
            .expect("manifest");
        assert_eq!(stored.to_json(), won[0].to_json());
        let bad = check_stored(&store, stored.files(), &TransferOptions::default())
            .await
            .expect("check");
        assert!(
            bad.is_empty(),
            "stored files differ from the manifest: {bad:?}"
        );
    }

    #[test]
    fn a_directory_with_keel_s_own_top_level_names_is_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        for reserved in [MANIFEST_KEY, CLAIM_KEY] {
            let dir = tmp.path().join(reserved.trim_start_matches('.'));
            write(&dir, &[("weights.bin", b"w"), (reserved, b"{}")]);
            let e = list_dir(&dir).expect_err("reserved name");
            assert!(
                matches!(&e, ArtifactError::BadName { name, .. } if name == reserved),
                "{e:?}"
            );
            assert!(e.to_string().contains("subdirectory"), "{e}");
            // Below the top level the name is an ordinary file.
            let nested = tmp
                .path()
                .join(format!("nested-{}", reserved.trim_start_matches('.')));
            write(&nested, &[(&format!("sub/{reserved}"), b"{}")]);
            assert_eq!(list_dir(&nested).expect("nested").len(), 1);
        }
    }
}
