//! What the SQL stores share: reading a record row back, and deciding what it means.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use std::future::Future;

use tokio::time::Instant;

use super::{Begin, BeginRequest, StaleLeasePolicy, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::record::{Record, RecordState, StoredResponse};

/// A record row as read back, with the time comparisons done by the database.
#[derive(Debug)]
pub(crate) struct RecordRow {
    pub(crate) state: String,
    pub(crate) fingerprint_version: i16,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) fencing_token: i64,
    /// How long the lease has left, in milliseconds (negative or zero: expired).
    pub(crate) lease_left_ms: Option<i64>,
    pub(crate) response_expired: bool,
    pub(crate) forgotten: bool,
    pub(crate) response_status: Option<i16>,
    pub(crate) response_headers: Option<Vec<u8>>,
    pub(crate) response_body: Option<Vec<u8>>,
}

/// What to do about a row found in the way of a claim.
#[derive(Debug)]
pub(crate) enum Found {
    /// The row is past its tombstone time: treat it as absent and claim again.
    Forgotten,
    /// Answer from this record.
    Record(Record),
    /// A leased holder died: mark the record `unknown` (fenced by this token), then answer.
    StaleLease { token: i64, record: Record },
    /// A leased holder is alive: wait up to this long, then look again.
    Live { lease_left: Duration },
}

impl RecordRow {
    pub(crate) fn decide(self, fingerprint: &Fingerprint, policy: StaleLeasePolicy) -> Result<Found, StoreError> {
        if self.forgotten {
            return Ok(Found::Forgotten);
        }
        let state = RecordState::parse(&self.state)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown record state {:?}", self.state)))?;
        let digest: [u8; 32] = self
            .fingerprint
            .as_slice()
            .try_into()
            .map_err(|_| StoreError::Corrupt("fingerprint is not 32 bytes".into()))?;
        let version = u8::try_from(self.fingerprint_version)
            .map_err(|_| StoreError::Corrupt("fingerprint version out of range".into()))?;
        let stored_fingerprint = Fingerprint::from_parts(version, digest);
        let expired = state == RecordState::Expired
            || (matches!(state, RecordState::Completed | RecordState::Failed) && self.response_expired);
        if expired {
            return Ok(Found::Record(Record::new(RecordState::Expired, stored_fingerprint)));
        }
        if stored_fingerprint != *fingerprint {
            return Ok(Found::Record(Record::new(state, stored_fingerprint)));
        }
        match state {
            RecordState::Processing => {
                let left = self.lease_left_ms.unwrap_or(0);
                if left > 0 {
                    Ok(Found::Live { lease_left: Duration::from_millis(left as u64) })
                } else if policy == StaleLeasePolicy::MarkUnknown {
                    let record = Record::new(RecordState::Unknown, stored_fingerprint);
                    Ok(Found::StaleLease { token: self.fencing_token, record })
                } else {
                    // Re-executable: the claim statement takes the stale lease over.
                    Ok(Found::Forgotten)
                }
            }
            RecordState::Completed | RecordState::Failed => {
                let response = self.response()?;
                Ok(Found::Record(Record::with_response(state, stored_fingerprint, response)))
            }
            _ => Ok(Found::Record(Record::new(state, stored_fingerprint))),
        }
    }

    fn response(&self) -> Result<StoredResponse, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("stored response {what}"));
        let status = self.response_status.ok_or_else(|| corrupt("has no status"))?;
        let status = u16::try_from(status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| corrupt("status is invalid"))?;
        let (headers, trailers) = StoredResponse::decode_fields(self.response_headers.as_deref().unwrap_or_default())
            .ok_or_else(|| corrupt("headers are unreadable"))?;
        let body = Bytes::from(self.response_body.clone().unwrap_or_default());
        Ok(StoredResponse { status, headers, trailers, body })
    }
}

/// A schema or table name that cannot be used: SQL stores splice these names into their
/// statements, so only plain lowercase identifiers are accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a plain lowercase SQL identifier ([a-z_][a-z0-9_]*, at most 48 bytes)")]
pub struct InvalidIdentifier(String);

/// Checks that a schema or table name is a plain SQL identifier (it is spliced into SQL).
pub(crate) fn check_identifier(name: &str) -> Result<(), InvalidIdentifier> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok { Ok(()) } else { Err(InvalidIdentifier(name.to_owned())) }
}

/// The result of a leased claim's fenced write (its completion, or its release): one row means
/// the claim still held the record; none, that the lease was lost; an error, that the write may
/// or may not have reached the database, unless `never_ran` says it surely did not.
pub(crate) fn fenced_write(
    rows: Result<u64, sqlx::Error>,
    never_ran: impl Fn(&sqlx::Error) -> bool,
) -> Result<(), super::FinishError> {
    use super::FinishError;
    match rows {
        Ok(1) => Ok(()),
        Ok(_) => Err(FinishError::ClaimLost),
        Err(error) if never_ran(&error) => Err(FinishError::Store(StoreError::Unavailable(Box::new(error)))),
        Err(error) => Err(FinishError::CommitUncertain(Box::new(error))),
    }
}

/// Milliseconds of a duration, saturating, for SQL intervals.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// What a SQL store does for [`settle`]: read a record, and mark a dead holder's record
/// `unknown`.
pub(crate) trait RecordAccess {
    /// The record of `id`, read in a statement of its own, outside any transaction.
    fn read(&self, id: &RecordId) -> impl Future<Output = Result<Option<RecordRow>, StoreError>> + Send;

    /// Marks `id` unknown if it is still `processing` under `token` with its lease run out.
    /// Whether it did.
    fn mark_unknown(&self, id: &RecordId, token: i64) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// Decides what a record found in the way of a claim means, reading it first if `row` is
/// `None`. `Ok(None)`: there is nothing in the way, claim (again). While a leased holder is
/// alive it looks again (10 ms backoff doubling to 200 ms), never past `deadline`.
pub(crate) async fn settle<C>(
    store: &impl RecordAccess,
    request: &BeginRequest<'_>,
    deadline: Instant,
    row: Option<RecordRow>,
) -> Result<Option<Begin<C>>, StoreError> {
    let mut backoff = Duration::from_millis(10);
    let mut row = match row {
        Some(row) => row,
        None => match store.read(request.id).await? {
            Some(row) => row,
            None => return Ok(None),
        },
    };
    loop {
        match row.decide(request.fingerprint, request.stale_lease)? {
            Found::Forgotten => return Ok(None),
            Found::Record(record) => return Ok(Some(Begin::Existing(record))),
            Found::StaleLease { token, record } => {
                if store.mark_unknown(request.id, token).await? {
                    return Ok(Some(Begin::Existing(record)));
                }
            }
            Found::Live { lease_left } => {
                let now = Instant::now();
                if now >= deadline {
                    return Ok(Some(Begin::InFlight { retry_after: lease_left.min(request.lease) }));
                }
                tokio::time::sleep(backoff.min(lease_left).min(deadline - now)).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
        match store.read(request.id).await? {
            Some(fresh) => row = fresh,
            None => return Ok(None),
        }
    }
}
