//! The payment settings, from the environment:
//!
//! - `PSP_URL` (`http://127.0.0.1:3100`): the payment provider. Unset or empty: the payment
//!   routes answer 503 `payments_unavailable`.
//! - `ORDERS_PSP_TIMEOUT_MS` (default 2000, at least 1): how long one provider call may take, from
//!   sending the request to the last byte of its answer.
//! - `ORDERS_RECONCILE_SECS` (default 5, fractions allowed): how often unknown payments are
//!   reconciled.
//! - `ORDERS_LEASE_SECS` (default 30, fractions allowed): the payment route's lease.
//! - `ORDERS_PSP_IDEMPOTENT` (default `true`; `true` or `false`): whether the provider honours
//!   `Idempotency-Key` and has a lookup by key.
//!
//! A value that is set but not valid stops the start, naming the variable.

use std::time::Duration;

use hyper::Uri;
use tower_idempotency::BoxError;

use super::super::lifecycle::parse_seconds;

/// The payment settings.
#[derive(Clone, Debug)]
pub(crate) struct PaymentSettings {
    /// The provider's base URL; `None`: payments are off.
    pub(crate) provider: Option<Uri>,
    /// The bound on one provider call.
    pub(crate) timeout: Duration,
    /// How often unknown payments are reconciled.
    pub(crate) reconcile_every: Duration,
    /// The payment route's lease.
    pub(crate) lease: Duration,
    /// Whether the provider deduplicates by key and can be asked by key.
    pub(crate) idempotent: bool,
}

impl PaymentSettings {
    /// The settings from the environment.
    pub(crate) fn from_env() -> Result<Self, BoxError> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|value| !value.is_empty()))
    }

    /// The settings from `var` (the environment, or a test's table).
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, BoxError> {
        let provider = match var("PSP_URL") {
            None => None,
            Some(url) => {
                let uri: Uri = url.trim_end_matches('/').parse().map_err(|_| "PSP_URL must be an http:// URL")?;
                if uri.scheme_str() != Some("http") || uri.authority().is_none() {
                    return Err("PSP_URL must be an http:// URL with a host (such as http://127.0.0.1:3100)".into());
                }
                Some(uri)
            }
        };
        let timeout = match var("ORDERS_PSP_TIMEOUT_MS") {
            None => Duration::from_millis(2000),
            Some(text) => match text.trim().parse::<u64>() {
                Ok(millis) if (1..=3_600_000).contains(&millis) => Duration::from_millis(millis),
                _ => {
                    return Err(format!("ORDERS_PSP_TIMEOUT_MS must be 1 to 3600000 milliseconds, got {text:?}").into());
                }
            },
        };
        let seconds = |name: &str, default: u64| -> Result<Duration, BoxError> {
            match var(name) {
                None => Ok(Duration::from_secs(default)),
                Some(text) => parse_seconds(&text).map_err(|problem| format!("{name} {problem}, got {text:?}").into()),
            }
        };
        let idempotent = match var("ORDERS_PSP_IDEMPOTENT").as_deref().map(str::trim) {
            None | Some("true") => true,
            Some("false") => false,
            Some(text) => return Err(format!("ORDERS_PSP_IDEMPOTENT must be true or false, got {text:?}").into()),
        };
        Ok(Self {
            provider,
            timeout,
            reconcile_every: seconds("ORDERS_RECONCILE_SECS", 5)?,
            lease: seconds("ORDERS_LEASE_SECS", 30)?,
            idempotent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<PaymentSettings, String> {
        PaymentSettings::from_vars(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned()))
            .map_err(|error| error.to_string())
    }

    #[test]
    fn defaults_and_values() {
        let defaults = from(&[]).unwrap();
        assert!(defaults.provider.is_none());
        assert_eq!(defaults.timeout, Duration::from_secs(2));
        assert_eq!(defaults.reconcile_every, Duration::from_secs(5));
        assert_eq!(defaults.lease, Duration::from_secs(30));
        assert!(defaults.idempotent);
        let set = from(&[
            ("PSP_URL", "http://127.0.0.1:3100/"),
            ("ORDERS_PSP_TIMEOUT_MS", "250"),
            ("ORDERS_RECONCILE_SECS", "0.5"),
            ("ORDERS_LEASE_SECS", "1.5"),
            ("ORDERS_PSP_IDEMPOTENT", "false"),
        ])
        .unwrap();
        assert_eq!(set.provider.unwrap().to_string(), "http://127.0.0.1:3100/");
        assert_eq!(set.timeout, Duration::from_millis(250));
        assert_eq!(set.reconcile_every, Duration::from_millis(500));
        assert_eq!(set.lease, Duration::from_millis(1500));
        assert!(!set.idempotent);
    }

    #[test]
    fn invalid_values_name_their_variable() {
        for (name, bad) in [
            ("PSP_URL", "ftp://x"),
            ("PSP_URL", "not a url"),
            ("ORDERS_PSP_TIMEOUT_MS", "0"),
            ("ORDERS_PSP_TIMEOUT_MS", "1.5"),
            ("ORDERS_RECONCILE_SECS", "0"),
            ("ORDERS_LEASE_SECS", "-1"),
            ("ORDERS_PSP_IDEMPOTENT", "yes"),
        ] {
            let error = from(&[(name, bad)]).expect_err(bad);
            assert!(error.starts_with(name), "{error}");
        }
    }
}
