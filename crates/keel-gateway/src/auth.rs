//! Who is calling: API keys (`Authorization: Bearer` or `api-key`) looked
//! up by SHA-256 in the key ring, or JWTs checked against a JWKS (issuer,
//! audience, expiry by the injected clock) with roles from a claim. And
//! what they may do: roles map to models and operations (RBAC).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::{Arc, RwLock};

use http::HeaderMap;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use crate::clock::Clock;
use crate::config::{JwtConfig, RoleConfig};
use crate::error::GatewayError;

/// An authenticated caller. Cloning shares the strings (a request takes
/// its key's identity without copying it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The key id (`key_...`) or `jwt:<sub>`; never a secret.
    pub id: Arc<str>,
    pub team: Option<Arc<str>>,
    pub roles: Arc<[String]>,
    /// The names of its limit counters, `key:<id>` and `team:<team>`.
    pub key_scope: Arc<str>,
    pub team_scope: Option<Arc<str>>,
}

impl Identity {
    pub fn new(id: Arc<str>, team: Option<Arc<str>>, roles: Arc<[String]>) -> Self {
        Self {
            key_scope: Arc::from(format!("key:{id}")),
            team_scope: team.as_ref().map(|t| Arc::from(format!("team:{t}"))),
            id,
            team,
            roles,
        }
    }
}

/// The credential a request carries, if any.
pub fn credential(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer ") {
            return Some(v[7..].trim());
        }
        return None;
    }
    headers
        .get("api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// Whether a token looks like a JWT (three base64url parts).
pub fn looks_like_jwt(t: &str) -> bool {
    let mut parts = 0;
    t.split('.').all(|p| {
        parts += 1;
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    }) && parts == 3
}

/// Validates JWTs against a key set.
#[derive(Debug)]
pub struct JwtVerifier {
    cfg: JwtConfig,
    keys: RwLock<Arc<JwkSet>>,
    clock: Arc<dyn Clock>,
}

pub fn parse_jwks(text: &str, source: &str) -> Result<JwkSet, GatewayError> {
    serde_json::from_str(text).map_err(|e| GatewayError::Jwks {
        url: source.to_owned(),
        reason: format!("not a JWKS: {e}"),
    })
}

impl JwtVerifier {
    pub fn new(cfg: JwtConfig, keys: JwkSet, clock: Arc<dyn Clock>) -> Self {
        Self {
            cfg,
            keys: RwLock::new(Arc::new(keys)),
            clock,
        }
    }

    pub fn config(&self) -> &JwtConfig {
        &self.cfg
    }

    pub fn set_keys(&self, keys: JwkSet) {
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
    }

    pub fn load_file(path: &Path) -> Result<JwkSet, GatewayError> {
        let text =
            keel_fs::read_regular_to_string(path, keel_fs::MAX_CONFIG_BYTES).map_err(|source| {
                GatewayError::Read {
                    path: path.to_owned(),
                    source,
                }
            })?;
        parse_jwks(&text, &path.display().to_string())
    }

    /// The identity a valid token carries, or why it is not valid.
    pub fn verify(&self, token: &str) -> Result<Identity, String> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| e.to_string())?;
        let alg = header.alg;
        if matches!(alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512) {
            return Err("symmetric algorithms are not accepted".into());
        }
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner()).clone();
        let jwk = match &header.kid {
            Some(kid) => keys.find(kid).ok_or("unknown key id")?,
            None if keys.keys.len() == 1 => &keys.keys[0],
            None => return Err("no key id and several keys".into()),
        };
        // A key that names its algorithm verifies that algorithm only: an
        // RS256 key must not accept a PS256 (or any other) signature.
        if let Some(ka) = &jwk.common.key_algorithm {
            if format!("{ka:?}") != format!("{alg:?}") {
                return Err(format!(
                    "the token's alg {alg:?} is not its key's alg {ka:?}"
                ));
            }
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|e| e.to_string())?;
        let mut v = Validation::new(alg);
        v.validate_exp = false; // checked below with the injected clock
        v.validate_nbf = false;
        v.set_issuer(&[&self.cfg.issuer]);
        v.set_audience(&[&self.cfg.audience]);
        v.required_spec_claims = ["exp", "iss", "aud", "sub"]
            .iter()
            .map(|s| s.to_string())
            .collect::<HashSet<_>>();
        let data = jsonwebtoken::decode::<Value>(token, &key, &v).map_err(|e| e.to_string())?;
        let c = data.claims;
        let now = (self.clock.now_ms() / 1000) as i64;
        let leeway = self.cfg.leeway_s as i64;
        let exp = c
            .get("exp")
            .and_then(Value::as_i64)
            .ok_or("exp is not a number")?;
        if now > exp + leeway {
            return Err("expired".into());
        }
        if let Some(nbf) = c.get("nbf").and_then(Value::as_i64) {
            if now + leeway < nbf {
                return Err("not valid yet".into());
            }
        }
        let sub = c
            .get("sub")
            .and_then(Value::as_str)
            .ok_or("sub is not a string")?;
        let roles = match c.get(&self.cfg.roles_claim) {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            Some(Value::String(s)) => s.split_whitespace().map(str::to_owned).collect(),
            _ => Vec::new(),
        };
        let team = c
            .get(&self.cfg.team_claim)
            .and_then(Value::as_str)
            .map(Arc::from);
        Ok(Identity::new(
            Arc::from(format!("jwt:{sub}")),
            team,
            Arc::from(roles),
        ))
    }
}

