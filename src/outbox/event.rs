//! An event as it is enqueued: its stable id, its type and its body, fixed once.

use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::IdempotencyContext;

/// An event's id: stable for the business operation that enqueued it, so that every delivery
/// of the event, first or repeated, carries the same `webhook-id`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EventId(String);

impl EventId {
    /// The id of the `event_type` event of the operation `context` describes: `evt_` and 40
    /// hex digits derived from the operation's identity
    /// ([`IdempotencyContext::downstream_key`] with purpose `outbox/<event_type>`). Every retry
    /// of the operation derives the same id; another operation, or another type, another one.
    pub fn for_operation(context: &IdempotencyContext, event_type: &str) -> Self {
        Self(format!("evt_{}", context.downstream_key(&format!("outbox/{event_type}"))))
    }

    /// An id of the application's own making (1 to 255 visible ASCII characters, none of them
    /// a space, a comma or a double quote, so it stays a valid header value and idempotency
    /// key). `None` if it is not one.
    pub fn new(id: impl Into<String>) -> Option<Self> {
        let id = id.into();
        let valid = (1..=255).contains(&id.len())
            && id.bytes().all(|b| b.is_ascii_graphic() && !matches!(b, b',' | b'"' | b'\\'));
        valid.then_some(Self(id))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An event to enqueue: `{"type", "timestamp", "data"}`, its body fixed here, once, and sent
/// byte for byte on every delivery (`timestamp` is the event's time, RFC 3339 in UTC).
#[derive(Clone, Debug)]
pub struct NewEvent {
    pub(crate) id: EventId,
    pub(crate) event_type: String,
    pub(crate) body: Bytes,
}

impl NewEvent {
    /// The `event_type` event of the operation `context` describes, with `data` as its payload,
    /// timestamped now. Its id is [`EventId::for_operation`].
    pub fn for_operation<T: serde::Serialize + ?Sized>(
        context: &IdempotencyContext,
        event_type: &str,
        data: &T,
    ) -> Result<Self, serde_json::Error> {
        Self::new(EventId::for_operation(context, event_type), event_type, data, SystemTime::now())
    }

    /// An event with an id of the caller's choosing and an explicit time. `data` is serialised
    /// as it is (a raw JSON number stays exact); it fails only if `data`'s own `Serialize` does.
    pub fn new<T: serde::Serialize + ?Sized>(
        id: EventId,
        event_type: &str,
        data: &T,
        time: SystemTime,
    ) -> Result<Self, serde_json::Error> {
        let mut body = Vec::with_capacity(256);
        body.extend_from_slice(b"{\"type\":");
        serde_json::to_writer(&mut body, event_type)?;
        body.extend_from_slice(b",\"timestamp\":");
        serde_json::to_writer(&mut body, &rfc3339(time))?;
        body.extend_from_slice(b",\"data\":");
        serde_json::to_writer(&mut body, data)?;
        body.push(b'}');
        Ok(Self { id, event_type: event_type.to_owned(), body: Bytes::from(body) })
    }

    /// The event's id.
    pub fn id(&self) -> &EventId {
        &self.id
    }

    /// The event's type (`order.created`, say).
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The body every delivery sends.
    pub fn body(&self) -> &Bytes {
        &self.body
    }
}

/// An event a relay holds under a lease: what a [`Sender`](super::Sender) delivers.
#[derive(Clone, Debug)]
pub struct PendingEvent {
    /// The event's stable id.
    pub id: EventId,
    /// Its type.
    pub event_type: String,
    /// Its body, byte for byte as enqueued.
    pub body: Bytes,
    /// Which attempt this is (1 for the first).
    pub attempt: u32,
    /// How long ago it was enqueued.
    pub age: Duration,
}

/// `time` as RFC 3339 in UTC with millisecond precision: `2026-12-01T06:03:50.123Z`.
pub(crate) fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (rest / 3600, rest % 3600 / 60, rest % 60);
    let millis = since.subsec_millis();
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{millis:03}Z")
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IdempotencyKey, RecordId, Scope};

    fn context(key: &str) -> IdempotencyContext {
        let id = RecordId::new(&Scope::new("acct_1"), "orders.create", &IdempotencyKey::new(key).unwrap());
        IdempotencyContext::new(id, "orders.create", None)
    }

    #[test]
    fn an_event_id_is_the_same_for_every_retry_of_the_operation_and_differs_by_type_and_operation() {
        let first = EventId::for_operation(&context("k-1"), "order.created");
        assert_eq!(first, EventId::for_operation(&context("k-1"), "order.created"));
        assert_ne!(first, EventId::for_operation(&context("k-2"), "order.created"));
        assert_ne!(first, EventId::for_operation(&context("k-1"), "order.cancelled"));
        assert!(first.as_str().starts_with("evt_") && first.as_str().len() == 44, "{first}");
        assert!(IdempotencyKey::new(first.as_str()).is_ok(), "an event id is a valid idempotency key");
    }

    #[test]
    fn the_body_is_type_timestamp_and_data() {
        let time = SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_568_800_123);
        let data = serde_json::json!({"a": 1});
        let event = NewEvent::new(EventId::new("evt_1").unwrap(), "order.created", &data, time).unwrap();
        let body: serde_json::Value = serde_json::from_slice(event.body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"type": "order.created", "timestamp": "2025-12-01T06:00:00.123Z", "data": {"a": 1}})
        );
    }

    #[test]
    fn rfc3339_handles_leap_years_and_the_epoch() {
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn an_own_id_must_be_a_plain_visible_token() {
        assert!(EventId::new("").is_none());
        assert!(EventId::new("a b").is_none());
        assert!(EventId::new("a,b").is_none());
        assert!(EventId::new("x".repeat(256)).is_none());
        assert_eq!(EventId::new("msg_1").unwrap().as_str(), "msg_1");
    }
}
