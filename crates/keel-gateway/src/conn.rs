//! What one client connection may hold, and for how long: its socket
//! wrapped with read and write deadlines (`Guarded`), and its service
//! wrapped so that the deadlines know whether a request is in flight and
//! an HTTP/1.1 request without exactly one `Host` is refused (`ConnService`).
//!
//! Deadlines on the read side follow the connection's phase: a request
//! head must arrive within the header timeout (from the connection's start,
//! or from the first byte of a later request), a kept-alive connection
//! waits at most the idle timeout for its next request, and while a
//! request is in flight the request path's own timeouts apply. A write
//! that makes no progress for the write timeout (a client that does not
//! read) closes the connection. A deadline that passes is an I/O error,
//! on which hyper closes the connection.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tower::Service;

use crate::body::GwBody;
use crate::error::ApiError;

/// The deadlines of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub header: Duration,
    pub idle: Duration,
    pub write: Duration,
}

/// One connection's requests: how many started, and how many of them are
/// not finished (their response body not yet all handed to the socket).
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    started: AtomicUsize,
    open: AtomicUsize,
}

impl InFlight {
    fn open(&self) -> bool {
        self.0.open.load(Ordering::Relaxed) > 0
    }
    fn started(&self) -> usize {
        self.0.started.load(Ordering::Relaxed)
    }
    fn enter(&self) -> Busy {
        self.0.started.fetch_add(1, Ordering::Relaxed);
        self.0.open.fetch_add(1, Ordering::Relaxed);
        Busy(self.0.clone())
    }
}

/// One request in flight; dropped with its response body (or with the
/// request's future when the client goes away first).
#[derive(Debug)]
pub struct Busy(Arc<Counts>);

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
pub struct Tracked {
    body: GwBody,
    _busy: Option<Busy>,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
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
/// deadlines and refuses an HTTP/1.1 request without exactly one `Host`
/// header (RFC 9112, section 3.2) with 400.
#[derive(Debug, Clone)]
pub struct ConnService<S> {
    inner: S,
    in_flight: InFlight,
}

impl<S> ConnService<S> {
    pub fn new(inner: S, in_flight: InFlight) -> Self {
        Self { inner, in_flight }
    }
}

fn host_ok<B>(req: &Request<B>) -> bool {
    req.version() != Version::HTTP_11 || {
        let mut hosts = req.headers().get_all(http::header::HOST).iter();
        hosts.next().is_some() && hosts.next().is_none()
    }
}

impl<S> Service<Request<hyper::body::Incoming>> for ConnService<S>
where
    S: Service<Request<hyper::body::Incoming>, Response = Response<GwBody>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = ConnFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<hyper::body::Incoming>) -> Self::Future {
        let busy = Some(self.in_flight.enter());
        if !host_ok(&req) {
            let refused =
                ApiError::bad_request("an HTTP/1.1 request needs exactly one Host header")
                    .into_response();
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
pub struct ConnFuture<F> {
    inner: Option<F>,
    refused: Option<Response<GwBody>>,
    busy: Option<Busy>,
}

impl<F> Future for ConnFuture<F>
where
    F: Future<Output = Result<Response<GwBody>, Infallible>> + Unpin,
{
    type Output = Result<Response<Tracked>, Infallible>;

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
