//! The response body type: a whole body, a whole body counted in the
//! gateway's body budget, or chunks sent by a task as they arrive (streams
//! are passed on chunk by chunk, never buffered).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

use crate::budget::BodyPermit;

/// Chunks sent over a channel; the sender ends the body by dropping.
pub type ChunkSender = mpsc::Sender<Bytes>;

#[derive(Debug)]
pub enum GwBody {
    Full(Option<Bytes>),
    Channel(mpsc::Receiver<Bytes>),
    /// A body counted in the budget: handed on in pieces of at most
    /// `HELD_PIECE` bytes, each given back to the budget as it goes, so
    /// what a client that does not read holds stays counted (hyper's write
    /// buffer takes another piece only when it has room).
    Held(Bytes, BodyPermit),
}

/// The largest piece of a held body handed to the connection at once.
pub const HELD_PIECE: usize = 64 << 10;

impl GwBody {
    pub fn full(b: impl Into<Bytes>) -> Self {
        Self::Full(Some(b.into()))
    }
    pub fn empty() -> Self {
        Self::Full(None)
    }
    /// A whole body whose bytes `permit` holds in the budget.
    pub fn held(b: Bytes, permit: BodyPermit) -> Self {
        Self::Held(b, permit)
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
            GwBody::Held(b, permit) => {
                if b.is_empty() {
                    return Poll::Ready(None);
                }
                let piece = b.split_to(b.len().min(HELD_PIECE));
                permit.release(piece.len());
                Poll::Ready(Some(Ok(Frame::data(piece))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GwBody::Full(b) => b.is_none(),
            GwBody::Held(b, _) => b.is_empty(),
            GwBody::Channel(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GwBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            GwBody::Full(None) => SizeHint::with_exact(0),
            GwBody::Held(b, _) => SizeHint::with_exact(b.len() as u64),
            GwBody::Channel(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::BodyBudget;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_held_body_goes_in_pieces_and_gives_its_bytes_back() {
        let budget = BodyBudget::default();
        let n = HELD_PIECE * 2 + 10;
        let permit = budget.take(n, usize::MAX).expect("fits");
        let mut body = GwBody::held(Bytes::from(vec![7u8; n]), permit);
        assert_eq!(body.size_hint().exact(), Some(n as u64));
        let mut sizes = Vec::new();
        while let Some(f) = body.frame().await {
            let d = f.expect("frame").into_data().expect("data");
            sizes.push(d.len());
            assert_eq!(budget.held(), n - sizes.iter().sum::<usize>());
        }
        assert_eq!(sizes, [HELD_PIECE, HELD_PIECE, 10]);
        assert!(body.is_end_stream());
        assert_eq!(budget.held(), 0);
    }
}
