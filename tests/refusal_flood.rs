//! A flood of refused deliveries cannot fill the device's storage. Anyone who can publish on the
//! command topic can send junk, and each refusal is stored before anything else (signing does not
//! help): refused dead letters are capped in count and bytes, the oldest evicted and counted, so
//! the application's own writes keep their room. The database here may grow to 8 MiB only
//! (`max_page_count`), far less than the flood's 30 MB.

mod common;
mod support;

use common::{TestResult, temp_db};
use edge_outbox::{Outbox, Received};

const JUNK: usize = 500;
const JUNK_BYTES: usize = 60 * 1024;

#[test]
fn a_flood_of_junk_cannot_make_the_applications_publish_fail() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    let page_size: i64 = outbox.with_connection(|c| c.query_row("PRAGMA page_size", [], |r| r.get(0)))?;
    outbox.with_connection(|c| c.pragma_update(None, "max_page_count", 8 * 1024 * 1024 / page_size))?;

    for i in 0..JUNK {
        // Not an envelope: refused and dead-lettered, every time with other bytes.
        let mut junk = vec![0xffu8; JUNK_BYTES];
        junk[..8].copy_from_slice(&(i as u64).to_be_bytes());
        match outbox.receive("devices/d1/commands/x", &junk)? {
            Received::DeadLettered { .. } => {}
            other => return Err(format!("junk {i} was not refused: {other:?}").into()),
        }
    }
    outbox.prune()?;
    // The application's own write still has room.
    outbox.transaction(|tx| {
        for order in 0..10 {
            tx.publish("orders/placed", &format!("o-{order}"), &vec![7u8; 60 * 1024])?;
        }
        Ok::<_, edge_outbox::Error>(())
    })?;

    let stats = outbox.stats()?;
    assert!(
        stats.refusals_kept > 0,
        "the newest refusals are kept for the operator"
    );
    assert_eq!(
        stats.refusals_kept + stats.refusals_evicted,
        JUNK as u64,
        "every refusal is kept or counted as evicted: {stats:?}"
    );
    assert_eq!(stats.dead_letters, stats.refusals_kept);
    let newest = outbox.dead_letters(JUNK)?;
    let last = newest
        .last()
        .and_then(|d| d.payload.as_ref())
        .ok_or("the newest refusal")?;
    assert_eq!(
        last[..8],
        ((JUNK - 1) as u64).to_be_bytes(),
        "the oldest are the ones evicted"
    );
    Ok(())
}

/// The broken build this scenario catches: refused deliveries kept without bound.
#[cfg(feature = "mutants")]
#[test]
fn the_unbounded_refusals_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    let test = "a_flood_of_junk_cannot_make_the_applications_publish_fail";
    assert!(
        support::mutant::caught(test, "unbounded-refusals")?,
        "mutant survived"
    );
    Ok(())
}
