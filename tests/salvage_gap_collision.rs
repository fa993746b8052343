//! Salvage accounts for every number of the damaged file: after it, each outbox number is either
//! pending (copied) or covered by exactly one gap row, which the relay announces.
//!
//! The unreadable range starts at the last readable row's number + 1, and here that number
//! already has a gap row: the even numbers were purged before the damage, the odd ones wait.
//! A salvage that records the range with an insert that a row of the same `seq` silently
//! defeats leaves the range's numbers neither pending nor announced (unexplained loss in the
//! cloud), while `Salvaged::unrecoverable` still lists it.
//!
//! Mutant: `salvage-gap-ignored` (the range in one row, `INSERT OR IGNORE`), caught here.

mod common;
mod support;

use std::collections::{BTreeMap, BTreeSet};

use common::{TestResult, query_i64, temp_db};
use edge_outbox::{Options, Outbox};
use support::damage::{damage_page_of, marked_payload};

const ROWS: i64 = 3000;

#[test]
fn an_unreadable_range_starting_at_a_purged_number_is_still_recorded() -> TestResult {
    let (_dir, db) = temp_db()?;
    let page_size = {
        let outbox = Outbox::open(&db)?;
        outbox.transaction(|tx| {
            for n in 1..=ROWS {
                let topic = if n % 2 == 0 {
                    "salvage/purged"
                } else {
                    "salvage/kept"
                };
                tx.publish(topic, "k", &marked_payload(n))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        assert_eq!(outbox.purge_pending(Some("salvage/purged"))?, (ROWS / 2) as u64);
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
        query_i64(&outbox, "PRAGMA page_size")? as usize
    };
    damage_page_of(&db, page_size, 1001)?;

    let salvaged = Outbox::salvage(&db, &Options::default())?;
    assert!(
        !salvaged.unrecoverable.is_empty(),
        "the damage was not noticed: {salvaged:?}"
    );
    let outbox = Outbox::open(&db)?;
    let pending: BTreeSet<i64> = outbox.with_connection(|c| {
        c.prepare("SELECT seq FROM outbox")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()
    })?;
    let gaps: Vec<(i64, i64, String)> = outbox.with_connection(|c| {
        c.prepare("SELECT seq, coalesce(last_seq, seq), cause FROM outbox_gaps ORDER BY seq")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()
    })?;
    // How many times each number is accounted for: pending, or under a gap row.
    let mut accounted: BTreeMap<i64, u32> = pending.iter().map(|&n| (n, 1)).collect();
    for (first, last, _) in &gaps {
        for n in *first..=*last {
            *accounted.entry(n).or_default() += 1;
        }
    }
    let neither: Vec<i64> = (1..=ROWS).filter(|n| !accounted.contains_key(n)).collect();
    assert!(
        neither.is_empty(),
        "{} numbers neither pending nor announced: {neither:?}; unrecoverable {:?}",
        neither.len(),
        salvaged.unrecoverable
    );
    let twice: Vec<i64> = accounted
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(n, _)| *n)
        .collect();
    assert!(twice.is_empty(), "numbers accounted for twice: {twice:?}");
    // What the salvage reports unrecoverable is what its gap rows say.
    let unrecoverable: BTreeSet<i64> = gaps
        .iter()
        .filter(|(_, _, cause)| cause == "unrecoverable")
        .flat_map(|(a, b, _)| *a..=*b)
        .collect();
    let reported: BTreeSet<i64> = salvaged.unrecoverable.iter().flat_map(|(a, b)| *a..=*b).collect();
    assert_eq!(
        unrecoverable, reported,
        "Salvaged::unrecoverable and the gap rows disagree"
    );
    Ok(())
}

/// The scenario above fails against the mutant that records the range as before.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "salvage-gap-ignored",
        "an_unreadable_range_starting_at_a_purged_number_is_still_recorded",
        "numbers neither pending nor announced",
    )
}
