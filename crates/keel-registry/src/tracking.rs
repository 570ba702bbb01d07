//! Asking an MLflow tracking server which run logged a model.
//!
//! MLflow 3's `log_model(..., registered_model_name=...)` first records a
//! *logged model* in the tracking server, then asks the registry to create
//! a version with `source: models:/m-<id>` and `model_id`, but no
//! `run_id`: MLflow's own registry fills the run in from the tracking
//! store. keel is a registry only, so it asks the tracking server for the
//! logged model (`GET /api/2.0/mlflow/logged-models/{model_id}`, the
//! answer's `model.info.source_run_id`), over plain HTTP or HTTPS (the
//! system's trusted roots), within a fixed time.
//!
//! It sends no credentials: the tracking server must answer this read
//! without authentication.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// How long one question may take, connection included.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// The largest answer read.
const MAX_ANSWER: usize = 1 << 20;

/// Why a tracking server could not be used or did not answer.
#[derive(Debug, thiserror::Error)]
pub enum TrackingError {
    #[error("tracking server URL {url:?} must be http://HOST[:PORT][/PATH] or https://...")]
    BadUrl { url: String },
    #[error("cannot set up TLS for the tracking server: {reason}")]
    Tls { reason: String },
    #[error("logged model id {id:?} is not of letters, digits, '-', '_' and '.'")]
    BadModelId { id: String },
    #[error("cannot reach the tracking server at {url}")]
    Request {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("reading the tracking server's answer from {url} failed: {reason}")]
    Read { url: String, reason: String },
    #[error("the tracking server did not answer {url} within {} ms", TIMEOUT.as_millis())]
    Timeout { url: String },
    #[error("the tracking server does not know this logged model ({url} answered HTTP 404)")]
    UnknownModel { url: String },
    #[error("the tracking server answered {url} with HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("the tracking server's answer from {url} is not a logged model")]
    NotALoggedModel { url: String },
}

impl TrackingError {
    /// The error and its causes, `: `-separated, for a log line.
    pub fn chain(&self) -> String {
        keel_error::one_line(self)
    }
}

/// An MLflow tracking server, by its base URL.
#[derive(Clone)]
pub struct TrackingServer {
    /// `http(s)://host[:port][/prefix]`, without a trailing `/`.
    base: Arc<str>,
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl std::fmt::Debug for TrackingServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackingServer")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl TrackingServer {
    /// A client for the tracking server at `url` (`http://` or
    /// `https://`, with an optional path prefix; no query, no user).
    pub fn new(url: &str) -> Result<Self, TrackingError> {
        let bad = || TrackingError::BadUrl {
            url: crate::http::head(url, 200).to_owned(),
        };
        let base = url.trim_end_matches('/');
        let rest = base
            .strip_prefix("http://")
            .or_else(|| base.strip_prefix("https://"))
            .ok_or_else(bad)?;
        let host = rest.split('/').next().unwrap_or_default();
        if host.is_empty()
            || host.contains('@')
            || rest.contains(['?', '#'])
            || rest.chars().any(|c| c.is_whitespace() || c.is_control())
            || format!("{base}/").parse::<http::Uri>().is_err()
        {
            return Err(bad());
        }
        let mut roots = rustls::RootCertStore::empty();
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "could not read some of the system's trusted certificates");
        }
        roots.add_parsable_certificates(found.certs);
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TrackingError::Tls {
                reason: e.to_string(),
            })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(TIMEOUT));
        tcp.set_nodelay(true);
        // https:// URIs go through to hyper-rustls, which wraps them.
        tcp.enforce_http(false);
        let https = HttpsConnector::from((tcp, tls));
        let client = Client::builder(TokioExecutor::new()).build(https);
        Ok(Self {
            base: Arc::from(base),
            client,
        })
    }

    /// The base URL as configured (without a trailing `/`).
    pub fn url(&self) -> &str {
        &self.base
    }

    /// The run that logged model `model_id`: `Some(run id)`, or `None`
    /// when the tracking server knows the model but records no run.
    pub async fn source_run(&self, model_id: &str) -> Result<Option<String>, TrackingError> {
        if model_id.is_empty()
            || model_id.len() > 256
            || !model_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            || model_id.bytes().all(|b| b == b'.')
        {
            return Err(TrackingError::BadModelId {
                id: crate::http::head(model_id, 100).to_owned(),
            });
        }
        let url = format!("{}/api/2.0/mlflow/logged-models/{model_id}", self.base);
        let uri: http::Uri = url
            .parse()
            .map_err(|_| TrackingError::BadUrl { url: url.clone() })?;
        let ask = async {
            let req = http::Request::get(uri)
                .header(http::header::ACCEPT, "application/json")
                .body(Empty::new())
                .map_err(|e| TrackingError::Read {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|source| TrackingError::Request {
                    url: url.clone(),
                    source,
                })?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| TrackingError::Read {
                    url: url.clone(),
                    reason: e.to_string(),
                })?
                .to_bytes();
            Ok::<_, TrackingError>((status, body))
        };
        let (status, body) = tokio::time::timeout(TIMEOUT, ask)
            .await
            .map_err(|_| TrackingError::Timeout { url: url.clone() })??;
        if status == http::StatusCode::NOT_FOUND {
            return Err(TrackingError::UnknownModel { url });
        }
        if !status.is_success() {
            return Err(TrackingError::Status {
                url,
                status: status.as_u16(),
            });
        }
        source_run_of(&body).ok_or(TrackingError::NotALoggedModel { url })
    }
}

