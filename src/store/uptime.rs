//! A clock that wall-clock jumps cannot move, for retention.
//!
//! A board without a real-time clock boots in 1970 and jumps decades ahead at its first NTP sync;
//! an operator fixes a clock by hours. Retention measured on the wall clock alone would then
//! delete, at once, sent rows and the ids of applied commands that are minutes old, and a
//! redelivered command would be applied twice. So each row that retention deletes also records
//! this clock when it was sent, applied or set aside, and is deleted only once it is old on both.
//!
//! The clock is the time a relay has run on this file, counted on the monotonic clock and kept in
//! `edge_outbox_meta` (`uptime_ms`). The relay writes it forward in steps (one small write per
//! step) and when it stops; rows are stamped with the stored value. A step is a fraction of the
//! shortest retention, capped at a minute: short enough that a short retention is honoured on
//! time, long enough that a retention of days costs a write a minute. A stamp and the stored
//! clock are each up to one step behind, so a row counts as old only once the clock has passed
//! its stamp by the retention plus one step: retention is a minimum. Time no relay runs is not
//! counted: across downtime, rows are kept longer, never shorter.

use std::time::{Duration, Instant};

use rusqlite::{Connection, params};

use super::options::Options;
use crate::error::Result;
use crate::time::ms;

/// The stored value, as SQL: what rows are stamped with.
pub(crate) const NOW_SQL: &str = "(SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms')";

/// The longest step: a device keeping rows for days writes the clock once a minute.
const LONGEST_STEP: Duration = Duration::from_secs(60);
/// The shortest step, for retentions of a fraction of a second (tests, mostly).
const SHORTEST_STEP: Duration = Duration::from_millis(10);

/// How far the stored clock may lag behind, for these options: a quarter of the shortest
/// retention, within [`SHORTEST_STEP`, `LONGEST_STEP`].
pub(crate) fn step(options: &Options) -> Duration {
    let shortest = options
        .sent_retention
        .map_or(options.inbox_retention, |s| s.min(options.inbox_retention));
    (shortest / 4).clamp(SHORTEST_STEP, LONGEST_STEP)
}

/// The stored uptime, in milliseconds.
pub(crate) fn now(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row(&format!("SELECT coalesce({NOW_SQL}, 0)"), [], |r| r.get(0))?)
}

/// The newest stamp a row may carry and be older than `retention` on this clock. A retention of
/// zero means at once, with no allowance for the step (and whether or not a relay runs).
pub(crate) fn cutoff(conn: &Connection, options: &Options, retention: Duration) -> Result<i64> {
    let allowance = if retention.is_zero() {
        Duration::ZERO
    } else {
        step(options)
    };
    Ok(now(conn)?
        .saturating_sub(ms(retention))
        .saturating_sub(ms(allowance)))
}

/// The relay's side: counts the time since it last wrote the clock forward.
pub(crate) struct UptimeClock {
    since: Instant,
    step: Duration,
    /// When to write next: a step after the last write, or after the last failed one (a write
    /// that failed is not retried at once: a full disk would keep the thread busy retrying).
    next: Instant,
}

impl UptimeClock {
    /// Starts counting now: the time before this relay started is not counted.
    pub(crate) fn start(options: &Options) -> Self {
        let since = Instant::now();
        let step = step(options);
        UptimeClock {
            since,
            step,
            next: since + step,
        }
    }

    /// Writes the clock forward if a step has passed since the last write (`force`: whatever
    /// has passed, at a stop).
    pub(crate) fn advance(&mut self, conn: &Connection, force: bool) -> Result<()> {
        let elapsed = self.since.elapsed();
        if !force && elapsed < self.step {
            return Ok(());
        }
        let now = Instant::now();
        // The time stays counted from the last write that succeeded.
        self.next = now + self.step;
        conn.execute(
            "UPDATE edge_outbox_meta SET value = value + ?1 WHERE name = 'uptime_ms'",
            params![ms(elapsed)],
        )?;
        self.since = now;
        Ok(())
    }

    /// When [`advance`](Self::advance) next writes: a relay that sleeps until its next timer
    /// wakes for this one too.
    pub(crate) fn due(&self) -> Instant {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_follows_the_shortest_retention_within_its_bounds() {
        let days = Options::new();
        assert_eq!(step(&days), LONGEST_STEP);
        let short_sent = Options::new().sent_retention(Duration::from_millis(200));
        assert_eq!(step(&short_sent), Duration::from_millis(50));
        let short_inbox = Options::new()
            .sent_retention(Duration::from_secs(3600))
            .inbox_retention(Duration::from_secs(8));
        assert_eq!(step(&short_inbox), Duration::from_secs(2));
        let tiny = Options::new().sent_retention(Duration::from_millis(1));
        assert_eq!(step(&tiny), SHORTEST_STEP);
    }

    #[test]
    fn a_failed_write_is_retried_a_step_later_not_at_once() {
        let options = Options::new().sent_retention(Duration::from_millis(200));
        let mut clock = UptimeClock::start(&options);
        // No edge_outbox_meta table: the write fails, as on a full or read-only disk.
        let conn = Connection::open_in_memory().expect("in-memory database");
        std::thread::sleep(clock.step);
        let before = Instant::now();
        assert!(clock.advance(&conn, false).is_err());
        assert!(clock.due() > before, "a failed write left its due time behind it");
    }
}
