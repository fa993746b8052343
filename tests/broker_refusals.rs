//! A broker that refuses: an ACL that denies the device's topic, packet and message size limits, a
//! quota, a subscription it will not grant, a broker that does not speak MQTT 5. Under MQTT 5 (the
//! default) every refusal ends in the dead letters with its reason code, counted, and the rows
//! behind it are delivered; nothing is lost silently and nothing wedges.
//!
//! mosquitto 2 with a password file, an ACL file and size limits for the real refusals (whatever
//! `EDGE_OUTBOX_BROKER` says: rumqttd has neither ACLs nor reason codes; ignored where mosquitto is
//! not installed); the MQTT-aware proxy for the reason
//! codes mosquitto has no setting for (quota exceeded), which runs against both brokers.

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use edge_outbox::{MqttConfig, Outbox, Protocol, Relay, RelayConfig};
use support::device::{open_device, relay_config, wait_drained};
use support::{Broker, BrokerKind, MqttProxy, Subscriber, WAIT, check};

const DEVICE: (&str, &str) = ("pump-17", "device-pw");
const CHECKER: (&str, &str) = ("checker", "checker-pw");

/// mosquitto (whatever `EDGE_OUTBOX_BROKER` says: rumqttd has no ACLs and never refuses) with
/// users and an ACL: the device may write `orders/#` and read its command topic, not
/// `forbidden/#` nor `commands/denied/#`; the checker may read everything. `extra`: more global
/// options (size limits). The tests that use it are ignored where mosquitto is not installed.
fn secured_mosquitto(dir: &Path, extra: &[&str]) -> Broker {
    let acl = dir.join("acl");
    std::fs::write(
        &acl,
        "user pump-17\ntopic readwrite orders/#\ntopic read commands/pump-17/#\n\n\
         user checker\ntopic readwrite #\n",
    )
    .expect("write the ACL file");
    let mut builder = Broker::builder()
        .kind(BrokerKind::Mosquitto)
        .user(DEVICE.0, DEVICE.1)
        .user(CHECKER.0, CHECKER.1)
        .mosquitto_option(format!("acl_file {}", acl.display()));
    for line in extra {
        builder = builder.mosquitto_option(*line);
    }
    builder.start().expect("mosquitto")
}

fn device_config(broker: &Broker, id: &str) -> RelayConfig {
    let mqtt = relay_config(broker.addr(), id)
        .mqtt()
        .clone()
        .credentials(DEVICE.0, DEVICE.1);
    RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
}

fn checker(broker: &Broker) -> Subscriber {
    Subscriber::builder(broker.addr())
        .filter("#")
        .credentials(CHECKER.0, CHECKER.1)
        .start()
        .expect("checker subscriber")
}

/// Commits one message per topic, in order, each in its own transaction.
fn commit(outbox: &Outbox, rows: &[(&str, Vec<u8>)]) -> Vec<(edge_outbox::MessageId, String)> {
    rows.iter()
        .map(|(topic, payload)| {
            let id = outbox
                .transaction(|tx| tx.publish(topic, "k", payload))
                .expect("commit")
                .ids[0];
            (id, "k".to_owned())
        })
        .collect()
}