/// `model.info.source_run_id` of a `GetLoggedModel` answer: `None` when
/// the answer is not one, `Some(None)` when it names no run.
fn source_run_of(body: &[u8]) -> Option<Option<String>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let info = v.get("model")?.get("info")?;
    if !info.is_object() {
        return None;
    }
    Some(
        info.get("source_run_id")
            .and_then(|r| r.as_str())
            .filter(|r| !r.is_empty())
            .map(str::to_owned),
    )
}

/// The logged model a version's `source` names: `models:/m-<id>` (MLflow
/// 3's logged-model URI), not `models:/NAME/VERSION` or `@ALIAS`.
pub fn logged_model_of_source(source: &str) -> Option<&str> {
    let id = source.strip_prefix("models:/")?;
    (id.starts_with("m-") && !id.contains(['/', '@'])).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_http_or_https_without_credentials() {
        for ok in [
            "http://127.0.0.1:5000",
            "http://mlflow.internal:5000/",
            "https://mlflow.example.com/prefix",
        ] {
            assert!(TrackingServer::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "127.0.0.1:5000",
            "file:///tmp/mlruns",
            "http://",
            "http://user:pw@host:5000",
            "http://host:5000/?x=1",
            "http://ho st:5000",
        ] {
            let err = TrackingServer::new(bad).expect_err(bad);
            assert!(matches!(err, TrackingError::BadUrl { .. }), "{bad}: {err}");
        }
        let t = TrackingServer::new("http://h:1/p/").expect("url");
        assert_eq!(t.url(), "http://h:1/p");
    }

    #[test]
    fn the_run_is_read_from_the_logged_model() {
        let body = br#"{"model":{"info":{"model_id":"m-1","source_run_id":"abc","artifact_uri":"x"},"data":{}}}"#;
        assert_eq!(source_run_of(body), Some(Some("abc".into())));
        assert_eq!(
            source_run_of(br#"{"model":{"info":{"model_id":"m-1"}}}"#),
            Some(None)
        );
        assert_eq!(source_run_of(br#"{"error_code":"X"}"#), None);
        assert_eq!(source_run_of(b"<html>"), None);
    }

    #[test]
    fn logged_model_sources() {
        assert_eq!(logged_model_of_source("models:/m-0a1b"), Some("m-0a1b"));
        assert_eq!(logged_model_of_source("models:/m/1"), None);
        assert_eq!(logged_model_of_source("models:/m-x@prod"), None);
        assert_eq!(logged_model_of_source("runs:/r/model"), None);
    }

    #[tokio::test]
    async fn model_ids_that_are_not_path_safe_are_not_sent() {
        let t = TrackingServer::new("http://127.0.0.1:9").expect("url");
        for id in ["", "..", "a/b", "m-1?x", "m 1", &"m".repeat(300)] {
            let err = t.source_run(id).await.expect_err(id);
            assert!(
                matches!(err, TrackingError::BadModelId { .. }),
                "{id}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn a_server_that_is_down_is_an_error() {
        // A port that was free a moment ago: nothing listens on it.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let t = TrackingServer::new(&format!("http://127.0.0.1:{port}")).expect("url");
        let err = t.source_run("m-1").await.expect_err("down");
        assert!(matches!(err, TrackingError::Request { .. }), "{err}");
    }
}
