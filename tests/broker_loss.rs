//! Where at-least-once ends: a broker that drops what it acknowledged, and how the cloud sees it.
//!
//! mosquitto with its stock queue limit (`max_queued_messages`, 1000 by default; 10 here) PUBACKs
//! every message to the device but keeps at most that many for a persistent subscriber that is
//! away, dropping the rest. The device has no way to know: it marks them sent. The consumer module
//! on the subscriber's side reports exactly the dropped numbers as an unexplained gap, once a
//! later message shows the stream went on. (With the limit raised, as tests/support/broker.rs and
//! docs/reliability.md do, nothing is dropped.)

mod common;
mod support;

use common::{TestResult, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::{Outbox, Relay};
use support::device::relay_config;
use support::{Broker, BrokerKind, Subscriber, WAIT, wait_until};

#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn messages_a_broker_acknowledged_and_dropped_are_an_unexplained_gap() -> TestResult {
    let broker = Broker::builder()
        .kind(BrokerKind::Mosquitto)
        .mosquitto_option("max_queued_messages 10")
        .start()?;
    // The cloud's persistent session exists, then goes away for a while.
    let cloud = || {
        Subscriber::builder(broker.addr())
            .client_id("slow-cloud")
            .clean_session(false)
            .filter("loss/#")
            .start()
    };
    cloud()?.stop();

    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    for i in 0..50u32 {
        outbox.transaction(|tx| tx.publish("loss/t", "k", &i))?;
    }
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "loss-device"))?;
    assert!(
        wait_until(|| outbox.stats().is_ok_and(|s| s.pending_messages == 0)),
        "the broker acknowledged everything"
    );
    let status = relay.status()?;
    assert_eq!((status.acknowledged, status.dead_lettered), (50, 0));

    // Back: the broker kept ten; one more message shows that the stream went on.
    let sub = cloud()?;
    outbox.transaction(|tx| tx.publish("loss/t", "k", &50u32))?;
    assert!(
        sub.wait_messages(WAIT, |m| m.len() >= 11),
        "got {} messages",
        sub.len()
    );
    relay.shutdown()?;
    let mut consumer = Consumer::new().from_start(true);
    for m in sub.messages() {
        consumer.observe_bytes(&m.payload)?;
    }
    let report = consumer.report();
    assert_eq!(report.totals.delivered, 11, "{report}");
    assert_eq!(report.totals.announced, 0, "the device removed nothing: {report}");
    assert_eq!(report.streams[0].unexplained, vec![(11, 50)], "{report}");
    assert_eq!(report.totals.unexplained, 40);
    Ok(())
}
