//! The gap rows a salvage records for the numbers a damaged page held.
//!
//! A lost range is a stretch of rowids between readable rows, so it may contain numbers that are
//! already accounted for: removed earlier (coalesced, evicted, purged during an outage) with a gap
//! row of their own, copied from the damaged file. `outbox_gaps.seq` is unique, so a range row
//! starting at such a number cannot be inserted; recording only what no gap row covers yet keeps
//! every number under exactly one gap row, and the range is never dropped silently.
//!
//! The range may also hold numbers already acknowledged, deleted from `outbox` long before the
//! damage. A notice over them is not loss, and would hide a broker's loss of one of them from the
//! cloud; those kept in `outbox_sent` (`Options::sent_retention`) are left out. Without sent
//! retention the store no longer knows them, and the notice may cover some (the consumer counts
//! only the numbers it did not get).

use rusqlite::{Connection, params};

use super::gaps::{FALLBACK_TOPIC, Removal};
use crate::error::Result;

/// What the gap rows say about a lost range.
const WHY: &str = "unreadable after the database file was damaged";

/// Records `first..=last` as unrecoverable in `tx`, less the numbers a gap row already covers
/// and those acknowledged (kept in `outbox_sent`); returns the ranges recorded.
pub(crate) fn record(tx: &Connection, first: i64, last: i64) -> Result<Vec<(i64, i64)>> {
    if crate::mutant::active("salvage-gap-ignored") {
        // The whole range in one row, ignored if a gap row has its first number.
        tx.execute(
            "INSERT OR IGNORE INTO main.outbox_gaps (seq, last_seq, topic, cause, why)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![first, last, FALLBACK_TOPIC, Removal::Unrecoverable.as_sql(), WHY],
        )?;
        return Ok(vec![(first, last)]);
    }
    let mut covered: Vec<(i64, i64)> = tx
        .prepare(
            "SELECT seq, coalesce(last_seq, seq) FROM main.outbox_gaps
             WHERE seq <= ?2 AND coalesce(last_seq, seq) >= ?1",
        )?
        .query_map([first, last], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    if !crate::mutant::active("salvage-covers-sent") {
        let sent = tx
            .prepare("SELECT seq, seq FROM main.outbox_sent WHERE seq BETWEEN ?1 AND ?2")?
            .query_map([first, last], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<Vec<(i64, i64)>>>()?;
        covered.extend(sent);
    }
    covered.sort_unstable();
    let free = uncovered(first, last, &covered);
    for &(a, b) in &free {
        // No `OR IGNORE`: `a` is covered by no gap row, so a conflict here is a bug to report,
        // not a range to drop.
        tx.execute(
            "INSERT INTO main.outbox_gaps (seq, last_seq, topic, cause, why)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![a, b, FALLBACK_TOPIC, Removal::Unrecoverable.as_sql(), WHY],
        )?;
    }
    Ok(free)
}

/// The parts of `first..=last` outside every range of `covered` (sorted by start; may overlap).
fn uncovered(first: i64, last: i64, covered: &[(i64, i64)]) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    let mut from = first;
    for &(a, b) in covered {
        if b < from {
            continue;
        }
        if a > last {
            break;
        }
        if a > from {
            out.push((from, a - 1));
        }
        match b.checked_add(1) {
            Some(next) => from = from.max(next),
            None => return out,
        }
        if from > last {
            return out;
        }
    }
    if from <= last {
        out.push((from, last));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::uncovered;

    #[test]
    fn covered_numbers_are_cut_out() {
        assert_eq!(uncovered(10, 20, &[]), vec![(10, 20)]);
        assert_eq!(
            uncovered(10, 20, &[(10, 10), (12, 12), (20, 25)]),
            vec![(11, 11), (13, 19)]
        );
        assert_eq!(uncovered(10, 20, &[(1, 30)]), vec![]);
        assert_eq!(uncovered(10, 20, &[(5, 12), (11, 14)]), vec![(15, 20)]);
        assert_eq!(uncovered(10, 20, &[(15, 15)]), vec![(10, 14), (16, 20)]);
    }
}
