//! The keel model registry.
//!
//! - [`Registry`]: one SQLite database (WAL, migrations by `user_version`,
//!   `BEGIN IMMEDIATE` for every write so concurrent registrations from
//!   several processes get gapless, unique numbers). Models; versions
//!   numbered 1, 2, 3 per model, immutable once READY (triggers refuse
//!   every change but to the description); files with size and SHA-256; lineage; tags; aliases with a
//!   hash-chained history; a hash-chained audit log of every change;
//!   signatures; API keys stored as SHA-256 hashes; online backup and
//!   restore.
//! - [`sign`]: OpenSSF model-signing v1.0 bundles with ECDSA P-256 keys,
//!   interoperable with the reference `model-signing` tool, and
//!   verification of any directory against any such bundle.
//! - [`artifacts`]: a version's files in any keel-store URL: upload with a
//!   manifest, verified pull.
//! - [`register`]: a version registered with its files: a directory
//!   uploaded, files already stored, or a checkpoint step (resolved and
//!   pinned through keel-ckpt), the number reserved first and the version
//!   marked FAILED_REGISTRATION when its files cannot be put in place.
//! - [`http`]: the HTTP API: read endpoints for versions, aliases and
//!   history, and MLflow's model-registry REST API (enough for the MLflow
//!   client to register, find, alias and load models), authenticated on
//!   every route, reads on connections of their own.
//! - [`tracking`]: asks an MLflow tracking server, when one is configured,
//!   which run logged a model, for versions MLflow 3's `log_model`
//!   registers without a run.
//!
//! It never prints, exits, reads environment variables (beyond where the
//! system keeps its trusted certificates, for HTTPS to a tracking server)
//! or the wall clock:
//! time comes from a [`Clock`], the acting user is passed in. It reads
//! checkpoints only through keel-ckpt (to register a step and pin it),
//! and serves no inference.

#![forbid(unsafe_code)]

pub mod artifacts;
pub mod auth;
mod backup;
mod chain;
mod db;
mod error;
pub mod http;
pub mod migrate;
pub mod register;
mod registry;
mod serve;
pub mod sign;
mod staging;
mod storage;
pub mod tracking;
mod types;

pub use backup::BackupReport;
pub use chain::{Break, ChainName, ChainReport};
pub use db::SCHEMA_VERSION;
pub use error::RegistryError;
pub use keel_time::{rfc3339, Clock, FixedClock};
pub use registry::{
    limits, version_manifest, Artifacts, Connector, ModelRow, NewVersion, Registry, VersionRow,
};
pub use staging::Staged;
pub use storage::{is_postgres_url, Backend, DbError, PgOptions};
pub use types::{
    check_alias, check_model_name, parse_version, AliasAction, AliasEvent, AliasTarget, ApiKey,
    AuditEvent, CheckpointLink, Dataset, Lineage, Model, Role, SignatureRecord, Status, Tag,
    Version, VersionFile, VersionRef,
};

/// The kind of an error of this crate or of the crates under it whose errors it passes on
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; RegistryError, sign::SignError, artifacts::ArtifactError, register::RegisterError; keel_ckpt::error_kind, keel_store::error_kind)
}
