//! Form canonicalisation against a reference decoder: the canonical form holds exactly the
//! input's decoded pairs in canonical order (so equal pair lists canonicalise the same and
//! different ones differently), and is a fixed point.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::fingerprint::canonical;
use tower_idempotency_fuzz::form_model;

fuzz_target!(|data: &[u8]| {
    let canonical = canonical::form(data);
    let expected = form_model::canonical_pairs(data);
    assert_eq!(form_model::pairs(&canonical), expected, "canonical form {:?}", String::from_utf8_lossy(&canonical));
    assert_eq!(canonical::form(&canonical), canonical, "the canonical form is not a fixed point");
});
