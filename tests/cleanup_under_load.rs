//! Cleanup on a time budget, not only when idle (docs/reliability.md, "Cleanup under load"): a device
//! that never catches up must still prune its retained sent rows and give free pages back, or its
//! file grows without bound. The relay used to prune only when it had nothing to do.
//!
//! A writer keeps the outbox from ever emptying while the relay publishes; sent rows are kept
//! for a short retention (`RETENTION`). Between two points of the run, chosen by how many messages
//! were acknowledged, not by time, the database's size (`page_count`, which includes what is
//! still in the WAL) must not take in what was acknowledged in between, and no kept row may be
//! far past its retention. The run is longer than `STALE`, so a relay that never pruned under
//! load fails both checks; the bounds leave room for the retained window itself, which swings
//! with the pace of marks on a loaded machine.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use edge_outbox::{Options, Outbox, Relay};
use support::device::relay_config;
use support::{Broker, WAIT};

fn pages(outbox: &Outbox) -> i64 {
    outbox
        .with_connection(|c| c.query_row("PRAGMA page_count", [], |r| r.get(0)))
        .expect("page_count")
}

/// Waits until `n` messages were acknowledged. The bound is on progress, not on the whole run:
/// a slow machine (or emulation) takes longer, a relay that stops publishing fails.
fn wait_acked(relay: &Relay, n: u64) {
    let mut progress = (
        relay.status().expect("status").acknowledged,
        std::time::Instant::now(),
    );
    loop {
        let acked = relay.status().expect("status").acknowledged;
        if acked >= n {
            return;
        }
        if acked > progress.0 {
            progress = (acked, std::time::Instant::now());
        }
        assert!(
            progress.1.elapsed() < WAIT,
            "{acked} of {n} acknowledged, none more for {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

const RETENTION: Duration = Duration::from_millis(200);
/// A kept row this old (ten retentions) was missed by cleanup.
const STALE_MS: i64 = 2_000;
/// Acknowledged before the first measure, and in all by the second.
const FIRST: u64 = 3_000;
const LAST: u64 = 30_000;

#[test]
fn retention_and_vacuum_run_while_the_outbox_never_empties() {
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let options = Options::new().sent_retention(RETENTION);
    let outbox = Outbox::open_with(dir.path().join("device.db"), options).expect("open");
    let config = relay_config(broker.addr(), "cleanup")
        .max_in_flight(10)
        .prune_interval(Duration::from_millis(50));
    let relay = Relay::start(&outbox, config).expect("relay");

    // The writer: keeps between 300 and 600 messages pending, so the relay is never idle.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (outbox, stop) = (outbox.clone(), stop.clone());
        std::thread::spawn(move || {
            let payload = vec![0x5au8; 200];
            while !stop.load(Ordering::Relaxed) {
                let pending = outbox.stats().expect("stats").pending_messages;
                if pending < 300 {
                    outbox
                        .transaction(|tx| {
                            for _ in 0..300 {
                                tx.publish("telemetry/load", "k", &payload)?;
                            }
                            Ok::<_, edge_outbox::Error>(())
                        })
                        .expect("commit");
                } else {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        })
    };

    let started = std::time::Instant::now();
    wait_acked(&relay, FIRST);
    let mid = pages(&outbox);
    let mid_sent: i64 = outbox
        .with_connection(|c| c.query_row("SELECT count(*) FROM outbox_sent", [], |r| r.get(0)))
        .expect("count");
    wait_acked(&relay, LAST);
    let ran_ms = started.elapsed().as_millis();
    let end = pages(&outbox);
    let (end_sent, stale): (i64, i64) = outbox
        .with_connection(|c| {
            c.query_row(
                "SELECT count(*), count(*) FILTER (WHERE sent_at < (CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)) - ?1)
                 FROM outbox_sent",
                [STALE_MS],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })
        .expect("count");
    let pending = outbox.stats().expect("stats").pending_messages;
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    eprintln!(
        "pages {mid} -> {end} while {} more were acknowledged in {ran_ms} ms; sent rows kept \
         {mid_sent} -> {end_sent}, {stale} older than {STALE_MS} ms; {pending} pending",
        LAST - FIRST
    );
    assert!(pending > 0, "the outbox was never meant to empty");
    assert!(
        ran_ms > STALE_MS as u128,
        "the run ({ran_ms} ms) was too short for a missed row to be stale"
    );
    assert_eq!(
        stale, 0,
        "sent rows past their retention were not pruned under load"
    );
    // Kept rows are the retained window, never what was acknowledged since the first measure.
    let acked_between = (LAST - FIRST) as i64;
    assert!(
        end_sent < acked_between / 2,
        "{end_sent} sent rows kept of {acked_between} acknowledged"
    );
    // Those rows, about 250 bytes each, would take about one page per seven: keeping them grows
    // the file by thousands of pages. A window that swings by a few thousand rows is a few hundred.
    assert!(
        end <= mid + acked_between / 20,
        "the file grew from {mid} to {end} pages under sustained load"
    );
    relay.shutdown().expect("shutdown");
}
