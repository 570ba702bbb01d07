//! Registering a version together with its files: a directory uploaded to
//! the artifact store, files already stored under a URL (with their
//! manifest), or a checkpoint step of keel-ckpt.
//!
//! An upload or a checkpoint reserves the version's number first (the
//! version is PENDING_REGISTRATION), puts its files in place, and then
//! makes it READY; if that fails the version is marked
//! FAILED_REGISTRATION with the reason, so a number is never taken
//! silently. A checkpoint is pinned before its version is READY, so that
//! the checkpoint's garbage collection cannot delete what a READY version
//! names; the pin's reason names the version (`keel ckpt ls` shows it).

use std::path::{Path, PathBuf};

use keel_store::{FileEntry, Store, StoreError, StoreOptions, StoreUrl, TransferOptions};

use crate::artifacts::{self, ArtifactError, BadObject};
use crate::{Artifacts, CheckpointLink, NewVersion, Registry, RegistryError, Version};

/// Where a new version's files come from.
#[derive(Debug, Clone, Copy)]
pub enum Files<'a> {
    /// A local directory, uploaded under `store_url/<model>/v<N>`.
    Dir { dir: &'a Path, store_url: &'a str },
    /// Files already stored under `url` with their manifest: checked (every
    /// byte against its SHA-256, or with `sizes_only` each one's size).
    Stored { url: &'a str, sizes_only: bool },
    /// A checkpoint step of run `run` under the checkpoint root `url`:
    /// its data checked as for `Stored`, then pinned.
    Checkpoint {
        url: &'a str,
        run: &'a str,
        step: u64,
        sizes_only: bool,
    },
}

/// Who registers, for the upload's claim and the checkpoint's pin (the
/// caller reads them: this crate reads no clock, host name or process).
#[derive(Debug, Clone)]
pub struct Registrant {
    pub actor: String,
    pub host: String,
    pub pid: u32,
    /// The time now, since the epoch.
    pub now: std::time::Duration,
}

/// Why a version could not be registered with its files.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("{} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Ckpt(#[from] keel_ckpt::CkptError),
    /// The files could not be uploaded: the version is marked
    /// FAILED_REGISTRATION.
    #[error("upload of {model}:{version} failed; the version is marked FAILED_REGISTRATION{}",
        if *.taken { " (the artifact store holds versions this registry database does not know: another database, or this one restored from an older backup, wrote or is writing there)" } else { "" })]
    Upload {
        model: String,
        version: u64,
        /// The store already holds (or is being written) this version.
        taken: bool,
        #[source]
        source: Box<RegisterError>,
    },
    /// The checkpoint could not be pinned: the version is marked
    /// FAILED_REGISTRATION.
    #[error("could not pin the checkpoint for {model}:{version}; the version is marked FAILED_REGISTRATION")]
    Pin {
        model: String,
        version: u64,
        #[source]
        source: Box<RegisterError>,
    },
}

impl keel_error::HasKind for RegisterError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::HasKind as H;
        match self {
            Self::NotADirectory(_) => keel_error::ErrorKind::Usage,
            Self::Registry(e) => H::kind(e),
            Self::Artifact(e) => H::kind(e),
            Self::Store(e) => H::kind(e),
            Self::Ckpt(e) => H::kind(e),
            Self::Upload { source, .. } | Self::Pin { source, .. } => H::kind(&**source),
        }
    }
}

