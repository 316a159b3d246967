//! [`WebhookVerifier`]: the receiver's check of a Standard Webhook's signature and timestamp.

use std::time::{Duration, SystemTime};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::Mac;
use http::HeaderMap;

use super::{SIGNATURE_HEADER, TIMESTAMP_HEADER, WEBHOOK_ID_HEADER, WebhookSecret};

/// Checks deliveries: a signature by the shared secret over `id.timestamp.body`, and a
/// timestamp within the tolerance (default 5 minutes either way) of the receiver's clock, so
/// an old delivery captured on the wire cannot be replayed later.
#[derive(Clone, Debug)]
pub struct WebhookVerifier {
    secret: WebhookSecret,
    tolerance: Duration,
}

/// A delivery that passed the check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifiedWebhook {
    /// `webhook-id`.
    pub id: String,
    /// `webhook-timestamp`, unix seconds.
    pub timestamp: i64,
}

/// Why a delivery was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A header is missing, repeated or not text.
    #[error("the {0} header is missing or malformed")]
    MissingHeader(&'static str),
    /// `webhook-timestamp` is not a number of seconds.
    #[error("webhook-timestamp is not a unix time in seconds")]
    BadTimestamp,
    /// The timestamp is further from now than the tolerance.
    #[error("webhook-timestamp is outside the tolerance")]
    Stale,
    /// No signature matches.
    #[error("no webhook-signature matches")]
    BadSignature,
}

impl WebhookVerifier {
    /// A verifier for deliveries signed with `secret`, with a 5 minute tolerance.
    pub fn new(secret: WebhookSecret) -> Self {
        Self { secret, tolerance: Duration::from_secs(300) }
    }

    /// How far a delivery's timestamp may be from now, either way.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Checks a delivery against the system clock.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<VerifiedWebhook, VerifyError> {
        self.verify_at(headers, body, SystemTime::now())
    }

    /// Checks a delivery as of `now`.
    pub fn verify_at(&self, headers: &HeaderMap, body: &[u8], now: SystemTime) -> Result<VerifiedWebhook, VerifyError> {
        let id = single(headers, &WEBHOOK_ID_HEADER, "webhook-id")?;
        let timestamp = single(headers, &TIMESTAMP_HEADER, "webhook-timestamp")?;
        let signatures = single(headers, &SIGNATURE_HEADER, "webhook-signature")?;
        let timestamp: i64 = timestamp.parse().map_err(|_| VerifyError::BadTimestamp)?;
        let now = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        if now.abs_diff(timestamp) > self.tolerance.as_secs() {
            return Err(VerifyError::Stale);
        }
        let matches = signatures.split(' ').filter_map(|entry| entry.strip_prefix("v1,")).any(|encoded| {
            STANDARD
                .decode(encoded)
                .is_ok_and(|given| self.secret.mac(id, timestamp, body).verify_slice(&given).is_ok())
        });
        if !matches {
            return Err(VerifyError::BadSignature);
        }
        Ok(VerifiedWebhook { id: id.to_owned(), timestamp })
    }
}

fn single<'a>(headers: &'a HeaderMap, name: &http::HeaderName, label: &'static str) -> Result<&'a str, VerifyError> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => value.to_str().ok().filter(|v| !v.is_empty()).ok_or(VerifyError::MissingHeader(label)),
        _ => Err(VerifyError::MissingHeader(label)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const BODY: &[u8] = br#"{"test": 2432232314}"#;

    fn signed(id: &str, timestamp: i64, signature: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(WEBHOOK_ID_HEADER, id.parse().unwrap());
        headers.insert(TIMESTAMP_HEADER, timestamp.to_string().parse().unwrap());
        headers.insert(SIGNATURE_HEADER, signature.parse().unwrap());
        headers
    }

    fn at(secs: i64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs as u64)
    }

    #[test]
    fn a_genuine_delivery_passes_and_anything_else_is_refused_with_its_reason() {
        let verifier = WebhookVerifier::new(WebhookSecret::parse(SECRET).unwrap());
        let good = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        let id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
        let ok = verifier.verify_at(&signed(id, 1_614_265_330, good), BODY, at(1_614_265_330 + 299));
        assert_eq!(ok, Ok(VerifiedWebhook { id: id.into(), timestamp: 1_614_265_330 }));
        // Several signatures (a secret being rotated): one match is enough.
        let rotated = format!("v1,AAAA {good}");
        assert!(verifier.verify_at(&signed(id, 1_614_265_330, &rotated), BODY, at(1_614_265_330)).is_ok());

        let stale = verifier.verify_at(&signed(id, 1_614_265_330, good), BODY, at(1_614_265_330 + 301));
        assert_eq!(stale, Err(VerifyError::Stale));
        let other_body = verifier.verify_at(&signed(id, 1_614_265_330, good), b"{}", at(1_614_265_330));
        assert_eq!(other_body, Err(VerifyError::BadSignature));
        let other_id = verifier.verify_at(&signed("msg_other", 1_614_265_330, good), BODY, at(1_614_265_330));
        assert_eq!(other_id, Err(VerifyError::BadSignature));
        let v2 = verifier.verify_at(&signed(id, 1_614_265_330, &good.replace("v1,", "v2,")), BODY, at(1_614_265_330));
        assert_eq!(v2, Err(VerifyError::BadSignature));
        let mut missing = signed(id, 1_614_265_330, good);
        missing.remove(SIGNATURE_HEADER);
        assert_eq!(
            verifier.verify_at(&missing, BODY, at(1_614_265_330)),
            Err(VerifyError::MissingHeader("webhook-signature"))
        );
    }
}
