//! The versioned request fingerprint ([contract §2](crate::contract#2-the-fingerprint)).
//!
//! A retry with the same `Idempotency-Key` must be *the same request*; a
//! different request under a used key is a client bug and must not get the
//! first request's stored answer. The layer stores a [`Fingerprint`] of the
//! canonical request with every record and compares it on each retry.
//!
//! # What goes in
//!
//! SHA-256 over a domain-separation prefix naming the algorithm version
//! (`tower-idempotency/fingerprint/v2\0`), then these fields, each
//! length-prefixed (a `u64` big-endian byte count, then the bytes) and lists
//! preceded by a `u64` big-endian item count, so that no two different
//! requests frame to the same byte stream:
//!
//! 1. the method;
//! 2. the path, as sent (not decoded);
//! 3. the query pairs, percent-decoded (`+` is a space) and sorted by
//!    (name, value): `?a=1&b=2` and `?b=2&a=1` agree;
//! 4. the `Content-Type` values, each as its normalised media type (see
//!    [below](#the-media-type));
//! 5. each header the route declares ([`FingerprintSpec::include_header`]),
//!    in the order declared: its lowercase name, then all its values in order;
//! 6. a body-kind tag byte and the canonical body:
//!    - `J` — `application/json` or any `type/subtype+json` (case-insensitive,
//!      parameters ignored): the canonical JSON of [`canonical::json`], with
//!      the route's ignored members left out;
//!    - `F` — `application/x-www-form-urlencoded`: [`canonical::form`];
//!    - `R` — anything else, no content type, an empty body, or a JSON body
//!      that [`canonical::json`] rejects (not valid JSON, a duplicate member
//!      name, nesting deeper than [`FingerprintSpec::max_json_depth`]): the raw
//!      bytes.
//!
//! Percent-decoding keeps bytes as bytes: `%FF` and `%FE` stay different
//! even though neither is UTF-8 (unlike `form_urlencoded::parse`, which would
//! turn both into U+FFFD).
//!
//! # The media type
//!
//! Each `Content-Type` value is parsed as a media type (RFC 9110 §8.3.1:
//! `type/subtype *( OWS ";" OWS name "=" value )`, a value being a token or
//! a quoted string) and written again one fixed way:
//!
//! - the essence (`type/subtype`) trimmed and lowercased;
//! - each parameter's name trimmed and lowercased; its value trimmed and,
//!   when quoted, unquoted (`\x` is `x`); the value of `charset` lowercased
//!   (charset names are case-insensitive); empty parameters (`;;`) dropped;
//! - for JSON (`application/json`, `*/*+json`), `charset=utf-8` dropped:
//!   JSON is UTF-8 (RFC 8259 §8.1), so `application/json` and
//!   `application/json; charset=UTF-8` are the same request;
//! - the parameters sorted by (name, value) bytes, duplicates kept;
//! - written as `essence;name=value;…`, a value quoted (`"` and `\`
//!   escaped) when it is empty or not a token, a parameter without `=` as
//!   its bare name.
//!
//! So `Application/JSON; Charset="UTF-8"` is `application/json`, and
//! `text/plain; format=flowed; charset=UTF-8` is
//! `text/plain;charset=utf-8;format=flowed`. Other parameter values keep
//! their case (`boundary` values are case-sensitive).
//!
//! # Version 1
//!
//! Records stored before version 2 carry version 1, which differs only in
//! its prefix (`tower-idempotency/fingerprint/v1\0`) and in the media type:
//! the essence lowercased, then the parameters exactly as given after the
//! first `;`, trimmed (`Application/JSON; charset=utf-8` →
//! `application/json;charset=utf-8`). The layer compares a version-1 record
//! with the version-1 fingerprint of the request
//! ([`fingerprint_with_version`]), computed only then.
//!
//! # Canonical JSON
//!
//! Members sorted by the UTF-8 bytes of their decoded names, no whitespace,
//! one fixed string escaping (only `"`, `\` and control characters are
//! escaped: `\"`, `\\`, `\b`, `\t`, `\n`, `\f`, `\r`, else `\u00xx`), and
//! **numbers by exact decimal value**: zero (also `-0`, `0.0`, `0e9`) is `0`;
//! any other number is `[-]D` or `[-]DeE`, with `D` its significant digits
//! (no leading or trailing zeros) and `E` the decimal exponent. `1`, `1.0`,
//! `1e0`, `10e-1`, `0.1e1`, `100e-2` are all `1`; `1500` is `15e2`; `0.25` is
//! `25e-2`; `9007199254740993` stays `9007199254740993`, distinct from
//! `9007199254740992`. Numbers never go through `f64`. A nonzero number
//! whose canonical exponent `E` needs more than 18 digits (however the number
//! is spelled) makes the body fall back to raw.
//! Strings with invalid UTF-8 or lone surrogates (`"\ud800"`) make the body
//! invalid JSON, as does anything after the top-level value; a top-level
//! scalar is valid.
//!
//! # Ignored members
//!
//! [`FingerprintSpec::ignore_json_member`] takes an RFC 6901 JSON Pointer.
//! Each reference token matches an object member of that (unescaped:
//! `~1` is `/`, `~0` is `~`) name, or, on an array, the element at that index
//! (`0` or a number without leading zeros). So `/client_request_time`,
//! `/meta/trace_id` and `/items/0/note` all work; `/items/0` leaves out the
//! whole first element. A pointer whose path is not in the body leaves it
//! untouched. There are no wildcards (`/items/*/note` names a member `*`),
//! and `-` (past the end of an array) matches nothing.
//!
//! # Example
//!
//! ```
//! use http::{HeaderMap, HeaderValue, Method, Uri, header};
//! use tower_idempotency::fingerprint::{FingerprintSpec, canonical, fingerprint};
//!
//! let spec = FingerprintSpec::new()
//!     .include_header(header::HeaderName::from_static("api-version"))
//!     .ignore_json_member("/client_request_time");
//!
//! let mut headers = HeaderMap::new();
//! headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
//! headers.insert("api-version", HeaderValue::from_static("2024-06-01"));
//! let uri: Uri = "/orders?b=2&a=1".parse().unwrap();
//!
//! let first = fingerprint(
//!     &Method::POST,
//!     &uri,
//!     &headers,
//!     br#"{"amount": 10.50, "currency": "EUR", "client_request_time": 1}"#,
//!     &spec,
//! );
//! let retry = fingerprint(
//!     &Method::POST,
//!     &"/orders?a=1&b=2".parse().unwrap(),
//!     &headers,
//!     br#"{"client_request_time":2,"currency":"\u0045UR","amount":1.05e1}"#,
//!     &spec,
//! );
//! assert_eq!(first, retry);
//!
//! let other = fingerprint(&Method::POST, &uri, &headers, br#"{"amount":10.51,"currency":"EUR"}"#, &spec);
//! assert_ne!(first, other);
//!
//! assert_eq!(
//!     canonical::json(br#"{ "b": 1.0, "a": [100, "\u00e9"] }"#, &[], 64).unwrap(),
//!     "{\"a\":[1e2,\"é\"],\"b\":1}".as_bytes(),
//! );
//! ```