fn wait(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn mqtt5_acl_denial_is_dead_lettered_with_its_reason_and_later_rows_flow() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = secured_mosquitto(dir.path(), &[]);
    let sub = checker(&broker);
    let outbox = open_device(&dir.path().join("device"));
    let before = commit(&outbox, &[("orders/1", vec![1])]);
    let denied = commit(&outbox, &[("forbidden/x", vec![2])]);
    let after = commit(&outbox, &[("orders/2", vec![3]), ("orders/3", vec![4])]);
    let relay = Relay::start(&outbox, device_config(&broker, "acl-v5")).expect("relay");

    let mut allowed = before.clone();
    allowed.extend(after.iter().cloned());
    check::wait_for_ids(&sub, allowed.iter().map(|(id, _)| *id), WAIT);
    let got = check::decode_all(&sub.messages());
    assert!(
        got.iter().all(|e| e.id != denied[0].0),
        "the denied message reached a subscriber"
    );
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(wait_drained(&outbox, WAIT));
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 1, "{dead:#?}");
    assert_eq!(dead[0].message_id, Some(denied[0].0));
    assert_eq!(dead[0].topic, "forbidden/x");
    assert!(dead[0].reason.contains("0x87"), "{}", dead[0].reason);
    assert!(dead[0].reason.contains("not authorized"), "{}", dead[0].reason);
    let status = relay.status().expect("status");
    assert_eq!((status.refused, status.dead_lettered), (1, 1), "{status:?}");
    assert_eq!(
        status.acknowledged, 3,
        "a refusal is not an acknowledgement: {status:?}"
    );
    assert_eq!(
        status.connections, 1,
        "a refusal does not cost a reconnect: {status:?}"
    );
    relay.shutdown().expect("shutdown");
}

/// The reproduction: mosquitto with `max_packet_size 2000`, one 5 KB row followed by 100
/// small ones. Before: nothing delivered, hundreds of connections. Now the broker's maximum packet
/// size comes with its CONNACK and the big row is dead-lettered before it is ever published.
#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn mqtt5_a_row_above_the_brokers_maximum_packet_size_is_dead_lettered_before_publishing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = secured_mosquitto(dir.path(), &["max_packet_size 2000"]);
    let sub = checker(&broker);
    let outbox = open_device(&dir.path().join("device"));
    let big = commit(&outbox, &[("orders/big", vec![7u8; 5000])]);
    let small: Vec<(&str, Vec<u8>)> = (0..100u8).map(|i| ("orders/small", vec![i])).collect();
    let small = commit(&outbox, &small);
    let relay = Relay::start(&outbox, device_config(&broker, "packet-v5")).expect("relay");

    check::wait_and_check(&sub, &small, WAIT).expect("the 100 small rows are delivered");
    assert!(wait_drained(&outbox, WAIT));
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 1, "{dead:#?}");
    assert_eq!(dead[0].message_id, Some(big[0].0));
    assert!(
        dead[0].reason.contains("the broker's maximum packet size"),
        "{}",
        dead[0].reason
    );
    let status = relay.status().expect("status");
    assert_eq!(status.broker_max_packet_size, Some(2000), "{status:?}");
    assert_eq!(status.connections, 1, "never disconnected over it: {status:?}");
    relay.shutdown().expect("shutdown");
}

/// `message_size_limit` refuses by payload size (mosquitto answers MQTT 5 with PUBACK 0x95,
/// which rumqttc cannot parse: the connection fails on it). The row is set aside at once as
/// poison, with the reason code, and the rest flows.
#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn mqtt5_a_row_above_the_brokers_message_size_limit_is_dead_lettered_with_its_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = secured_mosquitto(dir.path(), &["message_size_limit 1000"]);
    let sub = checker(&broker);
    let outbox = open_device(&dir.path().join("device"));
    let before = commit(&outbox, &[("orders/1", vec![1])]);
    let big = commit(&outbox, &[("orders/big", vec![7u8; 3000])]);
    let after: Vec<(&str, Vec<u8>)> = (0..20u8).map(|i| ("orders/after", vec![i])).collect();
    let after = commit(&outbox, &after);
    let relay = Relay::start(&outbox, device_config(&broker, "size-v5")).expect("relay");

    let mut allowed = before.clone();
    allowed.extend(after.iter().cloned());
    check::wait_and_check(&sub, &allowed, WAIT).expect("the rows around the big one are delivered");
    assert!(wait_drained(&outbox, WAIT));
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 1, "{dead:#?}");
    assert_eq!(dead[0].message_id, Some(big[0].0));
    assert!(dead[0].reason.contains("0x95"), "{}", dead[0].reason);
    relay.shutdown().expect("shutdown");
}

