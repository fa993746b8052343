//! Azure IoT Hub with a device's symmetric key: the relay makes the username the hub expects and
//! a new SAS token for every connection, and replaces each connection before its token expires.
//! The hub cannot be reached from here; an MQTT proxy in front of the test broker stands in for
//! it (tests/support/azure_sas.rs): it refuses a CONNECT whose username, resource, signature or
//! expiry is wrong, and closes a connection when its token expires, as the hub does.
//!
//! - Tokens of a few seconds, messages written all along: several renewals, none late, nothing
//!   lost, order per key kept; `status` names the credential and its expiry.
//! - A wrong key or device id is refused at every attempt and everything stays pending.
//! - The CLI's `--sas-key-file` does the same.
//! - Mutant `sas-not-renewed` (one token for good, no renewal) is caught.

mod support;

use std::time::{Duration, SystemTime};

use edge_outbox::{MqttConfig, Outbox, Protocol, Relay, RelayConfig, SasKey};
use support::azure_sas::Hub;
use support::device::{commit_orders, open_device};
use support::{Broker, MqttProxy, Subscriber, WAIT, check, wait_until};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const HUB: &str = "stand-in-hub.azure-devices.net";
const DEVICE: &str = "pump-17";
const RENEWALS: &str = "a_relay_with_a_sas_key_renews_before_expiry_and_loses_nothing";
const LIFETIME: Duration = Duration::from_secs(3);

fn hub_front(broker: &Broker, hub: &Hub) -> std::io::Result<MqttProxy> {
    let front = MqttProxy::start(broker.addr())?;
    let hub = hub.clone();
    front.authenticate(move |connect| hub.check(connect));
    Ok(front)
}

fn start_relay(outbox: &Outbox, front: &MqttProxy, device: &str, key: SasKey) -> edge_outbox::Result<Relay> {
    let mqtt = MqttConfig::new("127.0.0.1", front.addr().port())
        .client_id(device)
        .protocol(Protocol::V311)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2))
        .azure_sas(key.lifetime(LIFETIME).hub(HUB));
    Relay::start(
        outbox,
        RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250)),
    )
}

#[test]
fn a_relay_with_a_sas_key_renews_before_expiry_and_loses_nothing() -> TestResult {
    let broker = Broker::start()?;
    let hub = Hub::new(HUB, DEVICE);
    let front = hub_front(&broker, &hub)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let relay = start_relay(&outbox, &front, DEVICE, SasKey::from_base64(&hub.key_base64())?)?;
    // Written over three token lifetimes, so renewals fall between messages and in the middle
    // of the drain.
    let mut committed = Vec::new();
    let started = std::time::Instant::now();
    while started.elapsed() < LIFETIME * 3 {
        committed.extend(commit_orders(&outbox, &["a", "b", "c"], 6, 0));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        front.expired_closes(),
        0,
        "the relay renewed its token before it expired (refused since: {:?})",
        front.auth_refused()
    );
    assert_eq!(
        front.auth_refused(),
        Vec::<String>::new(),
        "every token the hub saw was good"
    );
    assert!(
        front.auth_accepted() >= 3,
        "a token of {LIFETIME:?} over {:?} was renewed at least twice: {} connections",
        LIFETIME * 3,
        front.auth_accepted()
    );
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    let status = relay.status()?;
    assert!(
        status.last_error.is_none() && status.previous_error.is_none(),
        "a renewal is planned, not an error: {status:?}"
    );
    let expires = status
        .credential_expires_at
        .ok_or("status names the token's expiry")?;
    assert!(
        expires > SystemTime::now() && expires <= SystemTime::now() + LIFETIME,
        "the current token's expiry: {status:?}"
    );
    relay.shutdown()?;
    Ok(())
}

