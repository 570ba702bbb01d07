//! A [`Store`]: one object_store backend, rooted at a URL's prefix, with
//! backend errors redacted and classified.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::error::BackendErrorKind;
use crate::{StoreError, StoreUrl};

/// How to open a store. Credentials come in as data: the binary passes the
/// process's `AZURE_*` and `AWS_*` variables in `env`.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// `(name, value)` pairs: `AZURE_STORAGE_ACCOUNT_NAME`,
    /// `AZURE_STORAGE_ACCOUNT_KEY`, `AZURE_STORAGE_SAS_TOKEN`,
    /// `AZURE_STORAGE_CONNECTION_STRING`, `AZURE_STORAGE_USE_EMULATOR`,
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`,
    /// `AWS_REGION`, `AWS_ALLOW_HTTP`... Others are ignored.
    pub env: Vec<(String, String)>,
    /// How long one request may keep retrying (object_store's backoff).
    pub retry_timeout: Duration,
    /// Retries of one request.
    pub max_retries: usize,
    /// Create a `file://` root directory that does not exist (for writers;
    /// readers get an error instead).
    pub create_root: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            env: Vec::new(),
            retry_timeout: Duration::from_secs(120),
            max_retries: 10,
            create_root: false,
        }
    }
}

/// Which kind of backend a store is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    File,
    Azure,
    S3,
    Memory,
}

/// An object as listed or stat'ed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The key relative to the store's root.
    pub key: String,
    pub size: u64,
    /// Seconds since the Unix epoch, as the backend reports it.
    pub modified_unix: i64,
}

/// Whether a create-if-absent put created the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateOutcome {
    Created,
    AlreadyExists,
}

/// Classifies HTTP answers that object_store leaves generic (Azure's 403 on
/// a list) and shortens the XML body a service sends to its error code.
fn refine(kind: BackendErrorKind, message: &str) -> (BackendErrorKind, String) {
    let code = message
        .split("<Code>")
        .nth(1)
        .and_then(|r| r.split("</Code>").next())
        .map(str::to_owned);
    let first = message.lines().next().unwrap_or("").trim_end_matches(':');
    let first = match first.find(": <?xml") {
        Some(i) => &first[..i],
        None => first,
    };
    let short = match &code {
        Some(c) => format!("{first} ({c})"),
        None => first.to_owned(),
    };
    let auth_codes = [
        "AuthorizationFailure",
        "AuthenticationFailed",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "AuthorizationPermissionMismatch",
    ];
    let kind = if kind != BackendErrorKind::Other {
        kind
    } else if message.contains("401 Unauthorized") {
        BackendErrorKind::Unauthenticated
    } else if message.contains("403 Forbidden")
        || code.as_deref().is_some_and(|c| auth_codes.contains(&c))
    {
        BackendErrorKind::PermissionDenied
    } else if code.as_deref() == Some("ContainerNotFound")
        || code.as_deref() == Some("NoSuchBucket")
    {
        BackendErrorKind::NotFound
    } else {
        kind
    };
    (kind, short)
}

/// Replaces secret values in messages.
#[derive(Debug, Default)]
pub(crate) struct Redactor {
    secrets: Vec<String>,
}

impl Redactor {
    pub(crate) fn redact(&self, s: &str) -> String {
        let mut out = s.to_owned();
        for secret in &self.secrets {
            if !secret.is_empty() {
                out = out.replace(secret.as_str(), "***");
            }
        }
        out
    }
}

/// One storage location: a backend and a key prefix.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    url: StoreUrl,
    root: String,
    backend: Backend,
    redactor: Arc<Redactor>,
}

fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    [
        "KEY",
        "SECRET",
        "TOKEN",
        "SAS",
        "CONNECTION_STRING",
        "PASSWORD",
        "SIGNATURE",
    ]
    .iter()
    .any(|w| n.contains(w))
        && !n.ends_with("_KEY_ID")
}

