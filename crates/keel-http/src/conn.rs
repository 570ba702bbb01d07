//! One connection: its socket wrapped with read and write deadlines
//! ([`Guarded`]), and its service wrapped so that the deadlines know
//! whether a request is in flight, the connection's place knows whether it
//! has authenticated, and (where asked) an HTTP/1.1 request without
//! exactly one `Host` is refused ([`ConnService`]).
//!
//! Deadlines on the read side follow the connection's phase: a request
//! head must arrive within the header timeout (from the connection's start,
//! or from the first byte of a later request), a kept-alive connection
//! waits at most the idle timeout for its next request, and while a
//! request is in flight the server's own request timeouts apply. A write
//! that makes no progress for the write timeout (a client that does not
//! read) closes the connection. A deadline that passes is an I/O error,
//! on which hyper closes the connection.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tower::Service;

use crate::places::State;

/// A response extension a server sets when the request came with a valid
/// credential: its connection then holds its place for good (it is never
/// closed to make room for a newer one, and may use the places reserved
/// for authenticated clients).
#[derive(Debug, Clone, Copy, Default)]
pub struct Authenticated;

/// The deadlines of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub header: Duration,
    pub idle: Duration,
    pub write: Duration,
}

/// One connection's state: how many of its requests started, how many of
/// them are not finished (their response body not yet all handed to the
/// socket), whether one was authenticated, and its place.
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<ConnState>);

/// Where a connection's place is kept.
#[derive(Debug)]
pub(crate) struct PlaceRef {
    pub(crate) state: Weak<Mutex<State>>,
    pub(crate) id: u64,
}

#[derive(Debug, Default)]
pub(crate) struct ConnState {
    started: AtomicUsize,
    open: AtomicUsize,
    pub(crate) authenticated: AtomicBool,
    /// The place was given back (the connection ended, or was closed to
    /// make room); changed only under the places' lock.
    pub(crate) released: AtomicBool,
    pub(crate) evict: Notify,
    pub(crate) place: Option<PlaceRef>,
}

impl ConnState {
    pub(crate) fn placed(place: PlaceRef) -> Self {
        Self {
            place: Some(place),
            ..Self::default()
        }
    }

    pub(crate) fn in_flight(&self) -> bool {
        self.open.load(Ordering::Relaxed) > 0
    }

    fn authenticate(&self) {
        if self.authenticated.load(Ordering::Relaxed) {
            return;
        }
        match self
            .place
            .as_ref()
            .and_then(|p| Some((p.state.upgrade()?, p.id)))
        {
            Some((state, id)) => state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .authenticated(id, self),
            None => self.authenticated.store(true, Ordering::Relaxed),
        }
    }
}

impl InFlight {
    pub(crate) fn from_state(s: Arc<ConnState>) -> Self {
        Self(s)
    }
    pub(crate) fn state(&self) -> &ConnState {
        &self.0
    }
    fn open(&self) -> bool {
        self.0.in_flight()
    }
    fn started(&self) -> usize {
        self.0.started.load(Ordering::Relaxed)
    }
    /// A request starts; it is finished when the returned guard drops.
    pub fn enter(&self) -> Busy {
        self.0.started.fetch_add(1, Ordering::Relaxed);
        self.0.open.fetch_add(1, Ordering::Relaxed);
        Busy(self.0.clone())
    }
    /// The connection has sent a valid credential: it keeps its place.
    pub fn authenticate(&self) {
        self.0.authenticate();
    }
    /// Whether a request of the connection has been authenticated.
    pub fn is_authenticated(&self) -> bool {
        self.0.authenticated.load(Ordering::Relaxed)
    }
}

/// One request in flight; dropped with its response body (or with the
/// request's future when the client goes away first).
#[derive(Debug)]
pub struct Busy(Arc<ConnState>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for (the rest of) a request head.
    Head,
    /// Kept alive, waiting for the next request.
    Idle,
    /// A request is in flight.
    Busy,
}

/// A timer made on first use and reset after.
#[derive(Debug, Default)]
struct Timer {
    sleep: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl Timer {
    /// Polls the deadline, setting it `after` from now if none is set.
    fn poll(&mut self, cx: &mut Context<'_>, after: Duration) -> Poll<()> {
        if !self.armed {
            self.armed = true;
            let at = Instant::now() + after;
            match &mut self.sleep {
                Some(s) => s.as_mut().reset(at),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(at))),
            }
        }
        match &mut self.sleep {
            Some(s) => s.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }
    fn disarm(&mut self) {
        self.armed = false;
    }
}

/// A connection's socket with its deadlines.
#[derive(Debug)]
pub struct Guarded<I> {
    io: I,
    deadlines: Deadlines,
    in_flight: InFlight,
    /// Requests started as of the last read.
    seen: usize,
    phase: Phase,
    read: Timer,
    write: Timer,
}

impl<I> Guarded<I> {
    pub fn new(io: I, deadlines: Deadlines, in_flight: InFlight) -> Self {
        Self {
            io,
            deadlines,
            in_flight,
            seen: 0,
            phase: Phase::Head,
            read: Timer::default(),
            write: Timer::default(),
        }
    }

    fn enter(&mut self, phase: Phase) {
        if self.phase != phase {
            self.phase = phase;
            self.read.disarm();
        }
    }
}

fn timed_out(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what)
}

