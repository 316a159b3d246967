//! Decoding the stored headers and trailers (`StoredResponse::decode_fields`, as SQL rows and
//! cached values hold them) from arbitrary bytes: a miss or fields that encode and decode back
//! to themselves; never a panic.
#![no_main]

use http::StatusCode;
use libfuzzer_sys::fuzz_target;
use tower_idempotency::StoredResponse;

fuzz_target!(|data: &[u8]| {
    let Some((headers, trailers)) = StoredResponse::decode_fields(data) else { return };
    let mut response = StoredResponse::new(StatusCode::OK, &b""[..]);
    response.headers = headers.clone();
    response.trailers = trailers.clone();
    let encoded = response.encode_fields();
    assert_eq!(StoredResponse::decode_fields(&encoded), Some((headers, trailers)));
    assert!(encoded.len() <= data.len(), "decoding made fields out of nothing");
});