use std::cell::RefCell;
use std::fmt;

use http::{HeaderMap, HeaderName, Method, Uri, header};
use sha2::{Digest, Sha256};

mod form;
mod json;
mod media_type;

use json::{Pointer, Scratch};

/// Version of the fingerprint algorithm that [`fingerprint`] computes and new records store.
pub const FINGERPRINT_VERSION: u8 = 2;

/// Every fingerprint version this build computes ([`fingerprint_with_version`]).
pub(crate) const KNOWN_VERSIONS: [u8; 2] = [1, 2];

/// Domain-separation prefix of the hash input for version 1.
const DOMAIN_V1: &[u8] = b"tower-idempotency/fingerprint/v1\0";

/// Domain-separation prefix of the hash input for version 2.
const DOMAIN_V2: &[u8] = b"tower-idempotency/fingerprint/v2\0";

/// Default for [`FingerprintSpec::max_json_depth`].
const DEFAULT_MAX_JSON_DEPTH: usize = 64;

/// A versioned SHA-256 fingerprint of the canonical request.
///
/// Two fingerprints are equal when both the algorithm version and the digest
/// are. Its `Debug` output shows the version and the digest in hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    version: u8,
    digest: [u8; 32],
}

impl Fingerprint {
    /// Rebuilds a fingerprint from its stored version and digest.
    pub const fn from_parts(version: u8, digest: [u8; 32]) -> Self {
        Self { version, digest }
    }

