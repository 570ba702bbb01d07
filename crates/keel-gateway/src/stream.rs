//! A streamed response passed on from the backend's body as the client's
//! connection takes it: no task, no channel and no buffer of its own
//! between the two connections. The client's connection polls this body;
//! it reads the backend's next frame, passes it through the SSE filter
//! (which reads `usage` and strips the chunk the gateway asked for), and
//! hands on what is ready. When the backend's stream ends (or breaks, or
//! stays silent for the idle timeout) the request is settled, counted and
//! audited before the body ends; when the client goes first, the same is
//! done in a task of its own.
//!
//! What an open stream holds: the backend connection's buffers, the
//! filter's unfinished event, the request's record, and one timer that
//! fires only when the idle timeout could have passed (once per idle
//! timeout at most: events in between only note their time).

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body::Body;
use tokio::time::{Instant, Sleep};

use crate::answer::SseFilter;
use crate::pool::UpstreamBody;

/// How a stream ended, for whoever settles it.
#[derive(Debug)]
pub struct StreamEnd {
    /// The filter, with what it read: usage, events, text, finish reason,
    /// whether `[DONE]` came.
    pub filter: SseFilter,
    /// The backend's stream ended whole and the client took all of it.
    pub ok: bool,
    /// Why not.
    pub error: Option<String>,
    /// What was passed on (up to the cap), when asked for.
    pub captured: Option<Vec<u8>>,
}

/// A future run once, when the stream ended.
pub type Ending = Box<dyn FnOnce(StreamEnd) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

enum State {
    Streaming,
    Finishing(Pin<Box<dyn Future<Output = ()> + Send>>),
    Done,
}

/// A streamed response body.
pub struct SseStream {
    body: UpstreamBody,
    filter: SseFilter,
    idle: Duration,
    /// When the backend last sent something.
    last: Instant,
    /// Fires at `last + idle` or earlier (it is not moved at every event:
    /// when it fires early it is set again).
    timer: Option<Pin<Box<Sleep>>>,
    /// The waker the timer was last polled with: while it is the same and
    /// the timer's deadline has not passed, the timer is not polled again
    /// (polling it registers the waker anew, at every event).
    timer_waker: Option<Waker>,
    /// The bytes passed on, up to `cap`, when the audit log records them.
    captured: Option<Vec<u8>>,
    cap: usize,
    ending: Option<Ending>,
    state: State,
}

impl std::fmt::Debug for SseStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseStream")
            .field("idle", &self.idle)
            .field("events", &self.filter.events)
            .field(
                "state",
                &match self.state {
                    State::Streaming => "streaming",
                    State::Finishing(_) => "finishing",
                    State::Done => "done",
                },
            )
            .finish()
    }
}

impl SseStream {
    /// Passes `body` on through `filter`; a backend silent for `idle` ends
    /// the stream; `capture` keeps up to that many bytes of what was
    /// passed on; `ending` runs once when the stream ends, however it ends.
    pub fn new(
        body: UpstreamBody,
        filter: SseFilter,
        idle: Duration,
        capture: Option<usize>,
        ending: Ending,
    ) -> Self {
        Self {
            body,
            filter,
            idle,
            last: Instant::now(),
            timer: None,
            timer_waker: None,
            captured: capture.map(|_| Vec::new()),
            cap: capture.unwrap_or(0),
            ending: Some(ending),
            state: State::Streaming,
        }
    }

    /// Ready when the backend has been silent for the idle timeout.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = self.last + self.idle;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        let same_waker = self
            .timer_waker
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()));
        if same_waker && Instant::now() < timer.deadline() {
            return Poll::Pending;
        }
        self.timer_waker = Some(cx.waker().clone());
        loop {
            ready!(timer.as_mut().poll(cx));
            let deadline = self.last + self.idle;
            if Instant::now() >= deadline {
                return Poll::Ready(());
            }
            // Events came since it was set: once more, from the last.
            timer.as_mut().reset(deadline);
        }
    }

    /// Starts settling: the ending's future runs from the next poll. A
    /// stream whose `[DONE]` was passed on is whole, whatever happens to
    /// either connection after it.
    fn end(&mut self, ok: bool, error: Option<String>) {
        let (ok, error) = if self.filter.done {
            (true, None)
        } else {
            (ok, error)
        };
        let end = StreamEnd {
            filter: std::mem::take(&mut self.filter),
            ok,
            error,
            captured: self.captured.take(),
        };
        self.timer = None;
        self.timer_waker = None;
        self.state = match self.ending.take() {
            Some(f) => State::Finishing(f(end)),
            None => State::Done,
        };
    }

    fn keep(&mut self, out: &[u8]) {
        if let Some(c) = &mut self.captured {
            if c.len() < self.cap {
                c.extend_from_slice(&out[..out.len().min(self.cap - c.len())]);
            }
        }
    }

    /// The next bytes for the client, or the end.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        loop {
            match &mut self.state {
                State::Done => return Poll::Ready(None),
                State::Finishing(_) => {
                    // Taken out while polled: a future that panics is not
                    // left for `Drop` to run again.
                    if let State::Finishing(mut f) = std::mem::replace(&mut self.state, State::Done)
                    {
                        if f.as_mut().poll(cx).is_pending() {
                            self.state = State::Finishing(f);
                            return Poll::Pending;
                        }
                    }
                    return Poll::Ready(None);
                }
                State::Streaming => {}
            }
            match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    self.last = Instant::now();
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let out = self.filter.push_bytes(data);
                    if out.is_empty() {
                        continue;
                    }
                    self.keep(&out);
                    return Poll::Ready(Some(out));
                }
                Poll::Ready(None) => {
                    let tail = self.filter.finish();
                    self.keep(&tail);
                    self.end(true, None);
                    if !tail.is_empty() {
                        return Poll::Ready(Some(Bytes::from(tail)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.end(false, Some(format!("backend stream broke off: {e}")));
                }
                Poll::Pending => {
                    ready!(self.poll_idle(cx));
                    self.end(false, Some("backend stream idle too long".into()));
                }
            }
        }
    }

    /// Whether the body has ended.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }
}

impl Drop for SseStream {
    fn drop(&mut self) {
        // The client went away (or its connection was closed) before the
        // end: the request is settled all the same, in a task.
        if matches!(self.state, State::Streaming) {
            self.end(
                false,
                Some("the client went away or stopped reading before the stream ended".into()),
            );
        }
        if let State::Finishing(f) = std::mem::replace(&mut self.state, State::Done) {
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn(f);
                }
                Err(_) => tracing::error!(
                    "a stream ended outside the runtime: its request could not be settled"
                ),
            }
        }
    }
}
