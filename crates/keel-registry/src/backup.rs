//! Backups in object storage: a registry copied into a private staging
//! file ([`Registry::backup_to`]), checked, and uploaded as one object; and
//! the way back, an object downloaded into a staging file and restored
//! from there ([`Registry::restore_from_named`]). The caller opens the
//! store (with its credentials) and names the object.

use keel_store::transfer::{upload_files, Upload};
use keel_store::{Store, TransferOptions};

use crate::{ChainReport, Registry, RegistryError};

/// What a backup uploaded.
#[derive(Debug, Clone)]
pub struct BackupReport {
    /// The object's size.
    pub bytes: u64,
    /// The backup's chains, as verified before the upload.
    pub chains: ChainReport,
}

impl Registry {
    /// Backs the registry up into the object `name` of `store`: a copy in
    /// a staging file (see [`Registry::backup_to`]) whose chains must
    /// verify (a registry that does not verify is not uploaded), uploaded
    /// as one object. Nothing is left behind locally either way.
    pub async fn backup_to_object(
        &self,
        store: &Store,
        name: &str,
    ) -> Result<BackupReport, RegistryError> {
        let tmp = self.staging()?;
        self.backup_to(tmp.path())?;
        let bytes = std::fs::metadata(tmp.path())
            .map_err(|source| RegistryError::Io {
                op: "read",
                path: tmp.path().to_owned(),
                source,
            })?
            .len();
        let chains = Registry::open(tmp.path(), self.clock())?.verify_chains()?;
        if let Some(b) = chains.breaks.first() {
            return Err(RegistryError::Unverified {
                what: b.what.clone(),
            });
        }
        upload_files(
            store,
            vec![Upload {
                local: tmp.path().to_owned(),
                key: name.to_owned(),
                name: name.to_owned(),
            }],
            &TransferOptions::default(),
        )
        .await?;
        Ok(BackupReport { bytes, chains })
    }

    /// Restores the registry from the object `name` of `store` (downloaded
    /// into an owner-only staging file first), as
    /// [`Registry::restore_from_named`] does from a file; `source` names
    /// the backup in the restore's audit event (its URL).
    pub async fn restore_from_object(
        &mut self,
        actor: &str,
        store: &Store,
        name: &str,
        source: &str,
        force: bool,
    ) -> Result<ChainReport, RegistryError> {
        let tmp = self.staging()?;
        let bytes = store.get(name).await?;
        // A new file only (never through a link left at that name), its
        // owner's only: it is a copy of the registry.
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(tmp.path())
            .and_then(|mut f| {
                std::io::Write::write_all(&mut f, &bytes)?;
                f.sync_all()
            })
            .map_err(|source| RegistryError::Io {
                op: "write",
                path: tmp.path().to_owned(),
                source,
            })?;
        self.restore_from_named(actor, tmp.path(), source, force)
    }
}
