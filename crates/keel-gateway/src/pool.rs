//! Kept-alive HTTP/1 connections to backends, one idle list per scheme and
//! authority.
//!
//! A request takes the most recently used idle connection, or opens one.
//! The connection goes back to its list when the response body has been
//! read to its end (a body dropped before its end closes the connection:
//! HTTP/1 cannot reuse it). A connection idle longer than the idle timeout is
//! dropped, by the next request to its backend or by [`reap`] when none
//! comes. A request that a reused connection could not
//! take (the backend had closed it while idle) is sent again on another
//! one; a request that was written is never sent twice here (retries are
//! the gateway's decision, under its retry budget).

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;

use crate::fnv::Fnv;

pub type Sender = SendRequest<Full<Bytes>>;

/// Idle lists by backend authority, hashed with FNV-1a: the authorities
/// are the configuration's backends and JWKS hosts, never a client's input,
/// and a request looks its backend up twice (take and put back).
type ByAuthority = HashMap<Authority, VecDeque<Idle>, BuildHasherDefault<Fnv>>;

/// Idle connections, per (TLS, authority).
#[derive(Debug)]
pub struct Pool {
    idle: Mutex<[ByAuthority; 2]>,
    max_idle: usize,
    idle_timeout: Duration,
}

#[derive(Debug)]
struct Idle {
    sender: Sender,
    since: Instant,
}

impl Pool {
    pub fn new(max_idle: usize, idle_timeout: Duration) -> Self {
        Self {
            idle: Mutex::new([ByAuthority::default(), ByAuthority::default()]),
            max_idle,
            idle_timeout,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [ByAuthority; 2]> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most recently returned connection that is still open, if any.
    /// It may not have signalled readiness yet; [`ready`] waits for that.
    pub fn take(&self, tls: bool, authority: &Authority, now: Instant) -> Option<Sender> {
        let mut idle = self.lock();
        let list = idle[usize::from(tls)].get_mut(authority)?;
        while let Some(i) = list.pop_back() {
            if i.sender.is_closed() || now.saturating_duration_since(i.since) > self.idle_timeout {
                continue;
            }
            return Some(i.sender);
        }
        None
    }

    /// Keeps a connection whose last response was read to its end.
    pub fn put(&self, tls: bool, authority: &Authority, sender: Sender, now: Instant) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.lock();
        let map = &mut idle[usize::from(tls)];
        let list = match map.get_mut(authority) {
            Some(l) => l,
            None => map.entry(authority.clone()).or_default(),
        };
        // The oldest are at the front: drop those idle too long, and make
        // room when the list is full.
        while list.front().is_some_and(|i| {
            now.saturating_duration_since(i.since) > self.idle_timeout || i.sender.is_closed()
        }) {
            list.pop_front();
        }
        if list.len() >= self.max_idle {
            list.pop_front();
        }
        list.push_back(Idle { sender, since: now });
    }

    /// Drops the connections idle longer than the idle timeout, and those
    /// the backend closed.
    pub fn evict(&self, now: Instant) {
        let mut idle = self.lock();
        for map in idle.iter_mut() {
            for list in map.values_mut() {
                list.retain(|i| {
                    now.saturating_duration_since(i.since) <= self.idle_timeout
                        && !i.sender.is_closed()
                });
            }
            map.retain(|_, l| !l.is_empty());
        }
    }

    /// Open idle connections kept now, all authorities together.
    pub fn idle_count(&self) -> usize {
        self.lock()
            .iter()
            .flat_map(|m| m.values())
            .flat_map(|l| l.iter())
            .filter(|i| !i.sender.is_closed())
            .count()
    }
}

/// Evicts expired connections every `every` until the pool is dropped, so
/// a backend no longer called does not keep its idle connections open.
pub async fn reap(pool: Weak<Pool>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(p) = pool.upgrade() else { return };
        p.evict(Instant::now());
    }
}

/// Waits until a taken connection can send; `None` when it closed meanwhile.
pub async fn ready(mut sender: Sender) -> Option<Sender> {
    if sender.is_ready() {
        return Some(sender);
    }
    sender.ready().await.ok().map(|()| sender)
}

/// Where a connection goes back when its response has been read.
#[derive(Debug)]
pub struct Return {
    pub pool: Arc<Pool>,
    pub tls: bool,
    pub authority: Authority,
    pub sender: Sender,
}

/// A backend's response body; hands its connection back to the pool at
/// the end of the body.
#[derive(Debug)]
pub struct UpstreamBody {
    inner: Incoming,
    back: Option<Return>,
}

impl UpstreamBody {
    pub fn new(inner: Incoming, back: Option<Return>) -> Self {
        let mut b = Self { inner, back };
        if b.inner.is_end_stream() {
            b.give_back();
        }
        b
    }