#[test]
fn a_wrong_key_or_device_is_refused_and_everything_stays_pending() -> TestResult {
    let broker = Broker::start()?;
    let hub = Hub::new(HUB, DEVICE);
    let front = hub_front(&broker, &hub)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let other_key = Hub::new(HUB, DEVICE).key_base64();
    let own_key = hub.key_base64();
    for (device, key, why) in [
        (DEVICE, other_key.as_str(), "signature does not match"),
        ("pump-18", own_key.as_str(), "unknown device id"),
    ] {
        let dir = tempfile::tempdir()?;
        let outbox = open_device(dir.path());
        commit_orders(&outbox, &["a"], 5, 0);
        let relay = start_relay(&outbox, &front, device, SasKey::from_base64(key)?)?;
        assert!(
            wait_until(|| front.auth_refused().iter().filter(|r| r.contains(why)).count() >= 2),
            "refused at every attempt for {why}: {:?}",
            front.auth_refused()
        );
        let status = relay.status()?;
        assert!(!status.connected && status.last_error.is_some(), "{status:?}");
        relay.shutdown()?;
        assert_eq!(outbox.stats()?.pending_messages, 5, "every message still pending");
    }
    assert_eq!(front.auth_accepted(), 0);
    assert!(sub.is_empty(), "nothing reached the broker");

    // A command session would need a second connection for the same device id, which the hub
    // does not allow: refused with the reason, before anything connects.
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let mqtt = MqttConfig::new("127.0.0.1", front.addr().port())
        .client_id(DEVICE)
        .protocol(Protocol::V311)
        .azure_sas(SasKey::from_base64(&hub.key_base64())?);
    let refused = Relay::start(
        &outbox,
        RelayConfig::new(mqtt).commands("devices/pump-17/messages/devicebound/#"),
    );
    let err = refused.err().ok_or("a SAS key with commands was accepted")?;
    assert!(err.to_string().contains("one connection per device id"), "{err}");
    Ok(())
}

/// `edge-outbox relay --sas-key-file`: the same, from the CLI, with `status` showing the
/// credential and its expiry.
#[cfg(feature = "cli")]
#[test]
fn the_cli_relay_renews_its_sas_token() -> TestResult {
    use std::process::{Command, Stdio};
    let broker = Broker::start()?;
    // Without a hub name of its own, the token is for the broker's host.
    let hub = Hub::new("127.0.0.1", DEVICE);
    let front = hub_front(&broker, &hub)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let db = device.path().join("device.db");
    let key_file = device.path().join("sas-key");
    std::fs::write(&key_file, format!("{}\n", hub.key_base64()))?;
    let bin = env!("CARGO_BIN_EXE_edge-outbox");
    let _relay = support::ChildGuard::new(
        Command::new(bin)
            .args(["relay", "--db"])
            .arg(&db)
            .args(["--client-id", DEVICE, "--mqtt-version", "3.1.1", "--broker"])
            .arg(format!("mqtt://{}", front.addr()))
            .arg("--sas-key-file")
            .arg(&key_file)
            // Renewed after the CLI's 10 s connect timeout, as a token must be.
            .args(["--sas-lifetime", "13"])
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    // Written until the relay has renewed its token once.
    let mut committed = Vec::new();
    let started = std::time::Instant::now();
    while front.auth_accepted() < 2 && started.elapsed() < WAIT {
        committed.extend(commit_orders(&outbox, &["a", "b"], 4, 0));
        std::thread::sleep(Duration::from_millis(100));
    }
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert_eq!(front.expired_closes(), 0, "refused: {:?}", front.auth_refused());
    assert!(front.auth_accepted() >= 2, "renewed: {}", front.auth_accepted());
    let mut shown = serde_json::Value::Null;
    let reported = wait_until(|| {
        let Ok(out) = Command::new(bin)
            .args(["--json", "status", "--db"])
            .arg(&db)
            .output()
        else {
            return false;
        };
        shown = serde_json::from_slice(&out.stdout).unwrap_or_default();
        shown.to_string().contains("credential_expires_ms")
    });
    assert!(reported, "status shows the token's expiry: {shown}");
    assert!(
        shown.to_string().contains("\"sas-token\""),
        "status names the credential: {shown}"
    );
    assert!(
        !shown.to_string().contains(&hub.key_base64()),
        "the key is never shown"
    );

    // What the relay would refuse at start, `config check` (and so a reload) refuses too.
    let empty = device.path().join("empty.toml");
    std::fs::write(&empty, "")?;
    let out = Command::new(bin)
        .args(["config", "check"])
        .arg(&empty)
        .arg("--db")
        .arg(&db)
        .args([
            "--client-id",
            DEVICE,
            "--broker",
            "mqtt://127.0.0.1:1883",
            "--sas-key-file",
        ])
        .arg(&key_file)
        .args(["--commands", "devices/pump-17/messages/devicebound/#"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("one connection per device id"), "{stderr}");
    Ok(())
}

/// A relay that keeps its first token and never renews (mutant `sas-not-renewed`) is closed by
/// the hub at expiry and refused after it.
#[test]
fn a_relay_that_never_renews_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "sas-not-renewed",
        RENEWALS,
        "the relay renewed its token before it expired",
    )
}
