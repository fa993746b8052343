//! Epochs: a database restored from a copy numbers its messages in a new epoch, from 1, so the
//! cloud never takes a new message for one it already has under the same number.
//!
//! A build that kept the epoch of a restored file would reuse numbers the cloud has seen with
//! other messages: a deduplicating consumer would drop them as duplicates, silently.

mod common;
mod support;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::{Outbox, Relay};
use support::device::relay_config;
use support::{Broker, Subscriber, WAIT, wait_until};

#[test]
fn a_backup_restored_over_the_database_starts_a_new_epoch_counted_from_one() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "restore/#")?;
    let (dir, db) = temp_db()?;
    let backup = dir.path().join("backup.db");
    let publish = |outbox: &Outbox, n: u32| -> TestResult {
        for i in 0..n {
            outbox.transaction(|tx| tx.publish("restore/t", "k", &i))?;
        }
        Ok(())
    };
    let first_epoch = {
        let outbox = Outbox::open(&db)?;
        publish(&outbox, 3)?;
        // The backup: a checkpointed copy of the file with its three pending messages.
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
        std::fs::copy(&db, &backup)?;
        let relay = Relay::start(&outbox, relay_config(broker.addr(), "restore-device"))?;
        publish(&outbox, 2)?;
        assert!(sub.wait_for(5, WAIT));
        relay.shutdown()?;
        outbox.epoch()?
    };
    // Reopening the same file keeps its epoch.
    assert_eq!(Outbox::open(&db)?.epoch()?, first_epoch);

    // The backup is restored over the database: its counter is behind numbers 4 and 5, which
    // the cloud has.
    std::fs::remove_file(&db)?;
    std::fs::copy(&backup, &db)?;
    let outbox = Outbox::open(&db)?;
    let second_epoch = outbox.epoch()?;
    assert_ne!(
        second_epoch, first_epoch,
        "a restored file must not keep its epoch"
    );
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT first_seq FROM edge_outbox_epochs WHERE reason = 'copied'"
        )?,
        4,
        "the new epoch starts after the rows the copy holds"
    );
    publish(&outbox, 2)?;
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "restore-device"))?;
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
    assert_eq!(report.streams.len(), 2, "{report}");
    let new = report
        .streams
        .iter()
        .find(|s| s.epoch == second_epoch)
        .ok_or("no stream in the new epoch")?;
    assert_eq!((new.first, new.last, new.delivered), (1, 2, 2), "{report}");
    assert_eq!(report.totals.delivered, 7, "{report}");
    assert_eq!(report.totals.duplicates, 3, "{report}");
    assert_eq!(report.totals.unexplained, 0, "{report}");
    Ok(())
}
