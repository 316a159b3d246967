//! Standard Webhooks: the `whsec_` secret, the signature, the sender and the receiver's check.

mod sender;
mod verify;

use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use http::HeaderName;
use sha2::Sha256;

pub use sender::WebhookSender;
pub use verify::{VerifiedWebhook, VerifyError, WebhookVerifier};

/// `webhook-id`: the event's stable id, the same on every delivery.
pub const WEBHOOK_ID_HEADER: HeaderName = HeaderName::from_static("webhook-id");
/// `webhook-timestamp`: the attempt's time, unix seconds.
pub const TIMESTAMP_HEADER: HeaderName = HeaderName::from_static("webhook-timestamp");
/// `webhook-signature`: `v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, one or more,
/// separated by spaces.
pub const SIGNATURE_HEADER: HeaderName = HeaderName::from_static("webhook-signature");

/// A Standard Webhooks signing secret: `whsec_` followed by the base64 of the key.
#[derive(Clone)]
pub struct WebhookSecret {
    key: Arc<[u8]>,
}

/// The text is not a `whsec_` secret (the message never repeats it).
#[derive(Debug, Clone, thiserror::Error)]
#[error("a webhook secret is `whsec_` followed by the base64 of at least 16 bytes")]
pub struct InvalidSecret;

impl WebhookSecret {
    /// Parses `whsec_<base64>`; the key must be at least 16 bytes.
    pub fn parse(text: &str) -> Result<Self, InvalidSecret> {
        let encoded = text.strip_prefix("whsec_").ok_or(InvalidSecret)?;
        let key = STANDARD.decode(encoded).map_err(|_| InvalidSecret)?;
        if key.len() < 16 {
            return Err(InvalidSecret);
        }
        Ok(Self { key: key.into() })
    }

    /// The signature of one delivery: `v1,<base64 HMAC-SHA256 of "id.timestamp.body">`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        format!("v1,{}", STANDARD.encode(self.mac(id, timestamp, body).finalize().into_bytes()))
    }

    fn mac(&self, id: &str, timestamp: i64, body: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.key).expect("HMAC takes keys of any length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks specification's reference libraries.
    #[test]
    fn the_signature_matches_the_specifications_test_vector() {
        let secret = WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signature = secret.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1_614_265_330, br#"{"test": 2432232314}"#);
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn only_whsec_secrets_of_enough_bytes_parse() {
        assert!(WebhookSecret::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
        assert!(WebhookSecret::parse("whsec_not base64!").is_err());
        assert!(WebhookSecret::parse("whsec_c2hvcnQ=").is_err());
        assert_eq!(
            format!("{:?}", WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap()),
            "WebhookSecret(<redacted>)"
        );
    }
}
