//! Object storage for keel: the layer that checkpoints (keel-ckpt) and the
//! model registry stand on.
//!
//! - [`StoreUrl`]: `file:///path`, `az://container/prefix`,
//!   `s3://bucket/prefix` (and `memory://` for tests), parsed and checked.
//! - [`Store`]: an [`object_store`] backend rooted at the URL's prefix,
//!   opened with credentials passed in as data ([`StoreOptions::env`], never
//!   read from the process environment here). Every backend error is
//!   redacted of the secrets it was given before it becomes a
//!   [`StoreError`].
//! - [`Bandwidth`] and [`Limiter`]: a cap in explicit units (`2300Mbit/s`,
//!   `280MB/s`) shared by every transfer of the process.
//! - [`Manifest`]: file names, sizes and SHA-256 digests as an in-toto
//!   Statement v1 in the OpenSSF model-signing v1.0 layout, so the same
//!   document can be signed later.
//! - [`transfer`]: parallel uploads (multipart for large files) with
//!   hashing overlapped with I/O, downloads and verification against a
//!   manifest, memory bounded by part size and parallelism.
//!
//! It knows nothing about checkpoints or models: no run, step or latest
//! pointer lives here. It never prints, exits, reads environment variables
//! or the wall clock; the limiter uses the monotonic clock.

#![forbid(unsafe_code)]

mod error;
pub mod limit;
pub mod manifest;
mod store;
pub mod transfer;
mod url;

pub use error::{BackendErrorKind, StoreError};
pub use limit::{Bandwidth, BandwidthError, Limiter};
pub use manifest::{Digest, FileEntry, Manifest, ManifestError};
pub use store::{Backend, CreateOutcome, ObjectInfo, Store, StoreOptions};
pub use transfer::{Progress, TransferOptions};
pub use url::StoreUrl;

/// The kind of an error of this crate
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; StoreError, BandwidthError)
}