/// Under MQTT 3.1.1 a broker cannot refuse a QoS 1 publish: mosquitto acknowledges the one its
/// ACL denies and drops it, and the relay, seeing a PUBACK, deletes the row. This pins the
/// behaviour docs/reliability.md describes (and why MQTT 5 is the default): if it ever changes,
/// the documentation must too.
#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn mqtt311_acl_denial_is_acknowledged_and_lost_as_documented() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = secured_mosquitto(dir.path(), &[]);
    let sub = checker(&broker);
    let outbox = open_device(&dir.path().join("device"));
    let denied = commit(&outbox, &[("forbidden/x", vec![2])]);
    let after = commit(&outbox, &[("orders/2", vec![3])]);
    let config = device_config(&broker, "acl-v311");
    let config = RelayConfig::new(config.mqtt().clone().protocol(Protocol::V311));
    let relay = Relay::start(&outbox, config).expect("relay");
    check::wait_and_check(&sub, &after, WAIT).expect("the allowed row is delivered");
    assert!(wait_drained(&outbox, WAIT));
    assert!(
        check::decode_all(&sub.messages())
            .iter()
            .all(|e| e.id != denied[0].0),
        "the denied message reached a subscriber"
    );
    assert!(
        outbox.dead_letters(10).expect("dead letters").is_empty(),
        "3.1.1 gives the relay nothing to dead-letter: the denied row was acknowledged"
    );
    let status = relay.status().expect("status");
    assert_eq!((status.acknowledged, status.refused), (2, 0), "{status:?}");
    relay.shutdown().expect("shutdown");
}

/// A refused subscription is an error the operator sees, not a silent absence of commands.
/// (mosquitto 2.0 grants subscriptions its ACL denies and applies the ACL at delivery, so the
/// refusal comes from the proxy here, which lets it run against both brokers.)
#[test]
fn a_refused_command_subscription_is_an_error_the_operator_sees() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    proxy.answer_subacks_with(Some(0x87));
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let config = relay_config(proxy.addr(), "subscriber").commands("commands/pump-17/#");
    let relay = Relay::start(&outbox, config).expect("relay");
    wait("the subscription to be refused", || {
        relay
            .status()
            .expect("status")
            .last_error
            .is_some_and(|e| e.contains("refused the command subscription"))
    });
    let status = relay.status().expect("status");
    assert!(!status.commands_connected, "{status:?}");
    let error = status.last_error.unwrap_or_default();
    assert!(
        error.contains("0x87") && error.contains("not authorized") && error.contains("commands/pump-17/#"),
        "{error}"
    );
    relay.shutdown().expect("shutdown");
}

/// "Quota exceeded" is not a refusal: nothing more is published for a backoff wait, then the
/// connection is renewed and the row published again. Nothing is dead-lettered.
#[test]
fn quota_exceeded_backs_off_and_publishes_again() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let committed = commit(&outbox, &[("orders/1", vec![1]), ("orders/2", vec![2])]);
    proxy.answer_pubacks_with(1, 0x97);
    let relay = Relay::start(&outbox, relay_config(proxy.addr(), "quota")).expect("relay");
    check::wait_and_check(&sub, &committed, WAIT).expect("delivered");
    assert!(wait_drained(&outbox, WAIT));
    assert!(outbox.dead_letters(10).expect("dead letters").is_empty());
    let status = relay.status().expect("status");
    assert!(
        status.connections >= 2,
        "published again on a new connection: {status:?}"
    );
    assert_eq!((status.refused, status.dead_lettered), (0, 0), "{status:?}");
    // The quota was an error while it lasted; once published again it cleared into the history.
    let seen = [&status.last_error, &status.previous_error]
        .into_iter()
        .flatten()
        .any(|e| e.contains("0x97"));
    assert!(seen, "the quota is visible in status: {status:?}");
    relay.shutdown().expect("shutdown");
}

