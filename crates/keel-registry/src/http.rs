//! The registry's HTTP API.
//!
//! Every route but `GET /health` needs a credential: `Authorization:
//! Bearer <secret>` or `api-key: <secret>`, either an API key from the
//! registry (stored as its SHA-256; role `read` or `write`) or the one
//! bearer token whose SHA-256 the configuration names (role `write`). A
//! missing or unknown credential is 401; a `read` key on a route that
//! changes something is 403. Nothing is anonymous.
//!
//! - keel's read API (`/api/v1/...`, JSON with a `version` field):
//!   models, versions (with files, lineage and signature), aliases, alias
//!   history, and the chain check; what the gateway reads. Two writes:
//!   `POST /api/v1/aliases/set` and `/api/v1/aliases/delete` set or
//!   delete an alias with the reason its history records (what a gateway
//!   rollout writes); with `"dry_run": true` they answer whether the
//!   change would be made (the key's rights, the model, the version, the
//!   alias) and change nothing.
//! - MLflow's model-registry API (`/api/2.0/mlflow/...`):
//!   `registered-models/create|get|search|update|rename|delete|set-tag|
//!   delete-tag|get-latest-versions`, `registered-models/alias` (POST set,
//!   GET get, DELETE delete), `model-versions/create|get|search|update|
//!   delete|set-tag|delete-tag|get-download-uri|transition-stage`, with
//!   MLflow's JSON shapes and error codes, so the MLflow client registers,
//!   finds, aliases and loads (`models:/...`) models unchanged. Deleting a
//!   version and stage transitions are refused (versions are kept; keel
//!   has aliases); a version's `source` is its artifact-store URL. A
//!   version created with MLflow 3's `model_id` and no `run_id` gets the
//!   run that the configured tracking server records for that logged
//!   model ([`crate::tracking`]), or none, with a warning.
//!
//! Reads run on connections of a bounded pool (read-only ones on SQLite;
//! a snapshot each), so a long search holds up no other request; writes
//! share one connection.
//!
//! What a read makes the server hold is bounded: every list is a page
//! (`max_results`, `page_token`, `next_page_token`: keel's lists 100 by
//! default and at most 1,000, MLflow's searches with MLflow's own sizes),
//! every answer holds at most [`MAX_RESPONSE_BYTES`] of items (a page is
//! cut short there with a token for the rest), and at most
//! [`HEAVY_READS`] lists, searches or chain checks run at once (the next
//! waits, then gets 503).
//!
//! Errors are `{"error_code": ..., "message": ...}` with the HTTP status.
//! A database that is down, restarting or past its timeouts, and a request
//! that waited its bound for a pooled connection or for the writer, get
//! 503 `TEMPORARILY_UNAVAILABLE` (the cause is logged here); other
//! database failures are a plain "internal error", never with internals.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::types::{parse_version, Role, Tag, Version, VersionRef};
use crate::{Model, NewVersion, Registry, RegistryError};

/// The JSON version of keel's own API bodies.
pub const API_VERSION: u32 = 1;

/// How the server authenticates, beyond the registry's API keys.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// SHA-256 (hex) of a bearer token that may read and write.
    pub token_sha256: Option<String>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// The most bytes of items one answer holds (0: [`MAX_RESPONSE_BYTES`]).
    pub max_response_bytes: usize,
    /// The Azure storage account `az://` artifact URLs live in: MLflow's
    /// client reads them as `wasbs://CONTAINER@ACCOUNT.blob.core.windows.net/PATH`.
    pub azure_account: Option<String>,
    /// The MLflow tracking server asked for the run of a version created
    /// with a logged model (`model_id`) and no `run_id`.
    pub tracking: Option<crate::tracking::TrackingServer>,
}

#[derive(Clone)]
struct AppState {
    /// The writer: every change goes through it, one at a time (a
    /// request waits for it at most `readers.wait`).
    reg: Arc<tokio::sync::Mutex<Registry>>,
    readers: Arc<Readers>,
    /// Places for heavy reads (lists, searches, the chain check).
    heavy: Arc<tokio::sync::Semaphore>,
    /// How long a heavy read waits for one.
    heavy_wait: std::time::Duration,
    /// The most bytes of items one answer holds.
    max_response: usize,
    token_sha256: Option<String>,
    azure_account: Option<Arc<str>>,
    tracking: Option<crate::tracking::TrackingServer>,
}

/// The pool of read connections (read-only ones to a SQLite file, full
/// ones to PostgreSQL), so that no read (a long search) holds up another
/// request or waits for a write. At most `places` of them are open at
/// once (the connector's pool size); a request waits at most `wait` for
/// one, then gets 503. An in-memory registry has only its writer's
/// connection: reads take its lock.
struct Readers {
    connector: Option<crate::Connector>,
    idle: Mutex<Vec<Registry>>,
    places: Arc<tokio::sync::Semaphore>,
    /// How many places there are.
    size: usize,
    wait: std::time::Duration,
}

impl Readers {
    fn new(connector: Option<crate::Connector>) -> Self {
        let (size, wait) = connector
            .as_ref()
            .map_or((1, crate::registry::SQLITE_POOL_WAIT), |c| {
                (c.pool_size(), c.wait())
            });
        Self {
            connector,
            idle: Mutex::new(Vec::new()),
            places: Arc::new(tokio::sync::Semaphore::new(size)),
            size,
            wait,
        }
    }
}

/// An error with its sources, `a: b: c` (what the log says).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// The answer to a request that found the database unreachable or every
/// connection busy past its bound: MLflow's code for it, which its client
/// retries.
fn unavailable(message: impl Into<String>) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "TEMPORARILY_UNAVAILABLE",
        message,
    )
}

/// Heavy reads (a list, a search, the chain check) that run at once; more
/// wait up to [`HEAVY_WAIT`] for a place, then get 503 with
/// `Retry-After`. Each holds at most one page (at most
/// [`MAX_RESPONSE_BYTES`]) of answer, so together they hold a bounded
/// amount of memory whatever the registry holds.
pub const HEAVY_READS: usize = 4;
/// How long a heavy read waits for a place.
const HEAVY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// The most bytes of items one answer holds: a page is cut short there
/// (at least one item), with a `next_page_token` for the rest.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// keel's own lists (`/api/v1/models`, `versions`, `history`): 100 items
/// a page by default, at most 1,000.
const KEEL_PAGES: PageBounds = PageBounds {
    default: 100,
    most: 1_000,
};

/// A place for a heavy read, or 503 when none frees up in time.
async fn heavy_place(st: &AppState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    match tokio::time::timeout(st.heavy_wait, st.heavy.clone().acquire_owned()).await {
        Ok(Ok(p)) => Ok(p),
        _ => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "TEMPORARILY_UNAVAILABLE",
            format!("the registry is busy with {HEAVY_READS} large reads: retry in a few seconds"),
        )),
    }
}

/// `items` as a JSON array, cut short before `cap` bytes (but holding at
/// least one item), and how many it holds.
fn capped_array<T: serde::Serialize>(items: &[T], cap: usize) -> Result<(String, usize), ApiError> {
    let mut out = String::from("[");
    let mut taken = 0;
    for item in items {
        let text = serde_json::to_string(item).map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL_ERROR",
                "internal error",
            )
        })?;
        if taken > 0 && out.len() + text.len() + 2 > cap {
            break;
        }
        if taken > 0 {
            out.push(',');
        }
        out.push_str(&text);
        taken += 1;
    }
    out.push(']');
    Ok((out, taken))
}

/// A page of keel's API: `{"version": 1, FIELD: [...], "next_page_token":
/// ...}` from `items` (fetched one past the page, so that a full page
/// knows whether more follow); `key` gives the token of an item, the
/// position after it.
fn keel_page<T: serde::Serialize>(
    field: &str,
    items: &[T],
    max: usize,
    cap: usize,
    key: impl Fn(&T) -> String,
) -> Result<Response, ApiError> {
    let page = &items[..items.len().min(max)];
    let (array, taken) = capped_array(page, cap)?;
    let next = (taken < items.len())
        .then(|| taken.checked_sub(1).map(|i| key(&items[i])))
        .flatten();
    let mut body = format!("{{\"version\":{API_VERSION},\"{field}\":{array}");
    if let Some(t) = next {
        body.push_str(",\"next_page_token\":");
        body.push_str(&serde_json::Value::from(t).to_string());
    }
    body.push('}');
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response())
}

/// `max_results` and `page_token` of one of keel's lists.
#[derive(Deserialize)]
struct PageQuery {
    #[serde(default)]
    name: String,
    alias: Option<String>,
    max_results: Option<String>,
    page_token: Option<String>,
}

impl PageQuery {
    fn max(&self) -> Result<usize, ApiError> {
        let Some(v) = &self.max_results else {
            return Ok(KEEL_PAGES.default);
        };
        match v.trim().parse::<usize>() {
            Ok(n) if (1..=KEEL_PAGES.most).contains(&n) => Ok(n),
            _ => Err(ApiError::invalid(format!(
                "max_results {:?} must be a whole number within 1..={}",
                head(v, 40),
                KEEL_PAGES.most
            ))),
        }
    }

    /// The token as a sequence or version number (0: from the start).
    fn number(&self) -> Result<i64, ApiError> {
        match self.page_token.as_deref().filter(|t| !t.is_empty()) {
            None => Ok(0),
            Some(t) => t.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                ApiError::invalid(format!(
                    "bad page_token {:?}: expected the next_page_token of an earlier page",
                    head(t, 40)
                ))
            }),
        }
    }
}

