//! Wall-clock time as the database stores it: milliseconds since the Unix epoch.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Now, in Unix milliseconds. A clock before 1970 (a board without RTC before NTP) reads as 0.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A duration in whole milliseconds, saturating.
pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The time from `then_ms` to now; zero if the clock went backwards.
pub(crate) fn age(then_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(now_ms().saturating_sub(then_ms)).unwrap_or(0))
}
