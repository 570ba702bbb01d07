//! The accept loop: `serve(listener, app, opts, shutdown)`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tower::Service;

use crate::conn::{ConnService, Deadlines, Guarded};
use crate::places::Places;

/// What a listener's clients may hold of it, in number and in time.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once; one more is answered 503 and closed
    /// (after the oldest unauthenticated connection waiting for a request
    /// head, if there is one, has been closed to make room for it).
    pub max_connections: usize,
    /// Connections served at once from one client (an IPv4 address or an
    /// IPv6 /64); one more is answered 503 and closed.
    pub max_per_client: usize,
    /// Places that connections which have not authenticated never hold.
    pub reserved: usize,
    /// A request head must arrive within this, from the connection's start
    /// or from the first byte of a later request.
    pub header_timeout: Duration,
    /// A kept-alive connection waits this long for its next request.
    pub idle_timeout: Duration,
    /// A write that makes no progress for this long (a client that does
    /// not read its answers) ends the connection.
    pub write_timeout: Duration,
    /// A connection this old finishes its request in flight, answers it
    /// with `Connection: close`, and closes; one that does not finish
    /// within `drain` is cut.
    pub lifetime: Duration,
    /// At shutdown (and at the end of a lifetime), requests in flight get
    /// this long to finish.
    pub drain: Duration,
    /// The longest request head (hyper's buffer, at least 8 KiB): a longer
    /// one is answered 431.
    pub max_head_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 512,
            max_per_client: 64,
            reserved: 64,
            header_timeout: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(15),
            write_timeout: Duration::from_secs(30),
            lifetime: Duration::from_secs(600),
            drain: Duration::from_secs(30),
            max_head_bytes: 64 << 10,
        }
    }
}

/// How a listener serves: its limits, what a refused connection is told,
/// and whether HTTP/1.1 requests need exactly one `Host`.
pub struct ServeOptions<B> {
    pub limits: Limits,
    /// The whole answer (head and body) to a connection that gets no
    /// place, given why ([`crate::Refused::message`]); [`busy_answer`]
    /// makes one.
    pub busy: fn(&'static str) -> Vec<u8>,
    /// The answer to an HTTP/1.1 request without exactly one `Host`
    /// header; `None` serves such requests.
    pub bad_host: Option<fn() -> Response<B>>,
}

impl<B> Clone for ServeOptions<B> {
    fn clone(&self) -> Self {
        Self {
            limits: self.limits,
            busy: self.busy,
            bad_host: self.bad_host,
        }
    }
}

impl<B> std::fmt::Debug for ServeOptions<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("limits", &self.limits)
            .field("host_check", &self.bad_host.is_some())
            .finish()
    }
}

/// A whole `503 Service Unavailable` answer that closes its connection.
pub fn busy_answer(content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: {content_type}\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The smallest buffer hyper accepts.
const MIN_HEAD_BYTES: usize = 8 << 10;

/// After a refusal: no more writes, and what the client sent read and
/// dropped until it closes or a second has passed (closing with the
/// client's bytes unread would reset the connection and lose the answer).
async fn linger(mut stream: TcpStream) {
    use tokio::io::AsyncReadExt;
    let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// Serves `app` (HTTP/1.1) on an already-bound listener until `shutdown`
/// completes; then stops accepting, lets the requests in flight finish
/// within `limits.drain`, and cuts what is left.
///
/// A connection without a place ([`Places`]) is answered `opts.busy` at
/// once: the answer fits a fresh socket's send buffer, then the write side
/// is shut and what the client sent is read for up to a second, by at
/// most 64 such refusals at a time (past that, closed at once). Accept
/// failures (out of file descriptors) back off up to a second.
pub async fn serve<S, B>(
    listener: TcpListener,
    app: S,
    opts: ServeOptions<B>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()>
where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + Unpin + 'static,
    B: Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let l = opts.limits;
    let places = Places::new(l.max_connections, l.max_per_client, l.reserved);
    let deadlines = Deadlines {
        header: l.header_timeout,
        idle: l.idle_timeout,
        write: l.write_timeout,
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = Duration::ZERO;
    let mut failed_accepts = 0u64;
    let lingering = Arc::new(tokio::sync::Semaphore::new(64));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset) => continue,
                Err(e) => {
                    failed_accepts += 1;
                    if backoff.is_zero() {
                        tracing::warn!(error = %e, "accept failed; backing off");
                    }
                    backoff = (backoff * 2).clamp(Duration::from_millis(20), Duration::from_secs(1));
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => continue,
                        _ = &mut shutdown => break,
                    }
                }
            },
            _ = &mut shutdown => break,
        };
        if !backoff.is_zero() {
            tracing::warn!(failed = failed_accepts, "accepting again");
            backoff = Duration::ZERO;
            failed_accepts = 0;
        }
        while tasks.try_join_next().is_some() {}
        let place = match places.admit(peer.ip()) {
            Ok(p) => p,
            Err(why) => {
                tracing::debug!(reason = why.message(), "connection refused");
                let _ = stream.try_write(&(opts.busy)(why.message()));
                if let Ok(permit) = lingering.clone().try_acquire_owned() {
                    tasks.spawn(async move {
                        let _permit = permit;
                        linger(stream).await;
                    });
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(ConnService::new(
            app.clone(),
            place.in_flight().clone(),
            opts.bad_host,
        ));
        let io = TokioIo::new(Guarded::new(stream, deadlines, place.in_flight().clone()));
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                // The head's and the idle connection's deadlines are
                // `Guarded`'s; hyper's own, later than either, makes it
                // read again as soon as a response is done.
                .header_read_timeout(l.header_timeout + l.idle_timeout)
                .max_buf_size(l.max_head_bytes.max(MIN_HEAD_BYTES))
                .serve_connection(io, svc);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = place.evicted() => {
                    tracing::debug!("an unauthenticated connection waiting for a request closed to make room");
                    Ok(())
                }
                _ = tokio::time::sleep(l.lifetime) => {
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(l.drain, conn.as_mut()).await.unwrap_or(Ok(()))
                }
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.as_mut().await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(place);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(l.drain, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = tasks.len(),
            "connections still open after the drain; closing them"
        );
        tasks.shutdown().await;
    }
    Ok(())
}