/// `AZURE_STORAGE_CONNECTION_STRING`'s `Key=Value;` pairs.
fn connection_string(s: &str) -> Vec<(String, String)> {
    s.split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

impl Store {
    /// Opens the store a URL names. Builds the client only: nothing is sent
    /// until the first request, so wrong credentials show on first use.
    pub fn open(url: &StoreUrl, opts: &StoreOptions) -> Result<Self, StoreError> {
        let mut redactor = Redactor::default();
        for (k, v) in &opts.env {
            if is_secret_name(k) {
                redactor.secrets.push(v.clone());
                if k == "AZURE_STORAGE_CONNECTION_STRING" {
                    for (ck, cv) in connection_string(v) {
                        if is_secret_name(&ck) {
                            redactor.secrets.push(cv);
                        }
                    }
                }
            }
        }
        // Longest first, so a secret containing another is replaced whole.
        redactor.secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        let redactor = Arc::new(redactor);
        let open_err = |e: object_store::Error| StoreError::Open {
            url: url.to_string(),
            message: redactor.redact(&e.to_string()),
        };
        let retry = object_store::RetryConfig {
            max_retries: opts.max_retries,
            retry_timeout: opts.retry_timeout,
            ..Default::default()
        };
        let (inner, backend): (Arc<dyn ObjectStore>, Backend) = match url {
            StoreUrl::File { path } => {
                if opts.create_root {
                    std::fs::create_dir_all(path).map_err(|source| StoreError::LocalWrite {
                        path: path.clone(),
                        source,
                    })?;
                } else if !path.is_dir() {
                    return Err(StoreError::Open {
                        url: url.to_string(),
                        message: "no such directory".into(),
                    });
                }
                // fsync: a manifest must not reach the disk before the data
                // it names, or a machine crash could leave a committed
                // checkpoint with missing data.
                let fs = object_store::local::LocalFileSystem::new_with_prefix(path)
                    .map_err(open_err)?
                    .with_automatic_cleanup(true)
                    .with_fsync(true);
                (Arc::new(fs), Backend::File)
            }
            StoreUrl::Memory { .. } => (
                Arc::new(object_store::memory::InMemory::new()),
                Backend::Memory,
            ),
            StoreUrl::Azure { container, .. } => {
                use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
                let mut b = MicrosoftAzureBuilder::new()
                    .with_container_name(container)
                    .with_retry(retry);
                for (k, v) in &opts.env {
                    if k == "AZURE_STORAGE_CONNECTION_STRING" {
                        for (ck, cv) in connection_string(v) {
                            b = match ck.as_str() {
                                "AccountName" => b.with_account(cv),
                                "AccountKey" => b.with_access_key(cv),
                                "SharedAccessSignature" => {
                                    b.with_config(AzureConfigKey::SasKey, cv)
                                }
                                "UseDevelopmentStorage" if cv.eq_ignore_ascii_case("true") => {
                                    b.with_use_emulator(true)
                                }
                                "BlobEndpoint" => {
                                    let local = cv.starts_with("http://127.0.0.1")
                                        || cv.starts_with("http://localhost");
                                    if local {
                                        b.with_use_emulator(true)
                                    } else {
                                        b.with_endpoint(cv)
                                    }
                                }
                                _ => b,
                            };
                        }
                    } else if k.starts_with("AZURE_") {
                        if let Ok(key) = k.to_ascii_lowercase().parse::<AzureConfigKey>() {
                            b = b.with_config(key, v);
                        }
                    }
                }
                (Arc::new(b.build().map_err(open_err)?), Backend::Azure)
            }
            StoreUrl::S3 { bucket, .. } => {
                use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
                let mut b = AmazonS3Builder::new()
                    .with_bucket_name(bucket)
                    .with_retry(retry);
                for (k, v) in &opts.env {
                    if k.starts_with("AWS_") {
                        if let Ok(key) = k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                            b = b.with_config(key, v);
                        }
                    }
                }
                (Arc::new(b.build().map_err(open_err)?), Backend::S3)
            }
        };
        Ok(Self {
            inner,
            root: url.prefix().to_owned(),
            url: url.clone(),
            backend,
            redactor,
        })
    }

    /// An empty in-memory store (unit tests).
    pub fn memory() -> Self {
        Self {
            inner: Arc::new(object_store::memory::InMemory::new()),
            url: StoreUrl::Memory {
                prefix: String::new(),
            },
            root: String::new(),
            backend: Backend::Memory,
            redactor: Arc::default(),
        }
    }

    /// The same backend with `sub` appended to the prefix.
    pub fn sub(&self, sub: &str) -> Self {
        let sub = sub.trim_matches('/');
        let mut s = self.clone();
        if !sub.is_empty() {
            s.root = if s.root.is_empty() {
                sub.to_owned()
            } else {
                format!("{}/{sub}", s.root)
            };
        }
        s
    }

    pub fn url(&self) -> &StoreUrl {
        &self.url
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The smallest part a multipart upload may have (but its last): S3
    /// refuses parts under 5 MiB.
    pub fn min_part_size(&self) -> u64 {
        match self.backend {
            Backend::S3 => 5 << 20,
            _ => 0,
        }
    }

    /// The object_store handle and the absolute path of a key, for the
    /// transfer module.
    pub(crate) fn raw(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    pub(crate) fn path(&self, key: &str) -> Result<ObjPath, StoreError> {
        let full = if self.root.is_empty() {
            key.to_owned()
        } else if key.is_empty() {
            self.root.clone()
        } else {
            format!("{}/{key}", self.root)
        };
        ObjPath::parse(&full).map_err(|e| StoreError::BadKey {
            key: key.to_owned(),
            reason: e.to_string(),
        })
    }

    fn rel(&self, p: &ObjPath) -> String {
        let s = p.as_ref();
        if self.root.is_empty() {
            s.to_owned()
        } else {
            s.strip_prefix(&self.root)
                .map(|r| r.trim_start_matches('/'))
                .unwrap_or(s)
                .to_owned()
        }
    }

    /// Turns a backend error into a redacted, classified one.
    pub(crate) fn err(&self, op: &'static str, key: &str, e: object_store::Error) -> StoreError {
        use object_store::Error as E;
        let kind = match &e {
            E::NotFound { .. } => BackendErrorKind::NotFound,
            E::AlreadyExists { .. } => BackendErrorKind::AlreadyExists,
            E::Precondition { .. } => BackendErrorKind::Precondition,
            E::PermissionDenied { .. } => BackendErrorKind::PermissionDenied,
            E::Unauthenticated { .. } => BackendErrorKind::Unauthenticated,
            E::NotSupported { .. } | E::NotImplemented { .. } => BackendErrorKind::NotSupported,
            _ => BackendErrorKind::Other,
        };
        // object_store's own message repeats the path; ours says it once.
        let message = match &e {
            E::NotFound { source, .. }
            | E::AlreadyExists { source, .. }
            | E::Precondition { source, .. }
            | E::PermissionDenied { source, .. }
            | E::Unauthenticated { source, .. } => source.to_string(),
            other => other.to_string(),
        };
        let (kind, message) = refine(kind, &message);
        StoreError::Backend {
            op,
            url: self.url.to_string(),
            key: key.to_owned(),
            kind,
            message: self.redactor.redact(&message),
        }
    }

    /// Reads a whole (small) object.
    pub async fn get(&self, key: &str) -> Result<Bytes, StoreError> {
        let p = self.path(key)?;
        let r = self
            .inner
            .get(&p)
            .await
            .map_err(|e| self.err("get", key, e))?;
        r.bytes().await.map_err(|e| self.err("get", key, e))
    }

    /// Reads a whole object, or `None` if there is none.
    pub async fn get_opt(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        match self.get(key).await {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes a whole object, replacing any.
    pub async fn put(&self, key: &str, data: Bytes) -> Result<(), StoreError> {
        let p = self.path(key)?;
        self.inner
            .put(&p, PutPayload::from(data))
            .await
            .map(|_| ())
            .map_err(|e| self.err("put", key, e))
    }

    /// Writes an object only if none exists at the key (If-None-Match: *
    /// on Azure and S3, a no-clobber link on the local file system). The
    /// one atomic primitive the checkpoint protocol builds on.
    pub async fn create(&self, key: &str, data: Bytes) -> Result<CreateOutcome, StoreError> {
        let p = self.path(key)?;
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.inner.put_opts(&p, PutPayload::from(data), opts).await {
            Ok(_) => Ok(CreateOutcome::Created),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(CreateOutcome::AlreadyExists),
            Err(e) => Err(self.err("create", key, e)),
        }
    }

    /// Size and time of an object, or `None`.
    pub async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, StoreError> {
        let p = self.path(key)?;
        match self.inner.head(&p).await {
            Ok(m) => Ok(Some(ObjectInfo {
                key: key.to_owned(),
                size: m.size,
                modified_unix: m.last_modified.timestamp(),
            })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("head", key, e)),
        }
    }

    /// Deletes an object; deleting a missing one is not an error.
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let p = self.path(key)?;
        match self.inner.delete(&p).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("delete", key, e)),
        }
    }

    /// Every object under `prefix` (recursively), sorted by key.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, StoreError> {
        let p = self.path(prefix.trim_end_matches('/'))?;
        let p = (!p.as_ref().is_empty()).then_some(p);
        let mut out: Vec<ObjectInfo> = self
            .inner
            .list(p.as_ref())
            .map_ok(|m| ObjectInfo {
                key: self.rel(&m.location),
                size: m.size,
                modified_unix: m.last_modified.timestamp(),
            })
            .try_collect()
            .await
            .map_err(|e| self.err("list", prefix, e))?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// The names of the "directories" directly under `prefix`, sorted.
    pub async fn list_dirs(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let p = self.path(prefix.trim_end_matches('/'))?;
        let p = (!p.as_ref().is_empty()).then_some(p);
        let r = self
            .inner
            .list_with_delimiter(p.as_ref())
            .await
            .map_err(|e| self.err("list", prefix, e))?;
        let mut out: Vec<String> = r
            .common_prefixes
            .iter()
            .filter_map(|c| c.filename().map(str::to_owned))
            .collect();
        out.sort();
        Ok(out)
    }

    /// A cheap request that fails on wrong credentials or a missing
    /// container: lists one page under the root.
    pub async fn check_access(&self) -> Result<(), StoreError> {
        let p = self.path("")?;
        let p = (!p.as_ref().is_empty()).then_some(p);
        self.inner
            .list_with_delimiter(p.as_ref())
            .await
            .map(|_| ())
            .map_err(|e| self.err("list", "", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_recognised_and_redacted() {
        assert!(is_secret_name("AZURE_STORAGE_ACCOUNT_KEY"));
        assert!(is_secret_name("AZURE_STORAGE_SAS_TOKEN"));
        assert!(is_secret_name("AWS_SECRET_ACCESS_KEY"));
        assert!(is_secret_name("AWS_SESSION_TOKEN"));
        assert!(is_secret_name("AZURE_STORAGE_CONNECTION_STRING"));
        assert!(!is_secret_name("AWS_ACCESS_KEY_ID"));
        assert!(!is_secret_name("AZURE_STORAGE_ACCOUNT_NAME"));
        let r = Redactor {
            secrets: vec!["s3cr3t".into()],
        };
        assert_eq!(r.redact("key s3cr3t in s3cr3t"), "key *** in ***");
    }

    #[test]
    fn http_answers_are_classified_and_shortened() {
        let msg = "Error performing GET http://h/c in 5ms - Server returned non-2xx status code: \
                   403 Forbidden: <?xml version=\"1.0\"?>\n<Error><Code>AuthorizationFailure</Code>\n</Error>";
        let (k, m) = refine(BackendErrorKind::Other, msg);
        assert_eq!(k, BackendErrorKind::PermissionDenied);
        assert_eq!(
            m,
            "Error performing GET http://h/c in 5ms - Server returned non-2xx status code: \
             403 Forbidden (AuthorizationFailure)"
        );
        let (k, _) = refine(BackendErrorKind::Other, "<Code>ContainerNotFound</Code>");
        assert_eq!(k, BackendErrorKind::NotFound);
        let (k, m) = refine(BackendErrorKind::NotFound, "gone");
        assert_eq!((k, m.as_str()), (BackendErrorKind::NotFound, "gone"));
    }

    #[tokio::test]
    async fn create_is_create_only_and_keys_are_rooted() {
        let s = Store::memory().sub("a/b");
        assert_eq!(
            s.create("k", Bytes::from_static(b"1"))
                .await
                .expect("create"),
            CreateOutcome::Created
        );
        assert_eq!(
            s.create("k", Bytes::from_static(b"2"))
                .await
                .expect("create"),
            CreateOutcome::AlreadyExists
        );
        assert_eq!(s.get("k").await.expect("get"), Bytes::from_static(b"1"));
        s.put("d/x", Bytes::from_static(b"xx")).await.expect("put");
        s.put("d/y/z", Bytes::from_static(b"z")).await.expect("put");
        let keys: Vec<String> = s
            .list("")
            .await
            .expect("list")
            .into_iter()
            .map(|o| o.key)
            .collect();
        assert_eq!(keys, ["d/x", "d/y/z", "k"]);
        assert_eq!(s.list_dirs("").await.expect("dirs"), ["d"]);
        assert_eq!(s.list_dirs("d").await.expect("dirs"), ["y"]);
        assert!(s.get_opt("nope").await.expect("get").is_none());
        assert!(s.head("nope").await.expect("head").is_none());
        assert_eq!(s.head("d/x").await.expect("head").map(|h| h.size), Some(2));
        s.delete("k").await.expect("delete");
        s.delete("k").await.expect("delete twice");
        let e = s.get("k").await.expect_err("gone");
        assert!(e.is_not_found(), "{e}");
    }

    #[tokio::test]
    async fn file_store_create_is_atomic_create_only() {
        let dir = tempfile::tempdir().expect("tmp");
        let url = StoreUrl::parse(&format!("file://{}", dir.path().display())).expect("url");
        let e = Store::open(&url, &StoreOptions::default()).map(|_| ());
        assert!(e.is_ok(), "an existing directory opens: {e:?}");
        let missing =
            StoreUrl::parse(&format!("file://{}/new", dir.path().display())).expect("url");
        let e = Store::open(&missing, &StoreOptions::default()).expect_err("missing");
        assert!(e.to_string().contains("no such directory"), "{e}");
        let s = Store::open(
            &missing,
            &StoreOptions {
                create_root: true,
                ..Default::default()
            },
        )
        .expect("open");
        assert_eq!(
            s.create("x/y", Bytes::from_static(b"1")).await.expect("c"),
            CreateOutcome::Created
        );
        assert_eq!(
            s.create("x/y", Bytes::from_static(b"2")).await.expect("c"),
            CreateOutcome::AlreadyExists
        );
        assert_eq!(
            std::fs::read(dir.path().join("new/x/y")).expect("read"),
            b"1"
        );
    }
}
