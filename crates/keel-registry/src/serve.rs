//! Serving the HTTP API on a listener: what one client may hold of the
//! server is bounded in number (connections at once, and from one address)
//! and in time (a request head, a write making no progress, a connection's
//! whole life), and a connection over a limit is told so at once (503)
//! rather than left waiting unseen in the listen queue.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// What one client may hold of the server.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections served at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Connections served at once from one client: an IPv4 address, or an
    /// IPv6 /64 (what one host is given); one more is answered 503 and
    /// closed.
    pub max_per_client: usize,
    /// A request head must arrive within this, and a kept-alive connection
    /// is closed when its next request has not begun within it.
    pub header_timeout: Duration,
    /// A write that makes no progress for this long (a client that does
    /// not read its answers) ends the connection.
    pub write_timeout: Duration,
    /// A connection this old finishes its request in flight, answers it
    /// with `Connection: close`, and closes (a body sent a byte at a time
    /// ends here); one that does not finish within `drain` is cut.
    pub lifetime: Duration,
    /// At shutdown (and at the end of a lifetime), requests in flight get
    /// this long to finish.
    pub drain: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 512,
            max_per_client: 64,
            header_timeout: Duration::from_secs(15),
            write_timeout: Duration::from_secs(30),
            lifetime: Duration::from_secs(600),
            drain: Duration::from_secs(30),
        }
    }
}

/// Serves `app` on an already-bound listener with the default
/// [`ConnectionLimits`] until `shutdown` completes, then lets the requests
/// in flight finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    serve_with(listener, app, ConnectionLimits::default(), shutdown).await
}

/// The connections open, in all and per address.
#[derive(Default)]
struct Open {
    total: usize,
    by_client: HashMap<IpAddr, usize>,
}

/// A connection's place in [`Open`], given back when it ends.
struct Place {
    open: Arc<Mutex<Open>>,
    client: IpAddr,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut o = self.open.lock().unwrap_or_else(|p| p.into_inner());
        o.total = o.total.saturating_sub(1);
        if let Some(n) = o.by_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                o.by_client.remove(&self.client);
            }
        }
    }
}

/// Whom a connection counts against: its IPv4 address (an IPv4-mapped
/// IPv6 address included), or its IPv6 /64.
fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(a) => {
            let mut s = a.segments();
            s[4..].fill(0);
            IpAddr::V6(s.into())
        }
        v4 => v4,
    }
}

/// A place for a connection from `client`, or why there is none.
fn admit(
    open: &Arc<Mutex<Open>>,
    client: IpAddr,
    l: &ConnectionLimits,
) -> Result<Place, &'static str> {
    let mut o = open.lock().unwrap_or_else(|p| p.into_inner());
    if o.total >= l.max_connections.max(1) {
        return Err("too many connections");
    }
    let n = o.by_client.entry(client).or_insert(0);
    if *n >= l.max_per_client.max(1) {
        if *n == 0 {
            o.by_client.remove(&client);
        }
        return Err("too many connections from this address");
    }
    *n += 1;
    o.total += 1;
    Ok(Place {
        open: open.clone(),
        client,
    })
}

/// The whole answer to a connection over a limit, in MLflow's error shape
/// (its client retries 503).
fn refusal(why: &str) -> Vec<u8> {
    let body = format!(r#"{{"error_code":"TEMPORARILY_UNAVAILABLE","message":"{why}"}}"#);
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// After a refusal: no more writes, and what the client sent read and
/// dropped until it closes or a second has passed.
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

/// [`serve`] with other limits.
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let open = Arc::new(Mutex::new(Open::default()));
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
                    // Out of file descriptors, say: back off up to a
                    // second, and say so once a run of failures.
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
        let place = match admit(&open, client_of(peer.ip()), &limits) {
            Ok(p) => p,
            Err(why) => {
                // A fresh socket's send buffer takes the answer whole.
                // Closing at once with the client's request unread would
                // reset the connection and lose the answer: the write side
                // is shut and what the client sent is read for up to a
                // second first, by at most 64 such refusals at a time (past
                // that, closed at once).
                let _ = stream.try_write(&refusal(why));
                if let Ok(permit) = lingering.clone().try_acquire_owned() {
                    tasks.spawn(async move {
                        let _permit = permit;
                        linger(stream).await;
                    });
                }
                continue;
            }
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let io = TokioIo::new(WriteDeadline::new(stream, limits.write_timeout));
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            let _place = place;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(io, svc);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = tokio::time::sleep(limits.lifetime) => {
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(limits.drain, conn.as_mut()).await.unwrap_or(Ok(()))
                }
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.as_mut().await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(limits.drain, async {
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

/// A stream whose writes fail when they make no progress for `timeout`.
struct WriteDeadline {
    io: TcpStream,
    timeout: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    fn new(io: TcpStream, timeout: Duration) -> Self {
        Self {
            io,
            timeout,
            stalled: None,
        }
    }

    /// After a write-side poll: progress clears the deadline; no progress
    /// starts it, or fails once it has passed.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match polled {
            Poll::Pending => {
                let timeout = self.timeout;
                let sleep = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if sleep.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client read nothing for the write timeout",
                    )));
                }
                Poll::Pending
            }
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_are_ipv4_addresses_and_ipv6_slash_64s() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("address");
        assert_eq!(client_of(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(client_of(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(
            client_of(ip("2001:db8:1:2:aaaa:bbbb:cccc:dddd")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            client_of(ip("2001:db8:1:2::1")),
            client_of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            client_of(ip("2001:db8:1:2::1")),
            client_of(ip("2001:db8:1:3::1"))
        );
        assert_eq!(client_of(ip("::1")), ip("::"));
    }
}
