//! Single-session mode: publishing and commands share one persistent session on the device's own
//! client id, as Azure IoT Hub (one connection per device identity) and AWS IoT policies that pin
//! the client id require. The cloud cannot be reached from here; an MQTT front in front of the
//! test broker stands in for its rule: it refuses every CONNECT whose client id is not the
//! device's, and the broker behind it (mosquitto or rumqttd) lets a new connection with an id
//! take over the old one.
//!
//! - Orders written while commands arrive, with the connection cut twice: every order delivered
//!   in order per key, every command applied exactly once, and no id but the device's seen.
//! - A command sent while the relay is down is kept by the broker for the shared session and
//!   applied when it comes back (mutant `single-session-clean` loses it).
//! - The two-session layout fails the front: its command session is refused.
//! - SAS keys and commands are accepted together only in single-session mode.

mod support;

use std::time::Duration;

use edge_outbox::{MqttConfig, Outbox, Protocol, Relay, RelayConfig, SasKey};
use rumqttc::QoS;
use support::credits::{balance, command, device};
use support::device::commit_orders;
use support::{Broker, BrokerKind, MqttProxy, Subscriber, WAIT, check, publish_raw, wait_until};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const DEVICE: &str = "pump-17";
const FILTER: &str = "devices/pump-17/commands/#";
const TOPIC: &str = "devices/pump-17/commands/credit";
const OFFLINE: &str = "a_command_sent_while_the_relay_is_down_is_applied_when_it_returns";

/// The cloud's rule: one identity per device, so one client id only.
fn one_id_front(broker: &Broker) -> std::io::Result<MqttProxy> {
    let front = MqttProxy::start(broker.addr())?;
    front.authenticate(|connect| {
        if connect.client_id == DEVICE {
            Ok(None)
        } else {
            Err(format!("client id {:?} is not the device's", connect.client_id))
        }
    });
    Ok(front)
}

/// The relay's settings for the device, through `front` (rumqttd's 3.1.1 subscribers take no
/// MQTT 5 message expiry).
fn config(broker: &Broker, front: &MqttProxy) -> RelayConfig {
    config_with(broker, front, Protocol::V5)
}

fn config_with(broker: &Broker, front: &MqttProxy, protocol: Protocol) -> RelayConfig {
    let mqtt = MqttConfig::new("127.0.0.1", front.addr().port())
        .protocol(protocol)
        .client_id(DEVICE)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2))
        .message_expiry(broker.kind() != BrokerKind::Rumqttd);
    RelayConfig::new(mqtt)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
        .commands(FILTER)
}

/// A relay whose handler adds credits (not idempotent on its own), with a receipt in the same
/// transaction.
fn start(outbox: &Outbox, config: RelayConfig) -> edge_outbox::Result<Relay> {
    Relay::start_with_handler(outbox, config, |tx, cmd| {
        let credits: i64 = cmd.payload_as()?;
        tx.execute(
            "UPDATE balance SET credits = credits + ?1 WHERE account = ?2",
            (credits, &cmd.key),
        )?;
        tx.publish("devices/pump-17/receipts", &cmd.key, &cmd.id.to_string())?;
        Ok::<_, edge_outbox::Error>(())
    })
}

