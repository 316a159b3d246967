//! When an order was recorded: microseconds since the Unix epoch, shown as RFC 3339.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

/// A point in time with microsecond precision, UTC; shown as RFC 3339.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct CreatedAt(i64);

impl CreatedAt {
    /// From microseconds since the Unix epoch.
    pub(crate) const fn from_unix_micros(micros: i64) -> Self {
        Self(micros)
    }

    /// Microseconds since the Unix epoch.
    pub(crate) const fn unix_micros(self) -> i64 {
        self.0
    }

    /// The system clock, now.
    pub(crate) fn now() -> Self {
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Self(i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX))
    }
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
impl fmt::Display for CreatedAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MICROS_PER_DAY: i64 = 86_400_000_000;
        let days = self.0.div_euclid(MICROS_PER_DAY);
        let micros_of_day = self.0.rem_euclid(MICROS_PER_DAY);
        let (year, month, day) = civil_from_days(days);
        let seconds_of_day = micros_of_day / 1_000_000;
        let (hour, minute, second) = (seconds_of_day / 3600, seconds_of_day / 60 % 60, seconds_of_day % 60);
        let micros = micros_of_day % 1_000_000;
        write!(f, "{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{micros:06}Z")
    }
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}
