//! What can go wrong, with the failing thing as data. Backend messages are
//! redacted of every secret the store was opened with before they get here.

use std::io;
use std::path::PathBuf;

/// The class of a backend failure, for callers that act on it (a missing
/// object, a create that lost its race) and for exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendErrorKind {
    NotFound,
    AlreadyExists,
    Precondition,
    PermissionDenied,
    Unauthenticated,
    NotSupported,
    Other,
}

impl BackendErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotFound => "not found",
            Self::AlreadyExists => "already exists",
            Self::Precondition => "precondition failed",
            Self::PermissionDenied => "permission denied",
            Self::Unauthenticated => "not authenticated",
            Self::NotSupported => "not supported",
            Self::Other => "failed",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("bad storage URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("cannot open {url}: {message}")]
    Open { url: String, message: String },
    #[error("{op} {url}/{key} {}: {message}", kind.as_str())]
    Backend {
        op: &'static str,
        url: String,
        key: String,
        kind: BackendErrorKind,
        message: String,
    },
    #[error("cannot read {path}")]
    LocalRead {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write {path}")]
    LocalWrite {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} changed while it was read ({before} bytes before, {after} after)")]
    Changed {
        path: PathBuf,
        before: u64,
        after: u64,
    },
    #[error("{key}: SHA-256 is {actual}, the manifest says {expected}")]
    DigestMismatch {
        key: String,
        expected: String,
        actual: String,
    },
    #[error("{key}: {actual} bytes, the manifest says {expected}")]
    SizeMismatch {
        key: String,
        expected: u64,
        actual: u64,
    },
    #[error(transparent)]
    BadBandwidth(#[from] keel_units::BandwidthError),
    #[error("invalid key {key:?}: {reason}")]
    BadKey { key: String, reason: String },
    #[error("internal task failed: {message}")]
    Task { message: String },
}

impl StoreError {
    /// The backend's class of failure, if this is a backend failure.
    pub fn backend_kind(&self) -> Option<BackendErrorKind> {
        match self {
            Self::Backend { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    pub fn is_not_found(&self) -> bool {
        self.backend_kind() == Some(BackendErrorKind::NotFound)
    }

    /// Whether stored data is not what its manifest says.
    pub fn is_integrity(&self) -> bool {
        matches!(
            self,
            Self::DigestMismatch { .. } | Self::SizeMismatch { .. }
        )
    }
}

impl keel_error::HasKind for StoreError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        use BackendErrorKind as B;
        match self {
            Self::BadUrl { .. }
            | Self::BadBandwidth(_)
            | Self::BadKey { .. }
            | Self::Open { .. } => K::Usage,
            Self::Backend { kind, .. } => match kind {
                B::Unauthenticated | B::PermissionDenied => K::Permission,
                _ => K::Io,
            },
            Self::DigestMismatch { .. } | Self::SizeMismatch { .. } => K::Failed,
            Self::LocalRead { .. }
            | Self::LocalWrite { .. }
            | Self::Changed { .. }
            | Self::Task { .. } => K::Io,
        }
    }
}
