//! Performs the core's reads (see [`super::core::ReadRequest`]) against the outbox: the gap rows
//! and each lane asked for, encoded for the connection. Shared by the publisher thread and the
//! core's model test, so that both read the real store the same way.

use rusqlite::Connection;

use super::core::{LaneRead, ReadRequest, ReadResult};
use super::gaps;
use super::rows::{self, Encoding, Sinks};
use crate::error::Result;
use crate::store::epoch::Epochs;

/// What encoding a row needs besides the request: the same for every read of a run.
pub(crate) struct Context<'a> {
    pub source: &'a str,
    pub epochs: &'a Epochs,
    pub allow_dollar: bool,
    pub cloud: Option<&'a crate::cloud_profile::TopicRules>,
    /// Where routing fields go, when the relay sends them.
    pub routing: Option<crate::routing_fields::Placement>,
    pub format: crate::envelope::EnvelopeFormat,
    pub ttl: &'a [(String, std::time::Duration)],
    /// The file's payload schemas: a row that does not match its schema is not published.
    #[cfg(feature = "schemas")]
    pub schemas: Option<&'a crate::payload_schema::Registry>,
}

/// Reads what `req` asks for. Nothing is written.
pub(crate) fn read(conn: &Connection, ctx: &Context<'_>, req: &ReadRequest) -> Result<ReadResult> {
    let enc = Encoding {
        source: ctx.source,
        epochs: ctx.epochs,
        max_packet: req.max_packet,
        limit_owner: req.limit_owner,
        properties: req.properties,
        allow_dollar: ctx.allow_dollar,
        cloud: ctx.cloud,
        routing: ctx.routing,
        format: ctx.format,
        ttl: ctx.ttl,
        now_ms: req.now_ms,
        #[cfg(feature = "schemas")]
        schemas: ctx.schemas,
    };
    let _snapshot = Snapshot::begin(conn)?;
    let mut out = ReadResult::default();
    let query = gaps::GapQuery {
        cursor: req.gap_cursor,
        limit: req.gap_limit,
        again: &req.gaps_again,
        settling: &|first, last| req.is_settling(first, last),
    };
    let gap_read = gaps::read_after(conn, &enc, &query, &mut out.notices, &mut out.ranges)?;
    out.gap_rows = gap_read.rows;
    out.last_gap_id = gap_read.last_gap_id;
    out.gaps_set_aside = gap_read.set_aside;
    // The higher lanes first, as the core serves them.
    for (lane, wanted) in req.lanes.iter().enumerate().rev() {
        if !wanted {
            continue;
        }
        let mut got = LaneRead::default();
        let sinks = Sinks {
            ready: &mut got.ready,
            bad: &mut out.bad,
            expired: &mut out.expired,
            claim: &mut out.claim,
        };
        #[allow(clippy::cast_possible_truncation, reason = "LANES fits a u8")]
        let read = rows::read_after(conn, &enc, lane as u8, req.cursors[lane], req.limit, sinks)?;
        got.visited = read.rows;
        got.last_seq = read.last_seq;
        out.lanes[lane] = Some(got);
    }
    Ok(out)
}

/// One read transaction around a request's statements. Each statement on its own would begin
/// one, and with the marker committing on another connection each would find the WAL moved and
/// load its pages again; one snapshot for the whole read also gives the gaps and every lane the
/// same view of the file.
pub(crate) struct Snapshot<'c> {
    /// `None` when a transaction was already open on the connection: it is the caller's.
    conn: Option<&'c Connection>,
}

impl<'c> Snapshot<'c> {
    /// Begins one, unless the connection is already in a transaction.
    pub(crate) fn begin(conn: &'c Connection) -> Result<Self> {
        if !conn.is_autocommit() {
            return Ok(Snapshot { conn: None });
        }
        conn.prepare_cached("BEGIN DEFERRED")?.execute([])?;
        Ok(Snapshot { conn: Some(conn) })
    }
}

impl Drop for Snapshot<'_> {
    fn drop(&mut self) {
        // Ending a read transaction writes nothing. Should it fail anyway, a rollback ends it: a
        // read left open would see the file as it was, and never a new row. SQLite may have
        // ended it already (an I/O error or out of memory rolls it back): the error that did
        // was reported where it happened, and there is nothing left to end.
        if let Some(conn) = self.conn
            && !conn.is_autocommit()
            && let Err(e) = conn.prepare_cached("COMMIT").and_then(|mut s| s.execute([]))
        {
            tracing::warn!(error = %e, "could not end the outbox read; rolling it back");
            let _ = conn.execute_batch("ROLLBACK");
        }
    }
}

impl ReadResult {
    /// The highest outbox row read, in any lane.
    pub(crate) fn last_seq(&self) -> Option<i64> {
        self.lanes.iter().flatten().filter_map(|l| l.last_seq).max()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// The log, as text.
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Log {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log").extend_from_slice(b);
            Ok(b.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_read_sqlite_already_ended_is_not_ended_again() {
        let conn = Connection::open_in_memory().expect("open");
        let log = Log::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let snapshot = Snapshot::begin(&conn).expect("begin");
            assert!(!conn.is_autocommit());
            // What SQLite does to a transaction on an I/O error or out of memory.
            conn.execute_batch("ROLLBACK").expect("ended underneath");
            drop(snapshot);
        });
        assert!(conn.is_autocommit());
        let logged = String::from_utf8_lossy(&log.0.lock().expect("log")).into_owned();
        assert!(
            logged.is_empty(),
            "a second warning beside the real error: {logged}"
        );
    }
}
