//! Expiry: a message's own lifetime (`Message::expires_after`) or its topic's
//! (`RelayConfig::expire_after`); an expired message is never published, it is removed and
//! announced (cause `expired`); under MQTT 5 a publish carries what is left of its lifetime as the
//! message expiry interval, so the broker drops it too.
//!
//! Broken builds these catch: a relay that ignores topic lifetimes (stale readings published), one
//! that applies a lifetime to the wrong topics (fresh messages lost), one that removes without the
//! gap row (unexplained gaps), and one that publishes without the expiry property.

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::envelope::Published;
use edge_outbox::{Message, Outbox, Relay};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{Client, Event, MqttOptions};
use support::device::{relay_config, relay_config_for};
use support::{Broker, BrokerKind, Subscriber, WAIT, wait_until};

#[test]
fn a_topic_lifetime_removes_stale_messages_and_announces_them() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "exp/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        for i in 0..5u64 {
            tx.publish("exp/telemetry/t1", "t1", &i)?;
        }
        tx.publish("exp/orders", "o1", &1u64)?;
        // Its own lifetime wins over the topic's.
        tx.send(&Message::new("exp/telemetry/t2", "t2", &2u64)?.expires_after(Duration::from_secs(3600)))?;
        Ok::<_, edge_outbox::Error>(())
    })?;
    std::thread::sleep(Duration::from_millis(300));
    let config =
        relay_config_for(&broker, "exp-device").expire_after("exp/telemetry/#", Duration::from_millis(200));
    let relay = Relay::start(&outbox, config)?;
    assert!(
        wait_until(|| outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)),
        "the relay did not settle"
    );
    assert!(sub.wait_messages(WAIT, |m| m.len() >= 3), "too few arrived");
    let mut consumer = Consumer::new().from_start(true);
    let mut keys = Vec::new();
    for m in sub.messages() {
        if let (Published::Message(env), _) = consumer.observe_bytes(&m.payload)? {
            keys.push(env.key.to_string());
        }
    }
    assert_eq!(keys, vec!["o1", "t2"], "only the fresh messages are published");
    let report = consumer.report();
    assert_eq!(report.totals.unexplained, 0);
    let expired: u64 = report
        .streams
        .iter()
        .filter_map(|s| s.announced_by_cause.get("expired"))
        .sum();
    assert_eq!(expired, 5);
    assert!(relay.status()?.expired >= 5, "the status counts them");
    Ok(())
}

/// The message expiry interval a v5 subscriber sees, for each message it gets.
fn expiry_intervals(
    addr: std::net::SocketAddr,
    n: usize,
    publish: impl FnOnce(),
) -> TestResult<Vec<Option<u32>>> {
    let mut options = MqttOptions::new("exp-v5-checker", addr.ip().to_string(), addr.port());
    options.set_keep_alive(Duration::from_secs(5));
    let (client, mut connection) = Client::new(options, 16);
    client.subscribe("exp5/#", QoS::AtLeastOnce)?;
    let mut publish = Some(publish);
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    while got.len() < n && std::time::Instant::now() < deadline {
        match connection.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                if let Some(p) = publish.take() {
                    p();
                }
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                got.push(p.properties.and_then(|props| props.message_expiry_interval));
            }
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => return Err(format!("checker: {e}").into()),
        }
    }
    Ok(got)
}

#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn mqtt5_publishes_carry_the_remaining_lifetime() -> TestResult {
    // mosquitto forwards the property to a v5 subscriber, less the time it held the message.
    let broker = Broker::builder().kind(BrokerKind::Mosquitto).start()?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let mut relay = None;
    let got = expiry_intervals(broker.addr(), 3, || {
        let mut run = || -> TestResult {
            outbox.transaction(|tx| {
                tx.send(&Message::new("exp5/a", "a", &1u64)?.expires_after(Duration::from_secs(600)))?;
                tx.publish("exp5/b", "b", &2u64)?;
                tx.publish("exp5/ttl/c", "c", &3u64)?;
                Ok::<_, edge_outbox::Error>(())
            })?;
            // The interval is what is left of the lifetime when it is published, not all of it.
            std::thread::sleep(Duration::from_secs(3));
            let config = relay_config(broker.addr(), "exp5-device")
                .expire_after("exp5/ttl/#", Duration::from_secs(60));
            relay = Some(Relay::start(&outbox, config)?);
            Ok(())
        };
        run().expect("commit and start the relay");
    })?;
    assert_eq!(got.len(), 3, "{got:?}");
    let a = got[0].ok_or("no expiry interval on a message with a lifetime")?;
    assert!((500..=597).contains(&a), "{a}");
    assert_eq!(
        got[1], None,
        "a message without a lifetime has no expiry interval"
    );
    let c = got[2].ok_or("no expiry interval from the topic's lifetime")?;
    assert!((1..=57).contains(&c), "{c}");
    drop(relay);
    Ok(())
}

/// A row read ahead that waits in its lane (here for the pace) is checked again when its turn
/// comes: a reading worthless after a second is removed and announced, never published late. A
/// relay that checks expiry only when it reads rows publishes all forty. The bound on the count
/// cannot see a single late publish (the one the pace held back after packing it):
/// `tests/expiry_held_back.rs` makes that one certain and checks it.
#[test]
fn a_message_that_expires_while_it_waits_its_turn_is_not_published() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "expq/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        for i in 0..40u64 {
            tx.send(&Message::new("expq/t", "t", &i)?.expires_after(Duration::from_secs(1)))?;
        }
        Ok::<_, edge_outbox::Error>(())
    })?;
    let _relay = Relay::start(&outbox, relay_config_for(&broker, "expq").pace_messages(5))?;
    assert!(
        wait_until(|| outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)),
        "the relay did not settle"
    );
    let mut consumer = Consumer::new().from_start(true);
    let mut delivered = 0;
    for m in sub.messages() {
        if let (Published::Message(_), _) = consumer.observe_bytes(&m.payload)? {
            delivered += 1;
        }
    }
    // At 5 a second, about six go out within their second (a slower machine sends fewer).
    assert!(
        delivered <= 8,
        "{delivered} of 40 one-second readings published at 5 a second"
    );
    let report = consumer.report();
    let expired: u64 = report
        .streams
        .iter()
        .filter_map(|s| s.announced_by_cause.get("expired"))
        .sum();
    assert_eq!(
        delivered + expired,
        40,
        "every reading delivered or announced expired"
    );
    assert_eq!(report.totals.unexplained, 0);
    Ok(())
}

/// `MqttConfig::message_expiry(false)` (for rumqttd 0.20 with 3.1.1 subscribers) sends no expiry
/// interval, and the message still goes out.
#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn message_expiry_off_sends_no_interval() -> TestResult {
    let broker = Broker::builder().kind(BrokerKind::Mosquitto).start()?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let mut relay = None;
    let got = expiry_intervals(broker.addr(), 1, || {
        outbox
            .transaction(|tx| {
                tx.send(&Message::new("exp5/off", "o", &1u64)?.expires_after(Duration::from_secs(600)))
            })
            .expect("commit");
        let mqtt = relay_config(broker.addr(), "exp5-off")
            .mqtt()
            .clone()
            .message_expiry(false);
        relay = Some(Relay::start(&outbox, edge_outbox::RelayConfig::new(mqtt)).expect("relay"));
    })?;
    assert_eq!(got, vec![None]);
    drop(relay);
    Ok(())
}
