//! A batch held back by the pace is checked for expiry when its turn comes: its rows whose
//! lifetime passed while it waited are removed and announced (cause `expired`), and the rest goes
//! out without them.
//!
//! As in `tests/expiry_held_back.rs`, the wait is made certain: a first message (not batched)
//! takes the pace's only token, the batch behind it is packed and held back for seconds, and the
//! wall clock jumps past its rows' lifetime meanwhile (`failpoint::shift_wall_clock`). A relay that
//! publishes what it packed without checking it again sends the expired readings.
//!
//! Mutant: `skip-expiry-held-back`, caught here too.
#![cfg(feature = "failpoints")]

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::envelope::Published;
use edge_outbox::failpoint::shift_wall_clock;
use edge_outbox::{Batching, Message, Outbox, Relay};
use support::device::relay_config_for;
use support::{Broker, Subscriber, wait_until};

/// Readings in the batch that expire while it waits.
const READINGS: u64 = 30;

#[test]
fn a_batch_held_back_by_the_pace_goes_without_its_expired_rows() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "exphb/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        tx.publish("exphb/first", "first", &0u64)?;
        for i in 0..READINGS {
            let reading = Message::new("exphb/t", format!("r{i}"), &i)?;
            tx.send(&reading.expires_after(Duration::from_secs(3600)))?;
        }
        // No lifetime: it outlives the jump and is what the batch becomes.
        tx.publish("exphb/t", "last", &READINGS)?;
        // Another topic closes the run: the batch is packed at once, without reading further.
        tx.publish("exphb/u", "tail", &0u64)?;
        Ok::<_, edge_outbox::Error>(())
    })?;
    // One message a second (the first goes at once), and a byte rate that holds the batch of
    // some three kilobytes back for seconds more. No linger: the batch is packed as soon as the
    // first message is handed over, so it is held back (not still lingering) when the clock jumps.
    let config = relay_config_for(&broker, "exphb")
        .batch("exphb/t", Batching::new().linger(Duration::ZERO))
        .pace_messages(1)
        .pace_bytes(1200);
    let _relay = Relay::start(&outbox, config)?;
    // The first message's PUBACK is handled only after the publisher has packed and held back
    // the batch (one thread does both, in that order): once the first is marked, the batch waits.
    assert!(
        wait_until(|| query_i64(&outbox, "SELECT count(*) FROM outbox WHERE seq = 1").is_ok_and(|n| n == 0)),
        "the first message was never acknowledged"
    );
    // The batch's readings expire while it waits.
    shift_wall_clock(2 * 3_600_000);
    assert!(
        wait_until(|| outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)),
        "the relay did not settle"
    );
    // Everything arrived once the tail has and no number is missing before it.
    let observe = || -> TestResult<(Consumer, Vec<String>)> {
        let mut consumer = Consumer::new().from_start(true);
        let mut keys = Vec::new();
        for m in sub.messages() {
            for (item, _) in consumer.observe_all(&m.payload)? {
                if let Published::Message(env) = item {
                    keys.push(env.key.to_string());
                }
            }
        }
        Ok((consumer, keys))
    };
    assert!(
        wait_until(|| observe().is_ok_and(|(c, keys)| {
            keys.iter().any(|k| k == "tail") && c.report().totals.unexplained == 0
        })),
        "not everything arrived"
    );
    let (consumer, keys) = observe()?;
    assert_eq!(
        keys,
        vec!["first", "last", "tail"],
        "expired readings of a held-back batch were published"
    );
    let report = consumer.report();
    let expired: u64 = report
        .streams
        .iter()
        .filter_map(|s| s.announced_by_cause.get("expired"))
        .sum();
    assert_eq!(expired, READINGS, "the expired readings are announced");
    assert_eq!(report.totals.unexplained, 0);
    Ok(())
}

/// The scenario above fails against the mutant that skips the check.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "skip-expiry-held-back",
        "a_batch_held_back_by_the_pace_goes_without_its_expired_rows",
        "expired readings of a held-back batch were published",
    )
}
