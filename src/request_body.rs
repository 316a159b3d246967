//! Buffering a guarded request's body, bounded by the body limit, the buffer budget and the
//! body deadline: admitted by its `Content-Length` before anything is read, then read.

use bytes::Bytes;
use http_body::Body;

use crate::BoxError;
use crate::budget::Reservation;
use crate::buffer::{self, ReadError};
use crate::config::Config;
use crate::problem::{Problem, ProblemCode};

/// Buffers the request body: refused before it is read when its `Content-Length` is over the
/// limit or does not fit the buffer budget ([`admit_request_body`]); then read by
/// [`read_request_body`]. Returns the body and its reservation, cut down to the body's length.
pub(crate) async fn buffer_request_body<B>(
    headers: &http::HeaderMap,
    body: B,
    config: &Config,
) -> Result<(Bytes, Reservation), Problem>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let admitted = admit_request_body(headers, config)?;
    read_request_body(body, admitted, config).await
}

/// A body admitted to be read: its reservation in the buffer budget, the most that is read,
/// and its declared length.
pub(crate) struct Admitted {
    reservation: Reservation,
    read_limit: usize,
    declared: Option<u64>,
}

/// Admits a request body before anything of it is read: refused when its `Content-Length` is
/// over the limit or does not fit the buffer budget (see [`BufferBudget`](crate::BufferBudget)).
pub(crate) fn admit_request_body(headers: &http::HeaderMap, config: &Config) -> Result<Admitted, Problem> {
    let limit = config.max_request_body;
    let declared = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (charge, read_limit) = match declared {
        Some(length) if length > limit as u64 => return Err(body_too_large(limit)),
        // At most `limit`, which is a `usize`.
        Some(length) => (length as usize, length as usize),
        None => (0, limit),
    };
    let Some(reservation) = config.buffer_budget.try_reserve(charge) else {
        return Err(budget_spent(config));
    };
    Ok(Admitted { reservation, read_limit, declared })
}

fn body_too_large(limit: usize) -> Problem {
    Problem::new(ProblemCode::BodyTooLarge, format!("the request body is larger than {limit} bytes"))
}

fn budget_spent(config: &Config) -> Problem {
    tracing::warn!("idempotency: request refused, the buffer budget is spent");
    Problem::new(ProblemCode::BufferBudgetExhausted, "the server is buffering too many request bodies; retry later")
        .retry_after(config.retry_after)
}

/// Reads an admitted body: without a declared length, charged chunk by chunk and refused when
/// the budget cannot take the next; never buffered past its declared length; refused when it is
/// not complete within the body deadline.
pub(crate) async fn read_request_body<B>(
    body: B,
    admitted: Admitted,
    config: &Config,
) -> Result<(Bytes, Reservation), Problem>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let Admitted { mut reservation, read_limit, declared } = admitted;
    // Without a declared length, each chunk is charged as it arrives.
    let admit = |length: usize| reservation.grow_to(length);
    let read = tokio::time::timeout(config.body_timeout, buffer::read_admitted(body, read_limit, admit)).await;
    match read {
        Ok(Err(ReadError::NotAdmitted)) => Err(budget_spent(config)),
        Ok(Ok((bytes, _trailers))) => {
            reservation.shrink_to(bytes.len());
            Ok((bytes, reservation))
        }
        Ok(Err(ReadError::TooLarge)) if declared.is_some() => {
            Err(Problem::new(ProblemCode::BodyUnreadable, "the request body is longer than its Content-Length"))
        }
        Ok(Err(ReadError::TooLarge)) => Err(body_too_large(config.max_request_body)),
        Ok(Err(ReadError::Failed)) => {
            Err(Problem::new(ProblemCode::BodyUnreadable, "the request body could not be read"))
        }
        Err(_elapsed) => Err(Problem::new(
            ProblemCode::BodyTimeout,
            format!("the request body did not arrive whole within {:?}", config.body_timeout),
        )),
    }
}
