//! Talking to backends: their URLs and the pooled HTTP/1 client (plain
//! or TLS). What is read from their answers is in [`crate::answer`].

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri};
use http_body_util::Full;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tower::Service;

pub use crate::config::BackendUrl;
use crate::config::UpstreamTlsConfig;
use crate::error::GatewayError;
use crate::pool::{self, Pool, Return, Sender, UpstreamBody};
use crate::tls::UpstreamTlsFiles;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Conn = MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>;

/// The HTTPS-or-HTTP connector, with the TCP connect and the TLS handshake
/// together bounded by the connect timeout for `https://` (plain `http://`
/// keeps the TCP connector's own timeout).
#[derive(Debug, Clone)]
struct Connector {
    inner: HttpsConnector<HttpConnector>,
    timeout: Duration,
}

impl tower::Service<Uri> for Connector {
    type Response = Conn;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Conn, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
        let fut = self.inner.call(uri);
        if !tls {
            return fut;
        }
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, fut).await {
                Ok(r) => r,
                Err(_) => Err(format!(
                    "no TLS connection within the connect timeout ({} ms)",
                    timeout.as_millis()
                )
                .into()),
            }
        })
    }
}

#[derive(Debug)]
struct Current {
    /// Kept-alive connections made by `connector`.
    pool: Arc<Pool>,
    connector: Connector,
    /// Digest of the `[upstream_tls]` files the client was built from.
    digest: [u8; 32],
    /// How many CA certificates it trusts.
    roots: usize,
}

impl Current {
    /// A connection to `uri`'s authority: an idle one that is still open,
    /// else a new one (TCP, TLS for `https://`, then the HTTP/1 handshake).
    async fn checkout(
        &self,
        uri: &Uri,
        tls: bool,
        authority: &Authority,
    ) -> Result<(Sender, bool), String> {
        while let Some(s) = self.pool.take(tls, authority, std::time::Instant::now()) {
            if let Some(s) = pool::ready(s).await {
                return Ok((s, true));
            }
        }
        // Boxed: opening a connection is rare once the pool is warm, and
        // its state (TCP, TLS, handshake) would otherwise be part of every
        // request's future, moved with it.
        Box::pin(self.connect(uri)).await.map(|s| (s, false))
    }

    /// A new connection to `uri`'s authority.
    async fn connect(&self, uri: &Uri) -> Result<Sender, String> {
        let mut c = self.connector.clone();
        std::future::poll_fn(|cx| c.poll_ready(cx))
            .await
            .map_err(|e| format!("connect: {}", describe(&*e)))?;
        let io = c
            .call(uri.clone())
            .await
            .map_err(|e| format!("connect: {}", describe(&*e)))?;
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .max_buf_size(BACKEND_BUFFER)
            .handshake(io)
            .await
            .map_err(|e| format!("handshake: {}", describe(&e)))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "backend connection ended");
            }
        });
        Ok(sender)
    }
}

/// The pooled client to every backend and JWKS URL. Clones share one
/// client, which a reload replaces when `[upstream_tls]` or its files
/// changed (requests in flight finish on the old one).
#[derive(Debug, Clone)]
pub struct Upstream {
    current: Arc<RwLock<Arc<Current>>>,
    connect_timeout: Duration,
}

/// The most a backend connection buffers (hyper's default, about 400 KiB,
/// held by every connection that read a large response, pooled ones too,
/// would make many concurrent large responses cost more than the body
/// budget they are counted in).
pub const BACKEND_BUFFER: usize = 64 << 10;

/// How many idle connections are kept per backend, and for how long.
const MAX_IDLE: usize = 512;
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

impl Upstream {
    pub fn new(connect_timeout: Duration, tls: &UpstreamTlsConfig) -> Result<Self, GatewayError> {
        let files = UpstreamTlsFiles::read(tls)?;
        let current = Self::build(connect_timeout, &files)?;
        Ok(Self {
            current: Arc::new(RwLock::new(Arc::new(current))),
            connect_timeout,
        })
    }