/// A PUBACK for a message written before the broker said "quota exceeded" says nothing about the
/// quota now: it neither clears the error nor resets the pause's backoff (which would keep a
/// broker that stays over quota at the shortest wait, whenever more than one message is in
/// flight). Only a message published after the refusal and accepted clears it.
#[test]
fn an_earlier_messages_puback_does_not_clear_a_quota_pause() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let committed = commit(&outbox, &[("orders/1", vec![1]), ("orders/2", vec![2])]);
    proxy.answer_pubacks_with(1, 0x97);
    // Both answers reach the relay, refusal first, once both messages are on the wire: the
    // second was written before the refusal came, whatever the client's timing.
    proxy.hold_pubacks(2);
    // A pause of at least 1.5 s: long enough to look at the status inside it.
    let config = relay_config(proxy.addr(), "quota-held")
        .reconnect_backoff(Duration::from_secs(3), Duration::from_secs(6));
    let relay = Relay::start(&outbox, config).expect("relay");
    assert!(proxy.wait_publishes(2, WAIT), "both messages published");
    assert!(proxy.wait_held(2, WAIT), "both answers held");
    assert_eq!(proxy.release_held(), 2, "both answers released");
    wait("the second message's PUBACK", || {
        relay.status().is_ok_and(|s| s.acknowledged >= 1)
    });
    let status = relay.status().expect("status");
    assert!(
        status.last_error.as_deref().is_some_and(|e| e.contains("0x97")),
        "the quota error still stands during its pause: {status:?}"
    );
    check::wait_and_check(&sub, &committed, WAIT).expect("delivered");
    assert!(wait_drained(&outbox, WAIT));
    let status = relay.status().expect("status");
    assert!(
        status.last_error.is_none(),
        "cleared once published again: {status:?}"
    );
    relay.shutdown().expect("shutdown");
}

/// The scenario above fails against the mutant that lets any accepted PUBACK end a quota pause.
#[test]
#[cfg(feature = "mutants")]
fn the_quota_pause_scenario_catches_its_mutant() -> Result<(), Box<dyn std::error::Error>> {
    support::mutant::caught_by(
        "quota-cleared-by-earlier",
        "an_earlier_messages_puback_does_not_clear_a_quota_pause",
        "the quota error still stands during its pause",
    )
}

/// A CONNACK with a Receive Maximum of 0, which MQTT 5 forbids: taken as it stands, rumqttc would
/// write nothing on that connection (no publish, no subscription, no ack) while the connection
/// looks healthy. The relay ends the connection with an error naming the property, retries with
/// backoff, and publishes once the broker answers within the protocol.
#[test]
fn a_connack_with_a_receive_maximum_of_0_is_an_error_and_retried() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let committed = commit(&outbox, &[("orders/1", vec![1])]);
    proxy.answer_connacks_with_receive_maximum(Some(0));
    let relay = Relay::start(&outbox, relay_config(proxy.addr(), "receive-max-0")).expect("relay");
    // The test's backoff is short: a few connections take well under this.
    assert!(
        proxy.wait_connacks(3, Duration::from_secs(10)),
        "connects again after a Receive Maximum of 0: {} CONNACKs",
        proxy.connacks()
    );
    // With backoff: the waits double from 20 ms up to 250 ms, about a dozen attempts in two
    // seconds; a retry without one makes hundreds.
    let before = proxy.connacks();
    std::thread::sleep(Duration::from_secs(2));
    let attempts = proxy.connacks() - before;
    assert!(
        attempts <= 40,
        "{attempts} connections in 2 s: retried without backoff"
    );
    let status = relay.status().expect("status");
    let error = status.last_error.clone().unwrap_or_default();
    assert!(error.contains("Receive Maximum of 0"), "{status:?}");
    assert_eq!(
        outbox.stats().expect("stats").pending_messages,
        1,
        "nothing was published"
    );
    proxy.answer_connacks_with_receive_maximum(None);
    check::wait_and_check(&sub, &committed, WAIT).expect("delivered");
    assert!(wait_drained(&outbox, WAIT));
    relay.shutdown().expect("shutdown");
}

