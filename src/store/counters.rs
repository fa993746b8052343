//! What is pending, counted without a write per message.
//!
//! `outbox_counters` holds the count and payload bytes of the outbox rows up to its
//! `counted_through` sequence number; a trigger keeps them right when any of those rows is
//! deleted, whoever deletes it. Rows above it (the tail: inserted since the last fold, by this
//! process or any other) are counted when read. A fold counts the tail into the counters and
//! moves `counted_through` up; it runs now and then (a writer every [`FOLD_TAIL`] rows, the
//! relay's periodic cleanup, and before every insert into a bounded outbox), so the tail stays
//! short and a read costs a few rows whatever the backlog. The relay's marks do not fold: a
//! relay that keeps up deletes rows of the tail, which were never counted, so its marks do not
//! touch the counters either.
//!
//! Why: a counter updated by a trigger on every insert wrote the counters' page to the WAL at
//! every commit and ran a statement per row, most of what a message cost beyond its own row.
//!
//! New rows always land in the tail: `seq` is AUTOINCREMENT, above every number ever used, and
//! `counted_through` never passes the highest row that existed when it was set.

use rusqlite::Connection;

use crate::error::Result;

/// A writer folds once the tail may hold this many of its rows.
pub(crate) const FOLD_TAIL: i64 = 1024;

/// Pending rows and payload bytes, and the eviction counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Counts {
    pub pending: u64,
    pub pending_bytes: u64,
    pub evicted: u64,
    pub evicted_bytes: u64,
}

/// Reads the counts, the tail included. Call inside a transaction for one snapshot.
pub(crate) fn read(conn: &Connection) -> Result<Counts> {
    Ok(conn
        .prepare_cached(
            "SELECT c.pending_count + t.n, c.pending_bytes + t.b, c.evicted, c.evicted_bytes
             FROM outbox_counters AS c,
                  (SELECT count(*) AS n, coalesce(sum(length(CAST(payload AS BLOB))), 0) AS b
                   FROM outbox WHERE seq > (SELECT counted_through FROM outbox_counters WHERE only = 1)) AS t
             WHERE c.only = 1",
        )?
        .query_row([], |r| {
            Ok(Counts {
                pending: r.get(0)?,
                pending_bytes: r.get(1)?,
                evicted: r.get(2)?,
                evicted_bytes: r.get(3)?,
            })
        })?)
}

/// Counts the tail into the counters; returns the new `counted_through`. Must run in a write
/// transaction (it reads, then writes, the counters).
pub(crate) fn fold(conn: &Connection) -> Result<i64> {
    Ok(conn
        .prepare_cached(
            "UPDATE outbox_counters SET
                 pending_count = pending_count + t.n,
                 pending_bytes = pending_bytes + t.b,
                 counted_through = max(counted_through, t.top)
             FROM (SELECT count(*) AS n, coalesce(sum(length(CAST(payload AS BLOB))), 0) AS b,
                          coalesce(max(seq), 0) AS top
                   FROM outbox WHERE seq > (SELECT counted_through FROM outbox_counters WHERE only = 1)) AS t
             WHERE only = 1
             RETURNING counted_through",
        )?
        .query_row([], |r| r.get(0))?)
}