    fn build(connect_timeout: Duration, files: &UpstreamTlsFiles) -> Result<Current, GatewayError> {
        let mut c = HttpConnector::new();
        c.set_connect_timeout(Some(connect_timeout));
        c.set_nodelay(true);
        c.set_keepalive(Some(Duration::from_secs(60)));
        // Let https:// URIs through to the TCP connector; hyper-rustls
        // wraps those in TLS (ALPN http/1.1 only: the client speaks
        // HTTP/1.1) and passes http:// ones on as they are.
        c.enforce_http(false);
        let (tls, roots) = files.client_config()?;
        let https = HttpsConnector::from((c, tls));
        let pool = Arc::new(Pool::new(MAX_IDLE, IDLE_TIMEOUT));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(pool::reap(Arc::downgrade(&pool), IDLE_TIMEOUT / 4));
        }
        Ok(Current {
            pool,
            connector: Connector {
                inner: https,
                timeout: connect_timeout,
            },
            digest: files.digest,
            roots,
        })
    }

    /// The client for `tls`: this one when nothing changed, else a new one
    /// (not shared with this one until [`Upstream::adopt`]). Reads the files
    /// every time, so a reload picks up a renewed certificate.
    pub fn prepare(&self, tls: &UpstreamTlsConfig) -> Result<Self, GatewayError> {
        let files = UpstreamTlsFiles::read(tls)?;
        if self.read().digest == files.digest {
            return Ok(self.clone());
        }
        Ok(Self {
            current: Arc::new(RwLock::new(Arc::new(Self::build(
                self.connect_timeout,
                &files,
            )?))),
            connect_timeout: self.connect_timeout,
        })
    }

    /// Makes every clone of this client use `other`'s from now on.
    pub fn adopt(&self, other: &Upstream) {
        if Arc::ptr_eq(&self.current, &other.current) {
            return;
        }
        let next = other.read();
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = next;
    }

    /// How many CA certificates the client trusts for `https://`.
    pub fn trusted_roots(&self) -> usize {
        self.read().roots
    }

    /// Idle backend connections kept now.
    #[cfg(test)]
    pub fn idle_connections(&self) -> usize {
        self.read().pool.idle_count()
    }

    fn read(&self) -> Arc<Current> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sends a request to the absolute `uri` (in origin form, with a
    /// `Host` header from the URI unless `headers` has one); `timeout`
    /// bounds the wait for a connection and the response head.
    pub async fn send(
        &self,
        method: Method,
        uri: Uri,
        mut headers: HeaderMap,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Response<UpstreamBody>, String> {
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(format!("{uri}: not an http:// or https:// URL")),
        };
        let Some(authority) = uri.authority().cloned() else {
            return Err(format!("{uri}: no host"));
        };
        if !headers.contains_key(http::header::HOST) {
            if let Ok(h) = HeaderValue::from_str(authority.as_str()) {
                headers.insert(http::header::HOST, h);
            }
        }
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = method;
        *req.uri_mut() = uri
            .path_and_query()
            .map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()));
        *req.headers_mut() = headers;
        let cur = self.read();
        let exchange = async move {
            loop {
                let (mut sender, reused) = cur.checkout(&uri, tls, &authority).await?;
                match sender.try_send_request(req).await {
                    Ok(resp) => {
                        let back = Return {
                            pool: cur.pool.clone(),
                            tls,
                            authority,
                            sender,
                        };
                        return Ok(resp.map(|b| UpstreamBody::new(b, Some(back))));
                    }
                    Err(mut e) => match e.take_message() {
                        // Not written: a kept connection that had closed.
                        Some(r) if reused => req = r,
                        _ => return Err(describe(e.error())),
                    },
                }
            }
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(format!("no response within {} ms", timeout.as_millis())),
        }
    }
}

/// An error and its causes on one line.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let chain = source_chain(e);
    if chain.is_empty() {
        e.to_string()
    } else {
        format!("{e}: {chain}")
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = String::new();
    let mut cur = e.source();
    while let Some(c) = cur {
        if !s.is_empty() {
            s.push_str(": ");
        }
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Seconds a `Retry-After` header asks for (delay form only).
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| Duration::from_secs_f64(s.min(86_400.0)))
}

/// Headers sent to a backend: content type, accept, the request id. The
/// client's credentials never are.
pub fn upstream_headers(
    host: Option<&HeaderValue>,
    content_type: Option<&HeaderValue>,
    request_id: crate::access::RequestId,
) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(4);
    if let Some(host) = host {
        h.insert(http::header::HOST, host.clone());
    }
    h.insert(
        http::header::CONTENT_TYPE,
        content_type
            .cloned()
            .unwrap_or(HeaderValue::from_static("application/json")),
    );
    h.insert(crate::access::X_REQUEST_ID, request_id.header_value());
    h
}
