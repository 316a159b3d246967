//! The opaque future of [`IdempotencyService`](crate::IdempotencyService).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;

use crate::body::IdempotencyBody;

pub(crate) type GuardedFuture<B, E> = Pin<Box<dyn Future<Output = Result<Response<IdempotencyBody<B>>, E>> + Send>>;

pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService): the inner
    /// future untouched for requests the layer does not guard, the guarded path otherwise.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Guarded { future: GuardedFuture<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self { kind: Kind::Passthrough { future } }
    }

    pub(crate) fn guarded(future: GuardedFuture<B, E>) -> Self {
        Self { kind: Kind::Guarded { future } }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<IdempotencyBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response.map(IdempotencyBody::inner)))
            }
            KindProj::Guarded { future } => future.as_mut().poll(cx),
        }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}
