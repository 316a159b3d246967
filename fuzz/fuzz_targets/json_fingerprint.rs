//! The canonical JSON of the fingerprint against a reference model with exact decimals:
//! - the crate's canonical form equals the model's (both refuse the same inputs), so two
//!   inputs that parse to the same value canonicalise the same and different values differently;
//! - another spelling of the same value (whitespace, member order, escapes, number spellings,
//!   chosen by the input's bytes) canonicalises and fingerprints the same;
//! - the canonical form is a fixed point; nothing panics.
#![no_main]

use http::{HeaderMap, HeaderValue, Method, Uri, header};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::fingerprint::{FingerprintSpec, canonical, fingerprint};
use tower_idempotency_fuzz::json_model::{self, Choices};

/// Low, so that the fuzzer reaches the nesting limit.
const MAX_DEPTH: usize = 8;

fuzz_target!(|data: &[u8]| {
    let got = canonical::json(data, &[], MAX_DEPTH);
    let expected = json_model::canonical(data, MAX_DEPTH);
    assert_eq!(
        got.as_deref().map(String::from_utf8_lossy),
        expected.as_deref().map(String::from_utf8_lossy),
        "input {:?}",
        String::from_utf8_lossy(data)
    );
    let Some(canonical) = got else { return };
    assert_eq!(canonical::json(&canonical, &[], MAX_DEPTH).as_ref(), Some(&canonical), "not a fixed point");

    let value = json_model::parse(data, MAX_DEPTH).expect("the model parsed it");
    let mut respelled = String::new();
    json_model::render(&value, &mut Choices(data), &mut respelled);
    assert_eq!(
        canonical::json(respelled.as_bytes(), &[], MAX_DEPTH).as_ref(),
        Some(&canonical),
        "another spelling {respelled:?} of {:?}",
        String::from_utf8_lossy(data)
    );

    let spec = FingerprintSpec::new().max_json_depth(MAX_DEPTH);
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let uri = Uri::from_static("/orders");
    let print = |body: &[u8]| fingerprint(&Method::POST, &uri, &headers, body, &spec);
    assert_eq!(print(data), print(respelled.as_bytes()), "same value, different fingerprints");
    assert_eq!(print(data), print(&canonical));
});