    /// The algorithm version that computed this fingerprint.
    pub const fn version(&self) -> u8 {
        self.version
    }

    /// The SHA-256 digest.
    pub const fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// The digest as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(64);
        for &b in &self.digest {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        out
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fingerprint")
            .field("version", &self.version)
            .field("digest", &format_args!("{}", self.to_hex()))
            .finish()
    }
}

/// What a route declares to be part of the request's meaning, beyond the
/// method, path, query, content type and body that always are.
///
/// The default includes no headers, ignores no JSON members and allows JSON
/// nesting up to 64 containers deep.
#[derive(Clone, Debug)]
pub struct FingerprintSpec {
    headers: Vec<HeaderName>,
    ignored: Vec<Pointer>,
    max_json_depth: usize,
}

impl Default for FingerprintSpec {
    fn default() -> Self {
        Self { headers: Vec::new(), ignored: Vec::new(), max_json_depth: DEFAULT_MAX_JSON_DEPTH }
    }
}

impl FingerprintSpec {
    /// The default spec: no headers, no ignored members, JSON depth 64.
    pub fn new() -> Self {
        Self::default()
    }

    /// A request header that is part of the request's meaning (e.g. an API
    /// version header). All its values are included, in order; a missing
    /// header counts as having no values. Headers are hashed in the order
    /// they are declared.
    pub fn include_header(mut self, name: HeaderName) -> Self {
        self.headers.push(name);
        self
    }

    /// A JSON member to leave out of the fingerprint, as a JSON Pointer
    /// (RFC 6901), e.g. `"/client_request_time"` or `"/meta/trace_id"`.
    ///
    /// Tokens match member names, or array indexes on arrays, so
    /// `"/items/0/note"` is supported (see the [module docs](self)). A pointer
    /// whose path does not exist in a body has no effect on it.
    ///
    /// # Panics
    ///
    /// If `pointer` is not a JSON Pointer to a member: the empty pointer (the
    /// whole document), a pointer not starting with `/`, or one with a `~`
    /// not followed by `0` or `1`. This is a configuration error, found at
    /// start-up.
    pub fn ignore_json_member(mut self, pointer: &str) -> Self {
        match Pointer::parse(pointer) {
            Some(parsed) => self.ignored.push(parsed),
            None => panic!(
                "ignore_json_member: {pointer:?} is not an RFC 6901 JSON Pointer to a member \
                 (it must start with '/' and escape '~' as \"~0\" and '/' as \"~1\")"
            ),
        }
        self
    }

    /// Maximum JSON nesting depth (arrays and objects) before the body falls
    /// back to its raw bytes (default 64). With `0`, only top-level scalars
    /// are canonicalised.
    pub fn max_json_depth(mut self, depth: usize) -> Self {
        self.max_json_depth = depth;
        self
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's reusable parse buffers.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => {
            let result = f(&mut scratch);
            scratch.trim();
            result
        }
        Err(_) => f(&mut Scratch::default()),
    })
}

fn json_into(body: &[u8], pointers: &[Pointer], max_depth: usize, out: &mut Vec<u8>) -> bool {
    with_scratch(|scratch| json::canonicalize_into(body, pointers, max_depth, scratch, out))
}

/// Canonical forms, public for tests, benches and users who want to inspect them.
pub mod canonical {
    use super::{Pointer, form};

