//! TLS to the broker with certificates made at run time: mutual TLS connects and delivers; a relay
//! trusting another CA, or presenting no client certificate, is refused and publishes nothing;
//! a TLS relay never falls back to plain TCP.

mod support;

use std::time::Duration;

use edge_outbox::{MqttConfig, Outbox, Relay, RelayConfig, TlsConfig};
use support::device::{commit_orders, open_device};
use support::{Broker, Pki, Subscriber, WAIT, check};

fn tls_relay(outbox: &Outbox, port: u16, tls: TlsConfig, id: &str) -> Relay {
    let mqtt = MqttConfig::new("127.0.0.1", port)
        .client_id(id)
        .tls(tls)
        .connect_timeout(Duration::from_secs(2));
    let config =
        RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
    Relay::start(outbox, config).expect("relay starts (connecting happens in the background)")
}

/// Waits until the relay has failed to connect at least once, then checks it never connected.
fn assert_refused(relay: &Relay, what: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    let status = loop {
        let status = relay.status().expect("status");
        if status.last_error.is_some() || std::time::Instant::now() > deadline {
            break status;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        status.last_error.is_some(),
        "{what}: no connection error reported: {status:?}"
    );
    assert!(
        !status.connected && status.connections == 0,
        "{what}: connected anyway: {status:?}"
    );
    eprintln!("{what}: refused with {:?}", status.last_error);
}

#[test]
fn mutual_tls_delivers_and_strangers_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::generate(&dir.path().join("pki"), "device").expect("pki");
    let other = Pki::generate(&dir.path().join("other"), "stranger").expect("other pki");
    let broker = Broker::builder().tls(pki.listener(true)).start().expect("broker");
    let tls_port = broker.tls_addr_v5().expect("tls listener").port();
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");

    // Mutual TLS with the right CA and a client certificate it signed.
    let good_dir = tempfile::tempdir().expect("tempdir");
    let good = open_device(good_dir.path());
    let tls = TlsConfig::with_ca_file(&pki.ca_cert)
        .expect("ca")
        .client_auth_files(&pki.client_cert, &pki.client_key)
        .expect("client cert");
    let relay = tls_relay(&good, tls_port, tls, "tls-good");
    let committed = commit_orders(&good, &["a", "b"], 20, 0);
    check::wait_and_check(&sub, &committed, WAIT).expect("delivered over mutual TLS");
    relay.shutdown().expect("shutdown");

    // A relay that trusts a different CA refuses the broker's certificate.
    let wrong_ca_dir = tempfile::tempdir().expect("tempdir");
    let wrong_ca = open_device(wrong_ca_dir.path());
    commit_orders(&wrong_ca, &["x"], 3, 0);
    let tls = TlsConfig::with_ca_file(&other.ca_cert)
        .expect("ca")
        .client_auth_files(&other.client_cert, &other.client_key)
        .expect("client cert");
    let relay = tls_relay(&wrong_ca, tls_port, tls, "tls-wrong-ca");
    assert_refused(&relay, "untrusted server certificate");
    relay.shutdown().expect("shutdown");

    // The broker refuses a client without a certificate.
    let no_cert_dir = tempfile::tempdir().expect("tempdir");
    let no_cert = open_device(no_cert_dir.path());
    commit_orders(&no_cert, &["y"], 3, 0);
    let relay = tls_relay(
        &no_cert,
        tls_port,
        TlsConfig::with_ca_file(&pki.ca_cert).expect("ca"),
        "tls-no-cert",
    );
    assert_refused(&relay, "no client certificate");
    relay.shutdown().expect("shutdown");

    // TLS configured, pointed at the plain listener: the handshake fails; no plain-TCP fallback.
    let plain_dir = tempfile::tempdir().expect("tempdir");
    let plain = open_device(plain_dir.path());
    commit_orders(&plain, &["z"], 3, 0);
    let tls = TlsConfig::with_ca_file(&pki.ca_cert)
        .expect("ca")
        .client_auth_files(&pki.client_cert, &pki.client_key)
        .expect("client cert");
    let relay = tls_relay(&plain, broker.port(), tls, "tls-to-plain");
    assert_refused(&relay, "TLS client on a plain listener");
    relay.shutdown().expect("shutdown");

    // None of the refused relays' messages reached the subscriber.
    let keys: Vec<String> = check::decode_all(&sub.messages())
        .iter()
        .map(|e| e.key.to_string())
        .collect();
    assert!(
        keys.iter().all(|k| k == "a" || k == "b"),
        "unexpected keys {keys:?}"
    );
    for outbox in [&wrong_ca, &no_cert, &plain] {
        assert_eq!(
            outbox.stats().expect("stats").pending_messages,
            3,
            "refused relays keep their rows"
        );
    }
}
