//! The `Idempotency-Key` header, the scope, and the scoped record identity ([contract §1](crate::contract#1-the-key)).
//!
//! A key is an RFC 8941 sf-string (`"…"`, as the IETF draft says) or a bare token (what most
//! clients send, such as an unquoted UUID). It must be 1 to 255 visible ASCII characters after
//! parsing, and the request must carry exactly one `Idempotency-Key` field.
//!
//! A key with a control character (NUL, CR, LF, DEL, any byte below `0x20` but the tab)
//! never reaches the layer: such a byte is not allowed in an HTTP field value, so hyper refuses
//! the request before any service runs (over HTTP/1.1 with a bare `400 Bad Request`, without
//! problem+json or a `code`; over HTTP/2 the codec rejects the malformed request). What HTTP
//! does allow in a field value but a key does not (a tab or space inside a quoted key, bytes
//! above `0x7E`) reaches the layer and is refused with 400 `idempotency_key_invalid`.
//!
//! ```
//! use http::HeaderMap;
//! use tower_idempotency::key::{parse_key, KeyError};
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("idempotency-key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"".parse().unwrap());
//! let key = parse_key(&headers, &"idempotency-key".parse().unwrap()).unwrap().unwrap();
//! assert_eq!(key.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
//!
//! headers.insert("idempotency-key", "\"a\", \"b\"".parse().unwrap());
//! assert_eq!(parse_key(&headers, &"idempotency-key".parse().unwrap()), Err(KeyError::List));
//! ```

use std::fmt;

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

/// The longest key accepted, in characters, after sf-string unescaping.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as the client sent it (after sf-string unescaping).
///
/// Its `Debug` output never shows the key itself: keys are not logged in clear.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates a key that was already taken out of its header (no sf-string quoting).
    ///
    /// ```
    /// use tower_idempotency::IdempotencyKey;
    /// assert!(IdempotencyKey::new("order-42").is_ok());
    /// assert!(IdempotencyKey::new("").is_err());
    /// ```
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        validate_chars(&key)?;
        Ok(Self(key))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IdempotencyKey(<redacted>)")
    }
}

/// Why an `Idempotency-Key` header was refused. Every variant answers 400
/// `idempotency_key_invalid`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request carries more than one `Idempotency-Key` field.
    #[error("more than one Idempotency-Key field")]
    Multiple,
    /// The field is an sf-list of several members.
    #[error("the Idempotency-Key field is a list; send exactly one key")]
    List,
    /// The key is empty.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    #[error("the Idempotency-Key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    /// The key has a control, space or non-ASCII character (only visible ASCII is allowed).
    #[error("the Idempotency-Key may contain visible ASCII characters only")]
    InvalidCharacters,
    /// The field is a structured item that is neither an sf-string nor a token-like key
    /// (an integer, a byte sequence, a boolean, or an item with parameters).
    #[error("the Idempotency-Key must be an sf-string (\"...\") or a bare token")]
    NotAString,
}

/// Reads the key from `headers[name]`.
///
/// Returns `Ok(None)` when the header is absent, an error when it is present but invalid.
pub fn parse_key(headers: &HeaderMap, name: &HeaderName) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    parse_field_value(value.as_bytes()).map(Some)
}

