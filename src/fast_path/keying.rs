//! The deployment's keying: one secret (the durable store's, or the application's) yields both
//! the namespace of the fast path's Redis keys and the key of the MAC that binds each cached
//! value to its identity. Two deployments with different secrets never read each other's keys,
//! and a value they could read anyway (copied, altered, planted) does not verify.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::key::RecordId;

/// The MAC's length: HMAC-SHA256.
pub(super) const TAG_LEN: usize = 32;

/// Milliseconds since the Unix epoch, now (the sealed values' clock; 0 before the epoch).
pub(super) fn unix_millis() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// The namespace's length in hex digits (64 bits of the secret's derivation).
const NAMESPACE_HEX_LEN: usize = 16;

/// What the fast path derives from the deployment's secret.
pub(super) struct Keying {
    /// Between the prefix and the identity in every Redis key.
    namespace: String,
    /// The MAC key of cached values.
    mac_key: [u8; 32],
}

impl Keying {
    /// The keying of `secret`.
    pub(super) fn derive(secret: &[u8]) -> Self {
        let namespace = derive(secret, b"namespace");
        let namespace = crate::hex::encode(&namespace)[..NAMESPACE_HEX_LEN].to_owned();
        Self { namespace, mac_key: derive(secret, b"cache-mac") }
    }

    /// The namespace of this deployment's keys.
    pub(super) fn namespace(&self) -> &str {
        &self.namespace
    }

    /// `payload`, followed by the time it may be replayed until (`until`, milliseconds since
    /// the Unix epoch, u64 big-endian) and the MAC over the identity `id`, the payload and
    /// that time.
    pub(super) fn seal(&self, id: &RecordId, until: u64, mut payload: Vec<u8>) -> Vec<u8> {
        payload.extend_from_slice(&until.to_be_bytes());
        let tag = self.mac(id, &payload).finalize().into_bytes();
        payload.extend_from_slice(&tag);
        payload
    }

    /// The payload of a value sealed by [`seal`](Self::seal) for `id` with this keying, if it
    /// is still before its time at `now` (milliseconds since the Unix epoch); `None` for
    /// anything else (too short, altered, another identity's, another deployment's, past its
    /// time: a value kept in Redis beyond the TTL it was written with).
    pub(super) fn open<'a>(&self, id: &RecordId, value: &'a [u8], now: u64) -> Option<&'a [u8]> {
        let (sealed, tag) = value.split_at_checked(value.len().checked_sub(TAG_LEN)?)?;
        // `verify_slice` compares in constant time.
        self.mac(id, sealed).verify_slice(tag).ok()?;
        let (payload, until) = sealed.split_last_chunk::<8>()?;
        (now < u64::from_be_bytes(*until)).then_some(payload)
    }

    fn mac(&self, id: &RecordId, payload: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.mac_key).expect("HMAC takes keys of any length");
        mac.update(b"tower-idempotency/cache/v2\0");
        mac.update(id.digest());
        mac.update(payload);
        mac
    }
}

/// HMAC-SHA256 of `label` under `secret`: one independent key per use.
fn derive(secret: &[u8], label: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(b"tower-idempotency/fast-path/");
    mac.update(label);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> RecordId {
        RecordId::new(&crate::Scope::new("t"), "POST /x", &crate::IdempotencyKey::new(key).expect("key"))
    }

    #[test]
    fn sealed_values_open_only_for_their_identity_and_deployment() {
        let (ours, theirs) = (Keying::derive(b"deployment one"), Keying::derive(b"deployment two"));
        assert_ne!(ours.namespace(), theirs.namespace());
        assert_eq!(ours.namespace().len(), NAMESPACE_HEX_LEN);
        let sealed = ours.seal(&id("a"), 1000, b"payload".to_vec());
        assert_eq!(ours.open(&id("a"), &sealed, 999), Some(&b"payload"[..]));
        assert_eq!(ours.open(&id("a"), &sealed, 1000), None, "a value past its time");
        assert_eq!(ours.open(&id("b"), &sealed, 0), None, "another identity's value");
        assert_eq!(theirs.open(&id("a"), &sealed, 0), None, "another deployment's value");
        let mut altered = sealed.clone();
        altered[0] ^= 1;
        assert_eq!(ours.open(&id("a"), &altered, 0), None, "an altered value");
        let mut extended = sealed.clone();
        let at = sealed.len() - TAG_LEN - 1;
        extended[at] ^= 0x80;
        assert_eq!(ours.open(&id("a"), &extended, 999), None, "a value whose time was pushed back");
        for cut in 0..sealed.len() {
            assert_eq!(ours.open(&id("a"), &sealed[..cut], 0), None, "a value cut to {cut} bytes");
        }
    }
}
