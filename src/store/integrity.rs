//! Is the file damaged? SQLite's `quick_check`, on a time budget.
//!
//! SD cards and cheap flash corrupt pages (power loss mid-write, worn cells). `quick_check` reads
//! every page and checks the b-trees' structure (not that indexes match their tables: that is
//! `integrity_check`, which `edge-outbox doctor` runs). It is as slow as reading the file, so it
//! runs under a budget: a timer thread interrupts it when the time is up, and an unfinished check
//! says nothing either way.

use std::time::Duration;

use rusqlite::{Connection, ErrorCode};

use crate::error::Result;

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Health {
    Ok,
    /// SQLite's words for what is wrong (the first few problems).
    Damaged(String),
    /// The budget ran out first.
    Unfinished,
}

/// Problems listed at most, in the report of a damaged file.
const MAX_PROBLEMS: u32 = 10;

/// Runs `PRAGMA quick_check` (or the full `integrity_check` with `full`) for at most `budget`
/// (`None`: no limit).
pub(crate) fn check(conn: &Connection, budget: Option<Duration>, full: bool) -> Result<Health> {
    let timer = match budget {
        Some(budget) => {
            let interrupt = conn.get_interrupt_handle();
            let (done, finished) = crossbeam_channel::bounded::<()>(1);
            let thread = std::thread::Builder::new()
                .name("edge-outbox-check".into())
                .spawn(move || {
                    if finished.recv_timeout(budget).is_err() {
                        interrupt.interrupt();
                    }
                })
                .map_err(|e| crate::Error::io("spawning the integrity check's timer", e))?;
            Some((done, thread))
        }
        None => None,
    };
    let pragma = if full { "integrity_check" } else { "quick_check" };
    let result = (|| -> rusqlite::Result<Vec<String>> {
        let mut stmt = conn.prepare(&format!("PRAGMA {pragma}({MAX_PROBLEMS})"))?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        rows.collect()
    })();
    if let Some((done, thread)) = timer {
        let _ = done.send(());
        let _ = thread.join();
    }
    match result {
        Ok(lines) if lines.len() == 1 && lines[0] == "ok" => Ok(Health::Ok),
        Ok(lines) => Ok(Health::Damaged(lines.join("; "))),
        Err(e) => match e.sqlite_error_code() {
            Some(ErrorCode::OperationInterrupted) => Ok(Health::Unfinished),
            Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => Ok(Health::Damaged(e.to_string())),
            _ => Err(e.into()),
        },
    }
}

/// Whether `e` says the file is damaged.
pub(crate) fn is_corruption(e: &crate::Error) -> bool {
    match e {
        crate::Error::Corrupt { .. } => true,
        crate::Error::Sqlite(e) => matches!(e.sqlite_error_code(), Some(ErrorCode::DatabaseCorrupt)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sound_file_is_ok_and_a_tiny_budget_leaves_the_check_unfinished() {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch(
            "CREATE TABLE t (x TEXT);
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
             INSERT INTO t SELECT printf('%0100d', i) FROM n;",
        )
        .expect("fill");
        assert_eq!(check(&conn, None, false).expect("check"), Health::Ok);
        assert_eq!(check(&conn, None, true).expect("check"), Health::Ok);
        // With a budget, the timer is gone afterwards: later statements are not interrupted.
        assert_eq!(
            check(&conn, Some(Duration::from_secs(60)), false).expect("check"),
            Health::Ok
        );
        conn.execute_batch("SELECT count(*) FROM t")
            .expect("not interrupted");
    }
}
