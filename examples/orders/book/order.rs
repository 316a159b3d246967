//! An order, and the rules of the fields a client decides. Both services check them the same
//! way; only how the fields arrive (a JSON body, a protobuf message) is theirs.

use std::fmt;

use serde::{Serialize, Serializer};
use serde_json::value::RawValue;
use uuid::Uuid;

use super::account::Account;
use super::created_at::CreatedAt;
use super::storage::PagePosition;

/// The longest `sku` accepted, in characters.
const MAX_SKU_LEN: usize = 64;

/// An order as stored and as answered.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Order {
    /// A UUID v4, the unique tie-breaker of the listing order.
    #[serde(serialize_with = "as_display")]
    pub(crate) order_id: Uuid,
    /// The owner.
    pub(crate) account_id: Account,
    /// What was ordered.
    pub(crate) sku: String,
    /// How many.
    pub(crate) quantity: u64,
    /// The amount in minor units, exactly as the client wrote it.
    pub(crate) amount_minor: AmountMinor,
    /// Three uppercase letters.
    pub(crate) currency: String,
    /// When the order was recorded.
    #[serde(serialize_with = "as_display")]
    pub(crate) created_at: CreatedAt,
    /// The idempotency layer's stable id for the request that created the order.
    pub(crate) idempotency_operation_id: String,
}

impl Order {
    /// A new order of `account`: a fresh UUID v4, stamped `created_at`.
    pub(crate) fn new(account: Account, draft: OrderDraft, operation_id: &str, created_at: CreatedAt) -> Self {
        Self {
            order_id: Uuid::new_v4(),
            account_id: account,
            sku: draft.sku,
            quantity: draft.quantity,
            amount_minor: draft.amount_minor,
            currency: draft.currency,
            created_at,
            idempotency_operation_id: operation_id.to_owned(),
        }
    }

    /// Where the order can be read.
    pub(crate) fn location(&self) -> String {
        format!("/orders/{}", self.order_id)
    }

    /// The order's place in the listing.
    pub(crate) fn position(&self) -> PagePosition {
        PagePosition { created_at: self.created_at, order_id: self.order_id }
    }
}

fn as_display<T: fmt::Display, S: Serializer>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(value)
}

/// A validated order to create: everything of an order that the client decides.
#[derive(Clone, Debug)]
pub(crate) struct OrderDraft {
    sku: String,
    quantity: u64,
    amount_minor: AmountMinor,
    currency: String,
}

impl OrderDraft {
    /// Checks the fields in order (`sku`, `quantity`, `amount_minor`, `currency`); the error
    /// names the first field that breaks its rule. `amount_minor` comes already read by the
    /// caller ([`AmountMinor::parse`] for a JSON number, [`AmountMinor::from_digits`] for
    /// text), its error reported in its turn.
    pub(crate) fn new(
        sku: String,
        quantity: i64,
        amount_minor: Result<AmountMinor, String>,
        currency: String,
    ) -> Result<Self, String> {
        Ok(Self {
            sku: validate_sku(sku)?,
            quantity: validate_quantity(quantity)?,
            amount_minor: amount_minor?,
            currency: validate_currency(currency)?,
        })
    }
}

fn validate_sku(sku: String) -> Result<String, String> {
    let length = sku.chars().count();
    if !(1..=MAX_SKU_LEN).contains(&length) || sku.chars().any(char::is_control) {
        return Err(format!("sku must be 1 to {MAX_SKU_LEN} characters without control characters"));
    }
    Ok(sku)
}

fn validate_quantity(quantity: i64) -> Result<u64, String> {
    u64::try_from(quantity)
        .ok()
        .filter(|q| *q > 0)
        .ok_or_else(|| format!("quantity must be at least 1, got {quantity}"))
}

fn validate_currency(currency: String) -> Result<String, String> {
    if currency.len() == 3 && currency.bytes().all(|b| b.is_ascii_uppercase()) {
        Ok(currency)
    } else {
        Err("currency must be three uppercase ASCII letters, such as \"JPY\"".to_owned())
    }
}

/// A non-negative amount in minor units, of any size, kept as the client's integer literal
/// and written back as a JSON number, so `9007199254740993` stays `9007199254740993`.
#[derive(Clone, Debug, Serialize)]
#[serde(transparent)]
pub(crate) struct AmountMinor(Box<RawValue>);

impl AmountMinor {
    /// Accepts a JSON integer literal of digits only (no sign, fraction or exponent).
    pub(crate) fn parse(raw: Box<RawValue>) -> Result<Self, String> {
        let literal = raw.get();
        if literal.starts_with('-') {
            return Err(format!("amount_minor must not be negative, got {literal}"));
        }
        if literal.starts_with('"') {
            return Err("amount_minor must be a JSON number, not a string".to_owned());
        }
        let digits_only = !literal.is_empty() && literal.bytes().all(|b| b.is_ascii_digit());
        let leading_zero = literal.len() > 1 && literal.starts_with('0');
        if !digits_only || leading_zero {
            return Err(format!(
                "amount_minor must be a whole number of minor units without fraction or exponent, got {literal}"
            ));
        }
        Ok(Self(raw))
    }

    /// An amount given as its decimal digits: a database column, or a gRPC field.
    pub(crate) fn from_digits(digits: String) -> Result<Self, String> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err("amount_minor must be a whole number of minor units, as decimal digits without a sign, \
                        fraction or exponent"
                .to_owned());
        }
        let raw =
            RawValue::from_string(digits).map_err(|error| format!("amount_minor is not a JSON number: {error}"))?;
        Self::parse(raw)
    }

    /// The digits, as the client wrote them.
    pub(crate) fn digits(&self) -> &str {
        self.0.get()
    }
}
