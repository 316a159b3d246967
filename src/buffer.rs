//! Reading a whole body into memory, within a limit, keeping its trailers.
//!
//! `http_body_util`'s `Limited` + `collect` does the same through a queue of chunks; the common
//! body here is one chunk, which this hands on without a copy or an allocation.

use std::future::poll_fn;
use std::pin::pin;

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::Body;

/// Why a body could not be read whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadError {
    /// It is longer than the limit.
    TooLarge,
    /// The body failed while it was read.
    Failed,
    /// `admit` refused the bytes read so far (the buffer budget is spent).
    NotAdmitted,
}

/// Reads `body` to its end: its bytes (at most `limit`) and its trailers.
pub(crate) async fn read_to_end<B: Body>(body: B, limit: usize) -> Result<(Bytes, Option<HeaderMap>), ReadError> {
    read_admitted(body, limit, |_| true).await
}

/// [`read_to_end`], asking `admit` before it keeps each chunk whether the length read so far
/// may be held.
pub(crate) async fn read_admitted<B: Body>(
    body: B,
    limit: usize,
    mut admit: impl FnMut(usize) -> bool,
) -> Result<(Bytes, Option<HeaderMap>), ReadError> {
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge);
    }
    let mut body = pin!(body);
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut length = 0usize;
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(_) => return Err(ReadError::Failed),
        };
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    // The first (nearly always the only) trailers frame is kept as it came.
                    match &mut trailers {
                        Some(trailers) => trailers.extend(more),
                        None => trailers = Some(more),
                    }
                }
                continue;
            }
        };
        length = length.saturating_add(data.remaining());
        if length > limit {
            return Err(ReadError::TooLarge);
        }
        if !admit(length) {
            return Err(ReadError::NotAdmitted);
        }
        // For `Bytes` (what nearly every body yields) this takes the chunk without copying.
        let chunk = data.copy_to_bytes(data.remaining());
        match (&first, &mut joined) {
            (None, _) => first = Some(chunk),
            (Some(_), Some(joined)) => joined.extend_from_slice(&chunk),
            (Some(head), None) => {
                let mut both = BytesMut::with_capacity(head.len() + chunk.len());
                both.extend_from_slice(head);
                both.extend_from_slice(&chunk);
                joined = Some(both);
            }
        }
    }
    let bytes = match joined {
        Some(joined) => joined.freeze(),
        None => first.unwrap_or_default(),
    };
    Ok((bytes, trailers))
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use http_body::Frame;
    use http_body_util::{BodyExt, Full};

    use super::*;

    /// A body that yields the frames it is given, one per poll, with no size hint.
    struct Frames(VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn trailers() -> HeaderMap {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        trailers
    }

    #[tokio::test]
    async fn one_chunk_is_handed_on_and_several_are_joined_with_their_trailers() {
        let (bytes, none) = read_to_end(Full::new(Bytes::from_static(b"abc")), 10).await.unwrap();
        assert_eq!((bytes.as_ref(), none), (&b"abc"[..], None));
        let chunks = ["ab", "cd", "e"].map(|c| Frame::data(Bytes::from_static(c.as_bytes())));
        let body = Frames(chunks.into_iter().chain([Frame::trailers(trailers())]).collect());
        let (bytes, trailers) = read_to_end(body, 10).await.unwrap();
        assert_eq!(bytes.as_ref(), b"abcde");
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
    }

    #[tokio::test]
    async fn trailers_of_several_frames_are_all_kept() {
        let mut more = HeaderMap::new();
        more.insert("grpc-message", "fine".parse().unwrap());
        let frames = [Frame::data(Bytes::from_static(b"x")), Frame::trailers(trailers()), Frame::trailers(more)];
        let (_, trailers) = read_to_end(Frames(frames.into()), 10).await.unwrap();
        let trailers = trailers.unwrap();
        assert_eq!(
            (&trailers["grpc-status"], &trailers["grpc-message"]),
            (&"0".parse::<http::HeaderValue>().unwrap(), &"fine".parse::<http::HeaderValue>().unwrap())
        );
    }

    #[tokio::test]
    async fn the_limit_holds_with_and_without_a_size_hint() {
        assert_eq!(read_to_end(Full::new(Bytes::from_static(b"abcdef")), 5).await, Err(ReadError::TooLarge));
        assert_eq!(read_to_end(Full::new(Bytes::from_static(b"abcde")), 5).await.map(|r| r.0.len()), Ok(5));
        let streamed = Frames(["abc", "def"].map(|c| Frame::data(Bytes::from_static(c.as_bytes()))).into());
        assert_eq!(read_to_end(streamed, 5).await, Err(ReadError::TooLarge));
        let failing = Full::new(Bytes::from_static(b"x")).map_err(|_: std::convert::Infallible| "never");
        assert!(read_to_end(failing, 5).await.is_ok());
    }
}