/// A keel storage URL as MLflow's artifact repositories name it:
/// `file://` and `s3://` as they are, `az://C/P` as `wasbs://` in
/// `account` (`None` without an account, or for `memory://`).
pub fn mlflow_artifact_uri(url: &str, azure_account: Option<&str>) -> Option<String> {
    if url.starts_with("file://") || url.starts_with("s3://") {
        return Some(url.to_owned());
    }
    let rest = url
        .strip_prefix("az://")
        .or_else(|| url.strip_prefix("azure://"))?;
    let account = azure_account.filter(|a| !a.is_empty())?;
    let (container, path) = rest.split_once('/').unwrap_or((rest, ""));
    Some(format!(
        "wasbs://{container}@{account}.blob.core.windows.net/{path}"
    ))
}

/// Who is calling: the audit log's actor.
#[derive(Debug, Clone)]
struct Identity {
    actor: String,
}

/// An error as the API shows it.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            Json(json!({"error_code": self.code, "message": self.message})),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        if e.is_unavailable() {
            // The database is down, restarting or busy past the bounds:
            // worth a retry. What failed goes to the log, not the client.
            tracing::warn!(error = %error_chain(&e), "registry database unavailable");
            unavailable("the registry database is unavailable or busy: retry in a few seconds")
        } else if e.is_not_found() {
            Self::new(
                StatusCode::NOT_FOUND,
                "RESOURCE_DOES_NOT_EXIST",
                e.to_string(),
            )
        } else if matches!(
            e,
            RegistryError::ModelExists { .. } | RegistryError::KeyExists { .. }
        ) {
            // MLflow's status for RESOURCE_ALREADY_EXISTS.
            Self::new(
                StatusCode::BAD_REQUEST,
                "RESOURCE_ALREADY_EXISTS",
                e.to_string(),
            )
        } else if e.is_conflict() {
            Self::new(StatusCode::CONFLICT, "INVALID_STATE", e.to_string())
        } else if e.is_invalid() {
            Self::invalid(e.to_string())
        } else {
            Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL_ERROR",
                "internal error",
            )
        }
    }
}

type ApiResult = Result<Json<Value>, ApiError>;

/// Runs a read on the blocking pool, on a read connection of its own (in
/// one snapshot): it waits for no write and no other read.
async fn read<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&Registry) -> Result<T, RegistryError> + Send + 'static,
) -> Result<T, ApiError> {
    read_raw(st, f).await?.map_err(ApiError::from)
}

/// [`read`], with the registry's error as it is.
async fn read_raw<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&Registry) -> Result<T, RegistryError> + Send + 'static,
) -> Result<Result<T, RegistryError>, ApiError> {
    let Some(connector) = st.readers.connector.clone() else {
        return db_raw(st, move |r| r.snapshot(f)).await;
    };
    let readers = st.readers.clone();
    let place =
        match tokio::time::timeout(readers.wait, readers.places.clone().acquire_owned()).await {
            Ok(Ok(p)) => p,
            _ => {
                return Err(unavailable(format!(
                    "all {} database connections stayed busy for {} ms: retry in a few seconds",
                    readers.size,
                    readers.wait.as_millis()
                )))
            }
        };
    tokio::task::spawn_blocking(move || {
        let _place = place;
        let idle = readers.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let r = match idle {
            Some(r) => r,
            None => connector.open()?,
        };
        let out = r.snapshot(f);
        // A connection that failed is closed rather than pooled; the next
        // request opens a new one.
        if !out.as_ref().is_err_and(RegistryError::is_unavailable) {
            readers
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(r);
        }
        out
    })
    .await
    .map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "INTERNAL_ERROR",
            "internal error",
        )
    })
}

/// Runs a registry call on the blocking pool.
async fn db<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&mut Registry) -> Result<T, RegistryError> + Send + 'static,
) -> Result<T, ApiError> {
    db_raw(st, f).await?.map_err(ApiError::from)
}

/// [`db`], with the registry's error as it is.
async fn db_raw<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&mut Registry) -> Result<T, RegistryError> + Send + 'static,
) -> Result<Result<T, RegistryError>, ApiError> {
    let wait = st.readers.wait;
    let Ok(mut r) = tokio::time::timeout(wait, st.reg.clone().lock_owned()).await else {
        return Err(unavailable(format!(
            "the registry's writer stayed busy for {} ms: retry in a few seconds",
            wait.as_millis()
        )));
    };
    tokio::task::spawn_blocking(move || f(&mut r))
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL_ERROR",
                "internal error",
            )
        })
}

/// The application: every route, behind authentication.
pub fn router(reg: Registry, opts: ServeOptions) -> Router {
    let readers = Readers::new(reg.connector());
    let st = AppState {
        readers: Arc::new(readers),
        heavy: Arc::new(tokio::sync::Semaphore::new(HEAVY_READS)),
        heavy_wait: HEAVY_WAIT,
        max_response: if opts.max_response_bytes == 0 {
            MAX_RESPONSE_BYTES
        } else {
            opts.max_response_bytes
        },
        reg: Arc::new(tokio::sync::Mutex::new(reg)),
        token_sha256: opts.token_sha256.map(|s| s.to_ascii_lowercase()),
        azure_account: opts.azure_account.map(Arc::from),
        tracking: opts.tracking,
    };
    let max_body = if opts.max_body_bytes == 0 {
        1 << 20
    } else {
        opts.max_body_bytes
    };
    let m = "/api/2.0/mlflow";
    let api = Router::new()
        .route("/api/v1/models", get(v1_models))
        .route("/api/v1/models/get", get(v1_model))
        .route("/api/v1/versions", get(v1_versions))
        .route("/api/v1/versions/get", get(v1_version))
        .route("/api/v1/aliases", get(v1_aliases))
        .route("/api/v1/history", get(v1_history))
        .route("/api/v1/aliases/set", post(v1_set_alias))
        .route("/api/v1/aliases/delete", post(v1_delete_alias))
        .route("/api/v1/audit/verify", get(v1_audit_verify))
        .route(
            &format!("{m}/registered-models/create"),
            post(mlf_create_model),
        )
        .route(&format!("{m}/registered-models/get"), get(mlf_get_model))
        .route(
            &format!("{m}/registered-models/search"),
            get(mlf_search_models),
        )
        .route(
            &format!("{m}/registered-models/delete"),
            axum::routing::delete(mlf_delete_model),
        )
        .route(
            &format!("{m}/registered-models/set-tag"),
            post(mlf_set_model_tag),
        )
        .route(
            &format!("{m}/registered-models/get-latest-versions"),
            get(mlf_latest_versions_query).post(mlf_latest_versions_body),
        )
        .route(
            &format!("{m}/model-versions/get-download-uri"),
            get(mlf_download_uri),
        )
        .route(
            &format!("{m}/registered-models/update"),
            axum::routing::patch(mlf_update_model),
        )
        .route(
            &format!("{m}/registered-models/rename"),
            post(mlf_rename_model),
        )
        .route(
            &format!("{m}/model-versions/update"),
            axum::routing::patch(mlf_update_version),
        )
        .route(
            &format!("{m}/model-versions/delete"),
            axum::routing::delete(mlf_delete_version),
        )
        .route(
            &format!("{m}/model-versions/transition-stage"),
            post(mlf_transition_stage),
        )
        .route(
            &format!("{m}/registered-models/delete-tag"),
            axum::routing::delete(mlf_delete_model_tag),
        )
        .route(
            &format!("{m}/registered-models/alias"),
            get(mlf_get_alias)
                .post(mlf_set_alias)
                .delete(mlf_delete_alias),
        )
        .route(
            &format!("{m}/model-versions/create"),
            post(mlf_create_version),
        )
        .route(&format!("{m}/model-versions/get"), get(mlf_get_version))
        .route(
            &format!("{m}/model-versions/search"),
            get(mlf_search_versions),
        )
        .route(
            &format!("{m}/model-versions/set-tag"),
            post(mlf_set_version_tag),
        )
        .route(
            &format!("{m}/model-versions/delete-tag"),
            axum::routing::delete(mlf_delete_version_tag),
        )
        .fallback(not_found)
        .layer(
            tower::ServiceBuilder::new()
                .layer(axum::middleware::map_response(json_errors))
                .layer(axum::extract::DefaultBodyLimit::max(max_body))
                .layer(axum::middleware::from_fn_with_state(
                    st.clone(),
                    authenticate,
                )),
        );
    Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .merge(api)
        .layer(axum::middleware::from_fn(close_if_body_unread))
        .with_state(st)
}

pub use crate::serve::{serve, serve_with, ConnectionLimits};

