//! A publish held back by the pace is checked for expiry when its turn comes: a reading that
//! expires while it waits is removed and announced (cause `expired`), never published late.
//!
//! The scenario makes the wait certain rather than likely: the pace (in bytes, slow) lets one
//! message go and holds the next one back for seconds, and the wall clock then jumps past the
//! held one's lifetime (`failpoint::shift_wall_clock`, feature `failpoints`; process-wide, so this
//! scenario has its own file). A relay that checks expiry only in the lanes, not in what it has
//! already packed and held back, publishes it.
//!
//! Mutant: `skip-expiry-held-back` (the held-back publish goes out unchecked), caught here.
#![cfg(feature = "failpoints")]

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::envelope::Published;
use edge_outbox::failpoint::shift_wall_clock;
use edge_outbox::{Message, Outbox, Relay};
use support::device::relay_config_for;
use support::{Broker, Subscriber, WAIT, wait_until};

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn a_publish_held_back_by_the_pace_is_not_published_after_its_expiry() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "exph/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        tx.send(&Message::new("exph/t", "first", &1u64)?.expires_after(HOUR))?;
        tx.send(&Message::new("exph/t", "held", &2u64)?.expires_after(HOUR))?;
        // No lifetime: it outlives the jump, and is published after the held one's turn.
        tx.send(&Message::new("exph/t", "last", &3u64)?)?;
        Ok::<_, edge_outbox::Error>(())
    })?;
    // A message is about a hundred bytes: at forty bytes a second each waits seconds for its turn,
    // and the one after the first is packed and held back as soon as the first is handed over.
    let config = relay_config_for(&broker, "exph").pace_bytes(40);
    let _relay = Relay::start(&outbox, config)?;
    // The first message's PUBACK is handled only after the publisher has packed and held back
    // the next one (one thread does both, in that order): once the first is marked, the next is
    // waiting.
    assert!(
        wait_until(|| query_i64(&outbox, "SELECT count(*) FROM outbox WHERE seq = 1").is_ok_and(|n| n == 0)),
        "the first message was never acknowledged"
    );
    // The held-back message's lifetime passes while it waits.
    shift_wall_clock(2 * 3_600_000);
    assert!(
        wait_until(|| outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)),
        "the relay did not settle"
    );
    assert!(
        sub.wait_messages(WAIT, |m| m.len() >= 3),
        "the last message or the notice never arrived"
    );
    let mut consumer = Consumer::new().from_start(true);
    let mut keys = Vec::new();
    for m in sub.messages() {
        if let (Published::Message(env), _) = consumer.observe_bytes(&m.payload)? {
            keys.push(env.key.to_string());
        }
    }
    assert_eq!(
        keys,
        vec!["first", "last"],
        "the held-back message was published after its expiry"
    );
    let report = consumer.report();
    let expired: u64 = report
        .streams
        .iter()
        .filter_map(|s| s.announced_by_cause.get("expired"))
        .sum();
    assert_eq!(expired, 1, "the expired message is announced");
    assert_eq!(report.totals.unexplained, 0);
    Ok(())
}

/// The scenario above fails against the mutant that skips the check.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "skip-expiry-held-back",
        "a_publish_held_back_by_the_pace_is_not_published_after_its_expiry",
        "the held-back message was published after its expiry",
    )
}
