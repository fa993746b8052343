//! A backup copied back over the database file in place (`cp backup.db device.db`: the same
//! inode, the same creation time) starts a new epoch, counted from 1, so the cloud never takes a
//! new message for one it already has under the same number.
//!
//! What the file carries cannot tell it from the file last written here: everything in it is
//! restored. The relay keeps, beside the file, how far the cloud has it; a file whose counter is
//! behind that is not the one the relay published from. A build that kept the epoch reuses
//! numbers 4 and 5, which the cloud holds with other messages, and the consumer drops the new
//! messages as duplicates, silently. (`tests/epochs.rs` restores by removing the file first.)
//!
//! Mutant: `skip-published-check` (the check against what was published skipped), caught here.

mod common;
mod support;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::{Outbox, Relay};
use support::device::relay_config;
use support::{Broker, Subscriber, WAIT, wait_until};

#[test]
fn a_backup_copied_over_the_file_in_place_starts_a_new_epoch() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "inplace/#")?;
    let (dir, db) = temp_db()?;
    let backup = dir.path().join("backup.db");
    let publish = |outbox: &Outbox, n: u32| -> TestResult {
        for i in 0..n {
            outbox.transaction(|tx| tx.publish("inplace/t", "k", &i))?;
        }
        Ok(())
    };
    let first_epoch = {
        let outbox = Outbox::open(&db)?;
        publish(&outbox, 3)?;
        // The backup: a checkpointed copy of the file with its three pending messages.
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
        std::fs::copy(&db, &backup)?;
        let relay = Relay::start(&outbox, relay_config(broker.addr(), "inplace-device"))?;
        publish(&outbox, 2)?;
        assert!(sub.wait_for(5, WAIT));
        assert!(wait_until(|| outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0)));
        relay.shutdown()?;
        outbox.epoch()?
    };
    // Reopening the same file keeps its epoch.
    assert_eq!(Outbox::open(&db)?.epoch()?, first_epoch);

    // The backup is copied over the database, in place: its counter is behind numbers 4 and 5.
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&db)?);
    for leftover in ["device.db-wal", "device.db-shm"] {
        let _ = std::fs::remove_file(dir.path().join(leftover));
    }
    std::fs::copy(&backup, &db)?;
    #[cfg(unix)]
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&db)?),
        inode,
        "the copy went into the same file"
    );
    let outbox = Outbox::open(&db)?;
    let second_epoch = outbox.epoch()?;
    assert_ne!(
        second_epoch, first_epoch,
        "a backup restored in place kept its epoch"
    );
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT first_seq FROM edge_outbox_epochs ORDER BY first_seq DESC LIMIT 1"
        )?,
        4,
        "the new epoch starts after the rows the copy holds"
    );
    // Opened again, it is the file last written here: the same epoch.
    drop(outbox);
    let outbox = Outbox::open(&db)?;
    assert_eq!(
        outbox.epoch()?,
        second_epoch,
        "a second new epoch for the same file"
    );

    publish(&outbox, 2)?;
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "inplace-device"))?;
    assert!(wait_until(|| outbox
        .stats()
        .is_ok_and(|s| s.pending_messages == 0)));
    // The copy's three pending rows go out again under the old epoch (duplicates of what the
    // cloud has), the two new ones as numbers 1 and 2 of the new one.
    assert!(sub.wait_for(10, WAIT), "got {}", sub.len());
    relay.shutdown()?;

    let mut consumer = Consumer::new().from_start(true);
    for m in sub.messages() {
        consumer.observe_bytes(&m.payload)?;
    }
    let report = consumer.report();
    assert_eq!(report.totals.delivered, 7, "{report}");
    assert_eq!(report.totals.duplicates, 3, "{report}");
    assert_eq!(report.totals.unexplained, 0, "{report}");
    Ok(())
}

/// The scenario above fails against the mutant that skips the check.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "skip-published-check",
        "a_backup_copied_over_the_file_in_place_starts_a_new_epoch",
        "a backup restored in place kept its epoch",
    )
}
