//! Deployments from the model registry: a gateway model may name a
//! registry model and two of its aliases, the stable one (`production`)
//! and optionally the candidate (`canary`), instead of fixed backend URLs.
//! The registry is the source of truth for which version is live; each
//! version names the backend serving it in its tag [`BACKEND_TAG`]
//! (`keel model register NAME ... --tag keel.backend=http://host:port`, or
//! MLflow's `set_model_version_tag` for a version registered already).
//!
//! [`RegistryClient::resolve`] reads the registry's HTTP API (keel's
//! `/api/v1` read routes) with an API key and turns the aliases into a
//! [`Routing`]. It refuses, with an error naming what to fix, a model the
//! registry does not have, an alias that is not set, a version that is not
//! READY, a version with no (or a malformed) backend tag, a backend not
//! in the model's `allowed_backends`, a version with no signature (or one
//! that does not sign this model, version and digest) when the model
//! requires signatures, and a key the registry does not accept. It never
//! falls back to anything it was not told.
//!
//! What routes traffic is the backend tag, which the registry can change
//! on a signed version: so a model that requires signatures also names
//! the backends its versions may be served from (`allowed_backends`, the
//! gateway's own configuration), and a signature must sign this model and
//! version (its statement's subject, `MODEL:VERSION` as `keel model sign`
//! writes it), not only the same files. The registry is reached over
//! `http://` or `https://` (the system's roots and an optional CA file;
//! its keys travel in cleartext over `http://`), and every answer is read
//! up to [`MAX_ANSWER_BYTES`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use thiserror::Error;

/// The version tag that names the backend serving a version.
pub const BACKEND_TAG: &str = "keel.backend";

/// How long one registry request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest registry answer read (a version with its file list and
/// signature bundle is some kilobytes; one with 100,000 files some
/// megabytes). A larger one is an error, read no further.
pub const MAX_ANSWER_BYTES: usize = 16 << 20;

#[derive(Debug, Error)]
pub enum RegistrySourceError {
    #[error("the registry at {url} cannot be reached")]
    Unreachable {
        url: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("the registry at {url} did not answer within {}s", REQUEST_TIMEOUT.as_secs())]
    Timeout { url: String },
    #[error("the registry refused the key (HTTP {status}): it needs a registry API key with read rights")]
    Unauthorized { status: u16 },
    #[error("the registry has no model {model:?}")]
    ModelNotFound { model: String },
    #[error("the registry refused the change (HTTP {status}): it needs a registry API key with write rights (registry.write_key_file)")]
    NoWriteRights { status: u16 },
    #[error("registry model {model:?} has no alias {alias:?} (set it with `keel model alias set {model} {alias} VERSION`)")]
    AliasNotFound { model: String, alias: String },
    #[error("registry model {model:?} version {version} (alias {alias:?}) is {status}, not READY")]
    NotReady {
        model: String,
        version: u64,
        alias: String,
        status: String,
    },
    #[error("registry model {model:?} version {version} (alias {alias:?}) names no backend: give it the tag {BACKEND_TAG}=http://host:port")]
    NoBackend {
        model: String,
        version: u64,
        alias: String,
    },
    #[error("registry model {model:?} version {version} (alias {alias:?}): backend {backend:?} is not one of the model's allowed_backends")]
    BackendNotAllowed {
        model: String,
        version: u64,
        alias: String,
        backend: String,
    },
    #[error("asked for registry model {model:?} version {version}, the registry answered {got}")]
    WrongVersion {
        model: String,
        version: u64,
        got: String,
    },
    #[error("the registry's answer to {path} is larger than {} MiB", MAX_ANSWER_BYTES >> 20)]
    TooLarge { path: String },
    #[error("registry TLS: {reason}")]
    Tls { reason: String },
    #[error("registry model {model:?} version {version}: tag {BACKEND_TAG} {value:?} is not an http:// or https:// URL")]
    BadBackend {
        model: String,
        version: u64,
        value: String,
    },
    #[error("registry model {model:?} version {version} (alias {alias:?}) is not signed and the gateway requires signatures for it")]
    Unsigned {
        model: String,
        version: u64,
        alias: String,
    },
    #[error("registry model {model:?} version {version} (alias {alias:?}): the signature does not verify: {reason}")]
    BadSignature {
        model: String,
        version: u64,
        alias: String,
        reason: String,
    },
    #[error("the registry answered {path} with HTTP {status}: {message}")]
    Status {
        path: String,
        status: u16,
        message: String,
    },
    #[error("the registry's answer to {path} is not what keel expects")]
    BadResponse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("registry url {url:?} must be http://host:port or https://host:port")]
    BadUrl { url: String },
}

