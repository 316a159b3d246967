//! The account that owns orders.

use serde::Serialize;

/// The longest account id accepted.
const MAX_ACCOUNT_LEN: usize = 64;

/// An authenticated account: the idempotency scope, and the owner of orders.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub(crate) struct Account(String);

impl Account {
    /// An account id, if it follows the rule: 1 to 64 visible ASCII characters.
    pub(crate) fn parse(id: &str) -> Option<Self> {
        let valid = (1..=MAX_ACCOUNT_LEN).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic());
        valid.then(|| Self(id.to_owned()))
    }

    /// The account id.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}