/// Parses one field value: an sf-string, or a bare token.
///
/// ```
/// use tower_idempotency::key::parse_field_value;
/// assert_eq!(parse_field_value(b"\"a\\\"b\"").unwrap().as_str(), "a\"b");
/// assert_eq!(parse_field_value(b"550e8400-e29b-41d4-a716-446655440000").unwrap().as_str(),
///            "550e8400-e29b-41d4-a716-446655440000");
/// assert!(parse_field_value(b"").is_err());
/// ```
pub fn parse_field_value(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
    if !raw.is_ascii() {
        return Err(KeyError::InvalidCharacters);
    }
    let trimmed = raw.trim_ascii();
    if trimmed.is_empty() {
        return Err(KeyError::Empty);
    }
    if trimmed.first() == Some(&b'"') {
        return parse_sf_string(trimmed);
    }
    // A bare key. A real sf-token starts with a letter or `*`, but clients send unquoted
    // UUIDs and numbers, which RFC 8941 would read as integers: accept any run of visible
    // ASCII that is not a list, a parameterised item or a broken string.
    if trimmed.contains(&b',') {
        return Err(KeyError::List);
    }
    if trimmed.iter().any(|b| matches!(b, b';' | b'"' | b'\\')) {
        return Err(KeyError::NotAString);
    }
    let text = std::str::from_utf8(trimmed).map_err(|_| KeyError::InvalidCharacters)?;
    IdempotencyKey::new(text)
}

fn parse_sf_string(field: &[u8]) -> Result<IdempotencyKey, KeyError> {
    match sfv::Parser::new(field).parse::<sfv::Item>() {
        Ok(item) => match item.bare_item {
            sfv::BareItem::String(s) if item.params.is_empty() => IdempotencyKey::new(s.as_str()),
            _ => Err(KeyError::NotAString),
        },
        Err(_) => match sfv::Parser::new(field).parse::<sfv::List>() {
            Ok(list) if list.len() > 1 => Err(KeyError::List),
            _ => Err(KeyError::NotAString),
        },
    }
}

fn validate_chars(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(KeyError::InvalidCharacters);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(())
}

/// The tenant or principal a key belongs to. A key of one scope never replays another's answer.
///
/// Insert it into the request's extensions from your authentication layer, and the
/// [`IdempotencyLayer`](crate::IdempotencyLayer) reads it from there by default:
///
/// ```
/// use tower_idempotency::Scope;
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Scope::new("account-7"));
/// assert_eq!(request.extensions().get::<Scope>().unwrap().as_str(), "account-7");
/// ```
///
/// A scope keeps its [`digest`](Scope::digest) once computed, and a clone made after that
/// carries it: a scope value shared by many requests (as
/// [`shared_scope`](crate::IdempotencyLayer::shared_scope) shares one) is hashed once, not on
/// every request.
#[derive(Clone)]
pub struct Scope {
    text: std::sync::Arc<str>,
    digest: std::sync::OnceLock<[u8; 32]>,
}

impl Scope {
    /// A scope from the authenticated tenant or principal's identifier.
    pub fn new(scope: impl Into<std::sync::Arc<str>>) -> Self {
        Self { text: scope.into(), digest: std::sync::OnceLock::new() }
    }

    /// The scope as text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// A SHA-256 digest of the scope, what the stores keep of it (never the scope itself), so
    /// that a record is found by its operation id only within its own scope.
    ///
    /// Computed on the first call and kept; clones made after it share the result.
    ///
    /// ```
    /// use tower_idempotency::Scope;
    /// let scope = Scope::new("account-7");
    /// assert_eq!(scope.digest(), Scope::new("account-7").digest());
    /// assert_ne!(scope.digest(), Scope::new("account-8").digest());
    /// ```
    pub fn digest(&self) -> [u8; 32] {
        *self.digest.get_or_init(|| {
            let mut hasher = Sha256::new();
            hasher.update(b"tower-idempotency/scope/v1\0");
            hasher.update(self.text.as_bytes());
            hasher.finalize().into()
        })
    }
}

/// Two scopes are equal when their text is: the kept digest follows from it.
impl PartialEq for Scope {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Scope {}

impl std::hash::Hash for Scope {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Scope(<redacted>)")
    }
}

