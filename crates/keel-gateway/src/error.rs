//! The gateway's errors: setting it up (`GatewayError`), and answering a
//! request (`ApiError`, which becomes a JSON response and never carries
//! internals to the client).

use std::borrow::Cow;
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

impl From<keel_gateway_config::ConfigError> for GatewayError {
    fn from(e: keel_gateway_config::ConfigError) -> Self {
        use keel_gateway_config::ConfigError as C;
        match e {
            C::Read { path, source } => Self::Read { path, source },
            C::Config(m) => Self::Config(m),
            C::Redis { url, reason } => Self::Redis { url, reason },
        }
    }
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

/// The most bytes of one value from a client (a model name, a header) that
/// an error, a log line or the audit log repeats.
pub const REFLECT_BYTES: usize = 256;

/// The most bytes of a whole message (which may hold several reflected
/// values) in an error body or an audit line's `error`.
pub const MESSAGE_BYTES: usize = 1024;

/// `s` as errors and logs repeat it: whole when it is at most `max` bytes,
/// else its first bytes up to `max` (at a character boundary), `…` and
/// its length. Every value a client sent passes through here before it is
/// written anywhere, so a huge value costs the logs a few hundred bytes.
pub fn truncated(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}… ({} bytes)", &s[..end], s.len()))
}

/// One client value, [`truncated`] to [`REFLECT_BYTES`].
pub fn reflect(s: &str) -> Cow<'_, str> {
    truncated(s, REFLECT_BYTES)
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
            "error": {"message": truncated(&self.message, MESSAGE_BYTES), "type": self.kind, "code": self.status.as_u16()}
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

impl keel_error::HasKind for GatewayError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Read { .. } | Self::Write { .. } => K::Io,
            Self::Config(_) | Self::NoSuchKey { .. } => K::Usage,
            Self::Malformed { .. } => K::Input,
            Self::Jwks { .. } | Self::Redis { .. } => K::Unavailable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reflected_values_are_truncated_at_a_character_boundary() {
        assert_eq!(reflect("chat"), "chat");
        let exact = "m".repeat(REFLECT_BYTES);
        assert_eq!(reflect(&exact), exact.as_str());
        let long = format!("{}é{}", "m".repeat(REFLECT_BYTES - 1), "x".repeat(4 << 20));
        let r = reflect(&long);
        assert_eq!(
            r,
            format!("{}… ({} bytes)", "m".repeat(REFLECT_BYTES - 1), long.len())
        );
        let e = ApiError::bad_request("y".repeat(1 << 20)).into_response();
        let n = http_body::Body::size_hint(e.body()).exact();
        assert!(n.is_some_and(|n| n < 2 * MESSAGE_BYTES as u64), "{n:?}");
    }
}
