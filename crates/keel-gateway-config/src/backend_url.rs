//! A backend's URL, parsed once: scheme, authority, path prefix, the
//! request URIs of the OpenAI routes and the `Host` header.

use http::{HeaderValue, Uri};

/// `http://host:port[/prefix]` or `https://host:port[/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendUrl {
    pub tls: bool,
    pub authority: String,
    pub prefix: String,
    /// The request URIs of the OpenAI routes, parsed once.
    openai: Vec<(&'static str, Uri)>,
    /// The `Host` header for this backend, made once.
    pub host: Option<HeaderValue>,
}

/// The paths every OpenAI-compatible request goes to.
const OPENAI_PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];

impl BackendUrl {
    pub fn parse(url: &str) -> Result<Self, String> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else {
            return Err("only http:// and https:// backends are supported".into());
        };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err("no host, or user info in the URL".into());
        }
        let mut url = Self {
            tls,
            authority: authority.to_owned(),
            prefix: prefix.to_owned(),
            openai: Vec::new(),
            host: HeaderValue::from_str(authority).ok(),
        };
        url.uri("/")
            .parse::<http::Uri>()
            .map_err(|e| e.to_string())?;
        for p in OPENAI_PATHS {
            let u = url.uri(p).parse::<Uri>().map_err(|e| e.to_string())?;
            url.openai.push((p, u));
        }
        Ok(url)
    }

    /// The URI of `path` on this backend.
    pub fn request_uri(&self, path: &str) -> Result<Uri, String> {
        if let Some((_, u)) = self.openai.iter().find(|(p, _)| *p == path) {
            return Ok(u.clone());
        }
        self.uri(path).parse::<Uri>().map_err(|e| e.to_string())
    }

    fn scheme(&self) -> &'static str {
        if self.tls {
            "https"
        } else {
            "http"
        }
    }

    pub fn uri(&self, path: &str) -> String {
        format!(
            "{}://{}{}{}",
            self.scheme(),
            self.authority,
            self.prefix,
            path
        )
    }

    /// The URL as configured, for labels and logs.
    pub fn label(&self) -> String {
        format!("{}://{}{}", self.scheme(), self.authority, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = BackendUrl::parse("http://127.0.0.1:8000/api/").expect("ok");
        assert_eq!(u.uri("/v1/models"), "http://127.0.0.1:8000/api/v1/models");
        assert!(!u.tls);
        let u = BackendUrl::parse("https://llm.internal:8443/v").expect("ok");
        assert!(u.tls);
        assert_eq!(u.uri("/health"), "https://llm.internal:8443/v/health");
        assert_eq!(u.label(), "https://llm.internal:8443/v");
        assert!(BackendUrl::parse("ftp://x").is_err());
        assert!(BackendUrl::parse("http://").is_err());
        assert!(BackendUrl::parse("https://").is_err());
        assert!(BackendUrl::parse("http://u:p@x").is_err());
        assert!(BackendUrl::parse("https://u:p@x").is_err());
    }
}
