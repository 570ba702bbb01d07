//! OpenSSF model signing v1.0 with ECDSA P-256 keys, in the format of the
//! reference implementation (`model-signing` 1.1.1, key-based signing):
//!
//! - the payload is an in-toto Statement v1 with predicate type
//!   `https://model_signing/signature/v1.0` (keel-store's [`Manifest`]
//!   JSON; its extra `size` fields and `predicate.keel` object are ignored
//!   by v1.0 verifiers, which read only `serialization` and `resources`);
//! - it is signed in a DSSE envelope: ECDSA P-256 with SHA-256 over
//!   `PAE = "DSSEv1" SP len(type) SP type SP len(payload) SP payload`, with
//!   type `application/vnd.in-toto+json`, the signature DER-encoded;
//! - the envelope sits in a Sigstore bundle (media type
//!   `application/vnd.dev.sigstore.bundle.v0.3+json`) whose
//!   `verificationMaterial.publicKey.hint` is the SHA-256 (hex) of the
//!   signer's public key as SPKI PEM, and no transparency-log entries.
//!
//! Verification checks the media type, the key hint, the signature, the
//! statement (types, subject digest over the resource digests), then
//! re-hashes a directory the way the statement's `serialization` says
//! (`files` or `shards`, `ignore_paths`, `allow_symlinks`) and compares
//! every resource, naming each file that differs, is missing or is extra.
//!
//! Keys: private keys as SEC1 PEM (`-----BEGIN EC PRIVATE KEY-----`, as
//! `openssl ecparam -name prime256v1 -genkey` writes it, with or without
//! the `EC PARAMETERS` block) or unencrypted PKCS#8 PEM; public keys as
//! SPKI PEM (`-----BEGIN PUBLIC KEY-----`).

use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use p256::ecdsa::signature::{Signer as _, Verifier as _};
use p256::ecdsa::{Signature, SigningKey, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePublicKey, LineEnding};
use serde::{Deserialize, Serialize};

use keel_store::manifest::Hasher;
use keel_store::{Digest, Manifest};

pub const BUNDLE_MEDIA_TYPE: &str = "application/vnd.dev.sigstore.bundle.v0.3+json";
pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
pub const PREDICATE_TYPE: &str = "https://model_signing/signature/v1.0";

/// Paths the reference tool ignores by default when it hashes a directory.
pub const GIT_PATHS: &[&str] = &[".git", ".gitattributes", ".github", ".gitignore"];

#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadKey { path: PathBuf, reason: String },
    #[error("{path}: wrong key type: {found} (keel signs with ECDSA P-256 keys)")]
    WrongKeyType { path: PathBuf, found: String },
    #[error("the signature bundle is malformed: {reason}")]
    BadBundle { reason: String },
    #[error("the signature was not made with this public key: {reason}")]
    WrongKey { reason: String },
    #[error(
        "the signature does not verify: the signed statement was changed or signed by another key"
    )]
    BadSignature,
    #[error("the signed statement is malformed: {reason}")]
    BadStatement { reason: String },
    #[error("unsupported {what} {value:?} in the signed statement")]
    Unsupported { what: &'static str, value: String },
    #[error("{path} is a symbolic link and the signature does not allow symbolic links")]
    Symlink { path: PathBuf },
    #[error("the model does not match its signature: {}", summary(problems))]
    Mismatch { problems: Vec<FileProblem> },
}

fn summary(problems: &[FileProblem]) -> String {
    let mut s: Vec<String> = problems.iter().take(5).map(|p| p.to_string()).collect();
    if problems.len() > 5 {
        s.push(format!("and {} more", problems.len() - 5));
    }
    s.join("; ")
}

/// One way a file fails its signature.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "problem", rename_all = "snake_case")]
pub enum FileProblem {
    /// The content differs (the resource name: a file, or `file:start:end`
    /// for a shard).
    Changed {
        name: String,
    },
    Missing {
        name: String,
    },
    /// A file the signature does not list.
    Extra {
        name: String,
    },
}

