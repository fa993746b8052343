//! Messages removed before they were published: each leaves a row in `outbox_gaps`, written in
//! the transaction that removes it, until the relay's gap notice for it is acknowledged. A crash
//! between the removal and the notice therefore loses neither: both or neither committed.

use rusqlite::{Connection, params};

use crate::error::Result;
use crate::time::now_ms;

/// Where a notice goes when the removed message's own topic cannot be published to (the reason
/// it was dead-lettered may be a wildcard in it).
pub(crate) const FALLBACK_TOPIC: &str = "edge-outbox/gaps";

/// Why a message was removed unpublished, as stored in `outbox_gaps.cause` and sent in the notice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Removal {
    Evicted,
    Expired,
    DeadLettered,
    Purged,
    Unrecoverable,
}

impl Removal {
    pub(crate) fn as_sql(self) -> &'static str {
        match self {
            Removal::Evicted => "evicted",
            Removal::Expired => "expired",
            Removal::DeadLettered => "dead-lettered",
            Removal::Purged => "purged",
            Removal::Unrecoverable => "unrecoverable",
        }
    }
}

/// Records outbox rows `first..=last` (those that exist) as removed, in the caller's transaction;
/// the caller deletes them in the same transaction.
pub(crate) fn record(
    conn: &Connection,
    first: i64,
    last: i64,
    cause: Removal,
    why: Option<&str>,
) -> Result<usize> {
    Ok(conn
        .prepare_cached(
            "INSERT OR IGNORE INTO outbox_gaps (seq, topic, cause, why, removed_at)
             SELECT seq, topic, ?3, ?4, ?5 FROM outbox WHERE seq BETWEEN ?1 AND ?2",
        )?
        .execute(params![first, last, cause.as_sql(), why, now_ms()])?)
}

/// Deletes the pending rows `seqs` (sorted, distinct) and records each as removed for `cause`, in
/// the caller's transaction. Returns how many were deleted.
pub(crate) fn remove(conn: &Connection, seqs: &[i64], cause: Removal, why: Option<&str>) -> Result<u64> {
    let mut removed = 0;
    for (first, last) in runs(seqs) {
        record(conn, first, last, cause, why)?;
        removed += conn
            .prepare_cached("DELETE FROM outbox WHERE seq BETWEEN ?1 AND ?2")?
            .execute([first, last])? as u64;
    }
    Ok(removed)
}

/// Sorted, distinct sequence numbers as runs of consecutive numbers `(first, last)`: a statement
/// per run touches exactly those numbers (no other row can lie between consecutive integers).
pub(crate) fn runs(sorted: &[i64]) -> Vec<(i64, i64)> {
    let mut runs: Vec<(i64, i64)> = Vec::new();
    for &seq in sorted {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == seq => *last = seq,
            _ => runs.push((seq, seq)),
        }
    }
    runs
}

/// Removes pending messages whose expiry has passed, at most `batch`, with their gap rows, in one
/// `BEGIN IMMEDIATE` transaction. Returns how many. A row the relay has claimed is left to the
/// relay: it may be on the wire, and announced as expired the cloud would get it and a notice
/// that it was removed; the relay removes it when it reads it again and it is still unpublished.
pub(crate) fn expire_due(conn: &Connection, batch: usize) -> Result<u64> {
    let tx = rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Immediate)?;
    let mut stmt = tx.prepare_cached(if crate::mutant::active("remove-claimed") {
        "SELECT seq FROM outbox WHERE expires_at IS NOT NULL AND expires_at <= ?1 ORDER BY seq LIMIT ?2"
    } else {
        "SELECT seq FROM outbox WHERE expires_at IS NOT NULL AND expires_at <= ?1 AND claimed IS NULL
         ORDER BY seq LIMIT ?2"
    })?;
    let seqs = stmt
        .query_map(params![now_ms(), i64::try_from(batch).unwrap_or(i64::MAX)], |r| {
            r.get::<_, i64>(0)
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    drop(stmt);
    if seqs.is_empty() {
        return Ok(0);
    }
    let n = remove(&tx, &seqs, Removal::Expired, None)?;
    tx.commit()?;
    if n > 0 {
        tracing::info!(
            messages = n,
            "removed expired messages unpublished (the relay announces the gap)"
        );
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_group_consecutive_numbers() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[5]), vec![(5, 5)]);
        assert_eq!(runs(&[1, 2, 3, 7, 8, 9, 11]), vec![(1, 3), (7, 9), (11, 11)]);
    }
}