    /// Canonical JSON bytes, or `None` if the body is not valid JSON, has
    /// duplicate member names (after decoding escapes), or nests deeper
    /// than `max_depth` arrays and objects.
    ///
    /// `ignored_members` are RFC 6901 JSON Pointers of members to leave out;
    /// text that is not a pointer to a member (see
    /// [`FingerprintSpec::ignore_json_member`](super::FingerprintSpec::ignore_json_member))
    /// matches nothing. See the [module docs](super) for the canonical form.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::canonical;
    ///
    /// let a = canonical::json(br#"{"amount": 1.0, "note": "x"}"#, &["/note"], 64);
    /// let b = canonical::json(br#"{"amount":10e-1}"#, &[], 64);
    /// assert_eq!(a, b);
    /// assert_eq!(a.as_deref(), Some(&b"{\"amount\":1}"[..]));
    /// assert_eq!(canonical::json(br#"{"a":1,"a":1}"#, &[], 64), None);
    /// ```
    pub fn json(body: &[u8], ignored_members: &[&str], max_depth: usize) -> Option<Vec<u8>> {
        let pointers: Vec<Pointer> = ignored_members.iter().filter_map(|p| Pointer::parse(p)).collect();
        let mut out = Vec::new();
        super::json_into(body, &pointers, max_depth, &mut out).then_some(out)
    }

    /// Canonical form-urlencoded bytes: decoded pairs, stably ordered by
    /// name, values of one name kept in their order, re-encoded one fixed
    /// way (`form_urlencoded`'s byte serializer) as `name=value&…`.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::canonical;
    ///
    /// assert_eq!(canonical::form(b"b=2&a=x%20y&b=1&c"), b"a=x+y&b=2&b=1&c=");
    /// ```
    pub fn form(body: &[u8]) -> Vec<u8> {
        form::canonical(body)
    }
}

/// Streams length-prefixed fields into SHA-256.
struct Hasher(Sha256);

impl Hasher {
    fn count(&mut self, n: usize) {
        // `usize` is at most 64 bits on every supported target.
        self.0.update((n as u64).to_be_bytes());
    }

    fn field(&mut self, bytes: &[u8]) {
        self.count(bytes.len());
        self.0.update(bytes);
    }
}

/// How the body is canonicalised, from the content type's essence.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum BodyKind {
    Json,
    Form,
    Raw,
}

/// The body kind of a lowercased media type essence.
fn body_kind(essence: &[u8]) -> BodyKind {
    if essence == b"application/json" || (essence.contains(&b'/') && essence.ends_with(b"+json")) {
        BodyKind::Json
    } else if essence == b"application/x-www-form-urlencoded" {
        BodyKind::Form
    } else {
        BodyKind::Raw
    }
}

/// Splits a `Content-Type` value into its canonical text and body kind, as version 1 did:
/// the essence lowercased, the parameters as given, trimmed.
fn content_type_v1(value: &[u8], canonical: &mut Vec<u8>) -> BodyKind {
    let (essence, params) = match value.iter().position(|&b| b == b';') {
        Some(k) => (&value[..k], Some(&value[k + 1..])),
        None => (value, None),
    };
    let essence = essence.trim_ascii();
    let start = canonical.len();
    canonical.extend(essence.iter().map(u8::to_ascii_lowercase));
    let kind = body_kind(&canonical[start..]);
    if let Some(params) = params.map(<[u8]>::trim_ascii).filter(|p| !p.is_empty()) {
        canonical.push(b';');
        canonical.extend_from_slice(params);
    }
    kind
}

/// Splits a `Content-Type` value into its normalised media type (version 2; see
/// [the module docs](self#the-media-type)) and body kind.
fn content_type_v2(value: &[u8], canonical: &mut Vec<u8>) -> BodyKind {
    let start = canonical.len();
    let mut pieces = media_type::split(value);
    let essence = pieces.next().unwrap_or_default();
    canonical.extend_from_slice(essence.trim_ascii());
    canonical[start..].make_ascii_lowercase();
    let kind = body_kind(&canonical[start..]);
    // The common value, a media type alone, has nothing more to split.
    if essence.len() == value.len() {
        return kind;
    }
    let mut params: Vec<media_type::Parameter> = pieces.filter_map(media_type::Parameter::parse).collect();
    params.retain(|param| !(kind == BodyKind::Json && param.is_charset_utf8()));
    params.sort_unstable();
    for param in &params {
        param.write(canonical);
    }
    kind
}

/// Computes the fingerprint of a request, at [`FINGERPRINT_VERSION`]; see the
/// [module docs](self) for exactly what it covers.
///
/// The body must be the complete request body. This never panics, whatever
/// the body.
pub fn fingerprint(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    spec: &FingerprintSpec,
) -> Fingerprint {
    compute(FINGERPRINT_VERSION, method, uri, headers, body, spec)
}

