//! Object-storage test services: Azurite (Azure Blob) and an S3 server,
//! started by `scripts/services/azurite` and `scripts/services/s3` and found
//! here through the variables those scripts print.
//!
//! Each service has one container or bucket, `keel-test`; tests stay apart
//! by using a [`unique`] prefix inside it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Set to `1` by `scripts/services/azurite start`.
pub const AZURITE_VAR: &str = "KEEL_TEST_AZURITE";
/// Set to `1` by `scripts/services/s3 start`.
pub const S3_VAR: &str = "KEEL_TEST_S3";
/// The container and bucket the service scripts create.
pub const BUCKET: &str = "keel-test";

/// A running object store for tests: a URL base and the credentials a
/// client needs, as `(NAME, value)` pairs.
#[derive(Debug, Clone)]
pub struct ObjectService {
    pub name: &'static str,
    /// `az://keel-test` or `s3://keel-test`.
    pub base: String,
    /// `AZURE_*` or `AWS_*` variables to pass to the store (and to child
    /// keel processes, which inherit them anyway).
    pub env: Vec<(String, String)>,
}

impl ObjectService {
    /// Azurite, or a panic telling how to start it.
    pub fn azurite() -> Self {
        Self::from_env(
            "Azurite",
            AZURITE_VAR,
            "AZURE_",
            "az",
            "scripts/services/azurite",
        )
    }

    /// The S3 server, or a panic telling how to start it.
    pub fn s3() -> Self {
        Self::from_env("S3", S3_VAR, "AWS_", "s3", "scripts/services/s3")
    }

    fn from_env(name: &'static str, var: &str, prefix: &str, scheme: &str, script: &str) -> Self {
        if std::env::var(var).ok().as_deref() != Some("1") {
            panic!(
                "no {name} test service: {var} is not set; run `eval \"$({script} start)\"` \
                 first, or run everything with scripts/test"
            );
        }
        let env = std::env::vars()
            .filter(|(k, _)| k.starts_with(prefix))
            .collect();
        Self {
            name,
            base: format!("{scheme}://{BUCKET}"),
            env,
        }
    }

    /// `<base>/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        format!("{}/{prefix}", self.base)
    }
}

/// A name no other test (in this or another process) uses.
pub fn unique(name: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{name}-{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos % 1_000_000_000
    )
}
