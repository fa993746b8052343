//! An unrecoverable range a salvage announces leaves out the numbers it knows were acknowledged:
//! a notice over a delivered number is not loss, and would hide a broker's loss of it from the
//! cloud (the consumer takes the number as explained).
//!
//! Sent rows are kept here (`Options::sent_retention`): the odd numbers wait, the even ones were
//! acknowledged and moved to `outbox_sent`, as the relay's marker does; then the page holding row
//! 1001 is damaged. The rowid range the salvage cannot read spans the even numbers between.
//!
//! Mutant: `salvage-covers-sent` (the sent numbers not left out), caught here.

mod common;
mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::{Options, Outbox};
use support::damage::{damage_page_of, marked_payload};

const ROWS: i64 = 3000;

#[test]
fn an_unrecoverable_range_leaves_out_acknowledged_numbers() -> TestResult {
    let (_dir, db) = temp_db()?;
    let options = Options::new().sent_retention(Duration::from_secs(3600));
    let page_size = {
        let outbox = Outbox::open_with(&db, options.clone())?;
        outbox.transaction(|tx| {
            for n in 1..=ROWS {
                tx.publish("salvage/t", "k", &marked_payload(n))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        // The even ones acknowledged, moved as the marker moves them.
        outbox.with_connection(|c| {
            c.execute_batch(
                "INSERT INTO outbox_sent (seq, id, topic, key, payload, created_at, sent_at, sent_uptime)
                 SELECT seq, id, topic, key, payload, created_at, created_at, 0
                 FROM outbox WHERE seq % 2 = 0;
                 DELETE FROM outbox WHERE seq % 2 = 0;
                 PRAGMA wal_checkpoint(TRUNCATE);",
            )
        })?;
        query_i64(&outbox, "PRAGMA page_size")? as usize
    };
    damage_page_of(&db, page_size, 1001)?;

    let salvaged = Outbox::salvage(&db, &options)?;
    assert!(
        !salvaged.unrecoverable.is_empty(),
        "the damage was not noticed: {salvaged:?}"
    );
    let outbox = Outbox::open_with(&db, options)?;
    let sent: BTreeSet<i64> = outbox.with_connection(|c| {
        c.prepare("SELECT seq FROM outbox_sent")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()
    })?;
    assert_eq!(sent.len(), (ROWS / 2) as usize, "the sent rows were copied");
    let announced: BTreeSet<i64> = outbox
        .with_connection(|c| {
            c.prepare("SELECT seq, coalesce(last_seq, seq) FROM outbox_gaps WHERE cause = 'unrecoverable'")?
                .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })?
        .into_iter()
        .flat_map(|(a, b)| a..=b)
        .collect();
    let delivered: Vec<&i64> = announced.intersection(&sent).collect();
    assert!(
        delivered.is_empty(),
        "acknowledged numbers announced unrecoverable: {delivered:?}"
    );
    let reported: BTreeSet<i64> = salvaged.unrecoverable.iter().flat_map(|(a, b)| *a..=*b).collect();
    assert_eq!(
        reported, announced,
        "Salvaged::unrecoverable and the gap rows disagree"
    );
    assert!(
        announced.iter().all(|n| n % 2 == 1),
        "only waiting (odd) numbers are unrecoverable: {announced:?}"
    );
    Ok(())
}

/// The scenario above fails against the mutant that covers sent numbers.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "salvage-covers-sent",
        "an_unrecoverable_range_leaves_out_acknowledged_numbers",
        "acknowledged numbers announced unrecoverable",
    )
}
