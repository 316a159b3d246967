//! Decoding a value of the Redis replay cache from arbitrary bytes: a miss or a finished record
//! that encodes and decodes back to itself; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::RecordState;
use tower_idempotency::fuzzing::{decode_cached_value, encode_cached_value};

fuzz_target!(|data: &[u8]| {
    let Some(record) = decode_cached_value(data) else { return };
    assert!(matches!(record.state, RecordState::Completed | RecordState::Failed), "{:?}", record.state);
    let encoded = encode_cached_value(&record);
    assert_eq!(decode_cached_value(&encoded).as_ref(), Some(&record));
    assert!(encoded.len() <= data.len(), "decoding made a value out of nothing");
});
