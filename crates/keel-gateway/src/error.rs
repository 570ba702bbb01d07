//! The gateway's errors: setting it up (`GatewayError`), and answering a
//! request (`ApiError`, which becomes a JSON response and never carries
//! internals to the client).

use std::path::PathBuf;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

use crate::body::GwBody;

/// What went wrong loading configuration, keys or the audit log.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("failed to read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("malformed {what} in {path}: {reason}")]
    Malformed {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("no key with id {id}")]
    NoSuchKey { id: String },
    #[error("cannot fetch JWKS from {url}: {reason}")]
    Jwks { url: String, reason: String },
    #[error("redis at {url}: {reason}")]
    Redis { url: String, reason: String },
}

impl From<keel_fs::FsError> for GatewayError {
    fn from(e: keel_fs::FsError) -> Self {
        use keel_fs::FsError as F;
        match e {
            F::Read { path, source } => Self::Read { path, source },
            F::Write { path, source } | F::Lock { path, source } => Self::Write { path, source },
            F::NoFileName { path } => Self::Write {
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"),
            },
        }
    }
}

/// Why a request was refused or failed, as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI-style error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    pub message: String,
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            retry_after_s: None,
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or invalid credentials",
        )
    }
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }
    pub fn unavailable(message: impl Into<String>, retry_after_s: Option<u64>) -> Self {
        Self {
            retry_after_s,
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                message,
            )
        }
    }

    /// The response: `{"error": {"message", "type", "code"}}`, which OpenAI
    /// clients parse and whose `error` key OIP clients find too.
    pub fn into_response(self) -> Response<GwBody> {
        let body = serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "code": self.status.as_u16()}
        });
        let mut r = Response::new(GwBody::full(Bytes::from(body.to_string())));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}
