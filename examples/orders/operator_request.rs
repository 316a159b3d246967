//! What the operator routes read from a request: the record's name in the query
//! (`account`, `operation`, `key`), a page size, and the body of a settlement. Each refusal is
//! a problem answer that names what is wrong.

use axum::http::header::{
    CONTENT_LANGUAGE, CONTENT_LOCATION, CONTENT_TYPE, ETAG, HeaderMap, LAST_MODIFIED, LINK, LOCATION,
};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use tower_idempotency::{IdempotencyKey, RecordId, Scope, StoredResponse};

use super::book::account::Account;
use super::problem::ApiProblem;

/// The longest operation name accepted in a query.
const MAX_OPERATION_LEN: usize = 255;
/// The largest settlement body, in bytes (the layer's default limit on a stored answer).
pub(crate) const MAX_SETTLEMENT_BYTES: usize = 1024 * 1024;
/// `limit` of `GET /admin/idempotency/unknown` when the operator gives none.
const DEFAULT_UNKNOWN_PAGE: usize = 100;
/// The largest `limit` of `GET /admin/idempotency/unknown`.
const MAX_UNKNOWN_PAGE: usize = 1000;
/// The headers a settlement may store: the layer's default allow-list. `set-cookie`,
/// `authorization` and the like are never stored or replayed, by hand or otherwise.
const STORABLE_HEADERS: [HeaderName; 7] =
    [CONTENT_TYPE, LOCATION, ETAG, LAST_MODIFIED, LINK, CONTENT_LANGUAGE, CONTENT_LOCATION];

/// The query naming one record, as it arrives.
#[derive(Debug, Deserialize)]
pub(crate) struct RecordQuery {
    account: Option<String>,
    operation: Option<String>,
    key: Option<String>,
}

/// A record's name, read from the query: its identity, and the operation it belongs to.
pub(crate) struct RecordName {
    /// The digest of (account, operation, key): the record's identity in the store.
    pub(crate) id: RecordId,
}

impl RecordQuery {
    /// The identity the query names; 400 `invalid_query` naming what is missing or invalid.
    /// The key is the caller's raw key (as it appears in the `Idempotency-Key` field without
    /// sf-string quotes); it is used only to compute the identity, never stored or logged.
    pub(crate) fn name(self) -> Result<RecordName, ApiProblem> {
        let required = |value: Option<String>, name: &str| {
            value.filter(|value| !value.is_empty()).ok_or_else(|| {
                ApiProblem::invalid_query(format!("name the record with account, operation and key; {name} is missing"))
            })
        };
        let account = required(self.account, "account")?;
        let operation = required(self.operation, "operation")?;
        let key = required(self.key, "key")?;
        let account = Account::parse(&account)
            .ok_or_else(|| ApiProblem::invalid_query("account must be 1 to 64 visible ASCII characters".to_owned()))?;
        if operation.chars().count() > MAX_OPERATION_LEN || operation.chars().any(char::is_control) {
            return Err(ApiProblem::invalid_query(format!(
                "operation must be 1 to {MAX_OPERATION_LEN} characters without control characters"
            )));
        }
        let key = IdempotencyKey::new(key)
            .map_err(|error| ApiProblem::invalid_query(format!("key is not a valid idempotency key: {error}")))?;
        Ok(RecordName { id: RecordId::new(&Scope::new(account.as_str()), &operation, &key) })
    }
}

/// The query of `GET /admin/idempotency/unknown`.
#[derive(Debug, Deserialize)]
pub(crate) struct UnknownQuery {
    limit: Option<String>,
}

impl UnknownQuery {
    /// `limit`: absent means 100; otherwise an integer from 1 to 1000, else 400 `invalid_limit`.
    pub(crate) fn limit(&self) -> Result<usize, ApiProblem> {
        let Some(raw) = self.limit.as_deref() else {
            return Ok(DEFAULT_UNKNOWN_PAGE);
        };
        raw.parse::<usize>()
            .ok()
            .filter(|limit| (1..=MAX_UNKNOWN_PAGE).contains(limit))
            .ok_or_else(|| ApiProblem::invalid_limit(format!("limit must be an integer from 1 to {MAX_UNKNOWN_PAGE}")))
    }
}

