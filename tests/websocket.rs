//! MQTT over WebSockets (feature `websocket`), for networks open to HTTP(S) only: the relay, its
//! commands, `send_command` and `subscribe` reach a broker's WebSocket listener (subprotocol
//! `mqtt`) with `ws://host:port/path`. The listener is mosquitto's where its build has one and
//! rumqttd's otherwise ([`Broker::with_websockets`]); rumqttd's speaks MQTT 3.1.1 only, so these
//! run 3.1.1. A client speaking plain MQTT to it gets nothing through, which is what makes the
//! listener a stand-in for a WebSocket-only endpoint.
#![cfg(feature = "websocket")]

mod support;

use std::time::Duration;

use edge_outbox::{MqttConfig, Protocol, Relay, RelayConfig};
use support::device::{commit_orders, open_device};
use support::{Broker, BrokerKind, Subscriber, WAIT, check, wait_until};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn ws_config(broker: &Broker, id: &str, protocol: Protocol) -> TestResult<MqttConfig> {
    let ws = broker.ws_addr().ok_or("no WebSocket listener")?;
    Ok(MqttConfig::from_url(&format!("ws://{ws}/mqtt"))?
        .client_id(id)
        .protocol(protocol)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2)))
}

#[test]
fn the_relay_delivers_over_websockets_and_takes_commands() -> TestResult {
    let broker = Broker::with_websockets()?;
    // rumqttd's WebSocket listener speaks 3.1.1 only; mosquitto's both.
    let mut protocols = vec![Protocol::V311];
    if broker.kind() == BrokerKind::Mosquitto {
        protocols.push(Protocol::V5);
    }
    for protocol in protocols {
        deliver_and_command(&broker, protocol)?;
    }
    Ok(())
}

fn deliver_and_command(broker: &Broker, protocol: Protocol) -> TestResult {
    let device = format!("ws-device-{}", protocol.as_str().replace('.', ""));
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let mut committed = commit_orders(&outbox, &["a", "b", "c"], 50, 7);
    let config = RelayConfig::new(ws_config(broker, &device, protocol)?)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
        .commands(format!("devices/{device}/commands/#"))
        .single_session(true);
    let relay = Relay::start(&outbox, config)?;
    committed.extend(commit_orders(&outbox, &["a", "b", "c"], 50, 7));
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)),
        "subscribed over the WebSocket"
    );
    // A command through the broker, sent with send_command over the WebSocket as well.
    let payload = edge_outbox::envelope::to_cbor(&7i64)?;
    let command = edge_outbox::Envelope {
        id: edge_outbox::MessageId::new_v7(),
        source: "cloud".into(),
        epoch: 0,
        seq: 1,
        key: "valve".into(),
        created_ms: 0,
        event_type: None,
        headers: vec![],
        payload: payload.into(),
    };
    edge_outbox::send_command(
        &ws_config(broker, "ws-cloud", protocol)?,
        &format!("devices/{device}/commands/set"),
        &command,
        WAIT,
    )?;
    assert!(
        wait_until(|| outbox.stats().is_ok_and(|s| s.inbox_unapplied == 1)),
        "the command arrived over the WebSocket: {:?}",
        outbox.stats()
    );
    relay.shutdown()?;
    Ok(())
}

#[test]
fn a_relay_speaking_plain_mqtt_to_the_websocket_listener_delivers_nothing() -> TestResult {
    let broker = Broker::with_websockets()?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    commit_orders(&outbox, &["a"], 5, 0);
    let ws = broker.ws_addr().ok_or("no WebSocket listener")?;
    let plain = MqttConfig::new("127.0.0.1", ws.port())
        .client_id("plain-device")
        .protocol(Protocol::V311)
        .connect_timeout(Duration::from_secs(1));
    let relay = Relay::start(
        &outbox,
        RelayConfig::new(plain).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100)),
    )?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.last_error.is_some())),
        "the listener takes no plain MQTT"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(sub.is_empty(), "nothing went through");
    relay.shutdown()?;
    assert_eq!(outbox.stats()?.pending_messages, 5, "every message still pending");
    Ok(())
}

#[test]
fn websocket_urls_parse_with_their_path_and_default_ports() -> TestResult {
    let c = MqttConfig::from_url("ws://broker.example")?;
    assert_eq!(
        (c.port(), c.websocket_path(), c.uses_tls()),
        (80, Some("/mqtt"), false)
    );
    let c = MqttConfig::from_url("wss://user:pa%2Fss@hub.example/$iothub/websocket")?;
    assert_eq!(
        (c.port(), c.websocket_path(), c.uses_tls()),
        (443, Some("/$iothub/websocket"), true)
    );
    assert_eq!(c.username(), Some("user"));
    let bad = MqttConfig::new("broker.example", 80).websocket("no-slash");
    let e = RelayConfig::new(bad)
        .check()
        .expect_err("a path without its slash");
    assert!(e.to_string().contains("WebSocket path"), "{e}");
    Ok(())
}
