//! What can go wrong, with the failing thing as data.

use std::path::PathBuf;

use crate::storage::DbError;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("cannot open the registry database {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: DbError,
    },
    #[error("cannot connect to the registry database {location}")]
    Connect {
        location: String,
        #[source]
        source: DbError,
    },
    #[error(
        "registry database {path} has schema version {found}, newer than this keel knows ({known})"
    )]
    SchemaTooNew {
        path: PathBuf,
        found: i64,
        known: i64,
    },
    #[error("registry database error while {context}")]
    Db {
        context: &'static str,
        #[source]
        source: DbError,
    },
    #[error("invalid {what} {value:?}: {reason}")]
    Invalid {
        what: &'static str,
        value: String,
        reason: String,
    },
    #[error("no model named {name:?}")]
    UnknownModel { name: String },
    #[error("model {name:?} already exists")]
    ModelExists { name: String },
    #[error("model {name:?} has no version {version}")]
    UnknownVersion { name: String, version: u64 },
    #[error("model {name:?} has no alias {alias:?}")]
    UnknownAlias { name: String, alias: String },
    #[error("model {name:?} version {version} is {status}, not {expected}")]
    WrongStatus {
        name: String,
        version: u64,
        status: String,
        expected: &'static str,
    },
    #[error("alias {alias:?} of model {name:?} has no earlier version to roll back to")]
    NothingToRollBack { name: String, alias: String },
    #[error("model {name:?} has {versions} version(s); versions are immutable and a model that has any cannot be deleted")]
    ModelHasVersions { name: String, versions: u64 },
    #[error("model {name:?} version {version} is never deleted: versions are immutable and kept (move its aliases elsewhere, or mark it with a tag)")]
    VersionsAreKept { name: String, version: u64 },
    #[error("model {name:?} cannot be renamed: {reason}")]
    NoRename { name: String, reason: String },
    #[error("an API key named {name:?} already exists")]
    KeyExists { name: String },
    #[error("no API key named {name:?}")]
    UnknownKey { name: String },
    #[error("cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("backup {path} is not a usable registry: {reason}")]
    BadBackup { path: PathBuf, reason: String },
    #[error("the registry database {path} already holds data (use force to replace it)")]
    NotEmpty { path: PathBuf },
    #[error("{what} is not available on {backend}: {hint}")]
    Unsupported {
        what: &'static str,
        backend: &'static str,
        hint: &'static str,
    },
    #[error("cannot migrate the registry: {reason}")]
    Migrate { reason: String },
    #[error("the registry's chains do not verify ({what}), so no backup was uploaded; run `keel model audit verify`")]
    Unverified { what: String },
    #[error(transparent)]
    Store(#[from] keel_store::StoreError),
}

impl RegistryError {
    pub(crate) fn db<E: Into<DbError>>(context: &'static str) -> impl FnOnce(E) -> Self {
        move |source| Self::Db {
            context,
            source: source.into(),
        }
    }

    /// Whether the database could not be reached or was busy past its
    /// bounds (HTTP 503, worth a retry), rather than the request failing.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Db { source, .. } | Self::Connect { source, .. } => source.is_unavailable(),
            _ => false,
        }
    }

    /// Whether the error is about something that does not exist (HTTP 404,
    /// MLflow `RESOURCE_DOES_NOT_EXIST`).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            Self::UnknownModel { .. }
                | Self::UnknownVersion { .. }
                | Self::UnknownAlias { .. }
                | Self::UnknownKey { .. }
        )
    }

    /// Whether the request conflicts with what is stored (HTTP 409).
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            Self::ModelExists { .. }
                | Self::KeyExists { .. }
                | Self::WrongStatus { .. }
                | Self::NothingToRollBack { .. }
                | Self::ModelHasVersions { .. }
                | Self::VersionsAreKept { .. }
                | Self::NoRename { .. }
                | Self::NotEmpty { .. }
        )
    }

    /// Whether the request itself is malformed (HTTP 400).
    pub fn is_invalid(&self) -> bool {
        matches!(self, Self::Invalid { .. })
    }
}

impl keel_error::HasKind for RegistryError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Open { .. } | Self::Connect { .. } | Self::Db { .. } | Self::Io { .. } => K::Io,
            Self::SchemaTooNew { .. } | Self::BadBackup { .. } | Self::Unverified { .. } => {
                K::Input
            }
            Self::Store(s) => keel_error::HasKind::kind(s),
            Self::Migrate { .. } => K::Failed,
            Self::Unsupported { .. } => K::Usage,
            Self::Invalid { .. }
            | Self::UnknownModel { .. }
            | Self::ModelExists { .. }
            | Self::UnknownVersion { .. }
            | Self::UnknownAlias { .. }
            | Self::WrongStatus { .. }
            | Self::NothingToRollBack { .. }
            | Self::ModelHasVersions { .. }
            | Self::VersionsAreKept { .. }
            | Self::NoRename { .. }
            | Self::KeyExists { .. }
            | Self::UnknownKey { .. }
            | Self::NotEmpty { .. } => K::Usage,
        }
    }
}
