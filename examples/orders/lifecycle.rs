//! How long idempotency records live, and how often the recovery worker looks at them, from
//! the environment (seconds, fractions allowed: `0.5`, `86400`):
//!
//! - `ORDERS_RETENTION_SECS` (default 86400, one day): how long an answer replays after it was
//!   given;
//! - `ORDERS_TOMBSTONE_SECS` (default 604800, seven days): how long after that a retry with
//!   the same key is refused with 422 `idempotency_key_expired` (after that the key is
//!   forgotten, and may be used again);
//! - `ORDERS_JANITOR_SECS` (default 60): how often the recovery worker runs;
//! - `ORDERS_CENSUS_SECS` (default: unset, a census every pass): how often a pass of the
//!   recovery worker counts every record by state (the `completed`, `failed` and `expired`
//!   gauges); the passes between count only the open records (`processing`, `unknown`) from
//!   their index. On PostgreSQL and SQLite a census reads the whole records table: with hundreds
//!   of millions of records, set it to hours (`docs/scale.md`, "The recovery pass's counts");
//! - `ORDERS_PURGE_RATE` (default: unset, no limit): the most records a second the recovery
//!   worker's purge takes (`RecoveryWorker::purge_rate`), so that a backlog of records past
//!   their retention is purged at that pace instead of flat out, which takes the database's CPU
//!   from serving. A whole number greater than zero, at most 4294967295.
//!
//! Each of the `_SECS` settings must be a plain decimal number of seconds (digits, optionally a fraction: no sign, no
//! exponent), greater than zero and at most ten years. Anything else stops the start with a
//! message naming the variable. Zero is refused on purpose: no replay window, no tombstone (a
//! late retry would then create a second order) or a worker that never sleeps are never what
//! an operator meant.

use std::time::Duration;

use tower_idempotency::{BoxError, Retention};

/// `ORDERS_RETENTION_SECS` when unset: one day.
const DEFAULT_RETENTION_SECS: u64 = 86_400;
/// `ORDERS_TOMBSTONE_SECS` when unset: seven days.
const DEFAULT_TOMBSTONE_SECS: u64 = 604_800;
/// `ORDERS_JANITOR_SECS` when unset: one minute.
const DEFAULT_JANITOR_SECS: u64 = 60;
/// The longest value accepted for any of them: ten years (365-day years).
const MAX_SECS: u64 = 10 * 365 * 86_400;

/// The service's record lifecycle settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lifecycle {
    /// How long an answer replays (`ORDERS_RETENTION_SECS`).
    pub(crate) retention: Duration,
    /// How long a tombstone is kept after that (`ORDERS_TOMBSTONE_SECS`).
    pub(crate) tombstone: Duration,
    /// How often the recovery worker runs (`ORDERS_JANITOR_SECS`).
    pub(crate) janitor_every: Duration,
    /// How often the recovery worker counts every record (`ORDERS_CENSUS_SECS`); `None`: at
    /// every pass.
    pub(crate) census_every: Option<Duration>,
    /// The most records a second the worker's purge takes (`ORDERS_PURGE_RATE`); `None`: no
    /// limit.
    pub(crate) purge_rate: Option<u32>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(DEFAULT_RETENTION_SECS),
            tombstone: Duration::from_secs(DEFAULT_TOMBSTONE_SECS),
            janitor_every: Duration::from_secs(DEFAULT_JANITOR_SECS),
            census_every: None,
            purge_rate: None,
        }
    }
}

impl Lifecycle {
    /// The settings from the environment (see the module docs); a value that is set but not
    /// valid stops the start.
    pub(crate) fn from_env() -> Result<Self, BoxError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The retention of the service's records: answers and tombstones as configured;
    /// unsettled records (`processing`, `unknown`) keep the crate's default.
    pub(crate) fn retention(&self) -> Retention {
        Retention { response: self.retention, tombstone: self.tombstone, ..Retention::default() }
    }

    /// The settings from `var` (the environment, or a test's table).
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, BoxError> {
        let mut lifecycle = Self::default();
        let settings: [(&str, &mut Duration); 3] = [
            ("ORDERS_RETENTION_SECS", &mut lifecycle.retention),
            ("ORDERS_TOMBSTONE_SECS", &mut lifecycle.tombstone),
            ("ORDERS_JANITOR_SECS", &mut lifecycle.janitor_every),
        ];
        let seconds = |name: &str| -> Result<Option<Duration>, BoxError> {
            match var(name).filter(|text| !text.is_empty()) {
                Some(text) => {
                    Ok(Some(parse_seconds(&text).map_err(|problem| format!("{name} {problem}, got {text:?}"))?))
                }
                None => Ok(None),
            }
        };
        for (name, setting) in settings {
            if let Some(value) = seconds(name)? {
                *setting = value;
            }
        }
        lifecycle.census_every = seconds("ORDERS_CENSUS_SECS")?;
        lifecycle.purge_rate = match var("ORDERS_PURGE_RATE").filter(|text| !text.is_empty()) {
            Some(text) => {
                Some(parse_rate(&text).map_err(|problem| format!("ORDERS_PURGE_RATE {problem}, got {text:?}"))?)
            }
            None => None,
        };
        Ok(lifecycle)
    }
}