impl std::fmt::Display for FileProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Changed { name } => write!(f, "{name} was modified (digest differs)"),
            Self::Missing { name } => write!(f, "{name} is missing"),
            Self::Extra { name } => write!(f, "{name} is not in the signature"),
        }
    }
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// The PEM blocks of a file: `(label, whole block text)`.
fn pem_blocks(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("-----BEGIN ") {
        let after = &rest[start + 11..];
        let Some(end_label) = after.find("-----") else {
            break;
        };
        let label = after[..end_label].to_owned();
        let end_marker = format!("-----END {label}-----");
        let Some(end) = rest[start..].find(&end_marker) else {
            break;
        };
        let stop = start + end + end_marker.len();
        out.push((label, format!("{}\n", &rest[start..stop])));
        rest = &rest[stop..];
    }
    out
}

/// An ECDSA P-256 private key.
#[derive(Debug, Clone)]
pub struct PrivateKey(SigningKey);

/// An ECDSA P-256 public key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey(VerifyingKey);

impl PrivateKey {
    /// A new random key (from the operating system's generator).
    pub fn generate() -> Self {
        Self(SigningKey::random(&mut rand_core::OsRng))
    }

    /// Parses a SEC1 or PKCS#8 PEM file's text; `path` is for messages.
    pub fn from_pem(text: &str, path: &Path) -> Result<Self, SignError> {
        let bad = |reason: &str| SignError::BadKey {
            path: path.to_owned(),
            reason: reason.to_owned(),
        };
        let blocks = pem_blocks(text);
        if blocks.is_empty() {
            return Err(bad("not a PEM file (no -----BEGIN ...----- block)"));
        }
        for (label, block) in &blocks {
            match label.as_str() {
                "EC PRIVATE KEY" => {
                    return p256::SecretKey::from_sec1_pem(block)
                        .map(|k| Self(SigningKey::from(&k)))
                        .map_err(|_| {
                            // A well-formed SEC1 key on another curve, or garbage.
                            match sec1_curve(block) {
                                Some(curve) if curve != "prime256v1" => SignError::WrongKeyType {
                                    path: path.to_owned(),
                                    found: format!("EC key on curve {curve}"),
                                },
                                _ => bad("malformed EC PRIVATE KEY block"),
                            }
                        });
                }
                "PRIVATE KEY" => {
                    return p256::SecretKey::from_pkcs8_pem(block)
                        .map(|k| Self(SigningKey::from(&k)))
                        .map_err(|e| match pkcs8_algorithm(block) {
                            Some(alg) if alg != "EC P-256" => SignError::WrongKeyType {
                                path: path.to_owned(),
                                found: alg,
                            },
                            _ => bad(&format!("malformed PRIVATE KEY block: {e}")),
                        });
                }
                "ENCRYPTED PRIVATE KEY" => {
                    return Err(bad(
                        "the key is encrypted; keel reads password-less keys only",
                    ))
                }
                "RSA PRIVATE KEY" => {
                    return Err(SignError::WrongKeyType {
                        path: path.to_owned(),
                        found: "RSA".into(),
                    })
                }
                "OPENSSH PRIVATE KEY" => {
                    return Err(SignError::WrongKeyType {
                        path: path.to_owned(),
                        found: "OpenSSH private key".into(),
                    })
                }
                "PUBLIC KEY" => {
                    return Err(bad("this is a public key; a private key is needed to sign"))
                }
                _ => {}
            }
        }
        Err(bad(&format!(
            "no private key in it (found {})",
            blocks
                .iter()
                .map(|(l, _)| l.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }

    pub fn read(path: &Path) -> Result<Self, SignError> {
        Self::from_pem(&read_text(path)?, path)
    }

    /// SEC1 PEM (`-----BEGIN EC PRIVATE KEY-----`), as openssl writes it.
    pub fn to_sec1_pem(&self) -> String {
        p256::SecretKey::from(&self.0)
            .to_sec1_pem(LineEnding::LF)
            .map(|z| z.to_string())
            .unwrap_or_default()
    }

    pub fn public_key(&self) -> PublicKey {
        PublicKey(*self.0.verifying_key())
    }

    /// Signs a statement: the Sigstore bundle JSON (`model.sig`).
    pub fn sign_statement(&self, payload: &[u8]) -> String {
        let sig: Signature = self.0.sign(&pae(payload));
        let bundle = Bundle {
            media_type: BUNDLE_MEDIA_TYPE.into(),
            verification_material: VerificationMaterial {
                public_key: Some(PublicKeyId {
                    hint: Some(self.public_key().hint()),
                }),
                tlog_entries: Some(Vec::new()),
            },
            dsse_envelope: Some(Envelope {
                payload: b64().encode(payload),
                payload_type: PAYLOAD_TYPE.into(),
                signatures: vec![EnvelopeSignature {
                    sig: b64().encode(sig.to_der().as_bytes()),
                    keyid: Some(String::new()),
                }],
            }),
        };
        serde_json::to_string(&bundle).unwrap_or_default()
    }
}

/// The curve OID's name in a SEC1 key, when it says (`prime256v1`,
/// `secp384r1`, ...).
fn sec1_curve(block: &str) -> Option<String> {
    let der = pem_der(block)?;
    let oid = |bytes: &[u8]| der.windows(bytes.len()).any(|w| w == bytes);
    Some(
        if oid(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07]) {
            "prime256v1"
        } else if oid(&[0x2b, 0x81, 0x04, 0x00, 0x22]) {
            "secp384r1"
        } else if oid(&[0x2b, 0x81, 0x04, 0x00, 0x23]) {
            "secp521r1"
        } else if oid(&[0x2b, 0x81, 0x04, 0x00, 0x0a]) {
            "secp256k1"
        } else {
            "an unknown curve"
        }
        .to_owned(),
    )
}

/// What kind of key a PKCS#8 or SPKI block holds, from its algorithm OIDs.
fn pkcs8_algorithm(block: &str) -> Option<String> {
    let der = pem_der(block)?;
    let has = |bytes: &[u8]| der.windows(bytes.len()).any(|w| w == bytes);
    Some(if has(&[0x2b, 0x65, 0x70]) {
        "Ed25519".to_owned()
    } else if has(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01]) {
        "RSA".to_owned()
    } else if has(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01]) {
        match sec1_curve(block).as_deref() {
            Some("prime256v1") => "EC P-256".to_owned(),
            Some(c) => format!("EC key on curve {c}"),
            None => "EC".to_owned(),
        }
    } else {
        "an unknown algorithm".to_owned()
    })
}

fn pem_der(block: &str) -> Option<Vec<u8>> {
    let body: String = block
        .lines()
        .filter(|l| !l.starts_with("-----") && !l.contains(':'))
        .collect();
    b64().decode(body.trim()).ok()
}

impl PublicKey {
    pub fn from_pem(text: &str, path: &Path) -> Result<Self, SignError> {
        let bad = |reason: &str| SignError::BadKey {
            path: path.to_owned(),
            reason: reason.to_owned(),
        };
        let blocks = pem_blocks(text);
        if blocks.is_empty() {
            return Err(bad("not a PEM file (no -----BEGIN ...----- block)"));
        }
        for (label, block) in &blocks {
            match label.as_str() {
                "PUBLIC KEY" => {
                    return VerifyingKey::from_public_key_pem(block)
                        .map(Self)
                        .map_err(|e| match pkcs8_algorithm(block) {
                            Some(alg) if alg != "EC P-256" => SignError::WrongKeyType {
                                path: path.to_owned(),
                                found: alg,
                            },
                            _ => bad(&format!("malformed PUBLIC KEY block: {e}")),
                        })
                }
                "EC PRIVATE KEY" | "PRIVATE KEY" | "ENCRYPTED PRIVATE KEY" => {
                    return Err(bad(
                        "this is a private key; pass the public key (openssl ec -in KEY -pubout)",
                    ))
                }
                "RSA PUBLIC KEY" => {
                    return Err(SignError::WrongKeyType {
                        path: path.to_owned(),
                        found: "RSA".into(),
                    })
                }
                _ => {}
            }
        }
        Err(bad("no PUBLIC KEY block in it"))
    }

