//! The deployment's keying: one secret (the durable store's, or the application's) yields both
//! the namespace of the fast path's Redis keys and the key of the MAC that binds each cached
//! value to its identity. Two deployments with different secrets never read each other's keys,
//! and a value they could read anyway (copied, altered, planted) does not verify.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::key::RecordId;

/// The MAC's length: HMAC-SHA256.
pub(super) const TAG_LEN: usize = 32;

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

    /// `payload`, followed by its MAC over the identity `id` and the payload.
    pub(super) fn seal(&self, id: &RecordId, mut payload: Vec<u8>) -> Vec<u8> {
        let tag = self.mac(id, &payload).finalize().into_bytes();
        payload.extend_from_slice(&tag);
        payload
    }

    /// The payload of a value sealed by [`seal`](Self::seal) for `id` with this keying; `None`
    /// for anything else (too short, altered, another identity's, another deployment's).
    pub(super) fn open<'a>(&self, id: &RecordId, value: &'a [u8]) -> Option<&'a [u8]> {
        let (payload, tag) = value.split_at_checked(value.len().checked_sub(TAG_LEN)?)?;
        // `verify_slice` compares in constant time.
        self.mac(id, payload).verify_slice(tag).ok()?;
        Some(payload)
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
        let sealed = ours.seal(&id("a"), b"payload".to_vec());
        assert_eq!(ours.open(&id("a"), &sealed), Some(&b"payload"[..]));
        assert_eq!(ours.open(&id("b"), &sealed), None, "another identity's value");
        assert_eq!(theirs.open(&id("a"), &sealed), None, "another deployment's value");
        let mut altered = sealed.clone();
        altered[0] ^= 1;
        assert_eq!(ours.open(&id("a"), &altered), None, "an altered value");
        for cut in 0..sealed.len() {
            assert_eq!(ours.open(&id("a"), &sealed[..cut]), None, "a value cut to {cut} bytes");
        }
    }
}
