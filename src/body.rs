//! The response body of an [`IdempotencyService`](crate::IdempotencyService): the inner
//! service's body streamed through untouched, or a body the layer holds in full (a buffered
//! first answer, a replay, a problem).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::BoxError;

pin_project! {
    /// The body of responses that pass through the idempotency layer.
    ///
    /// ```
    /// use http_body::Body;
    /// use tower_idempotency::IdempotencyBody;
    /// let body: IdempotencyBody<http_body_util::Empty<bytes::Bytes>> = IdempotencyBody::full("hi");
    /// assert_eq!(body.size_hint().exact(), Some(2));
    /// ```
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
    }
}

impl<B> IdempotencyBody<B> {
    /// The inner service's body, streamed through.
    pub fn inner(body: B) -> Self {
        Self { kind: Kind::Inner { body } }
    }

    /// A body held in full.
    pub fn full(data: impl Into<Bytes>) -> Self {
        Self::buffered(data, None)
    }

    /// A body held in full, followed by trailers (a buffered gRPC answer's `grpc-status`).
    pub fn buffered(data: impl Into<Bytes>, trailers: Option<HeaderMap>) -> Self {
        let data = data.into();
        Self { kind: Kind::Full { data: (!data.is_empty()).then_some(data), trailers } }
    }
}

impl<B> std::fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { .. } => f.write_str("IdempotencyBody::Inner"),
            Kind::Full { data, .. } => {
                write!(f, "IdempotencyBody::Full({} bytes)", data.as_ref().map_or(0, Bytes::len))
            }
        }
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Full { data, trailers } => match data.take() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t)))),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data, .. } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}
