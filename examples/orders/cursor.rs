//! Pagination cursors: opaque and tamper-evident,
//! `base64url(payload) "." base64url(HMAC-SHA256(secret, payload))`, bound to the account they
//! were issued to.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::book::account::Account;
use super::book::created_at::CreatedAt;
use super::book::storage::PagePosition;

/// The shortest `ORDERS_CURSOR_SECRET` accepted, in bytes.
const MIN_CURSOR_SECRET_LEN: usize = 16;
/// The only cursor version this service writes and reads.
const CURSOR_VERSION: u32 = 1;

/// Writes and checks opaque, tamper-evident cursors:
/// `base64url(payload) "." base64url(HMAC-SHA256(secret, payload))`.
#[derive(Clone)]
pub(crate) struct CursorCodec {
    mac: Hmac<Sha256>,
}

/// What a cursor carries (JSON, then signed).
#[derive(Debug, Serialize, Deserialize)]
struct CursorPayload {
    /// The format version, [`CURSOR_VERSION`].
    v: u32,
    /// The last row's `created_at`, in Unix microseconds (full precision).
    created_at: i64,
    /// The last row's `order_id`.
    order_id: String,
    /// A digest of the account the cursor was issued to.
    account: String,
}

impl CursorCodec {
    /// A codec signing with `secret`.
    pub(crate) fn new(secret: &[u8]) -> Self {
        Self { mac: <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC accepts keys of any length") }
    }

    /// A codec keyed by `ORDERS_CURSOR_SECRET`, or by a random key for this process.
    pub(crate) fn from_env() -> Result<Self, String> {
        match std::env::var("ORDERS_CURSOR_SECRET") {
            Ok(secret) if secret.len() >= MIN_CURSOR_SECRET_LEN => Ok(Self::new(secret.as_bytes())),
            Ok(_) => Err(format!("ORDERS_CURSOR_SECRET must be at least {MIN_CURSOR_SECRET_LEN} bytes")),
            Err(std::env::VarError::NotPresent) => Ok(Self::random()),
            Err(std::env::VarError::NotUnicode(_)) => Err("ORDERS_CURSOR_SECRET must be UTF-8".to_owned()),
        }
    }

    /// A codec with a random key (two UUID v4s: 244 random bits from the OS).
    pub(crate) fn random() -> Self {
        let mut secret = [0u8; 32];
        secret[..16].copy_from_slice(Uuid::new_v4().as_bytes());
        secret[16..].copy_from_slice(Uuid::new_v4().as_bytes());
        Self::new(&secret)
    }

    /// The cursor that continues after `position` for `account`.
    pub(crate) fn encode(&self, account: &Account, position: PagePosition) -> String {
        let payload = CursorPayload {
            v: CURSOR_VERSION,
            created_at: position.created_at.unix_micros(),
            order_id: position.order_id.to_string(),
            account: account_digest(account),
        };
        // Serialising a struct of numbers and strings cannot fail.
        let json = serde_json::to_vec(&payload).unwrap_or_default();
        self.sign(&json)
    }

    /// Signs raw payload bytes into a cursor. (The tests use it too, to write cursors of
    /// their own.)
    pub(crate) fn sign(&self, payload: &[u8]) -> String {
        let tag = self.mac.clone().chain_update(payload).finalize().into_bytes();
        format!("{}.{}", URL_SAFE_NO_PAD.encode(payload), URL_SAFE_NO_PAD.encode(tag))
    }

    /// The position a cursor continues after, if it is intact, current and `account`'s.
    pub(crate) fn decode(&self, cursor: &str, account: &Account) -> Result<PagePosition, &'static str> {
        let (payload, tag) = cursor.split_once('.').ok_or("the cursor is malformed")?;
        let payload = URL_SAFE_NO_PAD.decode(payload).map_err(|_| "the cursor is malformed")?;
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| "the cursor is malformed")?;
        self.mac.clone().chain_update(&payload).verify_slice(&tag).map_err(|_| "the cursor has been altered")?;
        let payload: CursorPayload = serde_json::from_slice(&payload).map_err(|_| "the cursor is malformed")?;
        if payload.v != CURSOR_VERSION {
            return Err("the cursor is of an unsupported version; start again from the first page");
        }
        if payload.account != account_digest(account) {
            return Err("the cursor was issued to another account");
        }
        let order_id = Uuid::try_parse(&payload.order_id).map_err(|_| "the cursor is malformed")?;
        Ok(PagePosition { created_at: CreatedAt::from_unix_micros(payload.created_at), order_id })
    }
}

/// A digest of the account for the cursor: binds it to its account without showing the id.
/// (The tests use it too, to write cursors of their own.)
pub(crate) fn account_digest(account: &Account) -> String {
    let digest = Sha256::new().chain_update(b"orders/cursor-account\0").chain_update(account.as_str()).finalize();
    digest[..16].iter().map(|byte| format!("{byte:02x}")).collect()
}