impl<I: AsyncRead + Unpin> AsyncRead for Guarded<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if this.in_flight.open() {
            this.enter(Phase::Busy);
            return r;
        }
        let started = this.in_flight.started();
        if started != this.seen {
            // Requests started and finished since the last read (hyper
            // need not read while it answers one without a body).
            this.seen = started;
            this.enter(Phase::Idle);
        }
        match r {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && this.phase != Phase::Head {
                    this.enter(Phase::Head);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if this.phase == Phase::Busy {
                    this.enter(Phase::Idle);
                }
                // A response still being written is not idleness.
                if this.write.armed && this.phase == Phase::Idle {
                    this.read.disarm();
                    return Poll::Pending;
                }
                let (after, what) = match this.phase {
                    Phase::Head => (this.deadlines.header, "request head timed out"),
                    _ => (this.deadlines.idle, "idle connection timed out"),
                };
                ready!(this.read.poll(cx, after));
                Poll::Ready(Err(timed_out(what)))
            }
        }
    }
}

impl<I: AsyncWrite + Unpin> Guarded<I> {
    /// A write's result; a write pending past the write timeout fails.
    /// `wrote` says whether bytes went out (a flush with nothing to send
    /// is no progress).
    fn written<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
        wrote: impl Fn(&T) -> bool,
    ) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.write.disarm();
                if self.phase == Phase::Idle && r.as_ref().is_ok_and(wrote) {
                    // Progress restarts the wait for the next request.
                    self.read.disarm();
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                ready!(self.write.poll(cx, self.deadlines.write));
                Poll::Ready(Err(timed_out("response write timed out")))
            }
        }
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Guarded<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.written(cx, r, |n| *n > 0)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.written(cx, r, |n| *n > 0)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_flush(cx);
        this.written(cx, r, |_| false)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_shutdown(cx);
        this.written(cx, r, |_| false)
    }
}

/// A response body that ends its request's time in flight when dropped.
#[derive(Debug)]
pub struct Tracked<B> {
    body: B,
    _busy: Option<Busy>,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// One connection's service: counts its requests in flight for the
/// deadlines, marks the connection authenticated when a response carries
/// [`Authenticated`], and, given `bad_host`, answers an HTTP/1.1 request
/// without exactly one `Host` header with it (RFC 9112, section 3.2: 400).
pub struct ConnService<S, B> {
    inner: S,
    in_flight: InFlight,
    bad_host: Option<fn() -> Response<B>>,
}

impl<S: Clone, B> Clone for ConnService<S, B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            in_flight: self.in_flight.clone(),
            bad_host: self.bad_host,
        }
    }
}

impl<S: std::fmt::Debug, B> std::fmt::Debug for ConnService<S, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnService")
            .field("inner", &self.inner)
            .field("in_flight", &self.in_flight)
            .field("host_check", &self.bad_host.is_some())
            .finish()
    }
}

impl<S, B> ConnService<S, B> {
    pub fn new(inner: S, in_flight: InFlight, bad_host: Option<fn() -> Response<B>>) -> Self {
        Self {
            inner,
            in_flight,
            bad_host,
        }
    }
}

fn host_ok<B>(req: &Request<B>) -> bool {
    req.version() != Version::HTTP_11 || {
        let mut hosts = req.headers().get_all(http::header::HOST).iter();
        hosts.next().is_some() && hosts.next().is_none()
    }
}

impl<S, B> Service<Request<hyper::body::Incoming>> for ConnService<S, B>
where
    S: Service<Request<hyper::body::Incoming>, Response = Response<B>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<Tracked<B>>;
    type Error = Infallible;
    type Future = ConnFuture<S::Future, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<hyper::body::Incoming>) -> Self::Future {
        let busy = Some(self.in_flight.enter());
        if let Some(bad_host) = self.bad_host.filter(|_| !host_ok(&req)) {
            let refused = bad_host();
            return ConnFuture {
                inner: None,
                refused: Some(refused),
                busy,
            };
        }
        ConnFuture {
            inner: Some(self.inner.call(req)),
            refused: None,
            busy,
        }
    }
}

/// The inner service's answer (or the refusal), its body tracked.
#[derive(Debug)]
pub struct ConnFuture<F, B> {
    inner: Option<F>,
    refused: Option<Response<B>>,
    busy: Option<Busy>,
}

impl<F, B> Unpin for ConnFuture<F, B> where F: Unpin {}

impl<F, B> Future for ConnFuture<F, B>
where
    F: Future<Output = Result<Response<B>, Infallible>> + Unpin,
{
    type Output = Result<Response<Tracked<B>>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let resp = match (this.refused.take(), &mut this.inner) {
            (Some(r), _) => r,
            (None, Some(f)) => match ready!(Pin::new(f).poll(cx)) {
                Ok(r) => r,
                Err(never) => match never {},
            },
            // Polled again after it was ready: it never is again.
            (None, None) => return Poll::Pending,
        };
        this.inner = None;
        let busy = this.busy.take();
        if let Some(b) = &busy {
            if resp.extensions().get::<Authenticated>().is_some() {
                b.0.authenticate();
            }
        }
        Poll::Ready(Ok(resp.map(|body| Tracked { body, _busy: busy })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http11_needs_exactly_one_host() {
        let req = |v: Version, hosts: &[&str]| {
            let mut b = Request::builder().version(v).uri("/");
            for h in hosts {
                b = b.header(http::header::HOST, *h);
            }
            b.body(()).expect("request")
        };
        assert!(host_ok(&req(Version::HTTP_11, &["a"])));
        assert!(!host_ok(&req(Version::HTTP_11, &[])));
        assert!(!host_ok(&req(Version::HTTP_11, &["a", "b"])));
        assert!(host_ok(&req(Version::HTTP_10, &[])));
    }
}