/// The fingerprint of a request as algorithm `version` computes it (1 or 2), to compare the
/// request with a record stored by an earlier version; `None` for a version this crate does
/// not know.
///
/// ```
/// use http::{HeaderMap, HeaderValue, Method, header};
/// use tower_idempotency::fingerprint::{FingerprintSpec, fingerprint, fingerprint_with_version};
///
/// let (uri, spec) = ("/orders".parse().unwrap(), FingerprintSpec::new());
/// let mut plain = HeaderMap::new();
/// plain.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
/// let mut utf8 = HeaderMap::new();
/// utf8.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json; charset=UTF-8"));
/// let v1 = |headers| fingerprint_with_version(1, &Method::POST, &uri, headers, b"{}", &spec).unwrap();
///
/// // Version 2 knows that JSON is UTF-8; version 1 did not.
/// assert_eq!(fingerprint(&Method::POST, &uri, &plain, b"{}", &spec), fingerprint(&Method::POST, &uri, &utf8, b"{}", &spec));
/// assert_ne!(v1(&plain), v1(&utf8));
/// assert_eq!(v1(&plain).version(), 1);
/// assert!(fingerprint_with_version(9, &Method::POST, &uri, &plain, b"{}", &spec).is_none());
/// ```
pub fn fingerprint_with_version(
    version: u8,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    spec: &FingerprintSpec,
) -> Option<Fingerprint> {
    KNOWN_VERSIONS.contains(&version).then(|| compute(version, method, uri, headers, body, spec))
}

/// The fingerprint at `version` (1 or 2).
fn compute(
    version: u8,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    spec: &FingerprintSpec,
) -> Fingerprint {
    let mut h = Hasher(Sha256::new());
    h.0.update(if version == 1 { DOMAIN_V1 } else { DOMAIN_V2 });
    h.field(method.as_str().as_bytes());
    h.field(uri.path().as_bytes());

    let mut query = form::pairs(uri.query().unwrap_or("").as_bytes());
    query.sort_unstable();
    h.count(query.len());
    for (name, value) in &query {
        h.field(name);
        h.field(value);
    }

    let content_type = if version == 1 { content_type_v1 } else { content_type_v2 };
    with_scratch(|scratch| {
        // One buffer, reused across calls, for the content type and the body.
        let mut canonical = std::mem::take(&mut scratch.output);
        let digest = finish(h, headers, body, spec, content_type, scratch, &mut canonical);
        canonical.clear();
        scratch.output = canonical;
        Fingerprint { version, digest }
    })
}

/// The content type, declared headers and body of [`fingerprint`].
fn finish(
    mut h: Hasher,
    headers: &HeaderMap,
    body: &[u8],
    spec: &FingerprintSpec,
    content_type: fn(&[u8], &mut Vec<u8>) -> BodyKind,
    scratch: &mut Scratch,
    canonical: &mut Vec<u8>,
) -> [u8; 32] {
    let mut kind = BodyKind::Raw;
    let content_types = headers.get_all(header::CONTENT_TYPE);
    h.count(content_types.iter().count());
    for (k, value) in content_types.iter().enumerate() {
        canonical.clear();
        let this = content_type(value.as_bytes(), canonical);
        if k == 0 {
            kind = this;
        }
        h.field(canonical);
    }

    h.count(spec.headers.len());
    for name in &spec.headers {
        h.field(name.as_str().as_bytes());
        let values = headers.get_all(name);
        h.count(values.iter().count());
        for value in values {
            h.field(value.as_bytes());
        }
    }

    if body.is_empty() {
        kind = BodyKind::Raw;
    }
    canonical.clear();
    let (tag, bytes) = match kind {
        BodyKind::Json if json::canonicalize_into(body, &spec.ignored, spec.max_json_depth, scratch, canonical) => {
            (b'J', &canonical[..])
        }
        BodyKind::Form => {
            *canonical = form::canonical(body);
            (b'F', &canonical[..])
        }
        BodyKind::Json | BodyKind::Raw => (b'R', body),
    };
    h.0.update([tag]);
    h.field(bytes);
    h.0.finalize().into()
}

#[cfg(test)]
mod tests;
