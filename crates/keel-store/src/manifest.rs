//! Content manifests: every file's name, size and SHA-256, written as an
//! in-toto Statement v1 in the OpenSSF model-signing v1.0 layout
//! (predicate type `https://model_signing/signature/v1.0`, serialization
//! method `files`), so a registry can later wrap the very same bytes in a
//! DSSE envelope and sign them.
//!
//! ```json
//! {
//!   "_type": "https://in-toto.io/Statement/v1",
//!   "subject": [{"name": "step-100", "digest": {"sha256": "<over the resource digests>"}}],
//!   "predicateType": "https://model_signing/signature/v1.0",
//!   "predicate": {
//!     "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": false, "ignore_paths": []},
//!     "resources": [{"name": "a.bin", "algorithm": "sha256", "digest": "<hex>", "size": 123}],
//!     "keel": {"version": 1, ...}
//!   }
//! }
//! ```
//!
//! Two additions that model-signing verifiers ignore: `size` on each
//! resource, and `predicate.keel`, an object that the caller fills
//! (checkpoint metadata) and that carries its own `version`. Resources are
//! sorted by name; the subject digest is SHA-256 over the concatenated raw
//! resource digests in that order, as the reference implementation does.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::Sha256;

pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
pub const PREDICATE_TYPE: &str = "https://model_signing/signature/v1.0";

/// A SHA-256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    pub fn of(data: &[u8]) -> Self {
        use sha2::Digest as _;
        Self(Sha256::digest(data).into())
    }

    pub fn hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        // Only lowercase is canonical.
        (Self(out).hex() == s).then_some(Self(out))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// Incremental SHA-256.
#[derive(Debug, Clone, Default)]
pub struct Hasher(Sha256);

impl Hasher {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn update(&mut self, data: &[u8]) {
        use sha2::Digest as _;
        self.0.update(data);
    }
    pub fn finish(self) -> Digest {
        use sha2::Digest as _;
        Digest(self.0.finalize().into())
    }
}

/// One file: its name relative to the manifest's root (`/`-separated),
/// size and digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub sha256: Digest,
}

/// A manifest: a name (the subject), files sorted by name, and the caller's
/// own metadata object.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    pub name: String,
    files: Vec<FileEntry>,
    /// `predicate.keel`: free-form for the caller, an object.
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest is not valid JSON: {message}")]
    Json { message: String },
    #[error("manifest {field} is {found:?}, expected {expected:?}")]
    Unexpected {
        field: &'static str,
        found: String,
        expected: &'static str,
    },
    #[error("manifest resource {name:?}: {reason}")]
    Resource { name: String, reason: String },
    #[error("manifest subject digest {found} does not match its resources ({computed})")]
    Subject { found: String, computed: String },
}

/// Checks a resource name: relative, `/`-separated, no empty, `.` or `..`
/// segments, no backslashes or NULs. Names are joined to local directories
/// on download, so this is what keeps a manifest from writing elsewhere.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty name".into());
    }
    if name.starts_with('/') {
        return Err("absolute name".into());
    }
    if name.contains('\\') || name.contains('\0') {
        return Err("backslash or NUL in name".into());
    }
    for seg in name.split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return Err(format!("bad path segment {seg:?}"));
        }
    }
    Ok(())
}

impl Manifest {
    /// Builds a manifest; names must be valid and unique.
    pub fn new(
        name: impl Into<String>,
        mut files: Vec<FileEntry>,
        metadata: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, ManifestError> {
        files.sort_by(|a, b| a.name.cmp(&b.name));
        let mut seen = BTreeSet::new();
        for f in &files {
            check_name(&f.name).map_err(|reason| ManifestError::Resource {
                name: f.name.clone(),
                reason,
            })?;
            if !seen.insert(f.name.as_str()) {
                return Err(ManifestError::Resource {
                    name: f.name.clone(),
                    reason: "listed twice".into(),
                });
            }
        }
        Ok(Self {
            name: name.into(),
            files,
            metadata,
        })
    }

    /// Files sorted by name.
    pub fn files(&self) -> &[FileEntry] {
        &self.files
    }

    /// The sum of the file sizes, `u64::MAX` when it does not fit.
    pub fn total_bytes(&self) -> u64 {
        self.files
            .iter()
            .fold(0u64, |sum, f| sum.saturating_add(f.size))
    }

    pub fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files
            .binary_search_by(|f| f.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.files[i])
    }

