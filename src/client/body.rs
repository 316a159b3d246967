//! Bodies: the request body buffered once (bounded) so every attempt sends the same bytes, and
//! the answer's body, of which the layer may have read a bounded prefix to find its problem code.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};

use crate::BoxError;

/// Reads a whole request body, refusing one over `limit` bytes (`Ok(None)`).
pub(crate) async fn buffer_request<B>(body: B, limit: usize) -> Result<Option<Bytes>, BoxError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Ok(None);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(Some(collected.to_bytes())),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Ok(None),
        Err(error) => Err(error),
    }
}

/// The body of an answer the layer hands back: the inner service's body, behind whatever
/// prefix the layer read from it to find a problem `code` (at most a small, bounded amount).
/// It yields exactly the bytes and trailers the inner body did.
pub struct ResponseBody<B> {
    prefix: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<Pin<Box<B>>>,
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("prefix_len", &self.prefix.as_ref().map(Bytes::len))
            .field("streaming", &self.rest.is_some())
            .finish()
    }
}

impl<B> ResponseBody<B> {
    /// The inner body, untouched.
    pub(crate) fn streaming(body: B) -> Self {
        Self { prefix: None, trailers: None, rest: Some(Box::pin(body)) }
    }
}

impl<B> ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    /// Reads `body` until its end or until more than `limit` bytes have come. `complete` in the
    /// answer says which; the returned body still yields everything, read or not.
    pub(crate) async fn read_prefix(body: B, limit: usize) -> Result<(Self, Peeked), BoxError> {
        let mut rest = Box::pin(body);
        let mut prefix = BytesMut::new();
        let mut trailers = None;
        let complete = loop {
            let Some(frame) = rest.frame().await else { break true };
            match frame.map_err(Into::into)?.into_data() {
                Ok(data) => {
                    prefix.extend_from_slice(&data);
                    if prefix.len() > limit {
                        break false;
                    }
                }
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        };
        let peeked = Peeked { bytes: prefix.freeze(), complete };
        let body = Self {
            prefix: (!peeked.bytes.is_empty()).then(|| peeked.bytes.clone()),
            trailers,
            rest: (!complete).then_some(rest),
        };
        Ok((body, peeked))
    }
}

/// What [`ResponseBody::read_prefix`] saw.
pub(crate) struct Peeked {
    /// The bytes read.
    pub bytes: Bytes,
    /// Whether they are the whole body.
    pub complete: bool,
}

impl Peeked {
    /// The `code` member of a complete problem+json body.
    pub fn problem_code(&self) -> Option<String> {
        if !self.complete {
            return None;
        }
        let problem: serde_json::Value = serde_json::from_slice(&self.bytes).ok()?;
        Some(problem.get("code")?.as_str()?.to_owned())
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(data) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if let Some(rest) = this.rest.as_mut() {
            match ready!(rest.as_mut().poll_frame(cx)) {
                Some(frame) => return Poll::Ready(Some(frame.map_err(Into::into))),
                None => this.rest = None,
            }
        }
        Poll::Ready(this.trailers.take().map(|trailers| Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.trailers.is_none() && self.rest.as_ref().is_none_or(|rest| rest.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut hint = self.rest.as_ref().map_or_else(|| SizeHint::with_exact(0), |rest| rest.size_hint());
        hint.set_lower(hint.lower() + prefix);
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + prefix);
        }
        hint
    }
}