#[test]
fn one_session_publishes_and_receives_and_loses_nothing_across_cuts() -> TestResult {
    let broker = Broker::start()?;
    let front = one_id_front(&broker)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let receipts = Subscriber::start(broker.addr(), "devices/pump-17/receipts")?;
    let dir = tempfile::tempdir()?;
    let outbox = device(dir.path());
    let relay = start(&outbox, config(&broker, &front).single_session(true))?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.connected && s.commands_connected)),
        "the shared session connected and subscribed: {:?}",
        relay.status()
    );
    let mut committed = Vec::new();
    let mut sent = 0i64;
    for round in 0..6 {
        committed.extend(commit_orders(&outbox, &["a", "b", "c"], 60, 7));
        publish_raw(broker.addr(), TOPIC, &command(round + 1), QoS::AtLeastOnce)?;
        sent += round + 1;
        if round % 3 == 1 {
            // Both directions lose the connection at once.
            front.cut();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert!(
        wait_until(|| balance(&outbox) == sent),
        "every command applied once: balance {} of {sent}",
        balance(&outbox)
    );
    assert!(receipts.wait_for(6, WAIT), "a receipt per command");
    assert!(
        front.connections() >= 3,
        "the cuts forced reconnects: {}",
        front.connections()
    );
    assert_eq!(
        front.auth_refused(),
        Vec::<String>::new(),
        "no client id but the device's reached the front"
    );
    relay.shutdown()?;
    assert_eq!(balance(&outbox), sent, "applied exactly once");
    Ok(())
}

#[test]
fn a_command_sent_while_the_relay_is_down_is_applied_when_it_returns() -> TestResult {
    let broker = Broker::start()?;
    // A persistent session is `clean_session = false` under 3.1.1 and a session that never
    // expires under MQTT 5: both.
    for protocol in [Protocol::V311, Protocol::V5] {
        kept_while_down(&broker, protocol)?;
    }
    Ok(())
}

fn kept_while_down(broker: &Broker, protocol: Protocol) -> TestResult {
    let front = one_id_front(broker)?;
    let dir = tempfile::tempdir()?;
    let outbox = device(dir.path());
    let config = || config_with(broker, &front, protocol).single_session(true);
    // The first run leaves a persistent session with its subscription on the broker.
    let relay = start(&outbox, config())?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)),
        "subscribed"
    );
    relay.shutdown()?;
    publish_raw(broker.addr(), TOPIC, &command(25), QoS::AtLeastOnce)?;
    let relay = start(&outbox, config())?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)),
        "subscribed again"
    );
    // A command sent now comes after the kept one, which the broker sent before its SUBACK: once
    // this one is applied, the kept one has been too, or it was lost.
    publish_raw(broker.addr(), TOPIC, &command(100), QoS::AtLeastOnce)?;
    assert!(wait_until(|| balance(&outbox) >= 100), "the live command applied");
    assert_eq!(
        balance(&outbox),
        125,
        "the broker kept the command for the shared session while the relay was down ({protocol})"
    );
    relay.shutdown()?;
    Ok(())
}

/// A shared session that starts clean (mutant `single-session-clean`) loses what was sent while
/// the relay was down.
#[test]
fn a_shared_session_that_starts_clean_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "single-session-clean",
        OFFLINE,
        "the broker kept the command for the shared session",
    )
}

#[test]
fn the_two_session_layout_fails_the_one_id_rule() -> TestResult {
    let broker = Broker::start()?;
    let front = one_id_front(&broker)?;
    let dir = tempfile::tempdir()?;
    let outbox = device(dir.path());
    let relay = start(&outbox, config(&broker, &front))?;
    assert!(
        wait_until(|| front
            .auth_refused()
            .iter()
            .any(|r| r.contains("pump-17-commands"))),
        "the front refused the command session's id: {:?}",
        front.auth_refused()
    );
    let status = relay.status()?;
    assert!(!status.commands_connected, "no command session: {status:?}");
    relay.shutdown()?;
    Ok(())
}

#[test]
fn sas_keys_take_commands_only_in_single_session_mode() -> TestResult {
    let key = SasKey::from_base64("c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seS0wMTIzNDU2Nzg5")?;
    let mqtt = MqttConfig::new("hub.azure-devices.net", 8883)
        .client_id(DEVICE)
        .azure_sas(key);
    let two = RelayConfig::new(mqtt.clone()).commands(FILTER);
    let refused = two.check().expect_err("two sessions for one Azure device id");
    assert!(refused.to_string().contains("single-session"), "{refused}");
    RelayConfig::new(mqtt)
        .commands(FILTER)
        .single_session(true)
        .check()?;
    Ok(())
}