    /// SHA-256 over the concatenated resource digests, in name order.
    pub fn subject_digest(&self) -> Digest {
        let mut h = Hasher::new();
        for f in &self.files {
            h.update(&f.sha256.0);
        }
        h.finish()
    }

    /// The statement as JSON bytes (pretty, stable key order).
    pub fn to_json(&self) -> Vec<u8> {
        let doc = Statement {
            type_: STATEMENT_TYPE.into(),
            subject: vec![Subject {
                name: self.name.clone(),
                digest: SubjectDigest {
                    sha256: self.subject_digest().hex(),
                },
            }],
            predicate_type: PREDICATE_TYPE.into(),
            predicate: Predicate {
                serialization: Serialization {
                    method: "files".into(),
                    hash_type: "sha256".into(),
                    allow_symlinks: false,
                    ignore_paths: Vec::new(),
                },
                resources: self
                    .files
                    .iter()
                    .map(|f| Resource {
                        name: f.name.clone(),
                        algorithm: "sha256".into(),
                        digest: f.sha256.hex(),
                        size: Some(f.size),
                    })
                    .collect(),
                keel: Some(self.metadata.clone()),
            },
        };
        let mut v = serde_json::to_vec_pretty(&doc).unwrap_or_default();
        v.push(b'\n');
        v
    }

    /// Parses and checks a statement: types, resource names and digests,
    /// sizes present, and the subject digest.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ManifestError> {
        let doc: Statement = serde_json::from_slice(bytes).map_err(|e| ManifestError::Json {
            message: e.to_string(),
        })?;
        if doc.type_ != STATEMENT_TYPE {
            return Err(ManifestError::Unexpected {
                field: "_type",
                found: doc.type_,
                expected: STATEMENT_TYPE,
            });
        }
        if doc.predicate_type != PREDICATE_TYPE {
            return Err(ManifestError::Unexpected {
                field: "predicateType",
                found: doc.predicate_type,
                expected: PREDICATE_TYPE,
            });
        }
        let ser = &doc.predicate.serialization;
        if ser.method != "files" {
            return Err(ManifestError::Unexpected {
                field: "predicate.serialization.method",
                found: ser.method.clone(),
                expected: "files",
            });
        }
        if ser.hash_type != "sha256" {
            return Err(ManifestError::Unexpected {
                field: "predicate.serialization.hash_type",
                found: ser.hash_type.clone(),
                expected: "sha256",
            });
        }
        let [subject] =
            <[Subject; 1]>::try_from(doc.subject).map_err(|s| ManifestError::Unexpected {
                field: "subject",
                found: format!("{} entries", s.len()),
                expected: "one entry",
            })?;
        let mut files = Vec::with_capacity(doc.predicate.resources.len());
        for r in doc.predicate.resources {
            let res = |reason: &str| ManifestError::Resource {
                name: r.name.clone(),
                reason: reason.to_owned(),
            };
            if r.algorithm != "sha256" {
                return Err(res("algorithm is not sha256"));
            }
            let sha256 = Digest::from_hex(&r.digest)
                .ok_or_else(|| res("digest is not 64 lowercase hex digits"))?;
            let size = r.size.ok_or_else(|| res("no size"))?;
            files.push(FileEntry {
                name: r.name,
                size,
                sha256,
            });
        }
        let m = Self::new(subject.name, files, doc.predicate.keel.unwrap_or_default())?;
        let computed = m.subject_digest().hex();
        if subject.digest.sha256 != computed {
            return Err(ManifestError::Subject {
                found: subject.digest.sha256,
                computed,
            });
        }
        Ok(m)
    }
}

#[derive(Serialize, Deserialize)]
struct Statement {
    #[serde(rename = "_type")]
    type_: String,
    subject: Vec<Subject>,
    #[serde(rename = "predicateType")]
    predicate_type: String,
    predicate: Predicate,
}

#[derive(Serialize, Deserialize)]
struct Subject {
    name: String,
    digest: SubjectDigest,
}

#[derive(Serialize, Deserialize)]
struct SubjectDigest {
    sha256: String,
}

#[derive(Serialize, Deserialize)]
struct Predicate {
    serialization: Serialization,
    resources: Vec<Resource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    keel: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Serialize, Deserialize)]
