//! Storage URLs: `file:///abs/path`, `az://container/prefix`,
//! `s3://bucket/prefix`, and `memory://prefix` (in-process, for tests).
//!
//! A URL never carries credentials: user info and query strings (where a
//! SAS token would go) are refused, and the refusal does not repeat them.

use std::fmt;
use std::path::PathBuf;

use crate::StoreError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A directory on a local (or shared) file system; absolute.
    File { path: PathBuf },
    /// An Azure Blob container and a prefix inside it (may be empty).
    Azure { container: String, prefix: String },
    /// An S3 bucket and a prefix inside it (may be empty).
    S3 { bucket: String, prefix: String },
    /// An in-memory store (`memory://prefix`): unit tests only.
    Memory { prefix: String },
}

/// The URL with anything after a `?`, and any user info, cut off: safe to
/// put into an error message.
fn safe_echo(input: &str) -> String {
    let mut s = input.split(['?', '#']).next().unwrap_or("").to_owned();
    if let Some((scheme, rest)) = s.split_once("://") {
        if let Some((_, host)) = rest.split_once('@') {
            s = format!("{scheme}://***@{host}");
        }
    }
    if s.len() < input.len() {
        s.push_str("...");
    }
    s
}

fn clean_prefix(url: &str, p: &str) -> Result<String, StoreError> {
    let p = p.trim_matches('/');
    for part in p.split('/').filter(|s| !s.is_empty()) {
        if part == "." || part == ".." {
            return Err(StoreError::BadUrl {
                url: safe_echo(url),
                reason: "`.` and `..` are not allowed in a prefix".into(),
            });
        }
    }
    if p.split('/').any(str::is_empty) && !p.is_empty() {
        return Err(StoreError::BadUrl {
            url: safe_echo(url),
            reason: "empty path segment (`//`) in the prefix".into(),
        });
    }
    Ok(p.to_owned())
}

impl StoreUrl {
    pub fn parse(input: &str) -> Result<Self, StoreError> {
        let bad = |reason: &str| StoreError::BadUrl {
            url: safe_echo(input),
            reason: reason.to_owned(),
        };
        if input.contains('?') || input.contains('#') {
            return Err(bad(
                "query strings are not accepted (pass a SAS token in AZURE_STORAGE_SAS_TOKEN)",
            ));
        }
        let (scheme, rest) = input.split_once("://").ok_or_else(|| {
            bad("expected file:///path, az://container/prefix or s3://bucket/prefix")
        })?;
        match scheme {
            "file" => {
                if !rest.starts_with('/') {
                    return Err(bad("a file URL needs an absolute path: file:///path"));
                }
                let path = rest.trim_end_matches('/');
                let path = if path.is_empty() { "/" } else { path };
                if path.split('/').any(|s| s == "..") {
                    return Err(bad("`..` is not allowed in the path"));
                }
                Ok(Self::File {
                    path: PathBuf::from(path),
                })
            }
            "az" | "azure" | "s3" => {
                if rest.contains('@') {
                    return Err(bad("credentials do not belong in the URL"));
                }
                let (head, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                let prefix = clean_prefix(input, prefix)?;
                if scheme == "s3" {
                    let ok = (3..=63).contains(&head.len())
                        && head.bytes().all(|b| {
                            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                        });
                    if !ok {
                        return Err(bad(
                            "bucket names are 3-63 lowercase letters, digits, `-` and `.`",
                        ));
                    }
                    Ok(Self::S3 {
                        bucket: head.to_owned(),
                        prefix,
                    })
                } else {
                    let ok = (3..=63).contains(&head.len())
                        && head
                            .bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                        && !head.starts_with('-')
                        && !head.ends_with('-')
                        && !head.contains("--");
                    if !ok {
                        return Err(bad(
                            "container names are 3-63 lowercase letters, digits and single `-`",
                        ));
                    }
                    Ok(Self::Azure {
                        container: head.to_owned(),
                        prefix,
                    })
                }
            }
            "memory" => Ok(Self::Memory {
                prefix: clean_prefix(input, rest)?,
            }),
            _ => Err(bad("unknown scheme: expected file://, az:// or s3://")),
        }
    }

    /// The key prefix inside the bucket or container (`""` for file URLs,
    /// whose path is the store's root).
    pub fn prefix(&self) -> &str {
        match self {
            Self::File { .. } => "",
            Self::Azure { prefix, .. } | Self::S3 { prefix, .. } | Self::Memory { prefix } => {
                prefix
            }
        }
    }

    pub fn scheme(&self) -> &'static str {
        match self {
            Self::File { .. } => "file",
            Self::Azure { .. } => "az",
            Self::S3 { .. } => "s3",
            Self::Memory { .. } => "memory",
        }
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let join = |head: &str, prefix: &str| {
            if prefix.is_empty() {
                head.to_owned()
            } else {
                format!("{head}/{prefix}")
            }
        };
        match self {
            Self::File { path } => write!(f, "file://{}", path.display()),
            Self::Azure { container, prefix } => write!(f, "az://{}", join(container, prefix)),
            Self::S3 { bucket, prefix } => write!(f, "s3://{}", join(bucket, prefix)),
            Self::Memory { prefix } => write!(f, "memory://{prefix}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(input: &str, expected: StoreUrl, shown: &str) {
        let u = StoreUrl::parse(input).unwrap_or_else(|e| panic!("{input}: {e}"));
        assert_eq!(u, expected, "{input}");
        assert_eq!(u.to_string(), shown, "{input}");
    }

    fn bad(input: &str, reason: &str) {
        let e = StoreUrl::parse(input).expect_err(input).to_string();
        assert!(e.contains(reason), "{input}: {e}");
    }

    #[test]
    fn parses_each_scheme() {
        ok(
            "file:///data/ckpt/",
            StoreUrl::File {
                path: "/data/ckpt".into(),
            },
            "file:///data/ckpt",
        );
        ok(
            "az://ckpts/team/a",
            StoreUrl::Azure {
                container: "ckpts".into(),
                prefix: "team/a".into(),
            },
            "az://ckpts/team/a",
        );
        ok(
            "az://ckpts",
            StoreUrl::Azure {
                container: "ckpts".into(),
                prefix: "".into(),
            },
            "az://ckpts",
        );
        ok(
            "s3://my-bucket.x/p/",
            StoreUrl::S3 {
                bucket: "my-bucket.x".into(),
                prefix: "p".into(),
            },
            "s3://my-bucket.x/p",
        );
        ok(
            "memory://t",
            StoreUrl::Memory { prefix: "t".into() },
            "memory://t",
        );
    }

    #[test]
    fn refuses_bad_urls_without_echoing_secrets() {
        bad("/data/ckpt", "expected file:///path");
        bad("file://data", "absolute path");
        bad("file:///data/../etc", "`..`");
        bad("gs://bucket/x", "unknown scheme");
        bad("az://Upper/x", "container names");
        bad("az://ab/x", "container names");
        bad("az://a--b/x", "container names");
        bad("s3://B/x", "bucket names");
        bad("az://c1c/a//b", "empty path segment");
        bad("az://c1c/a/../b", "`..`");
        let e = StoreUrl::parse("az://ckpts/x?sig=SECRETSIG&sv=1")
            .expect_err("query")
            .to_string();
        assert!(!e.contains("SECRETSIG"), "{e}");
        assert!(e.contains("query strings"), "{e}");
        let e = StoreUrl::parse("s3://AKIA:SECRETKEY@bucket/x")
            .expect_err("userinfo")
            .to_string();
        assert!(!e.contains("SECRETKEY"), "{e}");
    }
}