/// Every error in MLflow's JSON shape: the extractors' own rejections
/// (a body too large, 413; not JSON, 415; JSON of the wrong shape, 422; a
/// bad query string, 400) come as plain text and are rewritten as
/// `{"error_code", "message"}`, 415 and 422 as MLflow's 400
/// `INVALID_PARAMETER_VALUE`.
async fn json_errors(r: Response) -> Response {
    let status = r.status();
    let is_json = r
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return r;
    }
    let authenticated = r.extensions().get::<keel_http::Authenticated>().copied();
    let text = axum::body::to_bytes(r.into_body(), 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let (status, code) = match status {
        StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::UNPROCESSABLE_ENTITY => {
            (StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE")
        }
        StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => (status, "ENDPOINT_NOT_FOUND"),
        s if s.is_server_error() => (s, "INTERNAL_ERROR"),
        s => (s, "INVALID_PARAMETER_VALUE"),
    };
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        // Rejections can quote the request: a short start of it.
        let cut = head(&text, 300);
        if cut.len() < text.len() {
            format!("{cut}...")
        } else {
            text
        }
    };
    let mut out = ApiError::new(status, code, message).into_response();
    if let Some(a) = authenticated {
        out.extensions_mut().insert(a);
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        // The rest of the body was never read: the connection closes
        // after this answer, and says so, so that a client does not send
        // its next request on it.
        out.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    out
}

/// A request body, noting when it has been read to its end.
struct Tracked {
    inner: axum::body::Body,
    ended: Arc<std::sync::atomic::AtomicBool>,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None)) || self.inner.is_end_stream() {
            self.ended.store(true, std::sync::atomic::Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// An answer given before the request's body was read to its end (a
/// refusal, a missing key, an unknown endpoint) says `Connection: close`:
/// the server cannot reuse a connection with unread bytes on it and closes
/// it after the answer, and a pooling client that is not told sends its
/// next request there and gets no answer.
///
/// Answers to no one in particular close the connection too (a missing or
/// wrong key, `/health`): a connection is kept only for a client with a key.
async fn close_if_body_unread(req: Request, next: Next) -> Response {
    use hyper::body::Body as _;
    let (parts, body) = req.into_parts();
    let health = parts.uri.path() == "/health";
    let close = |mut r: Response| {
        if health || r.status() == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        r
    };
    if body.is_end_stream() {
        return close(next.run(Request::from_parts(parts, body)).await);
    }
    let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let body = axum::body::Body::new(Tracked {
        inner: body,
        ended: ended.clone(),
    });
    let mut response = close(next.run(Request::from_parts(parts, body)).await);
    if !ended.load(std::sync::atomic::Ordering::Acquire) {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "ENDPOINT_NOT_FOUND",
        "no such endpoint",
    )
}

fn credential(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let (scheme, rest) = v.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| rest.trim().to_owned());
    }
    headers
        .get("api-key")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_owned())
}

async fn authenticate(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let Some(secret) = credential(req.headers()).filter(|s| !s.is_empty()) else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHENTICATED",
            "authentication required: Authorization: Bearer <key> or api-key: <key>",
        )
        .into_response();
    };
    let hash = crate::auth::secret_hash(&secret);
    let found = if st.token_sha256.as_deref() == Some(hash.as_str()) {
        Some(("token".to_owned(), Role::Write))
    } else {
        match read(&st, move |r| r.authenticate(&secret)).await {
            Ok(k) => k.map(|k| (format!("key:{}", k.name), k.role)),
            Err(e) => return e.into_response(),
        }
    };
    let Some((actor, role)) = found else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHENTICATED",
            "unknown or revoked API key",
        )
        .into_response();
    };
    // MLflow's client asks for the latest versions with a POST: a read.
    let writes = !matches!(*req.method(), Method::GET | Method::HEAD)
        && !req.uri().path().ends_with("/get-latest-versions");
    let mut response = if writes && role != Role::Write {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "PERMISSION_DENIED",
            format!("{actor} may only read"),
        )
        .into_response()
    } else {
        req.extensions_mut().insert(Identity { actor });
        next.run(req).await
    };
    // A client with a valid key keeps its connection's place
    // (keel-http: it is never closed to make room for another).
    response.extensions_mut().insert(keel_http::Authenticated);
    response
}

// ----- keel's read API ----------------------------------------------------

#[derive(Deserialize)]
struct NameQuery {
    name: String,
    alias: Option<String>,
    version: Option<String>,
}

fn with_version(v: Value) -> Json<Value> {
    let mut doc = serde_json::Map::new();
    doc.insert("version".into(), API_VERSION.into());
    if let Value::Object(o) = v {
        doc.extend(o);
    }
    Json(Value::Object(doc))
}

/// Models by name, a page at a time (`max_results`, `page_token`: the
/// last name of the page before).
async fn v1_models(
    State(st): State<AppState>,
    Query(q): Query<PageQuery>,
) -> Result<Response, ApiError> {
    let max = q.max()?;
    let after = q.page_token.clone().filter(|t| !t.is_empty());
    let _place = heavy_place(&st).await?;
    let models = read(&st, move |r| r.models_after(after.as_deref(), max + 1)).await?;
    keel_page("models", &models, max, st.max_response, |m| m.name.clone())
}

async fn v1_model(State(st): State<AppState>, Query(q): Query<NameQuery>) -> ApiResult {
    let model = read(&st, move |r| r.model(&q.name)).await?;
    Ok(with_version(json!({ "model": model })))
}

/// A model's versions, oldest first, a page at a time (`max_results`,
/// `page_token`: the last version number of the page before).
async fn v1_versions(
    State(st): State<AppState>,
    Query(q): Query<PageQuery>,
) -> Result<Response, ApiError> {
    let max = q.max()?;
    let after = q.number()? as u64;
    let _place = heavy_place(&st).await?;
    let versions = read(&st, move |r| r.versions_after(&q.name, after, max + 1)).await?;
    keel_page("versions", &versions, max, st.max_response, |v| {
        v.version.to_string()
    })
}

/// One version by `version=N` or `alias=A` (else the latest READY one),
/// with its signature bundle when it has one.
async fn v1_version(State(st): State<AppState>, Query(q): Query<NameQuery>) -> ApiResult {
    let r = match (&q.alias, &q.version) {
        (Some(a), None) => VersionRef::Alias(q.name.clone(), a.clone()),
        (None, Some(v)) => VersionRef::Number(q.name.clone(), parse_version(v)?),
        (None, None) => VersionRef::Latest(q.name.clone()),
        (Some(_), Some(_)) => return Err(ApiError::invalid("give alias or version, not both")),
    };
    let (v, sig) = read(&st, move |reg| {
        let v = reg.resolve(&r)?;
        let sig = reg.signature(&v.model, v.version)?;
        Ok((v, sig))
    })
    .await?;
    Ok(with_version(json!({
        "model_version": v,
        "signature": sig.map(|s| json!({"bundle": s.bundle, "public_key_pem": s.public_key_pem, "key_hint": s.key_hint})),
    })))
}

async fn v1_aliases(State(st): State<AppState>, Query(q): Query<NameQuery>) -> ApiResult {
    let m = read(&st, move |r| r.model(&q.name)).await?;
    Ok(with_version(
        json!({ "name": m.name, "aliases": m.aliases }),
    ))
}

