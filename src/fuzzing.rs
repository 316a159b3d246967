//! Entry points for the fuzz targets in `fuzz/`: the decoders of stored records that are
//! otherwise private. Hidden, behind the `fuzzing` feature, and without any stability promise.

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "redis"))]
use crate::record::Record;

/// Decodes the payload of a value of the Redis fast path's replay cache (what its seal covers,
/// before the seal is checked); `None` is a miss.
#[cfg(feature = "redis")]
pub fn decode_cached_value(value: &[u8]) -> Option<Record> {
    crate::fast_path::codec::decode_payload(value)
}

/// Encodes a finished record as the Redis fast path caches it (for round trips).
///
/// # Panics
///
/// If `record` has no response: only finished records with a response are cached.
#[cfg(feature = "redis")]
pub fn encode_cached_value(record: &Record) -> Vec<u8> {
    let response = record.response.as_ref().expect("a cached record has a response");
    crate::fast_path::codec::encode_payload(record.state, &record.fingerprint, response)
}

/// A record row of the SQL stores, as read back from the database, column by column.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
#[derive(Debug, Clone, Default)]
pub struct SqlRow {
    /// The `state` column.
    pub state: String,
    /// The `fingerprint_version` column.
    pub fingerprint_version: i16,
    /// The `fingerprint` column.
    pub fingerprint: Vec<u8>,
    /// How long the lease has left, in milliseconds.
    pub lease_left_ms: Option<i64>,
    /// The `response_status` column.
    pub response_status: Option<i16>,
    /// The `response_headers` column (the encoded fields).
    pub response_headers: Option<Vec<u8>>,
    /// The `response_body` column.
    pub response_body: Option<Vec<u8>>,
}

/// Reads a SQL record row as the stores do: the record's state and fingerprint, then its
/// stored response. `Err` (with the store's message) for a row the store must call corrupt.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub fn decode_sql_row(row: SqlRow) -> Result<Record, String> {
    let row = crate::store::sql::RecordRow {
        state: row.state,
        fingerprint_version: row.fingerprint_version,
        fingerprint: row.fingerprint,
        fencing_token: 1,
        lease_left_ms: row.lease_left_ms,
        response_expired: false,
        forgotten: false,
        response_status: row.response_status,
        response_headers: row.response_headers,
        response_body: row.response_body,
    };
    let found = row.found().map_err(|e| e.to_string())?;
    let response = row.response().map_err(|e| e.to_string())?;
    Ok(Record::with_response(found.state, found.fingerprint, response))
}
