//! Two small combinators over futures (the crate depends on no futures library).

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

/// Which of two futures finished.
pub(crate) enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Whichever of `left` and `right` is ready first (`left` when both are).
pub(crate) async fn first<A: Future, B: Future>(
    mut left: Pin<&mut A>,
    mut right: Pin<&mut B>,
) -> Either<A::Output, B::Output> {
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = left.as_mut().poll(cx) {
            return Poll::Ready(Either::Left(output));
        }
        right.as_mut().poll(cx).map(Either::Right)
    })
    .await
}

/// Runs `futures` at once and gives their outputs in their order.
pub(crate) async fn all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(done) => *output = Some(done),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(()) }
    })
    .await;
    outputs.into_iter().map(|output| output.expect("every future finished")).collect()
}
