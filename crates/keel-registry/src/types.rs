//! The registry's records: models, versions, lineage, aliases and their
//! history, audit events, API keys. They derive serde because they are what
//! the CLI's `--json` and the HTTP API show.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::RegistryError;

/// A version's registration state (MLflow's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Status {
    /// Number reserved, artifacts still being uploaded.
    PendingRegistration,
    /// Complete and immutable.
    Ready,
    /// The upload failed; the number stays taken.
    FailedRegistration,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PendingRegistration => "PENDING_REGISTRATION",
            Self::Ready => "READY",
            Self::FailedRegistration => "FAILED_REGISTRATION",
        }
    }

    pub(crate) fn parse(s: &str) -> Self {
        match s {
            "READY" => Self::Ready,
            "FAILED_REGISTRATION" => Self::FailedRegistration,
            _ => Self::PendingRegistration,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tag: a key and a value, on a model or a version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tag {
    pub key: String,
    pub value: String,
}

/// Where a version came from, as recorded at registration. Immutable with
/// the version.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lineage {
    /// The training run (any id: a Slurm job, an MLflow run, a keel ckpt run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// The checkpoint the files were taken from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointLink>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub datasets: Vec<Dataset>,
    /// The code revision that trained it (a git commit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_commit: Option<String>,
    /// The version of the same model this one derives from (fine-tuning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_version: Option<u64>,
    /// A link to the training run (MLflow's `run_link`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_link: Option<String>,
    /// MLflow 3's logged model (`m-...`) a version registered through
    /// MLflow's API was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlflow_model_id: Option<String>,
}

/// A checkpoint in a keel checkpoint store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointLink {
    /// The checkpoint store (`keel ckpt ... URL`).
    pub url: String,
    pub run: String,
    pub step: u64,
    /// The checkpoint manifest's subject digest (SHA-256 over its files'
    /// digests): equal to the version's own when the files are the same.
    pub manifest_digest: String,
}

/// A data set the model was trained or evaluated on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dataset {
    pub uri: String,
    /// `sha256:<hex>` or any digest the data set publishes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

impl FromStr for Dataset {
    type Err = RegistryError;

    /// `URI` or `URI#DIGEST` (`s3://b/d#sha256:ab12...`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (uri, digest) = match s.rsplit_once('#') {
            Some((u, d)) => (u, Some(d)),
            None => (s, None),
        };
        if uri.is_empty() || digest.is_some_and(str::is_empty) {
            return Err(RegistryError::Invalid {
                what: "data set",
                value: s.to_owned(),
                reason: "expected URI or URI#DIGEST".into(),
            });
        }
        Ok(Self {
            uri: uri.to_owned(),
            digest: digest.map(str::to_owned),
        })
    }
}

/// One file of a version: its name relative to the artifact URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionFile {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// A registered model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Model {
    pub name: String,
    pub description: String,
    pub created_ms: i64,
    pub created_by: String,
    pub updated_ms: i64,
    pub tags: Vec<Tag>,
    /// `(alias, version)`, sorted by alias.
    pub aliases: Vec<AliasTarget>,
    /// The highest version number, if any.
    pub latest_version: Option<u64>,
    pub versions: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AliasTarget {
    pub alias: String,
    pub version: u64,
}

/// A model version.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Version {
    pub model: String,
    pub version: u64,
    pub status: Status,
    pub status_message: String,
    /// Where the version came from as given (a directory, a URL, an MLflow
    /// source URI).
    pub source: String,
    /// The storage URL its files live under (files are keyed by name below
    /// it); `None` for versions registered through the MLflow API, which
    /// record only a source.
    pub artifact_url: Option<String>,
    /// SHA-256 over the files' digests in name order (the model-signing
    /// subject digest).
    pub manifest_digest: Option<String>,
    pub description: String,
    pub lineage: Lineage,
    pub created_ms: i64,
    pub created_by: String,
    pub updated_ms: i64,
    pub files: Vec<VersionFile>,
    pub tags: Vec<Tag>,
    /// Aliases pointing at this version now.
    pub aliases: Vec<String>,
    /// Whether a signature is attached.
    pub signed: bool,
}

impl Version {
    /// The sum of the file sizes, `u64::MAX` when it does not fit.
    pub fn total_bytes(&self) -> u64 {
        self.files
            .iter()
            .fold(0u64, |sum, f| sum.saturating_add(f.size))
    }
}