/// Which registry model and aliases a gateway model follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    /// The model's name in the registry.
    pub model: String,
    /// The alias of the version that takes the traffic.
    pub stable_alias: String,
    /// The alias of a candidate version, if the model has one.
    pub canary_alias: Option<String>,
    /// Refuse versions with no signature.
    pub require_signature: bool,
    /// The backends this model's versions may name (URLs as the tag has
    /// them, without a trailing `/`); empty: any (only without
    /// `require_signature`, which the configuration enforces).
    pub allowed_backends: Vec<String>,
}

/// A version and the backend that serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionRoute {
    pub alias: String,
    pub version: u64,
    pub backend: String,
}

/// Where a model's traffic goes by the registry's aliases now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    pub stable: VersionRoute,
    /// `None` when the model has no canary alias configured or the alias
    /// is not set.
    pub canary: Option<VersionRoute>,
}

/// Checks a version's signature for models with `require_signature`:
/// the bundle (OpenSSF model signing) must sign version `version` of
/// registry model `model` (the statement's subject) and `digest`, the
/// version's manifest digest; `recorded_key_pem` is the key recorded at
/// signing. The implementation decides which key it trusts.
pub trait SignatureCheck: Send + Sync {
    fn check(
        &self,
        model: &str,
        version: u64,
        digest: Option<&str>,
        bundle: &str,
        recorded_key_pem: &str,
    ) -> Result<(), String>;
}

/// A reader of the registry's HTTP API with one API key.
#[derive(Clone)]
pub struct RegistryClient {
    base: String,
    authorization: http::HeaderValue,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    signatures: Option<std::sync::Arc<dyn SignatureCheck>>,
}

impl std::fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs.
        f.debug_struct("RegistryClient")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct ModelDoc {
    model: ModelBody,
}

#[derive(Deserialize)]
struct ModelBody {
    #[serde(default)]
    aliases: Vec<AliasBody>,
}

#[derive(Deserialize)]
struct AliasBody {
    alias: String,
    version: u64,
}

#[derive(Deserialize)]
struct VersionDoc {
    model_version: VersionBody,
    #[serde(default)]
    signature: Option<SignatureBody>,
}

#[derive(Deserialize)]
struct SignatureBody {
    bundle: String,
    public_key_pem: String,
}

#[derive(Deserialize)]
struct VersionBody {
    #[serde(default)]
    model: String,
    version: u64,
    status: String,
    #[serde(default)]
    tags: Vec<TagBody>,
    #[serde(default)]
    signed: bool,
    #[serde(default)]
    manifest_digest: Option<String>,
}

#[derive(Deserialize)]
struct TagBody {
    key: String,
    value: String,
}

#[derive(Deserialize)]
struct ErrorDoc {
    #[serde(default)]
    message: String,
}

impl RegistryClient {
    /// A client for the registry at `url` (`http://host:port`, or
    /// `https://host:port` trusting the system's roots) sending `key` as a
    /// bearer token.
    pub fn new(url: &str, key: &str) -> Result<Self, RegistrySourceError> {
        Self::with_ca(url, key, None)
    }

    /// [`RegistryClient::new`], an `https://` registry's certificate also
    /// checked against the CAs in the PEM file `ca_file`.
    pub fn with_ca(
        url: &str,
        key: &str,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, RegistrySourceError> {
        let base = url.trim_end_matches('/').to_owned();
        let scheme_len = if base.starts_with("http://") {
            "http://".len()
        } else if base.starts_with("https://") {
            "https://".len()
        } else {
            0
        };
        if scheme_len == 0 || base.len() <= scheme_len {
            return Err(RegistrySourceError::BadUrl { url: truncate(url) });
        }
        let mut authorization = http::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| RegistrySourceError::Unauthorized { status: 0 })?;
        authorization.set_sensitive(true);
        let tls_files =
            keel_gateway::UpstreamTlsFiles::read(&keel_gateway::config::UpstreamTlsConfig {
                system_roots: true,
                ca_file: ca_file.map(std::path::Path::to_owned),
                client_cert: None,
                client_key: None,
            })
            .map_err(|e| RegistrySourceError::Tls {
                reason: e.to_string(),
            })?;
        let (tls, _) = tls_files
            .client_config()
            .map_err(|e| RegistrySourceError::Tls {
                reason: e.to_string(),
            })?;
        let mut http = HttpConnector::new();
        // https:// URIs go through to hyper-rustls, which wraps them.
        http.enforce_http(false);
        http.set_connect_timeout(Some(REQUEST_TIMEOUT));
        let client = Client::builder(TokioExecutor::new()).build(HttpsConnector::from((http, tls)));
        Ok(RegistryClient {
            base,
            authorization,
            client,
            signatures: None,
        })
    }

