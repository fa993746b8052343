//! A damaged database does not brick the device.
//!
//! A real store is copied as a power cut would leave it (main file and WAL, while its handle is
//! open), then two pages holding pending messages are overwritten with garbage and the WAL is cut
//! short. Opening it must move the damaged file aside, salvage everything readable (the
//! application's rows, pending messages with their numbers, commands applied and unapplied) into a
//! fresh file with a new epoch, record the unreadable messages as an `unrecoverable` gap, and come
//! back: the relay publishes what was salvaged and the gap notices, and new messages in the new
//! epoch. A build that refused the file (or crashed on it) bricks the device; one that lost a
//! readable row, renumbered the salvaged messages or forgot the unreadable range fails the checks
//! below, the last through the consumer module's unexplained gaps.

mod common;
mod support;

use std::collections::BTreeSet;

use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::{MessageId, Options, Outbox, Relay};
use support::damage::{damage_page_of, marked_payload};
use support::device::relay_config;
use support::{Broker, Subscriber, wait_until};

fn payload(n: u64) -> String {
    marked_payload(n as i64)
}

#[test]
fn a_damaged_file_is_moved_aside_and_everything_readable_comes_back() -> TestResult {
    let (dir, original) = temp_db()?;
    let db = dir.path().join("damaged.db");
    let applied: Vec<MessageId> = (0..30).map(|_| MessageId::new_v7()).collect();
    let unapplied: Vec<MessageId> = (0..20).map(|_| MessageId::new_v7()).collect();
    let old_epoch;
    let page_size;
    {
        let outbox = Outbox::open(&original)?;
        outbox.with_connection(|c| {
            c.execute_batch("CREATE TABLE readings (n INTEGER PRIMARY KEY, celsius REAL)")
        })?;
        outbox.transaction(|tx| {
            for n in 1..=500 {
                tx.execute(
                    "INSERT INTO readings VALUES (?1, ?2)",
                    (n, 20.0 + n as f64 / 100.0),
                )?;
            }
            for n in 1..=3000 {
                tx.publish("salvage/orders", "k", &payload(n))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        for id in &applied {
            outbox.receive("cmd", &command_bytes(*id, "a", &"cmd-applied")?)?;
            outbox.apply_next(|_, _| Ok::<_, edge_outbox::Error>(()))?;
        }
        for id in &unapplied {
            outbox.receive("cmd", &command_bytes(*id, "u", &"cmd-waiting")?)?;
        }
        // A relay ran an hour on this file (the uptime clock retention reads).
        outbox.with_connection(|c| {
            c.execute_batch("UPDATE edge_outbox_meta SET value = 3600000 WHERE name = 'uptime_ms'")
        })?;
        // Everything so far in the main file; what follows stays in the WAL.
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
        for batch in 0..10 {
            outbox.transaction(|tx| {
                for n in 0..20 {
                    tx.publish("salvage/orders", "k", &payload(3001 + batch * 20 + n))?;
                }
                Ok::<_, edge_outbox::Error>(())
            })?;
        }
        old_epoch = outbox.epoch()?;
        page_size = query_i64(&outbox, "PRAGMA page_size")? as usize;
        // The power cut: the files as they are while the store is open.
        std::fs::copy(&original, &db)?;
        std::fs::copy(
            dir.path().join("device.db-wal"),
            dir.path().join("damaged.db-wal"),
        )?;
    }
    let mut damaged = damage_page_of(&db, page_size, 1000)?;
    damaged.extend(damage_page_of(&db, page_size, 2000)?);
    assert!(
        damaged.len() >= 10,
        "each page held a few dozen rows: {damaged:?}"
    );
    let wal = dir.path().join("damaged.db-wal");
    let wal_len = std::fs::metadata(&wal)?.len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&wal)?
        .set_len(wal_len * 6 / 10)?;

    // Opening salvages.
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let outbox = Outbox::open(&db)?;
    let aside: Vec<String> = std::fs::read_dir(dir.path())?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("damaged.db.corrupt-"))
        .collect();
    assert_eq!(
        aside.len(),
        2,
        "the damaged file and its WAL are kept aside: {aside:?}"
    );
    let stats = outbox.stats()?;
    assert_eq!(stats.salvaged, 1);
    assert_ne!(stats.epoch, old_epoch, "new messages are numbered in a new epoch");
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms'"
        )?,
        3_600_000,
        "the uptime clock carries on"
    );

    // What was readable is back, with its numbers.
    let pending: BTreeSet<i64> = outbox.with_connection(|c| {
        c.prepare("SELECT seq FROM outbox")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()
    })?;
    let readable: BTreeSet<i64> = (1..=3000).filter(|n| !damaged.contains(n)).collect();
    assert!(
        pending.is_superset(&readable),
        "lost readable rows: {:?}",
        readable.difference(&pending).take(5).collect::<Vec<_>>()
    );
    assert!(pending.is_disjoint(&damaged));
    let from_wal: Vec<i64> = pending.iter().copied().filter(|&n| n > 3000).collect();
    assert!(
        !from_wal.is_empty() && from_wal.len() < 200,
        "the WAL was cut: {} of its rows",
        from_wal.len()
    );
    assert_eq!(
        from_wal,
        (3001..3001 + from_wal.len() as i64).collect::<Vec<_>>(),
        "a prefix of the WAL"
    );
    let sample: String = outbox
        .with_connection(|c| {
            c.query_row(
                "SELECT CAST(payload AS BLOB) FROM outbox WHERE seq = 3",
                [],
                |r| r.get::<_, Vec<u8>>(0),
            )
        })
        .map(|b| edge_outbox::envelope::from_cbor::<String>(&b))??;
    assert_eq!(
        sample,
        payload(3),
        "a salvaged row keeps its payload under its number"
    );

    // The unreadable rows are recorded as an unrecoverable gap, nothing else is.
    let gaps: Vec<(i64, i64, String)> = outbox.with_connection(|c| {
        c.prepare("SELECT seq, coalesce(last_seq, seq), cause FROM outbox_gaps ORDER BY seq")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()
    })?;
    let covered: BTreeSet<i64> = gaps.iter().flat_map(|(a, b, _)| *a..=*b).collect();
    assert_eq!(covered, damaged, "gap rows {gaps:?}");
    assert!(gaps.iter().all(|(_, _, cause)| cause == "unrecoverable"));

    // The application's rows and the commands, applied (their ids deduplicate) and unapplied.
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM readings")?, 500);
    assert_eq!(stats.inbox_unapplied, 20);
    assert_eq!(stats.inbox_applied, 30);
    assert_eq!(
        outbox.receive("cmd", &command_bytes(applied[0], "a", &"cmd-applied")?)?,
        edge_outbox::Received::Duplicate(applied[0])
    );

    // The device comes back: a new message, and everything goes out.
    outbox.transaction(|tx| tx.publish("salvage/orders", "k", &"after the salvage"))?;
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "#")?;
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "salvaged-device"))?;
    assert!(
        wait_until(|| outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)),
        "the salvaged store did not drain: {:?}",
        outbox.stats()?
    );
    let expected = pending.len() as u64 + 1;
    assert!(
        wait_until(|| {
            let mut c = Consumer::new();
            sub.messages().iter().for_each(|m| {
                let _ = c.observe_bytes(&m.payload);
            });
            let r = c.report();
            r.totals.delivered == expected && r.totals.announced == damaged.len() as u64
        }),
        "not everything arrived"
    );
    relay.shutdown()?;
    let mut consumer = Consumer::new().from_start(true);
    for m in sub.messages() {
        consumer.observe_bytes(&m.payload)?;
    }
    let report = consumer.report();
    assert_eq!(report.totals.unexplained, 0, "{report}");
    let old = report
        .streams
        .iter()
        .find(|s| s.epoch == old_epoch)
        .ok_or("no old epoch")?;
    assert_eq!(
        old.announced_by_cause.get("unrecoverable"),
        Some(&(damaged.len() as u64)),
        "{report}"
    );
    let new = report
        .streams
        .iter()
        .find(|s| s.epoch == stats.epoch)
        .ok_or("no new epoch")?;
    assert_eq!((new.first, new.last, new.delivered), (1, 1, 1), "{report}");
    Ok(())
}

/// With salvage turned off, a damaged file is refused with a clear error and left alone.
#[test]
fn with_salvage_off_a_damaged_file_is_refused_untouched() -> TestResult {
    let (dir, db) = temp_db()?;
    {
        let outbox = Outbox::open(&db)?;
        outbox.transaction(|tx| {
            for n in 1..=2000 {
                tx.publish("t", "k", &payload(n))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
    }
    damage_page_of(&db, 4096, 1000)?;
    let before = std::fs::read(&db)?;
    let err = Outbox::open_with(&db, Options::new().salvage_on_corruption(false)).expect_err("refused");
    assert!(matches!(err, edge_outbox::Error::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("doctor --salvage"), "{err}");
    assert_eq!(std::fs::read(&db)?, before, "the file is left as it was");
    let moved: Vec<_> = std::fs::read_dir(dir.path())?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains("corrupt") || n.contains("salvag"))
        .collect();
    assert!(moved.is_empty(), "nothing moved aside: {moved:?}");
    Ok(())
}