    pub fn read(path: &Path) -> Result<Self, SignError> {
        Self::from_pem(&read_text(path)?, path)
    }

    /// SPKI PEM (`-----BEGIN PUBLIC KEY-----`), byte for byte as Python's
    /// `cryptography` writes it.
    pub fn to_pem(&self) -> String {
        self.0.to_public_key_pem(LineEnding::LF).unwrap_or_default()
    }

    /// SHA-256 (hex) of the SPKI PEM: the bundle's `publicKey.hint`.
    pub fn hint(&self) -> String {
        Digest::of(self.to_pem().as_bytes()).hex()
    }

    /// Checks a bundle's signature and returns the signed statement's
    /// bytes.
    pub fn open_bundle(&self, bundle_json: &[u8]) -> Result<Vec<u8>, SignError> {
        let bad = |reason: String| SignError::BadBundle { reason };
        let bundle: Bundle =
            serde_json::from_slice(bundle_json).map_err(|e| bad(format!("not JSON: {e}")))?;
        if bundle.media_type != BUNDLE_MEDIA_TYPE {
            return Err(bad(format!(
                "media type {:?}, expected {BUNDLE_MEDIA_TYPE:?}",
                bundle.media_type
            )));
        }
        let hint = bundle
            .verification_material
            .public_key
            .and_then(|k| k.hint)
            .filter(|h| !h.is_empty());
        if let Some(hint) = hint {
            if hint != self.hint() {
                return Err(SignError::WrongKey {
                    reason: format!(
                        "the bundle names key {hint}, the public key given is {}",
                        self.hint()
                    ),
                });
            }
        }
        let env = bundle
            .dsse_envelope
            .ok_or_else(|| bad("no dsseEnvelope (keel verifies key-based DSSE bundles)".into()))?;
        if env.payload_type != PAYLOAD_TYPE {
            return Err(bad(format!(
                "payload type {:?}, expected {PAYLOAD_TYPE:?}",
                env.payload_type
            )));
        }
        let payload = b64()
            .decode(&env.payload)
            .map_err(|e| bad(format!("payload is not base64: {e}")))?;
        let [sig] = env.signatures.as_slice() else {
            return Err(bad(format!(
                "{} signatures, expected one",
                env.signatures.len()
            )));
        };
        let raw = b64()
            .decode(&sig.sig)
            .map_err(|e| bad(format!("signature is not base64: {e}")))?;
        let sig = Signature::from_der(&raw)
            .or_else(|_| Signature::from_slice(&raw))
            .map_err(|_| bad("the signature is not an ECDSA P-256 signature".into()))?;
        self.0
            .verify(&pae(&payload), &sig)
            .map_err(|_| SignError::BadSignature)?;
        Ok(payload)
    }
}

fn read_text(path: &Path) -> Result<String, SignError> {
    let bytes = keel_fs::read_regular(path, keel_fs::MAX_CONFIG_BYTES).map_err(|source| {
        SignError::Read {
            path: path.to_owned(),
            source,
        }
    })?;
    String::from_utf8(bytes).map_err(|_| SignError::BadKey {
        path: path.to_owned(),
        reason: "not a PEM text file".into(),
    })
}

/// DSSE's pre-authentication encoding for an in-toto payload.
pub fn pae(payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {PAYLOAD_TYPE} {} ",
        PAYLOAD_TYPE.len(),
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bundle {
    media_type: String,
    verification_material: VerificationMaterial,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dsse_envelope: Option<Envelope>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct VerificationMaterial {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    public_key: Option<PublicKeyId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tlog_entries: Option<Vec<serde_json::Value>>,
}

#[derive(Serialize, Deserialize)]
struct PublicKeyId {
    #[serde(default)]
    hint: Option<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    payload: String,
    payload_type: String,
    signatures: Vec<EnvelopeSignature>,
}

#[derive(Serialize, Deserialize)]
struct EnvelopeSignature {
    sig: String,
    #[serde(default)]
    keyid: Option<String>,
}

/// How the signer turned the directory into resources.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Serialization {
    /// `files`, or `shards` with `shard_size`.
    pub method: String,
    pub shard_size: Option<u64>,
    pub hash_type: String,
    pub allow_symlinks: bool,
    pub ignore_paths: Vec<String>,
}

/// A signed statement's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SignedStatement {
    pub name: String,
    /// SHA-256 over the resource digests: the model's digest.
    pub digest: String,
    pub serialization: Serialization,
    /// `(name, sha256 hex)` in the statement's order.
    pub resources: Vec<(String, String)>,
}

/// Parses and checks a statement (v1.0 predicate): types, serialization,
/// resource names and digests, and the subject digest over the resources.
pub fn parse_statement(payload: &[u8]) -> Result<SignedStatement, SignError> {
    let bad = |reason: String| SignError::BadStatement { reason };
    let v: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| bad(format!("not JSON: {e}")))?;
    if v["_type"] != STATEMENT_TYPE {
        return Err(bad(format!(
            "_type is {}, expected {STATEMENT_TYPE}",
            v["_type"]
        )));
    }
    if v["predicateType"] != PREDICATE_TYPE {
        return Err(SignError::Unsupported {
            what: "predicate type",
            value: v["predicateType"].to_string(),
        });
    }
    let subjects = v["subject"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let [subject] = subjects else {
        return Err(bad(format!("{} subjects, expected one", subjects.len())));
    };
    let name = subject["name"].as_str().unwrap_or_default().to_owned();
    let digest = subject["digest"]["sha256"]
        .as_str()
        .ok_or_else(|| bad("subject has no sha256 digest".into()))?
        .to_owned();
    let s = &v["predicate"]["serialization"];
    let method = s["method"].as_str().unwrap_or_default().to_owned();
    let shard_size = match method.as_str() {
        "files" => None,
        "shards" => Some(
            // Protobuf's Struct carries numbers as doubles: 65536.0.
            s["shard_size"]
                .as_u64()
                .or_else(|| {
                    s["shard_size"]
                        .as_f64()
                        .filter(|f| f.fract() == 0.0 && *f >= 1.0 && *f < 9.0e15)
                        .map(|f| f as u64)
                })
                .filter(|n| *n > 0)
                .ok_or_else(|| bad("shards serialization without a positive shard_size".into()))?,
        ),
        other => {
            return Err(SignError::Unsupported {
                what: "serialization method",
                value: other.to_owned(),
            })
        }
    };
    let hash_type = s["hash_type"].as_str().unwrap_or_default().to_owned();
    if hash_type != "sha256" {
        return Err(SignError::Unsupported {
            what: "hash type",
            value: hash_type,
        });
    }
    let allow_symlinks = match &s["allow_symlinks"] {
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::String(t) => t.eq_ignore_ascii_case("true"),
        _ => false,
    };
    let ignore_paths = s["ignore_paths"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let mut resources = Vec::new();
    let mut h = Hasher::new();
    for r in v["predicate"]["resources"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        let rname = r["name"]
            .as_str()
            .ok_or_else(|| bad("a resource without a name".into()))?;
        let alg = r["algorithm"].as_str().unwrap_or_default();
        if alg != "sha256" && !alg.starts_with("sha256-sharded") {
            return Err(SignError::Unsupported {
                what: "resource algorithm",
                value: alg.to_owned(),
            });
        }
        let d = r["digest"]
            .as_str()
            .and_then(Digest::from_hex)
            .ok_or_else(|| {
                bad(format!(
                    "resource {rname}: digest is not 64 lowercase hex digits"
                ))
            })?;
        h.update(&d.0);
        resources.push((rname.to_owned(), d.hex()));
    }
    let computed = h.finish().hex();
    if computed != digest {
        return Err(bad(format!(
            "subject digest {digest} does not match its resources ({computed})"
        )));
    }
    Ok(SignedStatement {
        name,
        digest,
        serialization: Serialization {
            method,
            shard_size,
            hash_type,
            allow_symlinks,
            ignore_paths,
        },
        resources,
    })
}

/// Options for hashing a directory against a statement.
#[derive(Debug, Clone, Default)]
pub struct DirOptions {
    /// More paths to leave out, relative to the directory (a directory
    /// leaves out everything under it).
    pub ignore_paths: Vec<String>,
    /// Also leave out `.git`, `.gitattributes`, `.github`, `.gitignore`, as
    /// the reference tool does by default.
    pub ignore_git_paths: bool,
}

/// Hashes a directory as `ser` says: `(resource name, sha256 hex)`, sorted.
pub fn hash_dir(
    dir: &Path,
    ser: &Serialization,
    opts: &DirOptions,
) -> Result<Vec<(String, String)>, SignError> {
    let mut ignores: Vec<String> = ser
        .ignore_paths
        .iter()
        .chain(&opts.ignore_paths)
        .map(|p| p.trim_start_matches("./").trim_end_matches('/').to_owned())
        .collect();
    if opts.ignore_git_paths {
        ignores.extend(GIT_PATHS.iter().map(|s| (*s).to_owned()));
    }
    let ignored = |rel: &str| {
        ignores
            .iter()
            .any(|i| !i.is_empty() && (rel == i || rel.starts_with(&format!("{i}/"))))
    };
    let mut files = Vec::new();
    walk(dir, "", ser.allow_symlinks, &ignored, &mut files)?;
    files.sort();
    let mut out = Vec::new();
    for rel in files {
        let path = dir.join(&rel);
        match ser.shard_size {
            None => out.push((rel.clone(), hash_range(&path, 0, None)?.hex())),
            Some(shard) => {
                let size = std::fs::metadata(&path)
                    .map_err(|source| SignError::Read {
                        path: path.clone(),
                        source,
                    })?
                    .len();
                let mut start = 0;
                while start < size {
                    let end = (start + shard).min(size);
                    let d = hash_range(&path, start, Some(end - start))?;
                    out.push((format!("{rel}:{start}:{end}"), d.hex()));
                    start = end;
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

fn walk(
    dir: &Path,
    rel: &str,
    allow_symlinks: bool,
    ignored: &dyn Fn(&str) -> bool,
    out: &mut Vec<String>,
) -> Result<(), SignError> {
    let here = if rel.is_empty() {
        dir.to_owned()
    } else {
        dir.join(rel)
    };
    let entries = std::fs::read_dir(&here).map_err(|source| SignError::Read {
        path: here.clone(),
        source,
    })?;
    for entry in entries {
        let entry = entry.map_err(|source| SignError::Read {
            path: here.clone(),
            source,
        })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let child = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        if ignored(&child) {
            continue;
        }
        let path = entry.path();
        let lmeta = std::fs::symlink_metadata(&path).map_err(|source| SignError::Read {
            path: path.clone(),
            source,
        })?;
        if lmeta.file_type().is_symlink() && !allow_symlinks {
            return Err(SignError::Symlink { path });
        }
        let meta = std::fs::metadata(&path).map_err(|source| SignError::Read {
            path: path.clone(),
            source,
        })?;
        if meta.is_dir() {
            walk(dir, &child, allow_symlinks, ignored, out)?;
        } else if meta.is_file() {
            out.push(child);
        }
    }
    Ok(())
}

fn hash_range(path: &Path, start: u64, len: Option<u64>) -> Result<Digest, SignError> {
    use std::io::Seek;
    let rd = |source| SignError::Read {
        path: path.to_owned(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(rd)?;
    if start > 0 {
        f.seek(std::io::SeekFrom::Start(start)).map_err(rd)?;
    }
    let mut reader: Box<dyn Read> = match len {
        Some(n) => Box::new(f.take(n)),
        None => Box::new(f),
    };
    let mut h = Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf).map_err(rd)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finish())
}

/// Compares what a directory holds with what a statement signed.
pub fn compare(signed: &[(String, String)], actual: &[(String, String)]) -> Vec<FileProblem> {
    use std::collections::BTreeMap;
    let want: BTreeMap<&str, &str> = signed
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_str()))
        .collect();
    let have: BTreeMap<&str, &str> = actual
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_str()))
        .collect();
    let mut out = Vec::new();
    for (n, d) in &want {
        match have.get(n) {
            None => out.push(FileProblem::Missing {
                name: (*n).to_owned(),
            }),
            Some(h) if h != d => out.push(FileProblem::Changed {
                name: (*n).to_owned(),
            }),
            Some(_) => {}
        }
    }
    for n in have.keys() {
        if !want.contains_key(n) {
            out.push(FileProblem::Extra {
                name: (*n).to_owned(),
            });
        }
    }
    out
}

/// What a successful directory verification covered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DirVerification {
    pub statement: SignedStatement,
    pub key_hint: String,
    pub resources: usize,
}

/// Verifies a local directory against a model-signing bundle: signature,
/// statement, then every file.
pub fn verify_dir(
    dir: &Path,
    bundle_json: &[u8],
    key: &PublicKey,
    opts: &DirOptions,
) -> Result<DirVerification, SignError> {
    let payload = key.open_bundle(bundle_json)?;
    let statement = parse_statement(&payload)?;
    let actual = hash_dir(dir, &statement.serialization, opts)?;
    let problems = compare(&statement.resources, &actual);
    if !problems.is_empty() {
        return Err(SignError::Mismatch { problems });
    }
    Ok(DirVerification {
        resources: statement.resources.len(),
        key_hint: key.hint(),
        statement,
    })
}

/// The statement keel signs for a set of files: keel-store's manifest JSON
/// (resources with their sizes; a v1.0 verifier ignores the extras).
pub fn statement_for(manifest: &Manifest) -> Vec<u8> {
    manifest.to_json()
}

impl keel_error::HasKind for SignError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Read { .. } => K::Io,
            Self::BadKey { .. }
            | Self::WrongKeyType { .. }
            | Self::BadBundle { .. }
            | Self::BadStatement { .. } => K::Input,
            Self::Unsupported { .. } => K::Unavailable,
            Self::WrongKey { .. }
            | Self::BadSignature
            | Self::Mismatch { .. }
            | Self::Symlink { .. } => K::Failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pae_matches_the_dsse_spec() {
        assert_eq!(
            pae(b"hello"),
            b"DSSEv1 28 application/vnd.in-toto+json 5 hello".to_vec()
        );
    }

    #[test]
    fn sign_and_open_roundtrip_and_wrong_key() {
        let k = PrivateKey::generate();
        let other = PrivateKey::generate();
        let b = k.sign_statement(b"{\"x\":1}");
        assert_eq!(
            k.public_key().open_bundle(b.as_bytes()).expect("verify"),
            b"{\"x\":1}"
        );
        let e = other
            .public_key()
            .open_bundle(b.as_bytes())
            .expect_err("wrong key");
        assert!(matches!(e, SignError::WrongKey { .. }), "{e}");
        // Without the hint, the signature itself must fail.
        let mut v: serde_json::Value = serde_json::from_str(&b).expect("json");
        v["verificationMaterial"]["publicKey"]["hint"] = serde_json::Value::Null;
        let e = other
            .public_key()
            .open_bundle(v.to_string().as_bytes())
            .expect_err("wrong key");
        assert!(matches!(e, SignError::BadSignature), "{e}");
        // A changed payload fails.
        v["verificationMaterial"]["publicKey"]["hint"] = k.public_key().hint().into();
        v["dsseEnvelope"]["payload"] = b64().encode(b"{\"x\":2}").into();
        let e = k
            .public_key()
            .open_bundle(v.to_string().as_bytes())
            .expect_err("tampered");
        assert!(matches!(e, SignError::BadSignature), "{e}");
    }

    #[test]
    fn keys_roundtrip_through_pem() {
        let k = PrivateKey::generate();
        let pem = k.to_sec1_pem();
        assert!(pem.starts_with("-----BEGIN EC PRIVATE KEY-----\n"), "{pem}");
        let with_params = format!(
            "-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n{pem}"
        );
        let back = PrivateKey::from_pem(&with_params, Path::new("k")).expect("sec1");
        assert_eq!(back.public_key(), k.public_key());
        let pubpem = k.public_key().to_pem();
        assert!(pubpem.starts_with("-----BEGIN PUBLIC KEY-----\n"));
        assert_eq!(
            PublicKey::from_pem(&pubpem, Path::new("p")).expect("spki"),
            k.public_key()
        );
        let e = PublicKey::from_pem(&pem, Path::new("p")).expect_err("private as public");
        assert!(e.to_string().contains("private key"), "{e}");
        let e = PrivateKey::from_pem("hello", Path::new("k")).expect_err("garbage");
        assert!(e.to_string().contains("not a PEM"), "{e}");
    }

    #[test]
    fn statements_are_checked() {
        let m = Manifest::new(
            "m",
            vec![keel_store::FileEntry {
                name: "a".into(),
                size: 1,
                sha256: Digest::of(b"1"),
            }],
            Default::default(),
        )
        .expect("m");
        let s = parse_statement(&statement_for(&m)).expect("parse");
        assert_eq!(s.digest, m.subject_digest().hex());
        assert_eq!(s.resources, vec![("a".to_owned(), Digest::of(b"1").hex())]);
        let mut v: serde_json::Value = serde_json::from_slice(&m.to_json()).expect("json");
        v["predicate"]["serialization"]["hash_type"] = "blake3".into();
        let e = parse_statement(v.to_string().as_bytes()).expect_err("blake3");
        assert!(e.to_string().contains("blake3"), "{e}");
    }
}
