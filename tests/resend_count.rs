//! `Status::resent` counts the messages handed to the broker again after a cut, and only those:
//! a message that waited in a lower lane while a higher-numbered alarm went out was never sent
//! before, and is not a resend when it goes out after the reconnect.
//!
//! Broken build this catches: a resend decided by "at or below the highest number ever handed
//! over" (with lanes, every lower-lane message still waiting counts as a resend: the metric of
//! possible duplicates downstream then reports hundreds that cannot exist).

mod common;
mod support;

use common::{TestResult, temp_db};
use edge_outbox::{Error, Message, Outbox, Relay};
use support::device::relay_config;
use support::{Broker, Proxy, Subscriber, WAIT, wait_until};

const TELEMETRY: u64 = 300;

#[test]
fn only_messages_handed_over_before_a_cut_count_as_resent() -> TestResult {
    let broker = Broker::start()?;
    let proxy = Proxy::start(broker.addr())?;
    let sub = Subscriber::start(broker.addr(), "resend/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    // Offline: the telemetry first, then an alarm numbered above all of it, sent first.
    outbox.transaction(|tx| {
        for i in 0..TELEMETRY {
            tx.send(&Message::new("resend/telemetry", "t", &i)?)?;
        }
        tx.send(&Message::new("resend/alarm", "a", &1)?.priority(3))?;
        Ok::<_, Error>(())
    })?;
    // Paced, so most of the telemetry still waits when the connection is cut.
    let relay = Relay::start(
        &outbox,
        relay_config(proxy.addr(), "resend-device").pace_messages(100),
    )?;
    assert!(sub.wait_for(20, WAIT), "the drain did not start");
    proxy.cut();
    assert!(wait_until(|| relay
        .status()
        .is_ok_and(|s| s.store.pending_messages == 0)));
    let s = relay.status()?;
    relay.shutdown()?;
    assert!(s.connections >= 2, "no reconnect: {s:?}");
    // Every message was handed over once, plus once per resend.
    assert_eq!(s.published - s.resent, TELEMETRY + 1, "{s:?}");
    assert!(s.resent <= 100, "more resends than a window: {s:?}");
    Ok(())
}