/// The identity of one idempotency record: a SHA-256 digest of *(scope, operation, key)*.
///
/// Stores use the digest as their lookup key, so raw keys and scopes are never stored or
/// logged. The digest is framed (each part length-prefixed), so `("a", "bc")` and
/// `("ab", "c")` never collide.
///
/// ```
/// use tower_idempotency::{IdempotencyKey, RecordId, Scope};
/// let key = IdempotencyKey::new("k-1").unwrap();
/// let a = RecordId::new(&Scope::new("tenant-a"), "POST /orders", &key);
/// let b = RecordId::new(&Scope::new("tenant-b"), "POST /orders", &key);
/// assert_ne!(a, b);
/// assert_eq!(a.to_hex().len(), 64);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordId([u8; 32]);

impl std::hash::Hash for RecordId {
    /// The digest is already uniform: its first eight bytes identify it well enough for a
    /// hash table (equality still compares all 32).
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let (head, _) = self.0.split_first_chunk::<8>().expect("32 bytes");
        state.write_u64(u64::from_le_bytes(*head));
    }
}

impl RecordId {
    /// The identity of `key` for `operation` within `scope`.
    pub fn new(scope: &Scope, operation: &str, key: &IdempotencyKey) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/record/v1\0");
        for part in [scope.as_str(), operation, key.as_str()] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        Self(hasher.finalize().into())
    }

    /// The identity of a stored digest, as the stores read it back.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) const fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// The digest bytes.
    pub const fn digest(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest as lowercase hex: what logs and caches show instead of the key.
    pub fn to_hex(&self) -> String {
        crate::hex::encode(&self.0)
    }

    /// A stable operation id for this identity, the same on every retry: a UUID-shaped
    /// string derived from the digest (and not equal to it).
    pub fn operation_id(&self) -> String {
        let hex = crate::hex::encode(&self.operation_id_bytes());
        format!("{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
    }

    /// The identity under which shadow mode records this request: a one-way derivation of
    /// this digest, never equal to any enforced identity's, so enforce mode never replays what
    /// shadow mode saw (see [`rollout`](crate::rollout)).
    pub fn shadow(&self) -> RecordId {
        RecordId(derive(b"shadow-record", &self.0, b""))
    }

    /// The 16 bytes of [`operation_id`](Self::operation_id), as the stores keep them.
    pub(crate) fn operation_id_bytes(&self) -> [u8; 16] {
        let derived = derive(b"operation-id", &self.0, b"");
        let mut bytes = [0; 16];
        bytes.copy_from_slice(&derived[..16]);
        bytes
    }

    /// What the SQL stores keep to find this identity by its operation id within the scope
    /// whose digest is `scope_digest` (see [`scoped_operation_key`]).
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn operation_key(&self, scope_digest: &[u8; 32]) -> [u8; 16] {
        scoped_operation_key(&self.operation_id_bytes(), scope_digest)
    }

    /// A key for a downstream call (a payment provider's `Idempotency-Key`, say), stable for
    /// this identity and `purpose`, so the downstream sees the same key on every retry.
    pub fn downstream_key(&self, purpose: &str) -> String {
        let derived = derive(b"downstream-key", &self.0, purpose.as_bytes());
        crate::hex::encode(&derived[..20])
    }
}

/// The operation id's 16 bytes bound to a scope: a one-way digest of both, so that one column
/// (and one index entry) finds a record by its operation id only from within its own scope.
/// Knowing another scope's operation id does not give its key without that scope's digest.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn scoped_operation_key(operation_id: &[u8; 16], scope_digest: &[u8; 32]) -> [u8; 16] {
    let derived = derive(b"operation-in-scope", scope_digest, operation_id);
    let mut key = [0; 16];
    key.copy_from_slice(&derived[..16]);
    key
}