/// A model's alias history (`alias`: one alias), oldest first, a page at
/// a time (`max_results`, `page_token`: the last event number of the page
/// before).
async fn v1_history(
    State(st): State<AppState>,
    Query(q): Query<PageQuery>,
) -> Result<Response, ApiError> {
    let max = q.max()?;
    let after = q.number()?;
    let _place = heavy_place(&st).await?;
    let events = read(&st, move |r| {
        r.history_after(&q.name, q.alias.as_deref(), after, max + 1)
    })
    .await?;
    keel_page("events", &events, max, st.max_response, |e| {
        e.seq.to_string()
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AliasChange {
    version: u32,
    name: String,
    alias: String,
    /// `set` only.
    #[serde(default)]
    target: Option<u64>,
    reason: String,
    /// Check the change (rights included) and make none.
    #[serde(default)]
    dry_run: bool,
}

impl AliasChange {
    fn check_version(&self) -> Result<(), ApiError> {
        if self.version != 1 {
            return Err(ApiError::invalid(format!(
                "version {} of the alias change format is not known (1 is)",
                self.version
            )));
        }
        Ok(())
    }
}

/// Sets an alias with a reason: `{"version": 1, "name", "alias",
/// "target": N, "reason"}`.
async fn v1_set_alias(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<AliasChange>,
) -> ApiResult {
    b.check_version()?;
    let Some(v) = b.target else {
        return Err(ApiError::invalid(
            "target (the version the alias names) is missing",
        ));
    };
    if b.dry_run {
        read(&st, move |r| {
            r.check_alias_change(&b.name, &b.alias, Some(v), &b.reason)
        })
        .await?;
        return Ok(with_version(json!({ "dry_run": true, "allowed": true })));
    }
    let ev = db(&st, move |r| {
        r.set_alias(&id.actor, &b.name, &b.alias, v, &b.reason)
    })
    .await?;
    Ok(with_version(json!({ "event": ev })))
}

/// Deletes an alias with a reason: `{"version": 1, "name", "alias",
/// "reason"}`; an alias that is not set is 404.
async fn v1_delete_alias(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<AliasChange>,
) -> ApiResult {
    b.check_version()?;
    if b.target.is_some() {
        return Err(ApiError::invalid("delete takes no target"));
    }
    if b.dry_run {
        read(&st, move |r| {
            r.check_alias_change(&b.name, &b.alias, None, &b.reason)
        })
        .await?;
        return Ok(with_version(json!({ "dry_run": true, "allowed": true })));
    }
    let ev = db(&st, move |r| {
        r.delete_alias(&id.actor, &b.name, &b.alias, &b.reason)
    })
    .await?;
    Ok(with_version(json!({ "event": ev })))
}

async fn v1_audit_verify(State(st): State<AppState>) -> ApiResult {
    let _place = heavy_place(&st).await?;
    let report = read(&st, |r| r.verify_chains()).await?;
    Ok(with_version(json!({ "ok": report.ok(), "report": report })))
}

// ----- MLflow subset ------------------------------------------------------

fn mlf_tags(tags: &[Tag]) -> Value {
    tags.iter()
        .map(|t| json!({"key": t.key, "value": t.value}))
        .collect()
}

/// Where a version's files are, as MLflow's client reads them: the
/// artifact-store URL of its files (in MLflow's scheme), or for a version
/// registered through MLflow's API, the source it was given.
fn mlf_source(v: &Version, azure_account: Option<&str>) -> String {
    match &v.artifact_url {
        Some(url) => mlflow_artifact_uri(url, azure_account).unwrap_or_else(|| url.clone()),
        None => v.source.clone(),
    }
}

fn mlf_version(v: &Version, azure_account: Option<&str>) -> Value {
    let mut o = json!({
        "name": v.model,
        "version": v.version.to_string(),
        "creation_timestamp": v.created_ms,
        "last_updated_timestamp": v.updated_ms,
        "user_id": v.created_by,
        "current_stage": "None",
        "description": v.description,
        "source": mlf_source(v, azure_account),
        "status": v.status.as_str(),
        "status_message": v.status_message,
        "tags": mlf_version_tags(v),
        "aliases": v.aliases,
    });
    if let Some(run) = &v.lineage.run_id {
        o["run_id"] = run.clone().into();
    }
    if let Some(id) = &v.lineage.mlflow_model_id {
        o["model_id"] = id.clone().into();
    }
    if let Some(link) = run_link(v) {
        o["run_link"] = link.into();
    }
    o
}

/// The run link MLflow shows: the one given, else the checkpoint run the
/// version was registered from.
fn run_link(v: &Version) -> Option<String> {
    v.lineage.run_link.clone().or_else(|| {
        v.lineage
            .checkpoint
            .as_ref()
            .map(|c| format!("{}/{}", c.url, c.run))
    })
}

/// The prefix of the tags that show keel's lineage to MLflow clients.
const LINEAGE_TAG_PREFIX: &str = "keel.";

/// A version's tags as MLflow shows them: its own, then its lineage and
/// integrity as `keel.*` tags (read-only).
fn mlf_version_tags(v: &Version) -> Value {
    let mut tags: Vec<Value> = v
        .tags
        .iter()
        .map(|t| json!({"key": t.key, "value": t.value}))
        .collect();
    let mut add = |k: &str, val: String| {
        tags.push(json!({"key": format!("{LINEAGE_TAG_PREFIX}{k}"), "value": val}));
    };
    let l = &v.lineage;
    if let Some(c) = &l.checkpoint {
        add("checkpoint.url", c.url.clone());
        add("checkpoint.run", c.run.clone());
        add("checkpoint.step", c.step.to_string());
        add("checkpoint.manifest_digest", c.manifest_digest.clone());
    }
    for (i, d) in l.datasets.iter().enumerate() {
        add(&format!("dataset.{i}"), d.uri.clone());
        if let Some(x) = &d.digest {
            add(&format!("dataset.{i}.digest"), x.clone());
        }
    }
    if let Some(c) = &l.code_commit {
        add("code_commit", c.clone());
    }
    if let Some(p) = l.parent_version {
        add("parent_version", p.to_string());
    }
    if let Some(d) = &v.manifest_digest {
        add("manifest_digest", d.clone());
    }
    if v.signed {
        add("signed", "true".into());
    }
    Value::Array(tags)
}

fn mlf_model(m: &Model, latest: Option<&Version>, azure_account: Option<&str>) -> Value {
    json!({
        "name": m.name,
        "creation_timestamp": m.created_ms,
        "last_updated_timestamp": m.updated_ms,
        "user_id": m.created_by,
        "description": m.description,
        "latest_versions": latest.map(|v| vec![mlf_version(v, azure_account)]).unwrap_or_default(),
        "tags": mlf_tags(&m.tags),
        "aliases": m.aliases.iter().map(|a| json!({"alias": a.alias, "version": a.version.to_string()})).collect::<Vec<_>>(),
    })
}

fn model_with_latest(
    r: &Registry,
    name: &str,
    azure_account: Option<&str>,
) -> Result<Value, RegistryError> {
    let m = r.model(name)?;
    let latest = match m.latest_version {
        Some(n) => Some(r.version(name, n)?),
        None => None,
    };
    Ok(mlf_model(&m, latest.as_ref(), azure_account))
}

#[derive(Deserialize)]
struct MlfTag {
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
struct CreateModel {
    name: String,
    #[serde(default)]
    tags: Vec<MlfTag>,
    #[serde(default)]
    description: Option<String>,
}

fn required(field: &'static str, v: &str) -> Result<(), ApiError> {
    if v.is_empty() {
        Err(ApiError::invalid(format!(
            "missing value for required parameter '{field}'"
        )))
    } else {
        Ok(())
    }
}

async fn mlf_create_model(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<CreateModel>,
) -> ApiResult {
    required("name", &b.name)?;
    let tags: Vec<Tag> = b
        .tags
        .into_iter()
        .map(|t| Tag {
            key: t.key,
            value: t.value,
        })
        .collect();
    let acct = st.azure_account.clone();
    let v = db(&st, move |r| {
        r.create_model(
            &id.actor,
            &b.name,
            b.description.as_deref().unwrap_or(""),
            &tags,
        )?;
        model_with_latest(r, &b.name, acct.as_deref())
    })
    .await?;
    Ok(Json(json!({ "registered_model": v })))
}

async fn mlf_get_model(State(st): State<AppState>, Query(q): Query<NameQuery>) -> ApiResult {
    let acct = st.azure_account.clone();
    let v = read(&st, move |r| model_with_latest(r, &q.name, acct.as_deref())).await?;
    Ok(Json(json!({ "registered_model": v })))
}

/// A search's query string (`order_by` may repeat).
#[derive(Debug, Default)]
struct SearchQuery {
    filter: Option<String>,
    max_results: Option<usize>,
    page_token: Option<String>,
    order_by: Vec<String>,
}

/// MLflow's bounds on `max_results`: its default and the most a page may
/// ask for.
#[derive(Clone, Copy)]
struct PageBounds {
    default: usize,
    most: usize,
}

/// `search_registered_models`: 100 by default, at most 1,000.
const MODEL_PAGES: PageBounds = PageBounds {
    default: 100,
    most: 1_000,
};
/// `search_model_versions`: 10,000 by default, at most 200,000.
const VERSION_PAGES: PageBounds = PageBounds {
    default: 10_000,
    most: 200_000,
};

impl SearchQuery {
    fn parse(uri: &Uri, bounds: PageBounds) -> Result<Self, ApiError> {
        let mut q = SearchQuery::default();
        for (k, v) in query_pairs(uri)? {
            match k.as_str() {
                "filter" => q.filter = Some(v),
                "page_token" => q.page_token = Some(v),
                "order_by" => q.order_by.push(v),
                "max_results" => {
                    let n: i64 = v.trim().parse().map_err(|_| {
                        ApiError::invalid(format!(
                            "Invalid value {:?} for parameter 'max_results' supplied: expected a whole number",
                            head(&v, 40)
                        ))
                    })?;
                    if n < 1 || n as u64 > bounds.most as u64 {
                        return Err(ApiError::invalid(format!(
                            "Invalid value for request parameter max_results. It must be at least 1 and at most {}, but got value {n}",
                            bounds.most
                        )));
                    }
                    q.max_results = Some(n as usize);
                }
                _ => {}
            }
        }
        q.max_results.get_or_insert(bounds.default);
        Ok(q)
    }
}

/// One `KEY [ASC|DESC]` of an `order_by`, checked against the keys a
/// search allows (MLflow's rules: backquotes allowed, a key at most once).
fn parse_order_by(
    order_by: &[String],
    allowed: &[&'static str],
) -> Result<Vec<(&'static str, bool)>, ApiError> {
    let mut out: Vec<(&'static str, bool)> = Vec::new();
    for o in order_by {
        let shown = head(o, 100);
        let words: Vec<&str> = o.split_whitespace().collect();
        let (key, asc) = match words.as_slice() {
            [k] => (*k, true),
            [k, dir] if dir.eq_ignore_ascii_case("asc") => (*k, true),
            [k, dir] if dir.eq_ignore_ascii_case("desc") => (*k, false),
            [_, _] => {
                return Err(ApiError::invalid(format!(
                    "Invalid ordering key in order_by clause '{shown}': use ASC or DESC"
                )))
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "Invalid order_by clause '{shown}'. Could not be parsed."
                )))
            }
        };
        let key = key.trim_matches('`');
        let Some(&k) = allowed.iter().find(|a| **a == key) else {
            return Err(ApiError::invalid(format!(
                "Invalid order by key '{}' specified. Valid keys are {}",
                head(key, 100),
                allowed.join(", ")
            )));
        };
        if out.iter().any(|(seen, _)| *seen == k) {
            return Err(ApiError::invalid(format!(
                "`order_by` contains duplicate fields: {k}"
            )));
        }
        out.push((k, asc));
    }
    Ok(out)
}

const MODEL_ORDER_KEYS: &[&str] = &["name", "creation_timestamp", "last_updated_timestamp"];
const VERSION_ORDER_KEYS: &[&str] = &[
    "name",
    "version_number",
    "creation_timestamp",
    "last_updated_timestamp",
];

/// Sorts by `order` (key, ascending), then by MLflow's tie-breakers.
fn sort_rows<T>(
    rows: &mut [T],
    mut order: Vec<(&'static str, bool)>,
    tie_breakers: &[(&'static str, bool)],
    key: impl for<'a> Fn(&'a T, &str) -> SortKey<'a>,
) {
    for (k, asc) in tie_breakers {
        if !order.iter().any(|(o, _)| o == k) {
            order.push((k, *asc));
        }
    }
    rows.sort_by(|a, b| {
        order
            .iter()
            .map(|(k, asc)| {
                let o = key(a, k).cmp(&key(b, k));
                if *asc {
                    o
                } else {
                    o.reverse()
                }
            })
            .find(|o| o.is_ne())
            .unwrap_or(std::cmp::Ordering::Equal)
    });
}

/// A value to sort by: text or a number.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum SortKey<'a> {
    Num(i64),
    Text(&'a str),
}

/// A filter as error messages quote it: its first 200 bytes.
struct Shown<'a>(&'a str);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = head(self.0, 200);
        if h.len() < self.0.len() {
            write!(f, "{:?}...", h)
        } else {
            write!(f, "{:?}", h)
        }
    }
}

/// The longest search filter, in bytes.
const MAX_FILTER_BYTES: usize = 8192;
/// The longest `LIKE` / `ILIKE` pattern, in characters: matching costs up
/// to the pattern's length times the text's, for every row searched.
const MAX_PATTERN_CHARS: usize = 256;

/// One `key op 'value'` clause of an MLflow filter.
#[derive(Debug)]
struct Clause {
    key: String,
    op: String,
    value: String,
}

/// Parses MLflow's search filter subset: clauses `name`, `run_id`,
/// `source_path`, `version_number` with `=`, `!=`, `LIKE`, `ILIKE`,
/// joined by `AND`; values in single or double quotes (or bare numbers).
fn parse_filter(f: &str) -> Result<Vec<Clause>, ApiError> {
    if f.len() > MAX_FILTER_BYTES {
        return Err(ApiError::invalid(format!(
            "filter too long: at most {MAX_FILTER_BYTES} bytes, got {}",
            f.len()
        )));
    }
    let mut out = Vec::new();
    let mut rest = f.trim();
    // What error messages quote of the filter and its parts.
    let shown = Shown(f);
    while !rest.is_empty() {
        // A key: `name`, or `tag.KEY` / `tags.KEY` with KEY in backquotes
        // or bare.
        let (key, after_key) = match rest.find('.') {
            Some(dot)
                if matches!(&rest[..dot], "tag" | "tags") && rest[dot + 1..].starts_with('`') =>
            {
                let body = &rest[dot + 2..];
                let close = body.find('`').ok_or_else(|| {
                    ApiError::invalid(format!("unterminated ` in filter {shown}"))
                })?;
                (format!("tag.{}", &body[..close]), &body[close + 1..])
            }
            _ => {
                let end = rest
                    .find(|c: char| c.is_whitespace() || c == '=' || c == '!')
                    .ok_or_else(|| ApiError::invalid(format!("cannot parse filter {shown}")))?;
                let k = rest[..end].trim_matches('`');
                let k = match k.split_once('.') {
                    Some(("tag" | "tags", t)) => format!("tag.{t}"),
                    _ => k.to_owned(),
                };
                (k, &rest[end..])
            }
        };
        rest = after_key.trim_start();
        let op_end = rest
            .find(|c: char| c == '\'' || c == '"' || c.is_ascii_digit())
            .ok_or_else(|| ApiError::invalid(format!("cannot parse filter {shown}")))?;
        let op = rest[..op_end].trim().to_ascii_uppercase();
        rest = &rest[op_end..];
        let (value, after) = match rest.chars().next() {
            Some(q @ ('\'' | '"')) => {
                let close = rest[1..].find(q).ok_or_else(|| {
                    ApiError::invalid(format!("unterminated string in filter {shown}"))
                })?;
                (rest[1..1 + close].to_owned(), &rest[close + 2..])
            }
            _ => {
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                (rest[..end].to_owned(), &rest[end..])
            }
        };
        if !matches!(op.as_str(), "=" | "!=" | "LIKE" | "ILIKE") {
            return Err(ApiError::invalid(format!(
                "unsupported operator {:?} in filter {shown}",
                head(&op, 20)
            )));
        }
        if !matches!(
            key.as_str(),
            "name" | "run_id" | "source_path" | "version_number"
        ) && !key.starts_with("tag.")
        {
            return Err(ApiError::invalid(format!(
                "unsupported filter key {:?}: use name, run_id, source_path, version_number or tag.KEY",
                head(&key, 100)
            )));
        }
        if matches!(op.as_str(), "LIKE" | "ILIKE") && value.chars().count() > MAX_PATTERN_CHARS {
            return Err(ApiError::invalid(format!(
                "{op} pattern too long: at most {MAX_PATTERN_CHARS} characters, got {}",
                value.chars().count()
            )));
        }
        out.push(Clause { key, op, value });
        rest = after.trim_start();
        if rest.is_empty() {
            break;
        }
        let Some(r) = rest
            .strip_prefix("AND ")
            .or_else(|| rest.strip_prefix("and "))
        else {
            return Err(ApiError::invalid(format!(
                "only AND joins filter clauses: {shown}"
            )));
        };
        rest = r.trim_start();
    }
    Ok(out)
}

/// SQL LIKE: `%` any run, `_` one character, everything else itself (no
/// escape character). `fold` compares the lowercased pattern and text
/// (ILIKE).
///
/// Iterative, with the text position of the last `%` to go back to: time
/// is at most the product of the two lengths and the stack stays flat,
/// whatever the pattern.
fn like(pattern: &str, s: &str, fold: bool) -> bool {
    let (p, s): (Vec<char>, Vec<char>) = if fold {
        (
            pattern.to_lowercase().chars().collect(),
            s.to_lowercase().chars().collect(),
        )
    } else {
        (pattern.chars().collect(), s.chars().collect())
    };
    let (mut pi, mut si) = (0, 0);
    // After the last `%` seen: the pattern index past it and the text index
    // its run ends at so far.
    let mut back: Option<(usize, usize)> = None;
    while si < s.len() {
        match p.get(pi) {
            Some('%') => {
                pi += 1;
                back = Some((pi, si));
            }
            Some(&c) if c == '_' || c == s[si] => {
                pi += 1;
                si += 1;
            }
            _ => match back {
                // The `%` takes one more character and the rest of the
                // pattern tries again from there.
                Some((bp, bs)) => {
                    pi = bp;
                    si = bs + 1;
                    back = Some((bp, si));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '%')
}

/// A tag clause: an absent tag matches only `!=`.
fn matches_tag(c: &Clause, tags: &[Tag]) -> bool {
    let key = c.key.strip_prefix("tag.").unwrap_or(&c.key);
    match tags.iter().find(|t| t.key == key) {
        Some(t) => matches(c, &t.value),
        None => c.op == "!=",
    }
}

fn matches(c: &Clause, v: &str) -> bool {
    match c.op.as_str() {
        "=" => v == c.value,
        "!=" => v != c.value,
        "LIKE" => like(&c.value, v, false),
        _ => like(&c.value, v, true),
    }
}

/// Applies `max_results` and an offset `page_token`.
#[cfg(test)]
fn page<T>(
    items: Vec<T>,
    q: &SearchQuery,
    default_max: usize,
) -> Result<(Vec<T>, Option<String>), ApiError> {
    Ok(page_of(items, page_start(q)?, q, default_max))
}

/// Where a page starts: its `page_token`.
fn page_start(q: &SearchQuery) -> Result<usize, ApiError> {
    match &q.page_token {
        Some(t) if !t.is_empty() => t.parse().map_err(|_| {
            ApiError::invalid(format!(
                "bad page_token {:?}: expected the next_page_token of an earlier page",
                head(t, 40)
            ))
        }),
        _ => Ok(0),
    }
}

/// The page from `start`, and the next page's token.
fn page_of<T>(
    items: Vec<T>,
    start: usize,
    q: &SearchQuery,
    default_max: usize,
) -> (Vec<T>, Option<String>) {
    let max = q.max_results.unwrap_or(default_max).max(1);
    let total = items.len();
    let page: Vec<T> = items.into_iter().skip(start).take(max).collect();
    // Past the last item when the sum does not fit: no next page.
    let end = start.saturating_add(max);
    let next = (end < total).then(|| end.to_string());
    (page, next)
}

async fn mlf_search_models(State(st): State<AppState>, uri: Uri) -> ApiResult {
    let q = SearchQuery::parse(&uri, MODEL_PAGES)?;
    let order = parse_order_by(&q.order_by, MODEL_ORDER_KEYS)?;
    let clauses = parse_filter(q.filter.as_deref().unwrap_or(""))?;
    if let Some(c) = clauses
        .iter()
        .find(|c| c.key != "name" && !c.key.starts_with("tag."))
    {
        return Err(ApiError::invalid(format!(
            "registered models filter on name and tags only, not {}",
            c.key
        )));
    }
    let start = page_start(&q)?;
    let acct = st.azure_account.clone();
    let cap = st.max_response;
    let _place = heavy_place(&st).await?;
    let (models, next) = read(&st, move |r| {
        let with_tags = clauses.iter().any(|c| c.key.starts_with("tag."));
        let mut rows = r.model_rows(with_tags)?;
        rows.retain(|m| {
            clauses.iter().all(|c| {
                if c.key == "name" {
                    matches(c, &m.name)
                } else {
                    matches_tag(c, &m.tags)
                }
            })
        });
        sort_rows(&mut rows, order, &[("name", true)], |m, k| match k {
            "creation_timestamp" => SortKey::Num(m.created_ms),
            "last_updated_timestamp" => SortKey::Num(m.updated_ms),
            _ => SortKey::Text(&m.name),
        });
        // Only this page's models are loaded, up to the answer's size cap.
        let (rows, next) = page_of(rows, start, &q, MODEL_PAGES.default);
        let mut models = Vec::new();
        let mut bytes = 0usize;
        for m in &rows {
            let v = model_with_latest(r, &m.name, acct.as_deref())?;
            bytes += v.to_string().len() + 1;
            if !models.is_empty() && bytes > cap {
                break;
            }
            models.push(v);
        }
        let next = if models.len() < rows.len() {
            Some((start + models.len()).to_string())
        } else {
            next
        };
        Ok((models, next))
    })
    .await?;
    let mut body = json!({ "registered_models": models });
    if let Some(n) = next {
        body["next_page_token"] = n.into();
    }
    Ok(Json(body))
}

#[derive(Deserialize)]
struct NameBody {
    name: String,
}

async fn mlf_delete_model(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    uri: Uri,
    body: Bytes,
) -> ApiResult {
    let NameBody { name } = body_or_query(&uri, &body)?;
    db(&st, move |r| r.delete_model(&id.actor, &name)).await?;
    Ok(Json(json!({})))
}

#[derive(Deserialize)]
struct TagBody {
    name: String,
    #[serde(default)]
    version: Option<String>,
    key: String,
    #[serde(default)]
    value: Option<String>,
}

async fn mlf_set_model_tag(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<TagBody>,
) -> ApiResult {
    let value = b.value.unwrap_or_default();
    db(&st, move |r| {
        r.set_model_tag(&id.actor, &b.name, &b.key, Some(&value))
    })
    .await?;
    Ok(Json(json!({})))
}

/// A DELETE's arguments: MLflow's client sends a JSON body; plain HTTP
/// clients often use the query string. Either works.
fn body_or_query<T: serde::de::DeserializeOwned>(uri: &Uri, body: &Bytes) -> Result<T, ApiError> {
    if body.iter().any(|b| !b.is_ascii_whitespace()) {
        serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))
    } else {
        Query::<T>::try_from_uri(uri)
            .map(|q| q.0)
            .map_err(|e| ApiError::invalid(e.body_text()))
    }
}

async fn mlf_delete_model_tag(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    uri: Uri,
    body: Bytes,
) -> ApiResult {
    let b: TagBody = body_or_query(&uri, &body)?;
    db(&st, move |r| {
        r.set_model_tag(&id.actor, &b.name, &b.key, None)
    })
    .await?;
    Ok(Json(json!({})))
}

#[derive(Deserialize)]
struct AliasBody {
    name: String,
    alias: String,
    #[serde(default)]
    version: Option<String>,
}

async fn mlf_set_alias(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<AliasBody>,
) -> ApiResult {
    let v = parse_version(b.version.as_deref().unwrap_or(""))?;
    db(&st, move |r| {
        r.set_alias(
            &id.actor,
            &b.name,
            &b.alias,
            v,
            "set through the MLflow API",
        )
    })
    .await?;
    Ok(Json(json!({})))
}

/// MLflow answers a missing alias with 400 `INVALID_PARAMETER_VALUE`
/// (keel's own API: 404).
fn mlf_alias_error(e: RegistryError) -> ApiError {
    match e {
        RegistryError::UnknownAlias { name, alias } => ApiError::invalid(format!(
            "Registered model alias {alias} not found on model {name}"
        )),
        e => e.into(),
    }
}

async fn mlf_get_alias(State(st): State<AppState>, Query(b): Query<AliasBody>) -> ApiResult {
    let v = read_raw(&st, move |r| r.resolve(&VersionRef::Alias(b.name, b.alias)))
        .await?
        .map_err(mlf_alias_error)?;
    Ok(Json(
        json!({ "model_version": mlf_version(&v, st.azure_account.as_deref()) }),
    ))
}

async fn mlf_delete_alias(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    uri: Uri,
    body: Bytes,
) -> ApiResult {
    let b: AliasBody = body_or_query(&uri, &body)?;
    // Deleting an alias that is not set succeeds, as in MLflow (and
    // records nothing).
    match db_raw(&st, move |r| {
        r.delete_alias(
            &id.actor,
            &b.name,
            &b.alias,
            "deleted through the MLflow API",
        )
    })
    .await?
    {
        Ok(_) | Err(RegistryError::UnknownAlias { .. }) => Ok(Json(json!({}))),
        Err(e) => Err(e.into()),
    }
}

#[derive(Deserialize)]
struct CreateVersion {
    name: String,
    #[serde(default)]
    source: String,
    #[serde(default)]
    run_id: Option<String>,
    #[serde(default)]
    tags: Vec<MlfTag>,
    #[serde(default)]
    description: Option<String>,
    /// MLflow 3's logged model (`models:/m-...` sources).
    #[serde(default)]
    model_id: Option<String>,
    #[serde(default)]
    run_link: Option<String>,
}

async fn mlf_create_version(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<CreateVersion>,
) -> ApiResult {
    required("name", &b.name)?;
    required("source", &b.source)?;
    let model_id = b.model_id.filter(|m| !m.is_empty());
    let mut run_id = b.run_id.filter(|r| !r.is_empty());
    if run_id.is_none() {
        let logged = model_id
            .as_deref()
            .or_else(|| crate::tracking::logged_model_of_source(&b.source));
        if let Some(logged) = logged {
            run_id = logged_model_run(st.tracking.as_ref(), &b.name, logged).await;
        }
    }
    let new = NewVersion {
        model: b.name,
        source: b.source,
        description: b.description.unwrap_or_default(),
        lineage: crate::Lineage {
            run_id,
            mlflow_model_id: model_id,
            run_link: b.run_link.filter(|l| !l.is_empty()),
            ..Default::default()
        },
        tags: b
            .tags
            .into_iter()
            .map(|t| Tag {
                key: t.key,
                value: t.value,
            })
            .collect(),
        create_model: false,
    };
    let v = db(&st, move |r| r.register_version(&id.actor, &new, None)).await?;
    Ok(Json(
        json!({ "model_version": mlf_version(&v, st.azure_account.as_deref()) }),
    ))
}

/// The run that logged MLflow model `model_id`, from the tracking server,
/// as MLflow's own registry fills it in. A registration never fails for
/// it: without a tracking server, or when it cannot say, the version has
/// no run and a warning is logged.
async fn logged_model_run(
    tracking: Option<&crate::tracking::TrackingServer>,
    name: &str,
    model_id: &str,
) -> Option<String> {
    let name = head(name, 200);
    let model_id = head(model_id, 200);
    let Some(t) = tracking else {
        tracing::warn!(
            model = name,
            model_id,
            "a version of a logged model is registered without its run: no MLflow tracking server is configured (model.tracking_uri)"
        );
        return None;
    };
    match t.source_run(model_id).await {
        Ok(Some(run)) => Some(run),
        Ok(None) => {
            tracing::warn!(
                model = name,
                model_id,
                tracking_uri = t.url(),
                "the tracking server records no run for this logged model"
            );
            None
        }
        Err(error) => {
            tracing::warn!(
                model = name,
                model_id,
                error = %error.chain(),
                "a version of a logged model is registered without its run"
            );
            None
        }
    }
}

async fn mlf_get_version(State(st): State<AppState>, Query(q): Query<NameQuery>) -> ApiResult {
    let n = parse_version(q.version.as_deref().unwrap_or(""))?;
    let v = read(&st, move |r| r.version(&q.name, n)).await?;
    Ok(Json(
        json!({ "model_version": mlf_version(&v, st.azure_account.as_deref()) }),
    ))
}

async fn mlf_search_versions(State(st): State<AppState>, uri: Uri) -> ApiResult {
    let q = SearchQuery::parse(&uri, VERSION_PAGES)?;
    let order = parse_order_by(&q.order_by, VERSION_ORDER_KEYS)?;
    // MLflow's default: most recently updated first.
    let order = if order.is_empty() {
        vec![("last_updated_timestamp", false)]
    } else {
        order
    };
    let clauses = parse_filter(q.filter.as_deref().unwrap_or(""))?;
    // Equalities on the name and the run narrow the rows in SQL; every
    // clause is still applied below.
    let exact = |key: &str| {
        clauses
            .iter()
            .find(|c| c.key == key && c.op == "=")
            .map(|c| c.value.clone())
    };
    let exact_name = exact("name");
    // (A run id of "" matches versions without a run: left to the filter.)
    let exact_run = exact("run_id").filter(|r| !r.is_empty());
    let start = page_start(&q)?;
    let acct = st.azure_account.clone();
    let cap = st.max_response;
    let _place = heavy_place(&st).await?;
    let (versions, next) = read(&st, move |r| {
        let with_tags = clauses.iter().any(|c| c.key.starts_with("tag."));
        let mut rows = r.version_rows(exact_name.as_deref(), exact_run.as_deref(), with_tags)?;
        rows.retain(|v| {
            clauses.iter().all(|c| {
                if c.key.starts_with("tag.") {
                    return matches_tag(c, &v.tags);
                }
                match c.key.as_str() {
                    "name" => matches(c, &v.model),
                    "run_id" => matches(c, v.run_id.as_deref().unwrap_or_default()),
                    "source_path" => matches(c, &row_source(v, acct.as_deref())),
                    _ => matches(c, &v.version.to_string()),
                }
            })
        });
        sort_rows(
            &mut rows,
            order,
            &[("name", true), ("version_number", false)],
            |v, k| match k {
                "version_number" => SortKey::Num(v.version as i64),
                "creation_timestamp" => SortKey::Num(v.created_ms),
                "last_updated_timestamp" => SortKey::Num(v.updated_ms),
                _ => SortKey::Text(&v.model),
            },
        );
        // Only this page's versions are loaded, up to the answer's size
        // cap: a page cut short there says where the rest starts, as
        // MLflow's clients follow next_page_token.
        let (rows, next) = page_of(rows, start, &q, VERSION_PAGES.default);
        let mut versions = Vec::new();
        let mut bytes = 0usize;
        for v in r.versions_of_rows(&rows)? {
            let v = mlf_version(&v, acct.as_deref());
            bytes += v.to_string().len() + 1;
            if !versions.is_empty() && bytes > cap {
                break;
            }
            versions.push(v);
        }
        let next = if versions.len() < rows.len() {
            Some((start + versions.len()).to_string())
        } else {
            next
        };
        Ok((versions, next))
    })
    .await?;
    let mut body = json!({ "model_versions": versions });
    if let Some(n) = next {
        body["next_page_token"] = n.into();
    }
    Ok(Json(body))
}

/// [`mlf_source`] of a search row.
fn row_source(v: &crate::VersionRow, azure_account: Option<&str>) -> String {
    match &v.artifact_url {
        Some(url) => mlflow_artifact_uri(url, azure_account).unwrap_or_else(|| url.clone()),
        None => v.source.clone(),
    }
}

async fn mlf_set_version_tag(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<TagBody>,
) -> ApiResult {
    let n = parse_version(b.version.as_deref().unwrap_or(""))?;
    if b.key.starts_with(LINEAGE_TAG_PREFIX) {
        return Err(ApiError::invalid(format!(
            "tags under {LINEAGE_TAG_PREFIX} show the version's lineage and cannot be set: choose another key than {:?}",
            head(&b.key, 100)
        )));
    }
    let value = b.value.unwrap_or_default();
    db(&st, move |r| {
        r.set_version_tag(&id.actor, &b.name, n, &b.key, Some(&value))
    })
    .await?;
    Ok(Json(json!({})))
}

async fn mlf_delete_version_tag(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    uri: Uri,
    body: Bytes,
) -> ApiResult {
    let b: TagBody = body_or_query(&uri, &body)?;
    let n = parse_version(b.version.as_deref().unwrap_or(""))?;
    db(&st, move |r| {
        r.set_version_tag(&id.actor, &b.name, n, &b.key, None)
    })
    .await?;
    Ok(Json(json!({})))
}

#[derive(Deserialize)]
struct LatestVersions {
    name: String,
    #[serde(default)]
    stages: Vec<String>,
}

/// MLflow's stages: keel has none, so every version is in `None`.
async fn latest_versions(st: AppState, b: LatestVersions) -> ApiResult {
    required("name", &b.name)?;
    let mut none_stage = b.stages.is_empty();
    for s in &b.stages {
        match s.to_ascii_lowercase().as_str() {
            "none" => none_stage = true,
            "staging" | "production" | "archived" => {}
            _ => {
                return Err(ApiError::invalid(format!(
                    "Invalid Model Version stage: {}. Value must be one of None, Staging, Production, Archived",
                    head(s, 64)
                )))
            }
        }
    }
    let acct = st.azure_account.clone();
    let versions = read(&st, move |r| {
        r.model(&b.name)?;
        if !none_stage {
            return Ok(Vec::new());
        }
        Ok(match r.resolve(&VersionRef::Latest(b.name.clone())) {
            Ok(v) => vec![mlf_version(&v, acct.as_deref())],
            Err(RegistryError::Invalid { .. }) => Vec::new(),
            Err(e) => return Err(e),
        })
    })
    .await?;
    Ok(Json(json!({ "model_versions": versions })))
}

/// `get_latest_versions` (POST with a JSON body; also GET): the highest
/// READY version, as the one version in stage `None`.
async fn mlf_latest_versions_body(State(st): State<AppState>, body: Bytes) -> ApiResult {
    let b: LatestVersions = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))?;
    latest_versions(st, b).await
}

async fn mlf_latest_versions_query(State(st): State<AppState>, uri: Uri) -> ApiResult {
    let pairs = query_pairs(&uri)?;
    let mut b = LatestVersions {
        name: String::new(),
        stages: Vec::new(),
    };
    for (k, v) in pairs {
        match k.as_str() {
            "name" => b.name = v,
            "stages" => b.stages.push(v),
            _ => {}
        }
    }
    latest_versions(st, b).await
}

/// The query string's `key=value` pairs, keys repeated for lists.
fn query_pairs(uri: &Uri) -> Result<Vec<(String, String)>, ApiError> {
    serde_urlencoded::from_str(uri.query().unwrap_or(""))
        .map_err(|e| ApiError::invalid(format!("bad query string: {e}")))
}

/// The longest start of `s` of at most `max` bytes (reflected input).
pub(crate) fn head(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `get_model_version_download_uri`: where MLflow's client reads the
/// version's files with its own credentials (see [`mlf_source`]).
async fn mlf_download_uri(State(st): State<AppState>, Query(q): Query<NameQuery>) -> ApiResult {
    let n = parse_version(q.version.as_deref().unwrap_or(""))?;
    let v = read(&st, move |r| r.version(&q.name, n)).await?;
    if v.status != crate::Status::Ready {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "INVALID_STATE",
            format!(
                "model {} version {} is {}: only READY versions can be downloaded",
                v.model, v.version, v.status
            ),
        ));
    }
    Ok(Json(
        json!({ "artifact_uri": mlf_source(&v, st.azure_account.as_deref()) }),
    ))
}

