//! API keys: a JSON file of key records holding only SHA-256 hashes of the
//! secrets (`keel serve keys create|ls|revoke` edit it), and the `KeyRing`
//! that answers "whose secret is this?" and notices a changed file on the
//! very next request, so a revocation takes effect immediately.
//!
//! Secrets are random bytes handed in by the caller (the library does not
//! read the system's randomness or clock).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::auth::Identity;
use crate::error::GatewayError;

/// The key file's format version.
pub const KEY_FILE_VERSION: u32 = 1;
/// Every secret starts with this, so leaked ones are easy to find.
pub const SECRET_PREFIX: &str = "sk-keel-";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyFile {
    pub version: u32,
    pub keys: Vec<KeyRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    /// Hex SHA-256 of the secret.
    pub sha256: String,
    pub roles: Vec<String>,
    pub team: Option<String>,
    pub created_ms: u64,
    pub revoked_ms: Option<u64>,
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

pub fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[(b >> 4) as usize] as char);
        s.push(D[(b & 15) as usize] as char);
    }
    s
}

/// 64 hex digits (either case) as 32 bytes.
fn unhex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = nibble(b[2 * i])? << 4 | nibble(b[2 * i + 1])?;
    }
    Some(out)
}

/// What a new key needs.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub name: String,
    pub roles: Vec<String>,
    pub team: Option<String>,
}

impl KeyFile {
    /// Reads the file; a missing file is an empty key set.
    pub fn load(path: &Path) -> Result<Self, GatewayError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self {
                    version: KEY_FILE_VERSION,
                    keys: Vec::new(),
                })
            }
            Err(source) => {
                return Err(GatewayError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let f: KeyFile = serde_json::from_str(&text).map_err(|e| GatewayError::Malformed {
            what: "key file",
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        if f.version != KEY_FILE_VERSION {
            return Err(GatewayError::Malformed {
                what: "key file",
                path: path.to_owned(),
                reason: format!("version {} (this keel reads {KEY_FILE_VERSION})", f.version),
            });
        }
        Ok(f)
    }

    /// Writes the file atomically (a sibling temporary file renamed over it),
    /// readable by its owner only.
    pub fn store(&self, path: &Path) -> Result<(), GatewayError> {
        let werr = |source| GatewayError::Write {
            path: path.to_owned(),
            source,
        };
        let tmp = path.with_extension("json.tmp");
        let mut text = serde_json::to_string_pretty(self).expect("key file serialises");
        text.push('\n');
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(werr)?;
            f.write_all(text.as_bytes()).map_err(werr)?;
            f.sync_all().map_err(werr)?;
        }
        std::fs::rename(&tmp, path).map_err(werr)
    }

    /// Adds a key made from 32 random bytes; returns its record and the
    /// secret, which is shown once and stored nowhere.
    pub fn create(&mut self, new: NewKey, random: [u8; 32], now_ms: u64) -> (KeyRecord, String) {
        let id = format!("key_{}", hex(&random[..5]));
        let secret = format!("{SECRET_PREFIX}{}", hex(&random[5..]));
        let rec = KeyRecord {
            id,
            name: new.name,
            sha256: sha256_hex(secret.as_bytes()),
            roles: new.roles,
            team: new.team,
            created_ms: now_ms,
            revoked_ms: None,
        };
        self.keys.push(rec.clone());
        (rec, secret)
    }

    /// Marks a key revoked (it stays listed, with when).
    pub fn revoke(&mut self, id: &str, now_ms: u64) -> Result<&KeyRecord, GatewayError> {
        let k = self
            .keys
            .iter_mut()
            .find(|k| k.id == id)
            .ok_or_else(|| GatewayError::NoSuchKey { id: id.to_owned() })?;
        if k.revoked_ms.is_none() {
            k.revoked_ms = Some(now_ms);
        }
        Ok(k)
    }
}

type Stamp = Option<(u64, i64, i64, u64)>;

/// Live keys by the SHA-256 of their secret.
pub type KeyMap = HashMap<[u8; 32], Identity>;

/// The live key set, re-read whenever the file changes.
#[derive(Debug)]
pub struct KeyRing {
    path: PathBuf,
    state: RwLock<(Stamp, Arc<KeyMap>)>,
}

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.mtime(), m.mtime_nsec(), m.len()))
}

