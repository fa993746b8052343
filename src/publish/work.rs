//! The SQLite work of the publishing side, as SQLite counts it: virtual-machine steps, reported
//! in [`Status::database_steps`](crate::Status::database_steps).
//!
//! A step count is a measure that does not depend on the machine or its load, so a test can
//! tell a read that costs the rows it returns from one that costs the whole backlog without
//! timing anything (tests/drain_work.rs).

use std::sync::Arc;

use rusqlite::Connection;

use crate::mqtt::status::StatusCell;

/// Steps between two reports: SQLite calls back once per this many steps of a statement, so the
/// count is exact to within this many per statement, and the callback costs next to nothing.
const STEPS_PER_REPORT: u16 = 128;

/// Counts the steps of everything `conn` runs into `status`.
pub(crate) fn count_steps(conn: &Connection, status: &Arc<StatusCell>) {
    let status = status.clone();
    conn.progress_handler(
        i32::from(STEPS_PER_REPORT),
        Some(move || {
            status.on_database_steps(u64::from(STEPS_PER_REPORT));
            // Never interrupt the statement.
            false
        }),
    );
}