#[derive(Deserialize)]
struct UpdateBody {
    name: String,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    description: Option<String>,
}

/// `update_registered_model`: the description.
async fn mlf_update_model(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<UpdateBody>,
) -> ApiResult {
    required("name", &b.name)?;
    let acct = st.azure_account.clone();
    let m = db(&st, move |r| {
        r.update_model(&id.actor, &b.name, b.description.as_deref().unwrap_or(""))?;
        model_with_latest(r, &b.name, acct.as_deref())
    })
    .await?;
    Ok(Json(json!({ "registered_model": m })))
}

#[derive(Deserialize)]
struct RenameBody {
    name: String,
    #[serde(default)]
    new_name: String,
}

/// `rename_registered_model`: only a model with no versions and no alias
/// history (see [`Registry::rename_model`]).
async fn mlf_rename_model(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<RenameBody>,
) -> ApiResult {
    required("name", &b.name)?;
    required("new_name", &b.new_name)?;
    let acct = st.azure_account.clone();
    let m = db(&st, move |r| {
        r.rename_model(&id.actor, &b.name, &b.new_name)?;
        model_with_latest(r, &b.new_name, acct.as_deref())
    })
    .await?;
    Ok(Json(json!({ "registered_model": m })))
}

/// `update_model_version`: the description, the one field of a version
/// that may change after READY.
async fn mlf_update_version(
    State(st): State<AppState>,
    Extension(id): Extension<Identity>,
    Json(b): Json<UpdateBody>,
) -> ApiResult {
    required("name", &b.name)?;
    let n = parse_version(b.version.as_deref().unwrap_or(""))?;
    let v = db(&st, move |r| {
        r.update_version(
            &id.actor,
            &b.name,
            n,
            b.description.as_deref().unwrap_or(""),
        )
    })
    .await?;
    Ok(Json(
        json!({ "model_version": mlf_version(&v, st.azure_account.as_deref()) }),
    ))
}

