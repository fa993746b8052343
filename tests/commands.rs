//! Commands arrive through a persistent session, are stored before they are acknowledged, and
//! are applied exactly once: redeliveries are no-ops, offline commands are delivered on
//! reconnect, and malformed bytes are acknowledged and dead-lettered without stopping the session.

mod support;

use edge_outbox::{Outbox, Relay, RelayConfig};
use rumqttc::QoS;
use support::credits::{balance, command, credit_relay, device};
use support::device::relay_config;
use support::{Broker, Subscriber, WAIT, publish_raw, publish_raw_many, wait_until};

const FILTER: &str = "devices/d1/commands/#";
const TOPIC: &str = "devices/d1/commands/credit";

/// Starts a relay whose handler adds credits and publishes a receipt in the same transaction.
fn start(outbox: &Outbox, config: RelayConfig) -> Relay {
    credit_relay(outbox, config, FILTER, Some("devices/d1/receipts"))
}

#[test]
fn a_redelivered_command_is_applied_once() {
    let broker = Broker::start().expect("broker");
    let receipts = Subscriber::start(broker.addr(), "devices/d1/receipts").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = device(dir.path());
    let relay = start(&outbox, relay_config(broker.addr(), "cmd-dup"));
    let bytes = command(40);
    // The same command id delivered twice, as a broker redelivers after a lost ack.
    publish_raw(broker.addr(), TOPIC, &bytes, QoS::AtLeastOnce).expect("first delivery");
    publish_raw(broker.addr(), TOPIC, &bytes, QoS::AtLeastOnce).expect("second delivery");
    assert!(
        wait_until(|| relay.status().expect("status").commands_duplicate >= 1),
        "duplicate seen"
    );
    assert!(
        wait_until(|| relay.status().expect("status").commands_applied >= 1),
        "applied"
    );
    assert!(receipts.wait_for(1, WAIT), "receipt published with the effect");
    let status = relay.status().expect("status");
    assert_eq!(
        (status.commands_received, status.commands_applied),
        (1, 1),
        "{status:?}"
    );
    assert_eq!(balance(&outbox), 40);
    relay.shutdown().expect("shutdown");
    assert_eq!(balance(&outbox), 40);
}

#[test]
fn a_command_sent_while_the_device_is_offline_is_applied_when_it_reconnects() {
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = device(dir.path());
    // First run: establishes the persistent command session on the broker.
    start(&outbox, relay_config(broker.addr(), "cmd-offline"))
        .shutdown()
        .expect("shutdown");

    // Offline: the broker queues this for the device's command session.
    publish_raw(broker.addr(), TOPIC, &command(25), QoS::AtLeastOnce).expect("publish while offline");
    assert_eq!(balance(&outbox), 0);

    let relay = start(&outbox, relay_config(broker.addr(), "cmd-offline"));
    assert!(
        wait_until(|| balance(&outbox) == 25),
        "queued command applied after reconnect ({:?})",
        broker.kind()
    );
    relay.shutdown().expect("shutdown");
}

#[test]
fn malformed_command_bytes_are_acknowledged_and_dead_lettered_without_stopping_the_session() {
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = device(dir.path());
    let relay = start(&outbox, relay_config(broker.addr(), "cmd-bad"));
    let good = command(7);
    let truncated = &good[..good.len() / 2];
    let messages: Vec<(&str, &[u8])> = vec![
        (TOPIC, b"not cbor at all"),
        (TOPIC, truncated),
        ("devices/d1/commands/x/y/z/\u{e9}", &[0xa0]), // an empty map: no id, odd topic shape
        (TOPIC, &good),
    ];
    publish_raw_many(broker.addr(), &messages, QoS::AtLeastOnce).expect("publish");
    assert!(
        wait_until(|| balance(&outbox) == 7),
        "the good command behind the bad ones was applied"
    );
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 3, "{dead:#?}");
    assert!(dead.iter().all(|d| !d.reason.is_empty() && d.payload.is_some()));
    assert!(relay.status().expect("status").commands_connected);
    relay.shutdown().expect("shutdown");

    // They were acknowledged: a new session gets no redelivery, so no new dead letters.
    let relay = start(&outbox, relay_config(broker.addr(), "cmd-bad"));
    publish_raw(broker.addr(), TOPIC, &command(1), QoS::AtLeastOnce).expect("publish");
    assert!(wait_until(|| balance(&outbox) == 8));
    assert_eq!(outbox.dead_letters(10).expect("dead letters").len(), 3);
    relay.shutdown().expect("shutdown");
}