struct Serialization {
    method: String,
    hash_type: String,
    allow_symlinks: bool,
    #[serde(default)]
    ignore_paths: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct Resource {
    name: String,
    algorithm: String,
    digest: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    size: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(name: &str, data: &[u8]) -> FileEntry {
        FileEntry {
            name: name.into(),
            size: data.len() as u64,
            sha256: Digest::of(data),
        }
    }

    #[test]
    fn known_digests() {
        assert_eq!(
            Digest::of(b"").hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            Digest::of(b"abc").hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn statement_layout_and_subject_digest() {
        let mut meta = serde_json::Map::new();
        meta.insert("version".into(), 1.into());
        let m = Manifest::new("m", vec![entry("b", b"abc"), entry("a/x", b"")], meta)
            .expect("manifest");
        let v: serde_json::Value = serde_json::from_slice(&m.to_json()).expect("json");
        assert_eq!(v["_type"], STATEMENT_TYPE);
        assert_eq!(v["predicateType"], PREDICATE_TYPE);
        assert_eq!(v["predicate"]["serialization"]["method"], "files");
        assert_eq!(v["predicate"]["resources"][0]["name"], "a/x");
        assert_eq!(v["predicate"]["resources"][1]["size"], 3);
        assert_eq!(v["predicate"]["keel"]["version"], 1);
        // SHA-256(sha256("") || sha256("abc")), sorted by name.
        let mut cat = Digest::of(b"").0.to_vec();
        cat.extend_from_slice(&Digest::of(b"abc").0);
        assert_eq!(v["subject"][0]["digest"]["sha256"], Digest::of(&cat).hex());
        assert_eq!(Manifest::from_json(&m.to_json()).expect("parse"), m);
    }

    #[test]
    fn total_bytes_stops_at_the_largest_u64() {
        let big = |name: &str| FileEntry {
            name: name.into(),
            size: u64::MAX / 2 + 1,
            sha256: Digest::of(b""),
        };
        let m = Manifest::new("m", vec![big("a"), big("b")], Default::default()).expect("m");
        assert_eq!(m.total_bytes(), u64::MAX);
        let m = Manifest::new(
            "m",
            vec![entry("a", b"12"), entry("b", b"345")],
            Default::default(),
        )
        .expect("m");
        assert_eq!(m.total_bytes(), 5);
    }

    #[test]
    fn rejects_bad_manifests() {
        let m = Manifest::new("m", vec![entry("a", b"1")], Default::default()).expect("m");
        let good: serde_json::Value = serde_json::from_slice(&m.to_json()).expect("json");
        let check = |edit: &dyn Fn(&mut serde_json::Value), want: &str| {
            let mut v = good.clone();
            edit(&mut v);
            let e = Manifest::from_json(&serde_json::to_vec(&v).expect("ser"))
                .expect_err(want)
                .to_string();
            assert!(e.contains(want), "{want}: {e}");
        };
        check(&|v| v["_type"] = "x".into(), "_type");
        check(&|v| v["predicateType"] = "x".into(), "predicateType");
        check(
            &|v| v["predicate"]["resources"][0]["name"] = "../etc/passwd".into(),
            "bad path segment",
        );
        check(
            &|v| v["predicate"]["resources"][0]["name"] = "/abs".into(),
            "absolute",
        );
        check(
            &|v| v["predicate"]["resources"][0]["digest"] = "AB".into(),
            "hex",
        );
        check(
            &|v| v["predicate"]["resources"][0]["digest"] = Digest::of(b"2").hex().into(),
            "subject digest",
        );
        check(
            &|v| {
                let r = v["predicate"]["resources"][0].clone();
                v["predicate"]["resources"]
                    .as_array_mut()
                    .expect("arr")
                    .push(r);
            },
            "listed twice",
        );
        check(
            &|v| {
                v["predicate"]["resources"][0]
                    .as_object_mut()
                    .expect("obj")
                    .remove("size");
            },
            "no size",
        );
        assert!(Manifest::from_json(b"{").is_err());
        assert!(Manifest::from_json(b"").is_err());
    }

    proptest! {
        #[test]
        fn roundtrip(names in proptest::collection::btree_set("[a-z0-9_.-]{1,8}(/[a-z0-9_-]{1,8}){0,2}", 0..8),
                     sizes in proptest::collection::vec(any::<u64>(), 8)) {
            let files: Vec<FileEntry> = names.iter().enumerate().filter(|(_, n)| check_name(n).is_ok()).map(|(i, n)| FileEntry {
                name: n.clone(), size: sizes[i], sha256: Digest::of(n.as_bytes()),
            }).collect();
            let m = Manifest::new("x", files, Default::default()).expect("m");
            prop_assert_eq!(Manifest::from_json(&m.to_json()).expect("parse"), m);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Manifest::from_json(&bytes);
        }
    }
}
