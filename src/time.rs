//! Wall-clock time as the database stores it: milliseconds since the Unix epoch.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Now, in Unix milliseconds. A clock before 1970 (a board without RTC before NTP) reads as 0.
pub(crate) fn now_ms() -> i64 {
    let real = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    real.saturating_add(shift::get())
}

/// A wall clock that jumps, for the tests (feature `failpoints`): what the crate reads as now is
/// moved by the shift. Without the feature it is always zero.
#[cfg(feature = "failpoints")]
pub(crate) mod shift {
    use std::sync::atomic::{AtomicI64, Ordering};

    static SHIFT_MS: AtomicI64 = AtomicI64::new(0);

    pub(crate) fn get() -> i64 {
        SHIFT_MS.load(Ordering::Relaxed)
    }

    pub(crate) fn by(ms: i64) {
        SHIFT_MS.fetch_add(ms, Ordering::Relaxed);
    }
}

#[cfg(not(feature = "failpoints"))]
mod shift {
    #[inline(always)]
    pub(crate) const fn get() -> i64 {
        0
    }
}

/// A duration in whole milliseconds, saturating.
pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The time from `then_ms` to now; zero if the clock went backwards.
pub(crate) fn age(then_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(now_ms().saturating_sub(then_ms)).unwrap_or(0))
}