/// What an alias event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AliasAction {
    Set,
    Rollback,
    Delete,
}

impl AliasAction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Set => "set",
            Self::Rollback => "rollback",
            Self::Delete => "delete",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "set" => Some(Self::Set),
            "rollback" => Some(Self::Rollback),
            "delete" => Some(Self::Delete),
            _ => None,
        }
    }
}

/// One entry of an alias's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AliasEvent {
    pub seq: i64,
    pub time_ms: i64,
    pub actor: String,
    pub model: String,
    pub alias: String,
    pub action: AliasAction,
    pub old_version: Option<u64>,
    pub new_version: Option<u64>,
    pub reason: String,
    pub prev_hash: String,
    pub hash: String,
}

/// One entry of the audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditEvent {
    pub seq: i64,
    pub time_ms: i64,
    pub actor: String,
    /// `model.create`, `version.register`, `alias.set`, ...
    pub action: String,
    /// `model`, `model:3`, `model@alias`, `key:name`.
    pub target: String,
    /// What changed, as compact JSON.
    pub detail: String,
    pub prev_hash: String,
    pub hash: String,
}

/// What an API key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read endpoints only.
    Read,
    /// Read and write (create models and versions, set aliases).
    Write,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
        }
    }
}

impl FromStr for Role {
    type Err = RegistryError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "read" => Ok(Self::Read),
            "write" => Ok(Self::Write),
            _ => Err(RegistryError::Invalid {
                what: "role",
                value: s.to_owned(),
                reason: "expected read or write".into(),
            }),
        }
    }
}

/// An API key as stored: its SHA-256, never the secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiKey {
    pub name: String,
    pub role: Role,
    /// The first characters of the SHA-256 of the secret, to tell keys apart.
    pub id: String,
    pub created_ms: i64,
    pub created_by: String,
    pub revoked_ms: Option<i64>,
}

/// A stored signature: the Sigstore bundle JSON and the public key it was
/// made with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SignatureRecord {
    pub model: String,
    pub version: u64,
    pub bundle: String,
    pub public_key_pem: String,
    /// SHA-256 of the public key PEM (the bundle's `publicKey.hint`).
    pub key_hint: String,
    pub created_ms: i64,
    pub created_by: String,
}

/// How a command names a version: `NAME`, `NAME@ALIAS`, `NAME:VERSION`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionRef {
    /// The highest READY version.
    Latest(String),
    Alias(String, String),
    Number(String, u64),
}

impl VersionRef {
    pub fn model(&self) -> &str {
        match self {
            Self::Latest(m) | Self::Alias(m, _) | Self::Number(m, _) => m,
        }
    }
}

impl fmt::Display for VersionRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Latest(m) => f.write_str(m),
            Self::Alias(m, a) => write!(f, "{m}@{a}"),
            Self::Number(m, v) => write!(f, "{m}:{v}"),
        }
    }
}

impl FromStr for VersionRef {
    type Err = RegistryError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some((m, a)) = s.split_once('@') {
            check_stored_model_name(m)?;
            check_alias(a)?;
            return Ok(Self::Alias(m.to_owned(), a.to_owned()));
        }
        if let Some((m, v)) = s.split_once(':') {
            check_stored_model_name(m)?;
            return Ok(Self::Number(m.to_owned(), parse_version(v)?));
        }
        check_stored_model_name(s)?;
        Ok(Self::Latest(s.to_owned()))
    }
}

/// A version number: a positive integer (`3`, or MLflow's string `"3"`).
pub fn parse_version(v: &str) -> Result<u64, RegistryError> {
    let n = v.strip_prefix('v').unwrap_or(v);
    match n.parse::<u64>() {
        Ok(n) if n >= 1 && n <= i64::MAX as u64 => Ok(n),
        _ => Err(RegistryError::Invalid {
            what: "version",
            value: v.chars().take(40).collect(),
            reason: "versions are whole numbers from 1".into(),
        }),
    }
}

