//! A failover list of brokers: when the broker the relay is connected to dies, the relay moves on
//! to the next one in the list and loses nothing.
//!
//! The broker "dies" behind a proxy: its connection is cut and new ones are refused, which is what
//! the relay sees of a killed broker. The broker itself stays up, because a broker that is really
//! killed (SIGKILL) also loses what it had acknowledged but not yet delivered to its subscribers.
//! That loss is the broker's, which no client can prevent ("At-least-once ends at the broker's
//! PUBACK", docs/reliability.md). Under qemu, where the subscriber is slow, it happened in one CI run
//! and was counted against the relay.
//!
//! The two brokers are independent (not a cluster), so the cloud side reads both; the consumer
//! module is fed both streams and must find every number of the device delivered or announced.
//! A relay that kept retrying the dead broker would publish nothing more (the wait fails); one
//! that marked rows on the dead connection, or resumed after the last row sent instead of the
//! oldest unacknowledged one, would leave an unexplained gap.

mod common;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::{MqttConfig, Outbox, Relay, RelayConfig};
use support::{Broker, Proxy, Subscriber, WAIT, wait_until};

#[test]
fn killing_the_current_broker_moves_the_relay_to_the_next_and_loses_nothing() -> TestResult {
    let first = Broker::start()?;
    let first_route = Proxy::start(first.addr())?;
    let second = Broker::start()?;
    let on_first = Subscriber::start(first.addr(), "failover/#")?;
    let on_second = Subscriber::start(second.addr(), "failover/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let mqtt = MqttConfig::new("127.0.0.1", first_route.port())
        .failover(second.host(), second.port())
        .client_id("failover-device")
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2));
    let config =
        RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250));
    let relay = Relay::start(&outbox, config)?;

    // The device commits all along, in one thread, while the test kills the broker.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (outbox, writing) = (outbox.clone(), writing.clone());
        std::thread::spawn(move || -> edge_outbox::Result<u64> {
            let mut n = 0u64;
            while writing.load(Ordering::SeqCst) || n < 400 {
                outbox.transaction(|tx| {
                    tx.publish(&format!("failover/{}", n % 4), &format!("k{}", n % 4), &n)
                })?;
                n += 1;
                if n.is_multiple_of(50) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            Ok(n)
        })
    };
    assert!(
        on_first.wait_for(100, WAIT),
        "nothing arrived on the first broker"
    );
    let first_endpoint = first_route.addr().to_string();
    assert_eq!(relay.status()?.broker.as_deref(), Some(first_endpoint.as_str()));

    // The first broker dies, as the relay sees it: its connection gone, new ones refused.
    first_route.refuse(true);
    first_route.cut();
    let second_endpoint = second.addr().to_string();
    assert!(
        wait_until(|| relay
            .status()
            .is_ok_and(|s| s.connected && s.broker.as_deref() == Some(second_endpoint.as_str()))),
        "the relay did not move to the second broker: {:?}",
        relay.status()?
    );
    assert!(
        on_second.wait_for(100, WAIT),
        "nothing arrived on the second broker"
    );
    writing.store(false, Ordering::SeqCst);
    let committed = writer.join().map_err(|_| "writer panicked")??;
    assert!(
        wait_until(|| outbox.stats().is_ok_and(|s| s.pending_messages == 0)),
        "the backlog did not drain on the second broker"
    );
    let total = committed;
    assert!(
        wait_until(|| {
            let mut c = Consumer::new().from_start(true);
            for m in on_first.messages().iter().chain(on_second.messages().iter()) {
                let _ = c.observe_bytes(&m.payload);
            }
            c.report().totals.delivered == total
        }),
        "not every message arrived"
    );
    relay.shutdown()?;

    let mut consumer = Consumer::new().from_start(true);
    for m in on_first.messages().iter().chain(on_second.messages().iter()) {
        consumer.observe_bytes(&m.payload)?;
    }
    let report = consumer.report();
    assert_eq!(report.totals.delivered, total, "{report}");
    assert_eq!(report.totals.unexplained, 0, "{report}");
    assert_eq!(report.totals.announced, 0, "nothing was removed: {report}");
    assert!(!on_second.messages().is_empty() && !on_first.messages().is_empty());
    Ok(())
}