    fn give_back(&mut self) {
        if let Some(r) = self.back.take() {
            r.pool.put(r.tls, &r.authority, r.sender, Instant::now());
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let f = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &f {
            None => this.give_back(),
            Some(Ok(_)) if this.inner.is_end_stream() => this.give_back(),
            // An error: the connection is not reused (dropping the
            // sender lets it close).
            Some(Err(_)) => this.back = None,
            Some(Ok(_)) => {}
        }
        Poll::Ready(f)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::{HeaderMap, Method, Response, Uri};
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use crate::config::UpstreamTlsConfig;
    use crate::proxy::Upstream;

    use super::*;

    /// How the test server treats a connection after each answer.
    #[derive(Clone, Copy)]
    enum After {
        KeepOpen,
        /// Closes the socket a moment after answering, with no
        /// `Connection: close`: a backend's own idle timeout.
        CloseSoon,
    }

    /// An HTTP/1.1 server answering every request with a 4 KiB body;
    /// returns its address and the count of connections it accepted.
    async fn server(after: After) -> (String, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let n = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                n.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let Ok(k) = s.read(&mut chunk).await else {
                            return;
                        };
                        if k == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..k]);
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            let body = vec![b'x'; 4096];
                            let head = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                                body.len()
                            );
                            if s.write_all(head.as_bytes()).await.is_err()
                                || s.write_all(&body).await.is_err()
                            {
                                return;
                            }
                            if let After::CloseSoon = after {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn upstream() -> Upstream {
        let tls = UpstreamTlsConfig {
            system_roots: false,
            ca_file: None,
            client_cert: None,
            client_key: None,
        };
        Upstream::new(Duration::from_secs(2), &tls).expect("upstream")
    }

    /// A GET sent through the pool; the response's body not yet read.
    async fn send_get(u: &Upstream, addr: &str) -> Result<Response<UpstreamBody>, String> {
        let uri: Uri = format!("http://{addr}/v1/models").parse().expect("uri");
        u.send(
            Method::GET,
            uri,
            HeaderMap::new(),
            Bytes::new(),
            Duration::from_secs(2),
        )
        .await
    }

    /// A GET read to its end: the body's length.
    async fn get(u: &Upstream, addr: &str) -> Result<usize, String> {
        let r = send_get(u, addr).await?;
        assert_eq!(r.status(), 200);
        let b = r.into_body().collect().await.map_err(|e| e.to_string())?;
        Ok(b.to_bytes().len())
    }

    /// `n` requests at once, each answered in full.
    async fn get_at_once(u: &Upstream, addr: &str, n: usize) {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let (u, addr) = (u.clone(), addr.to_owned());
            tasks.push(tokio::spawn(async move { get(&u, &addr).await }));
        }
        for t in tasks {
            assert_eq!(t.await.expect("task"), Ok(4096));
        }
    }

    /// A new connection to `addr`, outside any pool.
    async fn open(addr: &str) -> Sender {
        let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        sender
    }

    #[tokio::test]
    async fn sequential_requests_reuse_one_connection() {
        let (addr, accepted) = server(After::KeepOpen).await;
        let u = upstream();
        for _ in 0..20 {
            assert_eq!(get(&u, &addr).await, Ok(4096));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(u.idle_connections(), 1);
    }

    #[tokio::test]
    async fn concurrent_requests_open_what_they_need_and_keep_it() {
        let (addr, accepted) = server(After::KeepOpen).await;
        let u = upstream();
        for _ in 0..3 {
            get_at_once(&u, &addr, 16).await;
        }
        let n = accepted.load(Ordering::SeqCst);
        assert!((1..=16).contains(&n), "{n} connections for 16 at a time");
        assert_eq!(u.idle_connections(), n);
    }

    #[tokio::test]
    async fn connections_the_backend_closed_while_idle_are_not_used() {
        let (addr, accepted) = server(After::CloseSoon).await;
        let u = upstream();
        for _ in 0..5 {
            assert_eq!(get(&u, &addr).await, Ok(4096));
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 5);
        assert_eq!(u.idle_connections(), 0);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_does_not_come_back() {
        let (addr, accepted) = server(After::KeepOpen).await;
        let u = upstream();
        let r = send_get(&u, &addr).await.expect("response");
        drop(r);
        assert_eq!(u.idle_connections(), 0);
        assert_eq!(get(&u, &addr).await, Ok(4096));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(u.idle_connections(), 1);
    }

    #[tokio::test]
    async fn idle_lists_are_bounded_and_expire() {
        let (addr, _) = server(After::KeepOpen).await;
        // A pool that keeps two, for 50 ms.
        let pool = Pool::new(2, Duration::from_millis(50));
        let a: Authority = addr.parse().expect("authority");
        let now = Instant::now();
        for _ in 0..3 {
            pool.put(false, &a, open(&addr).await, now);
        }
        assert_eq!(pool.idle_count(), 2);
        assert!(pool.take(true, &a, now).is_none(), "kept apart by scheme");
        assert!(pool
            .take(false, &a, now + Duration::from_millis(60))
            .is_none());
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn idle_connections_expire_without_further_requests() {
        let (addr, _) = server(After::KeepOpen).await;
        let pool = Arc::new(Pool::new(8, Duration::from_millis(50)));
        let a: Authority = addr.parse().expect("authority");
        for _ in 0..2 {
            pool.put(false, &a, open(&addr).await, Instant::now());
        }
        assert_eq!(pool.idle_count(), 2);
        let reaper = tokio::spawn(reap(Arc::downgrade(&pool), Duration::from_millis(20)));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(pool.idle_count(), 0, "expired without a take or put");
        drop(pool);
        tokio::time::timeout(Duration::from_secs(1), reaper)
            .await
            .expect("the reaper ends with its pool")
            .expect("reaper");
    }
}