/// Roles and what they allow.
#[derive(Debug, Clone, Default)]
pub struct Rbac {
    roles: BTreeMap<String, RoleConfig>,
}

impl Rbac {
    pub fn new(roles: BTreeMap<String, RoleConfig>) -> Self {
        Self { roles }
    }

    /// Whether any of `roles` allows `op` on `model` (`None`: the operation
    /// itself, as for listing models).
    pub fn allows(&self, roles: &[String], op: &str, model: Option<&str>) -> bool {
        roles.iter().filter_map(|r| self.roles.get(r)).any(|r| {
            r.operations.iter().any(|o| o == "*" || o == op)
                && model.is_none_or(|m| r.models.iter().any(|x| x == "*" || x == m))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials() {
        let mut h = HeaderMap::new();
        assert_eq!(credential(&h), None);
        h.insert("api-key", "abc".parse().expect("hv"));
        assert_eq!(credential(&h), Some("abc"));
        h.insert("authorization", "Bearer xyz".parse().expect("hv"));
        assert_eq!(credential(&h), Some("xyz"));
        h.insert("authorization", "Basic xyz".parse().expect("hv"));
        assert_eq!(
            credential(&h),
            None,
            "a non-bearer Authorization is not a key"
        );
        assert!(looks_like_jwt("a.b.c"));
        assert!(!looks_like_jwt("sk-keel-abc"));
        for t in [
            "", "a.b", "a.b.c.d", "a..c", ".b.c", "a.b.", "a.b.c=", "a.b c.d",
        ] {
            assert!(!looks_like_jwt(t), "{t:?}");
        }
        assert!(looks_like_jwt("eyJ-_0.x_Y.Z-9"));
    }

    #[test]
    fn rbac() {
        let mut roles = BTreeMap::new();
        roles.insert(
            "user".into(),
            RoleConfig {
                models: vec!["chat".into()],
                operations: vec!["chat".into(), "models".into()],
            },
        );
        roles.insert(
            "ops".into(),
            RoleConfig {
                models: vec!["*".into()],
                operations: vec!["*".into()],
            },
        );
        let r = Rbac::new(roles);
        let user = vec!["user".to_owned()];
        assert!(r.allows(&user, "chat", Some("chat")));
        assert!(!r.allows(&user, "chat", Some("big")));
        assert!(!r.allows(&user, "embeddings", Some("chat")));
        assert!(r.allows(&user, "models", None));
        assert!(r.allows(&["ops".to_owned()], "infer", Some("x")));
        assert!(!r.allows(&["nobody".to_owned()], "chat", Some("chat")));
    }
}
