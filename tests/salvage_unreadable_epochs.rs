//! A salvage that cannot read the damaged file's epochs numbers its pending messages anew, in a
//! fresh epoch; the gap rows it copies must not then name numbers of that epoch. Their numbers
//! belonged to epochs nobody can name any more, and announced in the fresh one they would cover
//! the renumbered messages: the cloud would get a message and a notice for one number.
//!
//! Here the even numbers of 200 were purged (each with its gap row, not yet announced), then the
//! page of `edge_outbox_epochs` was damaged.
//!
//! Mutant: `salvage-renumbered-gaps-kept` (the gap rows copied as they are), caught here.

mod common;
mod support;

use std::collections::BTreeSet;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::{Options, Outbox};

const ROWS: i64 = 200;

#[test]
fn copied_gap_rows_never_name_a_renumbered_message() -> TestResult {
    let (_dir, db) = temp_db()?;
    let (page_size, epochs_page) = {
        let outbox = Outbox::open(&db)?;
        outbox.transaction(|tx| {
            for n in 1..=ROWS {
                let topic = if n % 2 == 0 {
                    "salvage/purged"
                } else {
                    "salvage/kept"
                };
                tx.publish(topic, "k", &n)?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        assert_eq!(outbox.purge_pending(Some("salvage/purged"))?, (ROWS / 2) as u64);
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
        (
            query_i64(&outbox, "PRAGMA page_size")? as usize,
            query_i64(
                &outbox,
                "SELECT rootpage FROM sqlite_schema WHERE name = 'edge_outbox_epochs'",
            )? as usize,
        )
    };
    let mut bytes = std::fs::read(&db)?;
    bytes[(epochs_page - 1) * page_size..epochs_page * page_size].fill(0xAB);
    std::fs::write(&db, bytes)?;

    let salvaged = Outbox::salvage(&db, &Options::default())?;
    assert_eq!(salvaged.pending_messages, (ROWS / 2) as u64, "{salvaged:?}");
    let outbox = Outbox::open(&db)?;
    let epochs: Vec<(i64, i64)> = outbox.with_connection(|c| {
        c.prepare("SELECT first_seq, epoch FROM edge_outbox_epochs ORDER BY first_seq")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()
    })?;
    // (epoch, number) of outbox seq `seq`, as the relay numbers it.
    let locate = |seq: i64| -> (i64, i64) {
        let (first, epoch) = epochs
            .iter()
            .rev()
            .find(|(first, _)| *first <= seq)
            .copied()
            .unwrap_or((1, 0));
        (epoch, seq - first + 1)
    };
    let pending: BTreeSet<(i64, i64)> = outbox
        .with_connection(|c| {
            c.prepare("SELECT seq FROM outbox")?
                .query_map([], |r| r.get::<_, i64>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })?
        .into_iter()
        .map(locate)
        .collect();
    assert_eq!(pending.len(), (ROWS / 2) as usize);
    let announced: BTreeSet<(i64, i64)> = outbox
        .with_connection(|c| {
            c.prepare("SELECT seq, coalesce(last_seq, seq) FROM outbox_gaps")?
                .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })?
        .into_iter()
        .flat_map(|(a, b)| (a..=b).map(locate))
        .collect();
    let both: Vec<_> = pending.intersection(&announced).collect();
    assert!(
        both.is_empty(),
        "{} numbers both pending and announced as removed, e.g. {:?}",
        both.len(),
        both.iter().take(5).collect::<Vec<_>>()
    );
    Ok(())
}

/// The scenario above fails against the mutant that copies the gap rows as they are.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "salvage-renumbered-gaps-kept",
        "copied_gap_rows_never_name_a_renumbered_message",
        "both pending and announced as removed",
    )
}
