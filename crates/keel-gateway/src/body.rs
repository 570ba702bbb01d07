//! The response body type: a whole body, or chunks sent by a task as they
//! arrive (streams are passed on chunk by chunk, never buffered).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

/// Chunks sent over a channel; the sender ends the body by dropping.
pub type ChunkSender = mpsc::Sender<Bytes>;

#[derive(Debug)]
pub enum GwBody {
    Full(Option<Bytes>),
    Channel(mpsc::Receiver<Bytes>),
}

impl GwBody {
    pub fn full(b: impl Into<Bytes>) -> Self {
        Self::Full(Some(b.into()))
    }
    pub fn empty() -> Self {
        Self::Full(None)
    }
    /// A body fed by the returned sender; `depth` chunks may wait.
    pub fn channel(depth: usize) -> (ChunkSender, Self) {
        let (tx, rx) = mpsc::channel(depth);
        (tx, Self::Channel(rx))
    }
}

impl Body for GwBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            GwBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            GwBody::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, GwBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GwBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            GwBody::Full(None) => SizeHint::with_exact(0),
            GwBody::Channel(_) => SizeHint::default(),
        }
    }
}