    /// Verifies the signatures of versions of models that require them
    /// with `check` (without one, such versions only need to be signed).
    pub fn with_signature_check(mut self, check: std::sync::Arc<dyn SignatureCheck>) -> Self {
        self.signatures = Some(check);
        self
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    async fn get(&self, path_and_query: &str) -> Result<(u16, Bytes), RegistrySourceError> {
        self.send(http::Method::GET, path_and_query, Bytes::new())
            .await
    }

    async fn send(
        &self,
        method: http::Method,
        path_and_query: &str,
        body: Bytes,
    ) -> Result<(u16, Bytes), RegistrySourceError> {
        let uri = format!("{}{}", self.base, path_and_query);
        let req = http::Request::builder()
            .method(method)
            .uri(&uri)
            .header(http::header::AUTHORIZATION, self.authorization.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|_| RegistrySourceError::BadUrl {
                url: truncate(&self.base),
            })?;
        let unreachable =
            |e: Box<dyn std::error::Error + Send + Sync>| RegistrySourceError::Unreachable {
                url: self.base.clone(),
                source: e,
            };
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| unreachable(Box::new(e)))?;
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        RegistrySourceError::TooLarge {
                            path: path_and_query
                                .split('?')
                                .next()
                                .unwrap_or_default()
                                .to_owned(),
                        }
                    } else {
                        unreachable(e)
                    }
                })?
                .to_bytes();
            Ok((status, body))
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
            Ok(r) => r,
            Err(_) => Err(RegistrySourceError::Timeout {
                url: self.base.clone(),
            }),
        }
    }

    /// GETs a JSON document; `Ok(None)` for 404.
    async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        path_and_query: &str,
    ) -> Result<Option<T>, RegistrySourceError> {
        let (status, body) = self.get(path_and_query).await?;
        let path = path_and_query
            .split('?')
            .next()
            .unwrap_or_default()
            .to_owned();
        match status {
            200 => serde_json::from_slice(&body)
                .map(Some)
                .map_err(|source| RegistrySourceError::BadResponse { path, source }),
            401 | 403 => Err(RegistrySourceError::Unauthorized { status }),
            404 => Ok(None),
            _ => Err(RegistrySourceError::Status {
                path,
                status,
                message: truncate(
                    &serde_json::from_slice::<ErrorDoc>(&body)
                        .map(|e| e.message)
                        .unwrap_or_default(),
                ),
            }),
        }
    }

    /// Moves `alias` of `model` to `version`, with `reason` in the alias's
    /// history (a key with write rights).
    pub async fn set_alias(
        &self,
        model: &str,
        alias: &str,
        version: u64,
        reason: &str,
    ) -> Result<(), RegistrySourceError> {
        let body = serde_json::json!({"version": 1, "name": model, "alias": alias, "target": version, "reason": reason});
        self.post("/api/v1/aliases/set", body).await
    }

    /// Deletes `alias` of `model`, with `reason` in the alias's history (a
    /// key with write rights).
    pub async fn delete_alias(
        &self,
        model: &str,
        alias: &str,
        reason: &str,
    ) -> Result<(), RegistrySourceError> {
        let body =
            serde_json::json!({"version": 1, "name": model, "alias": alias, "reason": reason});
        self.post("/api/v1/aliases/delete", body).await
    }

    /// Whether this key may set `alias` of `model` to `version` and
    /// delete `alias2` (what a rollout's promotion and rollback do), asked
    /// with the registry's dry run: the registry checks the key's rights,
    /// the model, the version and the alias, and changes nothing.
    pub async fn may_change_aliases(
        &self,
        model: &str,
        set: (&str, u64),
        delete: &str,
    ) -> Result<(), RegistrySourceError> {
        let reason = "rollout start: may this key change the aliases";
        let body = serde_json::json!({"version": 1, "name": model, "alias": set.0, "target": set.1, "reason": reason, "dry_run": true});
        self.post("/api/v1/aliases/set", body).await?;
        let body = serde_json::json!({"version": 1, "name": model, "alias": delete, "reason": reason, "dry_run": true});
        self.post("/api/v1/aliases/delete", body).await
    }

    async fn post(&self, path: &str, body: serde_json::Value) -> Result<(), RegistrySourceError> {
        let (status, answer) = self
            .send(http::Method::POST, path, Bytes::from(body.to_string()))
            .await?;
        match status {
            200 => Ok(()),
            401 | 403 => Err(RegistrySourceError::NoWriteRights { status }),
            _ => Err(RegistrySourceError::Status {
                path: path.to_owned(),
                status,
                message: truncate(
                    &serde_json::from_slice::<ErrorDoc>(&answer)
                        .map(|e| e.message)
                        .unwrap_or_default(),
                ),
            }),
        }
    }

    /// The versions `src`'s aliases point at now, each with its backend.
    pub async fn resolve(&self, src: &ModelSource) -> Result<Routing, RegistrySourceError> {
        let name = encode(&src.model);
        let doc: ModelDoc = self
            .get_json(&format!("/api/v1/models/get?name={name}"))
            .await?
            .ok_or_else(|| RegistrySourceError::ModelNotFound {
                model: src.model.clone(),
            })?;
        let target = |alias: &str| {
            doc.model
                .aliases
                .iter()
                .find(|a| a.alias == alias)
                .map(|a| a.version)
        };
        let stable_version =
            target(&src.stable_alias).ok_or_else(|| RegistrySourceError::AliasNotFound {
                model: src.model.clone(),
                alias: src.stable_alias.clone(),
            })?;
        let stable = self
            .version_route(src, &src.stable_alias, stable_version)
            .await?;
        let canary = match src.canary_alias.as_deref() {
            Some(alias) => match target(alias) {
                Some(v) => Some(self.version_route(src, alias, v).await?),
                None => None,
            },
            None => None,
        };
        Ok(Routing { stable, canary })
    }

    /// `version` of `src`'s model with its backend, checked as an alias's
    /// version is (READY, signature when required, backend tag);
    /// `purpose` names what it is for in errors.
    pub async fn route_version(
        &self,
        src: &ModelSource,
        purpose: &str,
        version: u64,
    ) -> Result<VersionRoute, RegistrySourceError> {
        self.version_route(src, purpose, version).await
    }

    async fn version_route(
        &self,
        src: &ModelSource,
        alias: &str,
        version: u64,
    ) -> Result<VersionRoute, RegistrySourceError> {
        let name = encode(&src.model);
        let doc: VersionDoc = self
            .get_json(&format!(
                "/api/v1/versions/get?name={name}&version={version}"
            ))
            .await?
            .ok_or_else(|| RegistrySourceError::ModelNotFound {
                model: src.model.clone(),
            })?;
        let v = doc.model_version;
        let signature = doc.signature;
        if v.model != src.model || v.version != version {
            return Err(RegistrySourceError::WrongVersion {
                model: src.model.clone(),
                version,
                got: truncate(&format!("{}:{}", v.model, v.version)),
            });
        }
        if v.status != "READY" {
            return Err(RegistrySourceError::NotReady {
                model: src.model.clone(),
                version: v.version,
                alias: alias.to_owned(),
                status: truncate(&v.status),
            });
        }
        if src.require_signature {
            let Some(sig) = signature.filter(|_| v.signed) else {
                return Err(RegistrySourceError::Unsigned {
                    model: src.model.clone(),
                    version: v.version,
                    alias: alias.to_owned(),
                });
            };
            if let Some(check) = &self.signatures {
                check
                    .check(
                        &src.model,
                        v.version,
                        v.manifest_digest.as_deref(),
                        &sig.bundle,
                        &sig.public_key_pem,
                    )
                    .map_err(|reason| RegistrySourceError::BadSignature {
                        model: src.model.clone(),
                        version: v.version,
                        alias: alias.to_owned(),
                        reason: truncate(&reason),
                    })?;
            }
        }
        let backend = v
            .tags
            .iter()
            .find(|t| t.key == BACKEND_TAG)
            .map(|t| t.value.trim().to_owned())
            .ok_or_else(|| RegistrySourceError::NoBackend {
                model: src.model.clone(),
                version: v.version,
                alias: alias.to_owned(),
            })?;
        let valid = (backend.starts_with("http://") || backend.starts_with("https://"))
            && backend
                .parse::<http::Uri>()
                .is_ok_and(|u| u.host().is_some());
        if !valid {
            return Err(RegistrySourceError::BadBackend {
                model: src.model.clone(),
                version: v.version,
                value: truncate(&backend),
            });
        }
        // The registry names the backend; the gateway's configuration says
        // which ones may be named.
        if !src.allowed_backends.is_empty()
            && !src
                .allowed_backends
                .iter()
                .any(|a| a.trim_end_matches('/') == backend.trim_end_matches('/'))
        {
            return Err(RegistrySourceError::BackendNotAllowed {
                model: src.model.clone(),
                version: v.version,
                alias: alias.to_owned(),
                backend: truncate(&backend),
            });
        }
        Ok(VersionRoute {
            alias: alias.to_owned(),
            version: v.version,
            backend,
        })
    }
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Reflected input is cut to 200 characters.
fn truncate(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}