/// Registers `new` with its files (module docs). `opts` opens the stores
/// (credentials from the caller's environment).
pub async fn register(
    reg: &mut Registry,
    mut new: NewVersion,
    files: Files<'_>,
    opts: &StoreOptions,
    who: &Registrant,
) -> Result<Version, RegisterError> {
    let actor = who.actor.as_str();
    match files {
        Files::Dir { dir, store_url } => {
            if !dir.is_dir() {
                return Err(RegisterError::NotADirectory(dir.to_owned()));
            }
            // Fail before a number is taken when the directory is unusable.
            artifacts::list_dir(dir)?;
            let store_url = store_url.trim_end_matches('/');
            // The uploader's local directory is not recorded: the source
            // is the store the files go to (the version's artifact URL is
            // under it).
            new.source = store_url.to_owned();
            let pending = reg.reserve_version(actor, &new)?;
            let url = format!("{store_url}/{}/v{}", new.model, pending.version);
            let name = format!("{}:{}", new.model, pending.version);
            let claim = format!(
                "{name} by {actor} on {}, pid {}, at {}",
                who.host,
                who.pid,
                who.now.as_nanos()
            );
            let uploaded = async {
                let store = open(&url, true, opts)?;
                Ok::<_, RegisterError>(
                    artifacts::upload_dir(&store, dir, &name, &claim, &TransferOptions::default())
                        .await?,
                )
            }
            .await;
            match uploaded {
                Ok(manifest) => Ok(reg.complete_version(
                    actor,
                    &new.model,
                    pending.version,
                    &Artifacts { url, manifest },
                )?),
                Err(e) => {
                    let _ = reg.fail_version(
                        actor,
                        &new.model,
                        pending.version,
                        &keel_error::one_line(&e),
                    );
                    let taken = matches!(
                        e,
                        RegisterError::Artifact(
                            ArtifactError::VersionExists { .. } | ArtifactError::Claimed { .. }
                        )
                    );
                    Err(RegisterError::Upload {
                        model: new.model.clone(),
                        version: pending.version,
                        taken,
                        source: Box::new(e),
                    })
                }
            }
        }
        Files::Stored { url, sizes_only } => {
            let url = url.trim_end_matches('/').to_owned();
            let store = open(&url, false, opts)?;
            let manifest = artifacts::read_manifest(&store, &url).await?;
            check_files(&store, manifest.files(), sizes_only).await?;
            new.source = url.clone();
            Ok(reg.register_version(actor, &new, Some(&Artifacts { url, manifest }))?)
        }
        Files::Checkpoint {
            url,
            run,
            step,
            sizes_only,
        } => {
            let url = url.trim_end_matches('/');
            let (art, link, c) = from_checkpoint(url, run, step, sizes_only, opts).await?;
            new.source = format!("{url} run {run} step {step}");
            if new.lineage.run_id.is_none() {
                new.lineage.run_id = Some(run.to_owned());
            }
            new.lineage.checkpoint = Some(link);
            let pending = reg.reserve_version(actor, &new)?;
            match pin_checkpoint(url, run, c, &new.model, pending.version, opts, who).await {
                Ok(()) => Ok(reg.complete_version(actor, &new.model, pending.version, &art)?),
                Err(e) => {
                    let _ = reg.fail_version(
                        actor,
                        &new.model,
                        pending.version,
                        &keel_error::one_line(&e),
                    );
                    Err(RegisterError::Pin {
                        model: new.model.clone(),
                        version: pending.version,
                        source: Box::new(e),
                    })
                }
            }
        }
    }
}

/// Checks the files a manifest lists: every byte against its SHA-256, or
/// with `sizes_only` that each is stored with its size.
pub async fn check_files(
    store: &Store,
    files: &[FileEntry],
    sizes_only: bool,
) -> Result<(), ArtifactError> {
    let bad = if sizes_only {
        missing(store, files).await?
    } else {
        artifacts::check_stored(store, files, &TransferOptions::default()).await?
    };
    if bad.is_empty() {
        Ok(())
    } else {
        Err(ArtifactError::Corrupt { bad })
    }
}

/// The files a manifest lists that are not stored with their size (a
/// cheap check; `check_stored` reads every byte).
async fn missing(store: &Store, files: &[FileEntry]) -> Result<Vec<BadObject>, ArtifactError> {
    let mut bad = Vec::new();
    for f in files {
        match store.head(&f.name).await? {
            None => bad.push(BadObject {
                name: f.name.clone(),
                reason: "missing from storage".into(),
            }),
            Some(h) if h.size != f.size => bad.push(BadObject {
                name: f.name.clone(),
                reason: format!("{} bytes, the manifest says {}", h.size, f.size),
            }),
            Some(_) => {}
        }
    }
    Ok(bad)
}

fn open(url: &str, create_root: bool, opts: &StoreOptions) -> Result<Store, StoreError> {
    let opts = StoreOptions {
        create_root,
        ..opts.clone()
    };
    Store::open(&StoreUrl::parse(url)?, &opts)
}

/// The checkpoint step's files as a version's artifacts, its lineage link,
/// and the reference to pin.
async fn from_checkpoint(
    url: &str,
    run: &str,
    step: u64,
    sizes_only: bool,
    opts: &StoreOptions,
) -> Result<(Artifacts, CheckpointLink, keel_ckpt::CkptRef), RegisterError> {
    let no_step = || keel_ckpt::CkptError::NoSuchStep {
        run: run.to_owned(),
        step,
    };
    let store = open(url, false, opts)?;
    let ckpt = keel_ckpt::Ckpt::new(&store, run)?;
    let refs = ckpt.resolve(keel_ckpt::Selector::Step(step)).await?;
    let c = refs.first().copied().ok_or_else(no_step)?;
    let (manifest, meta) = ckpt.manifest(c).await?.ok_or_else(no_step)?;
    let data = keel_ckpt::layout::data_prefix(c.step, c.epoch, &meta.attempt);
    let link = CheckpointLink {
        url: url.to_owned(),
        run: run.to_owned(),
        step,
        manifest_digest: manifest.subject_digest().hex(),
    };
    let art = Artifacts {
        url: format!("{url}/{run}/{data}"),
        manifest,
    };
    // The data must still be there, intact (GC may have run before the pin).
    check_files(
        &open(&art.url, false, opts)?,
        art.manifest.files(),
        sizes_only,
    )
    .await?;
    Ok((art, link, c))
}