/// Model names: 1-128 letters, digits, `.`, `_` and `-`, starting with a
/// letter or digit, no `..`. `/` and `:` are refused as MLflow refuses
/// them: its client cannot address such a model in `models:/` URIs and
/// alias calls (and `@`, `:` would clash with `NAME@ALIAS` and
/// `NAME:VERSION`; the name is also a storage prefix).
pub fn check_model_name(name: &str) -> Result<(), RegistryError> {
    let bad = |reason: &str| RegistryError::Invalid {
        what: "model name",
        value: name.chars().take(140).collect(),
        reason: reason.into(),
    };
    if name.contains('/') || name.contains(':') {
        return Err(bad(
            "model names may not contain `/` or `:` (MLflow's models:/ URIs cannot name them); use 1-128 letters, digits, `.`, `_` and `-`",
        ));
    }
    check_stored_model_name(name).map_err(|_| {
        bad("use 1-128 letters, digits, `.`, `_` and `-`, starting with a letter or digit")
    })
}

/// The names a registry may already hold: [`check_model_name`]'s rule
/// before it refused `/` (`team/model`), so that such models stay
/// readable.
pub(crate) fn check_stored_model_name(name: &str) -> Result<(), RegistryError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && !name.ends_with('/')
        && !name.contains("..")
        && !name.contains("//")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'));
    if ok {
        Ok(())
    } else {
        Err(RegistryError::Invalid {
            what: "model name",
            value: name.chars().take(140).collect(),
            reason: "use 1-128 letters, digits, `.`, `_` and `-`, starting with a letter or digit"
                .into(),
        })
    }
}

/// Alias names: 1-64 letters, digits, `_` and `-`; not `latest` and not
/// `v<digits>` (MLflow reserves both).
pub fn check_alias(alias: &str) -> Result<(), RegistryError> {
    let bad = |reason: &str| RegistryError::Invalid {
        what: "alias",
        value: alias.chars().take(80).collect(),
        reason: reason.to_owned(),
    };
    if alias.is_empty()
        || alias.len() > 64
        || !alias
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
    {
        return Err(bad("use 1-64 letters, digits, `_` and `-`"));
    }
    let lower = alias.to_ascii_lowercase();
    if lower == "latest"
        || (lower.len() > 1
            && lower.starts_with('v')
            && lower[1..].bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(bad("`latest` and `v<number>` are reserved"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_parse() {
        assert_eq!(
            "m@prod".parse::<VersionRef>().expect("alias"),
            VersionRef::Alias("m".into(), "prod".into())
        );
        assert_eq!(
            "team/m:3".parse::<VersionRef>().expect("num"),
            VersionRef::Number("team/m".into(), 3)
        );
        assert_eq!(
            "m".parse::<VersionRef>().expect("latest"),
            VersionRef::Latest("m".into())
        );
        for bad in [
            "m:0", "m:x", "m:-1", "m@", "@a", "", "m@latest", "m@v2", "../m", "m:",
        ] {
            assert!(bad.parse::<VersionRef>().is_err(), "{bad}");
        }
        // New names may not hold `/` or `:`; stored ones stay addressable.
        for bad in ["team/m", "a:b", "m/"] {
            let e = check_model_name(bad).expect_err(bad);
            assert!(e.to_string().contains("`/` or `:`"), "{e}");
        }
        assert!(check_model_name("team.m_1-x").is_ok());
    }

    #[test]
    fn total_bytes_stops_at_the_largest_u64() {
        let file = |name: &str, size: u64| VersionFile {
            name: name.into(),
            size,
            sha256: String::new(),
        };
        let mut v = Version {
            model: "m".into(),
            version: 1,
            status: Status::Ready,
            status_message: String::new(),
            source: String::new(),
            artifact_url: None,
            manifest_digest: None,
            description: String::new(),
            lineage: Lineage::default(),
            created_ms: 0,
            created_by: String::new(),
            updated_ms: 0,
            files: vec![file("a", 2), file("b", 3)],
            tags: Vec::new(),
            aliases: Vec::new(),
            signed: false,
        };
        assert_eq!(v.total_bytes(), 5);
        v.files = vec![file("a", u64::MAX), file("b", 1)];
        assert_eq!(v.total_bytes(), u64::MAX);
    }

    #[test]
    fn datasets_parse() {
        let d: Dataset = "s3://b/d#sha256:ab".parse().expect("ds");
        assert_eq!(d.uri, "s3://b/d");
        assert_eq!(d.digest.as_deref(), Some("sha256:ab"));
        assert!("#x".parse::<Dataset>().is_err());
    }
}
