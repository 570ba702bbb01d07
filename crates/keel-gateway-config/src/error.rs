//! What is wrong with a configuration. The messages are the gateway's
//! own (keel-gateway's `GatewayError` takes each variant as its own).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("failed to read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("redis at {url}: {reason}")]
    Redis { url: String, reason: String },
}

impl keel_error::HasKind for ConfigError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            ConfigError::Read { .. } => K::Io,
            ConfigError::Config(_) => K::Usage,
            ConfigError::Redis { .. } => K::Unavailable,
        }
    }
}

/// The kind of an error of this crate
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; ConfigError, crate::drift_baseline::BaselineError)
}