/// How an `unknown` record is settled by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SettledAs {
    /// The effect happened: the answer is stored as `completed` and replayed.
    Completed,
    /// The effect did not happen and will not: the answer is stored as `failed` and replayed.
    Failed,
}

/// The body of `POST /admin/idempotency/record/settle`, checked.
#[derive(Debug)]
pub(crate) struct Settlement {
    /// The state the record moves to.
    pub(crate) state: SettledAs,
    /// The answer every retry gets from now on.
    pub(crate) response: StoredResponse,
}

/// The body as JSON, before the rules JSON types cannot say.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettlementBody {
    state: String,
    status: u16,
    #[serde(default)]
    headers: HeaderList,
    #[serde(default)]
    body: String,
}

/// `{"name": "value", ...}` in order; a name given twice is refused (not silently the last).
#[derive(Default)]
struct HeaderList(Vec<(String, String)>);

impl<'de> Deserialize<'de> for HeaderList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = HeaderList;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object of header names and string values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HeaderList, A::Error> {
                let mut fields: Vec<(String, String)> = Vec::new();
                while let Some((name, value)) = map.next_entry::<String, String>()? {
                    if fields.iter().any(|(seen, _)| seen.eq_ignore_ascii_case(&name)) {
                        return Err(serde::de::Error::custom(format!("header {name:?} is given twice")));
                    }
                    fields.push((name, value));
                }
                Ok(HeaderList(fields))
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

impl Settlement {
    /// Reads and checks a settlement: declared as JSON (else 415), a JSON object with `state`
    /// (`completed` or `failed`), `status` (200 to 399 for `completed`, 400 to 599 for
    /// `failed`), optional `headers` (only the storable ones) and an optional text `body`
    /// (else 422 `invalid_settlement`).
    pub(crate) fn parse(headers: &HeaderMap, body: &[u8]) -> Result<Self, ApiProblem> {
        super::create_request::require_json(headers).map_err(|_| ApiProblem::json_required())?;
        if body.trim_ascii_start().first() != Some(&b'{') {
            return Err(ApiProblem::invalid_settlement(
                "the body must be a JSON object with state, status, headers and body".to_owned(),
            ));
        }
        let body: SettlementBody = serde_json::from_slice(body)
            .map_err(|error| ApiProblem::invalid_settlement(format!("the body is not a valid settlement: {error}")))?;
        let (state, statuses) = match body.state.as_str() {
            "completed" => (SettledAs::Completed, 200..=399),
            "failed" => (SettledAs::Failed, 400..=599),
            _ => {
                return Err(ApiProblem::invalid_settlement(format!(
                    "state must be \"completed\" or \"failed\", got {:?}",
                    body.state
                )));
            }
        };
        let status = StatusCode::from_u16(body.status).ok().filter(|status| statuses.contains(&status.as_u16()));
        let Some(status) = status else {
            return Err(ApiProblem::invalid_settlement(format!(
                "status of a {} record must be from {} to {}, got {}",
                body.state,
                statuses.start(),
                statuses.end(),
                body.status
            )));
        };
        let mut response = StoredResponse::new(status, body.body);
        for (name, value) in body.headers.0 {
            let name = HeaderName::from_bytes(name.as_bytes())
                .ok()
                .filter(|name| STORABLE_HEADERS.contains(name))
                .ok_or_else(|| {
                    ApiProblem::invalid_settlement(format!(
                        "header {name:?} cannot be stored; storable headers are {}",
                        STORABLE_HEADERS.iter().map(HeaderName::as_str).collect::<Vec<_>>().join(", ")
                    ))
                })?;
            let value = HeaderValue::from_str(&value).map_err(|_| {
                ApiProblem::invalid_settlement(format!("the value of header {name} is not a valid header value"))
            })?;
            response.headers.push((name, value));
        }
        Ok(Self { state, response })
    }
}
