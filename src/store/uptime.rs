//! A clock that wall-clock jumps cannot move, for retention.
//!
//! A board without a real-time clock boots in 1970 and jumps decades ahead at its first NTP sync;
//! an operator fixes a clock by hours. Retention measured on the wall clock alone would then
//! delete, at once, sent rows and the ids of applied commands that are minutes old, and a
//! redelivered command would be applied twice. So each row that retention deletes also records
//! this clock when it was sent, applied or set aside, and is deleted only once it is old on both.
//!
//! The clock is the time a relay has run on this file, counted on the monotonic clock and kept in
//! `edge_outbox_meta` (`uptime_ms`). The relay advances it at most once a minute (one small write)
//! and when it stops; rows are stamped with the stored value, so a stamp is at most a minute
//! behind. Time no relay runs is not counted: across downtime, rows are kept longer, never
//! shorter (retention is a minimum).

use std::time::{Duration, Instant};

use rusqlite::{Connection, params};

use crate::error::Result;
use crate::time::ms;

/// The stored value, as SQL: what rows are stamped with.
pub(crate) const NOW_SQL: &str = "(SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms')";

/// How often the relay writes the clock forward.
const PERSIST_EVERY: Duration = Duration::from_secs(60);

/// The stored uptime, in milliseconds.
pub(crate) fn now(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row(&format!("SELECT coalesce({NOW_SQL}, 0)"), [], |r| r.get(0))?)
}

/// The relay's side: counts the time since it last wrote the clock forward.
pub(crate) struct UptimeClock {
    since: Instant,
}

impl UptimeClock {
    /// Starts counting now: the time before this relay started is not counted.
    pub(crate) fn start() -> Self {
        UptimeClock {
            since: Instant::now(),
        }
    }

    /// Writes the clock forward if a minute has passed since the last write (`force`: whatever
    /// has passed, at a stop).
    pub(crate) fn advance(&mut self, conn: &Connection, force: bool) -> Result<()> {
        let elapsed = self.since.elapsed();
        if !force && elapsed < PERSIST_EVERY {
            return Ok(());
        }
        conn.execute(
            "UPDATE edge_outbox_meta SET value = value + ?1 WHERE name = 'uptime_ms'",
            params![ms(elapsed)],
        )?;
        self.since = Instant::now();
        Ok(())
    }
}