/// `delete_model_version`: refused, versions are kept (409 INVALID_STATE,
/// naming the version).
async fn mlf_delete_version(State(st): State<AppState>, uri: Uri, body: Bytes) -> ApiResult {
    let b: UpdateBody = body_or_query(&uri, &body)?;
    let n = parse_version(b.version.as_deref().unwrap_or(""))?;
    read(&st, move |r| r.delete_version(&b.name, n)).await?;
    Ok(Json(json!({})))
}

/// `transition_model_version_stage`: stages are deprecated in MLflow and
/// keel has aliases instead.
async fn mlf_transition_stage() -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "NOT_IMPLEMENTED",
        "model version stages are not supported (MLflow deprecated them): use aliases, \
         e.g. MlflowClient().set_registered_model_alias(name, \"production\", version), \
         and load models:/NAME@production",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_and_match() {
        let c = parse_filter("name='m1' AND run_id = \"r 1\"").expect("parse");
        assert_eq!(c.len(), 2);
        assert!(matches(&c[0], "m1") && matches(&c[1], "r 1"));
        let c = parse_filter("name LIKE 'ab%'").expect("like");
        assert!(matches(&c[0], "abc") && !matches(&c[0], "xabc"));
        let c = parse_filter("name ILIKE '%B_'").expect("ilike");
        assert!(matches(&c[0], "xxbz"));
        assert!(parse_filter("").expect("empty").is_empty());
        let c = parse_filter("name LIKE 'm%' AND tag.`mlflow.prompt.is_prompt` != 'true'")
            .expect("tag");
        assert_eq!(c[1].key, "tag.mlflow.prompt.is_prompt");
        assert!(matches_tag(&c[1], &[]));
        assert!(parse_filter("foo = '1'").is_err());
        assert!(parse_filter("name = 'x' OR name = 'y'").is_err());
    }

    /// The backtracking matcher `like` replaced: every way to split the
    /// text is tried, one recursion level per pattern character.
    fn like_reference(pattern: &str, s: &str, fold: bool) -> bool {
        let (p, s): (Vec<char>, Vec<char>) = if fold {
            (
                pattern.to_lowercase().chars().collect(),
                s.to_lowercase().chars().collect(),
            )
        } else {
            (pattern.chars().collect(), s.chars().collect())
        };
        fn m(p: &[char], s: &[char]) -> bool {
            match p.first() {
                None => s.is_empty(),
                Some('%') => (0..=s.len()).any(|i| m(&p[1..], &s[i..])),
                Some('_') => !s.is_empty() && m(&p[1..], &s[1..]),
                Some(c) => s.first() == Some(c) && m(&p[1..], &s[1..]),
            }
        }
        m(&p, &s)
    }

    /// All strings over `alphabet` up to `max_len` characters.
    fn strings(alphabet: &[char], max_len: usize) -> Vec<String> {
        let mut out = vec![String::new()];
        let mut level = vec![String::new()];
        for _ in 0..max_len {
            level = level
                .iter()
                .flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}")))
                .collect();
            out.extend(level.iter().cloned());
        }
        out
    }

    #[test]
    fn like_agrees_with_backtracking_on_every_short_input() {
        let patterns = strings(&['a', 'B', '%', '_'], 5);
        let texts = strings(&['a', 'b', 'B'], 5);
        for p in &patterns {
            for t in &texts {
                for fold in [false, true] {
                    assert_eq!(
                        like(p, t, fold),
                        like_reference(p, t, fold),
                        "pattern {p:?} text {t:?} fold {fold}"
                    );
                }
            }
        }
    }

    #[test]
    fn like_semantics() {
        assert!(like("", "", false));
        assert!(!like("", "a", false));
        assert!(like("%", "", false));
        assert!(like("%%", "anything", false));
        assert!(!like("_", "", false));
        assert!(
            like("_", "\u{20ac}", false),
            "`_` is one character, not one byte"
        );
        assert!(like("a_c", "a\u{20ac}c", false));
        assert!(like("%.ckpt", "run/step-10.ckpt", false));
        assert!(!like("%.ckpt", "run/step-10.ckpt.tmp", false));
        assert!(like("%a%b%c%", "xxaxxbxxcxx", false));
        assert!(!like("%a%b%c%", "xxcxxbxxaxx", false));
        assert!(!like("ABC", "abc", false));
        assert!(like("ABC", "abc", true));
        assert!(like("%\u{c9}T\u{c9}", "\u{e9}t\u{e9}", true));
        // No escape character: `\` is a literal.
        assert!(like("a\\%", "a\\bc", false));
        assert!(!like("a\\%", "abc", false));
    }

    /// Runs `like` on its own thread and gives up after a few seconds.
    fn like_within_seconds(pattern: String, text: String) -> Option<bool> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(like(&pattern, &text, true));
        });
        rx.recv_timeout(std::time::Duration::from_secs(5)).ok()
    }

    #[test]
    fn like_is_polynomial_in_many_wildcards() {
        let text = "a".repeat(10_000);
        let pattern = format!("{}b", "%".repeat(5_000));
        assert_eq!(like_within_seconds(pattern, text.clone()), Some(false));
        let pattern = format!("{}a", "%a".repeat(2_000));
        assert_eq!(like_within_seconds(pattern, text.clone()), Some(true));
        let pattern = "%a".repeat(6_000);
        assert_eq!(like_within_seconds(pattern, "a".repeat(5_999)), Some(false));
        assert_eq!(like_within_seconds("%a".repeat(6_000), text), Some(true));
    }

    #[test]
    fn like_handles_patterns_longer_than_a_stack() {
        let text = "x".repeat(200_000);
        assert_eq!(
            like_within_seconds("_".repeat(200_000), text.clone()),
            Some(true)
        );
        assert_eq!(like_within_seconds("_".repeat(200_001), text), Some(false));
    }

    #[test]
    fn artifact_urls_in_mlflow_schemes() {
        let acct = Some("acct");
        assert_eq!(
            mlflow_artifact_uri("file:///srv/a/m/v1", acct).as_deref(),
            Some("file:///srv/a/m/v1")
        );
        assert_eq!(
            mlflow_artifact_uri("s3://b/p/m/v1", None).as_deref(),
            Some("s3://b/p/m/v1")
        );
        assert_eq!(
            mlflow_artifact_uri("az://models/p/m/v1", acct).as_deref(),
            Some("wasbs://models@acct.blob.core.windows.net/p/m/v1")
        );
        assert_eq!(mlflow_artifact_uri("az://models/p", None), None);
        assert_eq!(mlflow_artifact_uri("memory://x", acct), None);
    }

    fn query(max_results: Option<usize>, page_token: Option<&str>) -> SearchQuery {
        SearchQuery {
            filter: None,
            max_results,
            page_token: page_token.map(str::to_owned),
            order_by: Vec::new(),
        }
    }

    /// At most [`HEAVY_READS`] heavy reads hold a place; the next waits,
    /// is answered 503 when none frees up in time, and gets one as soon
    /// as one is given back.
    #[tokio::test]
    async fn heavy_reads_take_one_of_a_few_places() {
        let reg = Registry::open_in_memory(Arc::new(crate::FixedClock(0))).expect("registry");
        let st = AppState {
            reg: Arc::new(tokio::sync::Mutex::new(reg)),
            readers: Arc::new(Readers::new(None)),
            heavy: Arc::new(tokio::sync::Semaphore::new(HEAVY_READS)),
            heavy_wait: std::time::Duration::from_millis(50),
            max_response: MAX_RESPONSE_BYTES,
            token_sha256: None,
            azure_account: None,
            tracking: None,
        };
        let mut held = Vec::new();
        for _ in 0..HEAVY_READS {
            held.push(heavy_place(&st).await.expect("a place"));
        }
        let e = heavy_place(&st).await.expect_err("none left");
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, "TEMPORARILY_UNAVAILABLE");
        held.pop();
        let _place = heavy_place(&st).await.expect("a place given back");
    }

    /// Every connection of the pool in use: the next read waits its bound
    /// and gets 503 TEMPORARILY_UNAVAILABLE; the writer's lock, the same.
    /// A connection given back serves the next read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_waits_a_bounded_time_for_a_connection_then_gets_503() {
        let dir = tempfile::tempdir().expect("tmp");
        let reg =
            Registry::open(&dir.path().join("r.db"), Arc::new(crate::FixedClock(0))).expect("open");
        let mut readers = Readers::new(reg.connector());
        readers.places = Arc::new(tokio::sync::Semaphore::new(1));
        readers.size = 1;
        readers.wait = std::time::Duration::from_millis(50);
        let st = AppState {
            reg: Arc::new(tokio::sync::Mutex::new(reg)),
            readers: Arc::new(readers),
            heavy: Arc::new(tokio::sync::Semaphore::new(HEAVY_READS)),
            heavy_wait: std::time::Duration::from_millis(50),
            max_response: MAX_RESPONSE_BYTES,
            token_sha256: None,
            azure_account: None,
            tracking: None,
        };
        let held = st
            .readers
            .places
            .clone()
            .acquire_owned()
            .await
            .expect("held");
        let e = read(&st, |r| r.models())
            .await
            .expect_err("no connection free");
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, "TEMPORARILY_UNAVAILABLE");
        assert!(
            e.message.contains("1 database connections"),
            "{}",
            e.message
        );
        drop(held);
        assert!(read(&st, |r| r.models())
            .await
            .expect("a connection")
            .is_empty());

        let writer = st.reg.clone().lock_owned().await;
        let e = db(&st, |r| r.models()).await.expect_err("writer busy");
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        drop(writer);
        assert!(db(&st, |r| r.models())
            .await
            .expect("the writer")
            .is_empty());
    }

    #[test]
    fn pages_with_extreme_offsets_and_sizes() {
        let items = || (0..10).collect::<Vec<u32>>();
        let (p, next) = page(items(), &query(Some(4), None), 100).expect("first");
        assert_eq!((p, next.as_deref()), (vec![0, 1, 2, 3], Some("4")));
        let (p, next) = page(items(), &query(Some(4), Some("8")), 100).expect("last");
        assert_eq!((p, next), (vec![8, 9], None));
        let (p, next) = page(items(), &query(Some(usize::MAX), Some("3")), 100).expect("max");
        assert_eq!((p, next), ((3..10).collect(), None));
        let top = usize::MAX.to_string();
        let (p, next) = page(items(), &query(Some(usize::MAX), Some(&top)), 100).expect("both");
        assert_eq!((p, next), (vec![], None));
        let (p, next) = page(items(), &query(Some(2), Some(&top)), 100).expect("far");
        assert_eq!((p, next), (vec![], None));
        let e = page(items(), &query(None, Some("184467440737095516160")), 100)
            .expect_err("beyond usize");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("184467440737095516160"), "{}", e.message);
        let e = page(items(), &query(None, Some("-1")), 100).expect_err("negative");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}