/// A whole number of records a second, greater than zero and at most `u32::MAX`.
fn parse_rate(text: &str) -> Result<u32, String> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err("must be a whole number of records a second (digits only, such as 50000)".to_owned());
    }
    match text.parse::<u32>() {
        Ok(0) => Err("must be more than zero records a second".to_owned()),
        Ok(rate) => Ok(rate),
        Err(_) => Err(format!("must be at most {} records a second", u32::MAX)),
    }
}

/// A positive decimal number of seconds, at most [`MAX_SECS`], to the microsecond.
pub(crate) fn parse_seconds(text: &str) -> Result<Duration, String> {
    const FORMAT: &str = "must be a number of seconds (digits, optionally with a fraction, such as 0.5)";
    let (whole, fraction) = text.trim().split_once('.').unwrap_or((text.trim(), ""));
    let digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) || text.trim().ends_with('.') {
        return Err(FORMAT.to_owned());
    }
    let too_long = || format!("must be at most {MAX_SECS} seconds (ten years)");
    let secs: u64 = whole.parse().map_err(|_| too_long())?;
    // Microseconds are the finest the databases keep; further digits are cut off.
    let micros = format!("{:0<6}", &fraction[..fraction.len().min(6)]).parse::<u32>().map_err(|_| FORMAT.to_owned())?;
    let duration = Duration::from_secs(secs) + Duration::from_micros(u64::from(micros));
    if duration.is_zero() {
        return Err("must be more than zero seconds".to_owned());
    }
    if duration > Duration::from_secs(MAX_SECS) {
        return Err(too_long());
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<Lifecycle, String> {
        Lifecycle::from_vars(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned()))
            .map_err(|error| error.to_string())
    }

    #[test]
    fn unset_or_empty_means_the_defaults() {
        assert_eq!(from(&[]), Ok(Lifecycle::default()));
        assert_eq!(from(&[("ORDERS_RETENTION_SECS", "")]), Ok(Lifecycle::default()));
        let defaults = Lifecycle::default();
        assert_eq!(defaults.retention, Duration::from_secs(86_400));
        assert_eq!(defaults.tombstone, Duration::from_secs(604_800));
        assert_eq!(defaults.janitor_every, Duration::from_secs(60));
        assert_eq!(defaults.census_every, None, "a census every pass");
        assert_eq!(defaults.purge_rate, None, "the purge at no limit");
    }

    #[test]
    fn whole_and_fractional_seconds_are_read_to_the_microsecond() {
        let lifecycle = from(&[
            ("ORDERS_RETENTION_SECS", "2"),
            ("ORDERS_TOMBSTONE_SECS", "0.5"),
            ("ORDERS_JANITOR_SECS", " 0.0000019 "),
        ])
        .unwrap();
        assert_eq!(lifecycle.retention, Duration::from_secs(2));
        assert_eq!(lifecycle.tombstone, Duration::from_millis(500));
        assert_eq!(lifecycle.janitor_every, Duration::from_micros(1));
        assert_eq!(from(&[("ORDERS_JANITOR_SECS", "315360000")]).unwrap().janitor_every, Duration::from_secs(MAX_SECS));
        assert_eq!(from(&[("ORDERS_CENSUS_SECS", "3600")]).unwrap().census_every, Some(Duration::from_secs(3600)));
        assert_eq!(from(&[("ORDERS_CENSUS_SECS", "")]).unwrap().census_every, None);
    }

    #[test]
    fn the_purge_rate_is_a_whole_number_of_records_a_second() {
        assert_eq!(from(&[("ORDERS_PURGE_RATE", "50000")]).unwrap().purge_rate, Some(50_000));
        assert_eq!(from(&[("ORDERS_PURGE_RATE", " 1 ")]).unwrap().purge_rate, Some(1));
        assert_eq!(from(&[("ORDERS_PURGE_RATE", "4294967295")]).unwrap().purge_rate, Some(u32::MAX));
        assert_eq!(from(&[("ORDERS_PURGE_RATE", "")]).unwrap().purge_rate, None);
        for bad in ["0", "-1", "+1", "1.5", "1e3", "abc", "1 2", "4294967296"] {
            let error = from(&[("ORDERS_PURGE_RATE", bad)]).expect_err(bad);
            assert!(error.starts_with("ORDERS_PURGE_RATE"), "{error}");
            assert!(error.contains(&format!("{bad:?}")), "{error}");
        }
    }

    #[test]
    fn invalid_values_stop_the_start_naming_the_variable() {
        for bad in ["0", "0.0", "0.0000001", "-1", "+1", "1e3", "1.", ".5", "abc", "1 2", "inf", "NaN", "315360000.1"] {
            for name in ["ORDERS_RETENTION_SECS", "ORDERS_TOMBSTONE_SECS", "ORDERS_JANITOR_SECS", "ORDERS_CENSUS_SECS"]
            {
                let error = from(&[(name, bad)]).expect_err(bad);
                assert!(error.starts_with(name), "{error}");
                assert!(error.contains(&format!("{bad:?}")), "{error}");
            }
        }
        let huge = from(&[("ORDERS_RETENTION_SECS", "99999999999999999999999")]).unwrap_err();
        assert!(huge.contains("at most"), "{huge}");
    }
}
