//! AWS IoT Core serves MQTT with mutual TLS on port 443 only to clients that offer the ALPN
//! protocol `x-amzn-mqtt-ca`: the way through networks that open nothing but 443. Against a local
//! front that enforces that rule (tests/support/alpn_front.rs), a relay that offers it
//! (`TlsConfig::alpn`, `--alpn`) delivers everything; one that does not is refused at the
//! handshake and keeps every message pending; and the front refuses a client offering another
//! protocol.

mod support;

use edge_outbox::{MqttConfig, Outbox, Relay, RelayConfig, TlsConfig};
use support::alpn_front::AlpnFront;
use support::device::{commit_orders, open_device};
use support::{Broker, Pki, Subscriber, WAIT, check, wait_until};

const AWS_ALPN: &str = "x-amzn-mqtt-ca";

fn start_relay(outbox: &Outbox, front: &AlpnFront, tls: TlsConfig, id: &str) -> edge_outbox::Result<Relay> {
    let mqtt = MqttConfig::new("127.0.0.1", front.addr().port())
        .client_id(id)
        .tls(tls);
    Relay::start(outbox, RelayConfig::new(mqtt))
}

fn mutual_tls(pki: &Pki) -> Result<TlsConfig, Box<dyn std::error::Error>> {
    Ok(TlsConfig::with_ca_file(&pki.ca_cert)?.client_auth_files(&pki.client_cert, &pki.client_key)?)
}

#[test]
fn a_relay_offering_the_alpn_protocol_delivers_through_the_front() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"), "aws-stand-in")?;
    let broker = Broker::start()?;
    let front = AlpnFront::start(&pki, AWS_ALPN.as_bytes(), broker.addr())?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let relay = start_relay(&outbox, &front, mutual_tls(&pki)?.alpn(AWS_ALPN), "alpn-device")?;
    let committed = commit_orders(&outbox, &["a", "b"], 20, 0);
    assert!(
        wait_until(|| front.served() + front.refused() >= 1),
        "the relay reached the front"
    );
    assert_eq!(front.refused(), 0, "the front refused the relay's handshake");
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert!(
        front.served() >= 1 && front.refused() == 0,
        "served {} refused {}",
        front.served(),
        front.refused()
    );
    relay.shutdown()?;
    Ok(())
}

#[test]
fn a_relay_without_the_alpn_protocol_is_refused_and_keeps_its_messages()
-> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"), "aws-stand-in")?;
    let broker = Broker::start()?;
    let front = AlpnFront::start(&pki, AWS_ALPN.as_bytes(), broker.addr())?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    commit_orders(&outbox, &["a"], 10, 0);
    let relay = start_relay(&outbox, &front, mutual_tls(&pki)?, "no-alpn-device")?;
    assert!(
        wait_until(|| front.refused() >= 2),
        "the front refuses it, attempt after attempt"
    );
    let status = relay.status()?;
    assert!(!status.connected, "{status:?}");
    assert!(status.last_error.is_some(), "the relay says why: {status:?}");
    assert_eq!(front.served(), 0);
    assert!(sub.is_empty(), "nothing reached the broker");
    assert_eq!(
        outbox.stats()?.pending_messages,
        10,
        "every message still pending"
    );
    relay.shutdown()?;
    // Another protocol is refused as well: rustls on the front finds no protocol in common.
    let device = tempfile::tempdir()?;
    let other = open_device(device.path());
    commit_orders(&other, &["b"], 3, 0);
    let refused_before = front.refused();
    let relay = start_relay(
        &other,
        &front,
        mutual_tls(&pki)?.alpn("mqtt"),
        "wrong-alpn-device",
    )?;
    assert!(
        wait_until(|| front.refused() > refused_before),
        "another protocol is refused"
    );
    assert_eq!(front.served(), 0);
    assert_eq!(other.stats()?.pending_messages, 3);
    relay.shutdown()?;
    Ok(())
}

#[test]
fn an_alpn_name_of_the_wrong_length_is_refused_with_the_rule() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"), "aws-stand-in")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    for bad in [String::new(), "x".repeat(256)] {
        let mqtt = MqttConfig::new("127.0.0.1", 443).tls(mutual_tls(&pki)?.alpn(bad.as_bytes()));
        match Relay::start(&outbox, RelayConfig::new(mqtt)) {
            Err(edge_outbox::Error::InvalidConfig(why)) => assert!(why.contains("1 to 255 bytes"), "{why}"),
            other => {
                return Err(format!("expected InvalidConfig, got {:?}", other.map(|_| "a relay")).into());
            }
        }
    }
    Ok(())
}

/// The broken build the delivery test catches: a handshake that offers no ALPN.
#[cfg(feature = "mutants")]
#[test]
fn the_alpn_dropped_mutant_is_caught() -> Result<(), Box<dyn std::error::Error>> {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "alpn-dropped",
        "a_relay_offering_the_alpn_protocol_delivers_through_the_front",
        "the front refused the relay's handshake",
    )?;
    Ok(())
}

/// `--alpn` is a TLS option: with a plain `mqtt://` broker it is a usage error, and nothing is
/// created.
#[cfg(feature = "cli")]
#[test]
fn alpn_with_a_plain_broker_url_is_a_usage_error() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["relay", "--client-id", "pump-17", "--db"])
        .arg(dir.path().join("device.db"))
        .args(["--broker", "mqtt://127.0.0.1:1883", "--alpn", AWS_ALPN])
        .stdin(std::process::Stdio::null())
        .output()?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("mqtts://"), "{stderr}");
    assert!(!dir.path().join("device.db").exists());
    Ok(())
}

/// The standalone relay's `--alpn`, through the front: what it publishes arrives.
#[cfg(feature = "cli")]
#[test]
fn the_cli_relay_offers_the_alpn_protocol_given_with_alpn() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"), "aws-stand-in")?;
    let broker = Broker::start()?;
    let front = AlpnFront::start(&pki, AWS_ALPN.as_bytes(), broker.addr())?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let committed = commit_orders(&outbox, &["a"], 5, 0);
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["relay", "--client-id", "cli-alpn", "--db"])
        .arg(outbox.path())
        .args(["--broker", &format!("mqtts://127.0.0.1:{}", front.addr().port())])
        .args(["--alpn", AWS_ALPN, "--ca"])
        .arg(&pki.ca_cert)
        .arg("--cert")
        .arg(&pki.client_cert)
        .arg("--key")
        .arg(&pki.client_key)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let _relay = support::ChildGuard::new(child);
    check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(front.refused(), 0);
    Ok(())
}
