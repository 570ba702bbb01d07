//! The response body type: a whole body, a whole body counted in the
//! gateway's body budget, or a stream read from the backend as the client takes it (streams are
//! passed on event by event, never buffered).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};

use crate::budget::BodyPermit;
use crate::stream::SseStream;

#[derive(Debug)]
pub enum GwBody {
    Full(Option<Bytes>),
    /// A body counted in the budget until the connection has taken all
    /// of it. One longer than `HELD_PIECE` is handed on in copied pieces
    /// of that size, which hyper's write buffer takes only as it has room:
    /// a piece that shared the body's allocation would keep all of it
    /// alive, uncounted, while a client that does not read holds the
    /// piece.
    Held(Bytes, BodyPermit),
    /// A streamed response read from the backend as the client takes it.
    Stream(Box<SseStream>),
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
            GwBody::Stream(s) => s.poll_next(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
            GwBody::Held(b, permit) => {
                if b.is_empty() {
                    return Poll::Ready(None);
                }
                if permit.held() <= HELD_PIECE {
                    // Small enough to be a piece itself, as nearly every
                    // response is.
                    permit.release(usize::MAX);
                    return Poll::Ready(Some(Ok(Frame::data(std::mem::take(b)))));
                }
                let piece = Bytes::copy_from_slice(&b[..b.len().min(HELD_PIECE)]);
                b.advance(piece.len());
                if b.is_empty() {
                    // The body's allocation goes with its last reference.
                    *b = Bytes::new();
                    permit.release(usize::MAX);
                }
                Poll::Ready(Some(Ok(Frame::data(piece))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GwBody::Full(b) => b.is_none(),
            GwBody::Held(b, _) => b.is_empty(),
            GwBody::Stream(s) => s.is_done(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GwBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            GwBody::Full(None) => SizeHint::with_exact(0),
            GwBody::Held(b, _) => SizeHint::with_exact(b.len() as u64),
            GwBody::Stream(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::BodyBudget;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_held_body_goes_in_pieces_and_stays_counted_until_taken() {
        let budget = BodyBudget::default();
        let n = HELD_PIECE * 2 + 10;
        let permit = budget.take(n, usize::MAX).expect("fits");
        let mut body = GwBody::held(Bytes::from(vec![7u8; n]), permit);
        assert_eq!(body.size_hint().exact(), Some(n as u64));
        let mut sizes = Vec::new();
        while let Some(f) = body.frame().await {
            let d = f.expect("frame").into_data().expect("data");
            sizes.push(d.len());
            let left = n - sizes.iter().sum::<usize>();
            assert_eq!(budget.held(), if left > 0 { n } else { 0 });
        }
        assert_eq!(sizes, [HELD_PIECE, HELD_PIECE, 10]);
        assert!(body.is_end_stream());
        assert_eq!(budget.held(), 0);

        let small = Bytes::from(vec![1u8; 100]);
        let permit = budget.take(100, usize::MAX).expect("fits");
        let mut body = GwBody::held(small.clone(), permit);
        let d = body.frame().await.expect("a frame").expect("frame");
        assert_eq!(d.into_data().expect("data"), small, "whole, in one piece");
        assert_eq!(budget.held(), 0);
        assert!(body.frame().await.is_none());
    }
}