fn derive(domain: &[u8], digest: &[u8; 32], extra: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"tower-idempotency/");
    hasher.update(domain);
    hasher.update(b"\0");
    hasher.update(digest);
    hasher.update((extra.len() as u64).to_be_bytes());
    hasher.update(extra);
    hasher.finalize().into()
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<IdempotencyKey, KeyError> {
        parse_field_value(raw.as_bytes())
    }

    #[test]
    fn accepts_sf_strings_and_bare_tokens() {
        assert_eq!(parse("\"abc\"").unwrap().as_str(), "abc");
        assert_eq!(parse("abc").unwrap().as_str(), "abc");
        assert_eq!(parse("  abc  ").unwrap().as_str(), "abc");
        assert_eq!(parse("123").unwrap().as_str(), "123");
        assert_eq!(parse("a:b/c=+").unwrap().as_str(), "a:b/c=+");
        assert_eq!(parse("\"with space\""), Err(KeyError::InvalidCharacters));
        assert_eq!(parse("\"esc\\\\aped\"").unwrap().as_str(), "esc\\aped");
    }

    #[test]
    fn refuses_lists_empty_long_and_odd_characters() {
        assert_eq!(parse("\"a\", \"b\""), Err(KeyError::List));
        assert_eq!(parse("a, b"), Err(KeyError::List));
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
        assert_eq!(parse(&"x".repeat(256)), Err(KeyError::TooLong));
        assert!(parse(&"x".repeat(255)).is_ok());
        assert_eq!(parse("\"unterminated"), Err(KeyError::NotAString));
        assert_eq!(parse("\"a\";p=1"), Err(KeyError::NotAString));
        assert_eq!(parse("a;p=1"), Err(KeyError::NotAString));
        assert_eq!(parse_field_value("ключ".as_bytes()), Err(KeyError::InvalidCharacters));
        assert_eq!(parse_field_value(b"a\tb"), Err(KeyError::InvalidCharacters));
        assert_eq!(parse("a b"), Err(KeyError::InvalidCharacters));
    }

    #[test]
    fn refuses_two_fields() {
        let mut headers = HeaderMap::new();
        let name = HeaderName::from_static("idempotency-key");
        headers.append(&name, "a".parse().unwrap());
        headers.append(&name, "b".parse().unwrap());
        assert_eq!(parse_key(&headers, &name), Err(KeyError::Multiple));
    }

    #[test]
    fn identity_is_framed_and_scoped() {
        let k = IdempotencyKey::new("c").unwrap();
        let a = RecordId::new(&Scope::new("a"), "bc", &k);
        let b = RecordId::new(&Scope::new("ab"), "c", &k);
        assert_ne!(a, b);
        assert_eq!(a, RecordId::new(&Scope::new("a"), "bc", &k));
        assert_ne!(a.operation_id(), a.to_hex());
        assert_eq!(a.downstream_key("charge"), a.downstream_key("charge"));
        assert_ne!(a.downstream_key("charge"), a.downstream_key("refund"));
    }

    #[test]
    fn a_scope_keeps_its_digest_and_equality_follows_its_text() {
        use std::hash::BuildHasher;
        let (hashed, fresh) = (Scope::new("tenant-1"), Scope::new("tenant-1"));
        let expected: [u8; 32] =
            Sha256::new_with_prefix(b"tower-idempotency/scope/v1\0").chain_update(b"tenant-1").finalize().into();
        assert_eq!(hashed.digest(), expected);
        // A clone made after the digest carries it; one made before computes the same.
        let (before, after) = (fresh.clone(), hashed.clone());
        assert_eq!(after.digest.get(), Some(&expected));
        assert_eq!(before.digest.get(), None);
        assert_eq!(before.digest(), expected);
        // Whether the digest is kept does not change equality or hashing.
        assert_eq!(hashed, fresh);
        let state = std::collections::hash_map::RandomState::new();
        assert_eq!(state.hash_one(&hashed), state.hash_one(&fresh));
        assert_ne!(hashed, Scope::new("tenant-2"));
        assert_ne!(hashed.digest(), Scope::new("tenant-2").digest());
    }

    #[test]
    fn debug_output_hides_keys_and_scopes() {
        let k = IdempotencyKey::new("secret-key").unwrap();
        assert!(!format!("{k:?}").contains("secret"));
        assert!(!format!("{:?}", Scope::new("secret-tenant")).contains("secret"));
    }
}