/// The scenario above fails against the mutant that takes a Receive Maximum of 0 as it stands.
#[test]
#[cfg(feature = "mutants")]
fn the_receive_maximum_scenario_catches_its_mutant() -> Result<(), Box<dyn std::error::Error>> {
    support::mutant::caught_by(
        "receive-max-zero-taken",
        "a_connack_with_a_receive_maximum_of_0_is_an_error_and_retried",
        "connects again after a Receive Maximum of 0",
    )
}

/// Any refusal code the broker sends (here through the proxy, so it runs against rumqttd too):
/// dead-lettered with the code and the next row goes out.
#[test]
fn every_refusal_code_is_dead_lettered_and_counted() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    for code in [0x80u8, 0x83, 0x87, 0x90, 0x99] {
        let dir = tempfile::tempdir().expect("tempdir");
        let outbox = open_device(dir.path());
        let refused = commit(&outbox, &[("orders/refused", vec![code])]);
        let next = commit(&outbox, &[("orders/next", vec![code])]);
        proxy.answer_pubacks_with(1, code);
        let config = relay_config(proxy.addr(), &format!("refusal-{code:x}"));
        let relay = Relay::start(&outbox, config).expect("relay");
        assert!(
            check::wait_for_ids(&sub, [next[0].0], WAIT),
            "0x{code:02x}: next row"
        );
        assert!(wait_drained(&outbox, WAIT), "0x{code:02x}");
        let dead = outbox.dead_letters(10).expect("dead letters");
        assert_eq!(dead.len(), 1, "0x{code:02x}: {dead:#?}");
        assert_eq!(dead[0].message_id, Some(refused[0].0));
        assert!(
            dead[0].reason.contains(&format!("0x{code:02X}")),
            "{}",
            dead[0].reason
        );
        assert_eq!(relay.status().expect("status").refused, 1);
        relay.shutdown().expect("shutdown");
        sub.take();
    }
}

/// A broker that closes the connection on an MQTT 5 CONNECT without answering (RabbitMQ 3.10's
/// MQTT plugin does) gets an error that names the option to use 3.1.1, and the relay never
/// downgrades on its own.
#[test]
fn a_broker_that_drops_an_mqtt5_connect_gets_an_error_naming_the_311_option() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connects = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = connects.clone();
    let levels = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let levels2 = levels.clone();
    listener.set_nonblocking(false).expect("blocking");
    // It keeps answering every attempt the same way until the test ends: a listener closed after
    // the third would turn the next attempt's error into "connection refused" before the status
    // below is read.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = done.clone();
    let server = std::thread::spawn(move || {
        for stream in listener.incoming() {
            if finished.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            let Ok(mut s) = stream else { continue };
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).unwrap_or(0);
            // The protocol level: after the fixed header (2 bytes here) and "MQTT" (6 bytes).
            if n > 8 {
                levels2.lock().expect("levels").push(buf[8]);
            }
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = s.flush();
            drop(s);
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let mqtt = MqttConfig::new("127.0.0.1", addr.port())
        .client_id("not-v5")
        .connect_timeout(Duration::from_secs(2));
    let config =
        RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(10), Duration::from_millis(50));
    let relay = Relay::start(&outbox, config).expect("relay");
    wait("three connection attempts", || {
        connects.load(std::sync::atomic::Ordering::SeqCst) >= 3
    });
    let status = relay.status().expect("status");
    let error = status.last_error.clone().unwrap_or_default();
    assert!(
        error.contains("3.1.1") && error.contains("--mqtt-version"),
        "{error}"
    );
    relay.shutdown().expect("shutdown");
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    // Wakes the server's accept so that it sees `done`.
    let _ = std::net::TcpStream::connect(addr);
    server.join().expect("fake broker");
    let levels = levels.lock().expect("levels");
    assert!(
        levels.len() >= 3 && levels.iter().all(|&level| level == 5),
        "every attempt was MQTT 5, no silent downgrade: {levels:?}"
    );
}
