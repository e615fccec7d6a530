//! Following one forwarded write to its very end: the request body fully sent upstream and the
//! response fully sent back (or the exchange cut off), so that the permit of its resource is
//! released then, and not when the response head arrives.
//!
//! An upstream may answer before it has read the request body (HTTP allows it, and some servers
//! acknowledge early and apply later). Releasing the permit at the response head would let a
//! newer write reach the upstream while an older body is still trickling in: the upstream would
//! then finish applying the older write after the newer one.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

/// Error type of every body the proxy streams in either direction.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How one body of an exchange ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyEnd {
    /// Every byte passed through (end of stream reached).
    Complete,
    /// The source of the body failed (client or upstream broke the connection mid-body).
    Failed,
    /// The body was dropped before its end (its reader went away or gave up).
    Abandoned,
    /// The exchange deadline passed before the body ended; the proxy cut it off.
    TimedOut,
}

/// The exchange deadline passed while a body was still streaming.
#[derive(Debug, thiserror::Error)]
#[error("fence-proxy: the exchange of this write did not end within --upstream-timeout; cut off")]
pub struct ExchangeTimedOut;

/// An HTTP/2 request body ended without the client's END_STREAM: the client reset the stream
/// (or the connection went away) mid-body.
#[derive(Debug, thiserror::Error)]
#[error(
    "fence-proxy: the client's HTTP/2 stream ended before its END_STREAM (reset mid-body); the request body is incomplete"
)]
pub struct EndedWithoutEndStream;

/// A body that reports how it ended, and that ends itself with an error at the exchange deadline.
///
/// A body without a tracker (reads) behaves exactly as the body it wraps.
pub struct TrackedBody<B: Body> {
    inner: B,
    /// Whether an end of the body counts only when the peer announced it: true for an HTTP/2
    /// request body. hyper's `Incoming` also ends such a body without an error when the client
    /// resets the stream with NO_ERROR (RFC 9113 §8.1 lets a server stop reading so after an
    /// early response); passed on as an end, the upstream would get a cut-off upload as a whole
    /// one. h2 (0.4.20 and later) reports `is_end_stream` only once END_STREAM was received, so
    /// an end without it is a failure here.
    end_announced: bool,
    /// Told once how the body ended; `None` when untracked or already told.
    end: Option<oneshot::Sender<BodyEnd>>,
    /// The exchange deadline; only watched while the body is still tracked.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<B: Body> TrackedBody<B> {
    /// A body that is passed through as it is (reads, which hold no permit).
    pub fn untracked(inner: B) -> Self {
        TrackedBody {
            inner,
            end_announced: false,
            end: None,
            deadline: None,
        }
    }

    /// A body whose end is reported on the returned receiver, cut off at `deadline`. With
    /// `end_announced` (an HTTP/2 request body), an end the peer did not announce by END_STREAM
    /// is a failure, passed on as an error so that the upstream body is aborted.
    pub fn tracked(
        inner: B,
        deadline: Instant,
        end_announced: bool,
    ) -> (Self, oneshot::Receiver<BodyEnd>) {
        let (tx, rx) = oneshot::channel();
        let body = TrackedBody {
            inner,
            end_announced,
            end: Some(tx),
            deadline: Some(Box::pin(tokio::time::sleep_until(deadline))),
        };
        (body, rx)
    }

    fn tell(&mut self, how: BodyEnd) {
        if let Some(end) = self.end.take() {
            // The receiver is gone only when the write task is gone, which then no longer
            // needs to know.
            let _ = end.send(how);
        }
        self.deadline = None;
    }
}

impl<B> Body for TrackedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.end.is_some()
            && let Some(deadline) = this.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            this.tell(BodyEnd::TimedOut);
            return Poll::Ready(Some(Err(Box::new(ExchangeTimedOut))));
        }
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match frame {
            None if this.end_announced && !this.inner.is_end_stream() => {
                this.tell(BodyEnd::Failed);
                Poll::Ready(Some(Err(Box::new(EndedWithoutEndStream))))
            }
            None => {
                this.tell(BodyEnd::Complete);
                Poll::Ready(None)
            }
            Some(Ok(frame)) => {
                // With a known length the reader may stop polling after the last byte and
                // never see `None`: the end is reached now.
                if this.inner.is_end_stream() {
                    this.tell(BodyEnd::Complete);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => {
                this.tell(BodyEnd::Failed);
                Poll::Ready(Some(Err(e.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B: Body> Drop for TrackedBody<B> {
    fn drop(&mut self) {
        if self.end.is_some() {
            // Reached only when nobody polled the body to its end. An empty body (or one whose
            // last byte was read) is complete even if its reader never asked for `None`.
            let how = if self.inner.is_end_stream() {
                BodyEnd::Complete
            } else {
                BodyEnd::Abandoned
            };
            self.tell(how);
        }
    }
}