impl KeyRing {
    pub fn open(path: &Path) -> Result<Self, GatewayError> {
        let st = stamp(path);
        let map = Self::read(path)?;
        Ok(Self {
            path: path.to_owned(),
            state: RwLock::new((st, Arc::new(map))),
        })
    }

    fn read(path: &Path) -> Result<KeyMap, GatewayError> {
        let f = KeyFile::load(path)?;
        Ok(f.keys
            .into_iter()
            .filter(|k| k.revoked_ms.is_none())
            // A digest that is not 64 hex digits matches no secret.
            .filter_map(|k| Some((unhex32(&k.sha256)?, k)))
            .map(|(digest, k)| {
                (
                    digest,
                    Identity {
                        id: Arc::from(k.id),
                        roles: Arc::from(k.roles),
                        team: k.team.map(Arc::from),
                    },
                )
            })
            .collect())
    }

    /// The keys as of now: the file is checked (one `stat`) on every call
    /// and re-read when it changed. A file that cannot be read or parsed
    /// after a change leaves no key valid (fail closed) until it is fixed.
    pub fn current(&self) -> Result<Arc<KeyMap>, GatewayError> {
        let st = stamp(&self.path);
        {
            let g = self.state.read().unwrap_or_else(|p| p.into_inner());
            if g.0 == st {
                return Ok(g.1.clone());
            }
        }
        let mut g = self.state.write().unwrap_or_else(|p| p.into_inner());
        match Self::read(&self.path) {
            Ok(map) => {
                *g = (st, Arc::new(map));
                Ok(g.1.clone())
            }
            Err(e) => {
                *g = (None, Arc::new(HashMap::new()));
                Err(e)
            }
        }
    }

    /// The live key whose secret this is.
    pub fn lookup(&self, secret: &str) -> Result<Option<Identity>, GatewayError> {
        let map = self.current()?;
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        Ok(map.get(&digest).cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_lookup_revoke() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keys.json");
        let mut f = KeyFile::load(&path).expect("empty");
        let (rec, secret) = f.create(
            NewKey {
                name: "alice".into(),
                roles: vec!["user".into()],
                team: Some("ml".into()),
            },
            [7; 32],
            1000,
        );
        assert!(secret.starts_with(SECRET_PREFIX));
        assert!(!serde_json::to_string(&f).expect("json").contains(&secret));
        f.store(&path).expect("store");
        let ring = KeyRing::open(&path).expect("ring");
        let k = ring.lookup(&secret).expect("ok").expect("found");
        assert_eq!(&*k.id, rec.id.as_str());
        assert!(ring.lookup("sk-keel-wrong").expect("ok").is_none());

        let mut f = KeyFile::load(&path).expect("load");
        f.revoke(&rec.id, 2000).expect("revoke");
        f.store(&path).expect("store");
        assert!(
            ring.lookup(&secret).expect("ok").is_none(),
            "revoked at once"
        );
        assert!(matches!(
            f.revoke("key_nope", 1),
            Err(GatewayError::NoSuchKey { .. })
        ));

        std::fs::write(&path, "not json").expect("write");
        assert!(ring.lookup(&secret).is_err());
    }

    #[test]
    fn digests_in_either_case_match_and_malformed_ones_match_nothing() {
        let d = sha256_hex(b"s");
        assert_eq!(unhex32(&d), unhex32(&d.to_ascii_uppercase()));
        assert_eq!(unhex32(&d).map(|b| hex(&b)), Some(d.clone()), "round trip");
        assert_eq!(unhex32(&d[..63]), None);
        assert_eq!(unhex32(&format!("{}g", &d[..63])), None);
        assert_eq!(unhex32(&format!("{d}00")), None);
    }
}
