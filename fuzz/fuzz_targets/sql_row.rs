//! Decoding a SQL record row with arbitrary column values: a record whose response encodes and
//! decodes back to itself, or the store's "corrupt" error; never a panic.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::StoredResponse;
use tower_idempotency::fuzzing::{SqlRow, decode_sql_row};

const STATES: [&str; 5] = ["processing", "completed", "failed", "unknown", "expired"];

fn row(mut u: Unstructured<'_>) -> Result<SqlRow> {
    let state = if u.ratio(1, 8)? { u.arbitrary()? } else { (*u.choose(&STATES)?).to_owned() };
    let fingerprint = if u.ratio(1, 8)? { u.arbitrary()? } else { u.bytes(32)?.to_vec() };
    Ok(SqlRow {
        state,
        fingerprint_version: if u.ratio(1, 8)? { u.arbitrary()? } else { 1 },
        fingerprint,
        lease_left_ms: u.arbitrary()?,
        response_status: u.arbitrary()?,
        response_body: u.arbitrary()?,
        // The encoded fields last: they take the rest of the input.
        response_headers: if u.ratio(1, 16)? { None } else { Some(u.take_rest().to_vec()) },
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(row) = row(Unstructured::new(data)) else { return };
    let Ok(record) = decode_sql_row(row.clone()) else { return };
    assert_eq!(record.state.as_str(), row.state);
    assert_eq!(record.fingerprint.digest().as_slice(), row.fingerprint.as_slice());
    let response = record.response.expect("the row's response");
    assert_eq!(i16::try_from(response.status.as_u16()).ok(), row.response_status);
    let (headers, trailers) = StoredResponse::decode_fields(&response.encode_fields()).expect("fields round trip");
    assert_eq!((headers, trailers), (response.headers.clone(), response.trailers.clone()));
});