async fn pin_checkpoint(
    url: &str,
    run: &str,
    c: keel_ckpt::CkptRef,
    model: &str,
    version: u64,
    opts: &StoreOptions,
    who: &Registrant,
) -> Result<(), RegisterError> {
    let store = open(url, false, opts)?;
    let ckpt = keel_ckpt::Ckpt::new(&store, run)?;
    let ctx = keel_ckpt::Context {
        now_unix: who.now.as_secs() as i64,
        host: who.host.clone(),
        nonce: who.now.as_nanos() as u64 ^ u64::from(who.pid),
    };
    ckpt.pin_ref(
        c,
        &format!("registered as model version {model}:{version}"),
        &ctx,
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn new_version(model: &str) -> NewVersion {
        NewVersion {
            model: model.into(),
            source: String::new(),
            description: String::new(),
            lineage: crate::Lineage::default(),
            tags: Vec::new(),
            create_model: true,
        }
    }

    fn who() -> Registrant {
        Registrant {
            actor: "ci".into(),
            host: "node-1".into(),
            pid: 7,
            now: std::time::Duration::from_secs(1_700_000_000),
        }
    }

    fn opts() -> StoreOptions {
        StoreOptions {
            create_root: false,
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_directory_is_uploaded_and_its_version_made_ready() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("model");
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        std::fs::write(dir.join("weights.bin"), b"0123").expect("write");
        std::fs::write(dir.join("sub/config.json"), b"{}").expect("write");
        let store = format!("file://{}", tmp.path().join("store").display());
        let mut reg = Registry::open_in_memory(Arc::new(crate::FixedClock(0))).expect("open");
        let files = Files::Dir {
            dir: &dir,
            store_url: &store,
        };
        let v = register(&mut reg, new_version("m"), files, &opts(), &who())
            .await
            .expect("registered");
        assert_eq!((v.version, v.status), (1, crate::Status::Ready));
        assert_eq!(v.files.len(), 2);
        // The same files, registered again from where they are stored.
        let url = format!("{store}/m/v1");
        let files = Files::Stored {
            url: &url,
            sizes_only: false,
        };
        let v2 = register(&mut reg, new_version("m"), files, &opts(), &who())
            .await
            .expect("registered from storage");
        assert_eq!(v2.version, 2);
        assert_eq!(v2.manifest_digest, v.manifest_digest);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn what_cannot_be_registered_takes_no_number_or_is_marked_failed() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut reg = Registry::open_in_memory(Arc::new(crate::FixedClock(0))).expect("open");
        let store = format!("file://{}", tmp.path().join("store").display());
        // Not a directory: refused before a number is taken.
        let missing = tmp.path().join("nope");
        let files = Files::Dir {
            dir: &missing,
            store_url: &store,
        };
        let e = register(&mut reg, new_version("m"), files, &opts(), &who())
            .await
            .expect_err("not a directory");
        assert!(matches!(e, RegisterError::NotADirectory(_)), "{e}");
        assert_eq!(keel_error::HasKind::kind(&e), keel_error::ErrorKind::Usage);
        // No manifest where the files should be: nothing registered.
        let url = format!("{store}/elsewhere");
        std::fs::create_dir_all(tmp.path().join("store/elsewhere")).expect("mkdir");
        let files = Files::Stored {
            url: &url,
            sizes_only: true,
        };
        let e = register(&mut reg, new_version("m"), files, &opts(), &who())
            .await
            .expect_err("no manifest");
        assert!(
            matches!(e, RegisterError::Artifact(ArtifactError::NoManifest { .. })),
            "{e}"
        );
        assert!(reg.versions("m").map(|v| v.is_empty()).unwrap_or(true));
        // A checkpoint run with no such step: nothing registered.
        let files = Files::Checkpoint {
            url: &store,
            run: "run-1",
            step: 100,
            sizes_only: true,
        };
        let e = register(&mut reg, new_version("m"), files, &opts(), &who())
            .await
            .expect_err("no checkpoint");
        assert!(matches!(e, RegisterError::Ckpt(_)), "{e}");
        assert!(reg.versions("m").map(|v| v.is_empty()).unwrap_or(true));
    }
}
