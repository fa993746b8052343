//! The relay's counters each mean one thing: with nothing in flight, every outbox message
//! published was acknowledged, and the gap notices that announce removed messages are counted
//! apart (`notices_published`), the messages they cover in `gaps_announced`.
//!
//! Broken build this catches: a notice counted as a published message (with nothing in flight,
//! `published` then exceeds `acknowledged` by the number of notices, and an operator reads it as
//! loss).

mod common;
mod support;

use common::{TestResult, temp_db};
use edge_outbox::{Error, Message, Outbox, Relay};
use support::device::relay_config_for;
use support::{Broker, wait_until};

#[test]
fn published_equals_acknowledged_and_notices_are_counted_apart() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    // Offline: 30 readings of 3 sensors; each new one replaces the pending one of its sensor.
    outbox.transaction(|tx| {
        for i in 0..30u64 {
            tx.send(&Message::new("counters/t", format!("s{}", i % 3), &i)?.coalescing(true))?;
        }
        Ok::<_, Error>(())
    })?;
    let relay = Relay::start(&outbox, relay_config_for(&broker, "counters-device"))?;
    assert!(wait_until(|| relay.status().is_ok_and(|s| s.in_flight == 0
        && s.store.pending_messages == 0
        && s.store.gaps_unannounced == 0)));
    let s = relay.status()?;
    relay.shutdown()?;
    assert_eq!((s.published, s.acknowledged), (3, 3), "{s:?}");
    assert_eq!(s.gaps_announced, 27, "{s:?}");
    assert!(s.notices_published >= 1, "{s:?}");
    Ok(())
}
