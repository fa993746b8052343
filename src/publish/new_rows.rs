//! Whether a commit seen in the file can hold anything for the relay to read.
//!
//! The watch and `PRAGMA data_version` report every commit by another connection, and the
//! relay's own marker is one: during a drain it commits hundreds of times a second, and each of
//! those commits, taken as news, would cost a read of every higher lane and of the gap rows. What
//! a read can find is only ever new: a row of the outbox or a gap row, each numbered above every
//! number its table ever used (`AUTOINCREMENT`, kept in `sqlite_sequence`), however it came
//! (an application's insert, a retried dead letter, a coalescing or an eviction recording its
//! gap). The marker only deletes. So a commit that moved neither number brought nothing to read.

use rusqlite::Connection;

/// The highest numbers of the outbox and of its gap rows, as last seen.
#[derive(Default)]
pub(crate) struct NewRows {
    seen: Option<(i64, i64)>,
}

impl NewRows {
    /// True if a row or a gap row was numbered since the last call (and on the first call, or
    /// when the numbers cannot be read: then reading is the safe answer).
    pub(crate) fn appeared(&mut self, conn: &Connection) -> bool {
        if crate::mutant::active("foreign-rows-unseen") {
            return false;
        }
        let numbers = conn
            .prepare_cached(
                "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'outbox'), 0),
                        coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'outbox_gaps'), 0)",
            )
            .and_then(|mut stmt| stmt.query_row([], |r| Ok((r.get(0)?, r.get(1)?))));
        match numbers {
            Ok(now) => self.seen.replace(now) != Some(now),
            Err(e) => {
                tracing::debug!(error = %e, "could not read the outbox's numbers; reading anyway");
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Connection {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch(
            "CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, v);
             CREATE TABLE outbox_gaps (gap_id INTEGER PRIMARY KEY AUTOINCREMENT, v);",
        )
        .expect("schema");
        conn
    }

    #[test]
    fn only_a_new_number_in_either_table_is_news() {
        let conn = file();
        let mut news = NewRows::default();
        assert!(news.appeared(&conn), "the first look reads");
        assert!(!news.appeared(&conn));
        conn.execute("INSERT INTO outbox (v) VALUES (1)", [])
            .expect("row");
        assert!(news.appeared(&conn), "a new row");
        conn.execute("DELETE FROM outbox", []).expect("mark");
        assert!(!news.appeared(&conn), "a deletion is no news");
        conn.execute("INSERT INTO outbox_gaps (v) VALUES (1)", [])
            .expect("gap");
        assert!(news.appeared(&conn), "a new gap row");
        assert!(!news.appeared(&conn));
    }
}
