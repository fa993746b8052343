//! Credentials that rotate: CA, client certificate, key and password files are read again at
//! every connection, so an operator (or a provisioning agent) replaces a file and the next
//! connection uses it, without a restart and without losing anything.
//!
//! - TLS: a relay whose files hold another CA's certificates is refused; once the right CA,
//!   certificate and key are put in their place, the same relay connects and delivers everything.
//! - Password: the broker's password changes; the file is rewritten and the connection cut; the
//!   relay reconnects with the new one and delivers everything, with no refusal.
//! - Mutant `credential-files-read-once` (each file read once, at start) is caught.

mod support;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use edge_outbox::{MqttConfig, Outbox, Relay, RelayConfig, TlsConfig};
use support::device::{commit_orders, open_device};
use support::{Broker, MqttProxy, Pki, Subscriber, WAIT, check, wait_until};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const TLS_ROTATION: &str = "rotated_certificate_files_are_used_at_the_next_connection";

fn start_relay(outbox: &Outbox, mqtt: MqttConfig) -> edge_outbox::Result<Relay> {
    Relay::start(
        outbox,
        RelayConfig::new(mqtt.connect_timeout(Duration::from_secs(2)))
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250)),
    )
}

/// Replaces `to` with a copy of `from` in one rename, as a provisioning agent does.
fn replace(from: &Path, to: &Path) -> std::io::Result<()> {
    let staged = to.with_extension("new");
    std::fs::copy(from, &staged)?;
    std::fs::rename(staged, to)
}

#[test]
fn rotated_certificate_files_are_used_at_the_next_connection() -> TestResult {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"), "device")?;
    let stranger = Pki::generate(&dir.path().join("stranger"), "stranger")?;
    let broker = Broker::builder().tls(pki.listener(true)).start()?;
    let tls_port = broker.tls_addr_v5().ok_or("no TLS listener")?.port();
    let sub = Subscriber::start(broker.addr(), "orders/#")?;

    // The files the relay reads, holding at first another CA's certificates.
    let live = dir.path().join("live");
    std::fs::create_dir_all(&live)?;
    let (ca, cert, key) = (
        live.join("ca.pem"),
        live.join("device.crt"),
        live.join("device.key"),
    );
    replace(&stranger.ca_cert, &ca)?;
    replace(&stranger.client_cert, &cert)?;
    replace(&stranger.client_key, &key)?;

    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let tls = TlsConfig::with_ca_file(&ca)?.client_auth_files(&cert, &key)?;
    let relay = start_relay(
        &outbox,
        MqttConfig::new("127.0.0.1", tls_port)
            .client_id("rotating-device")
            .tls(tls),
    )?;
    let mut committed = commit_orders(&outbox, &["a", "b"], 20, 0);
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.last_error.is_some())),
        "the stranger's certificates are refused"
    );
    assert_eq!(relay.status()?.connections, 0);

    // The rotation: the right CA, certificate and key, in place; the relay is not touched.
    replace(&pki.ca_cert, &ca)?;
    replace(&pki.client_cert, &cert)?;
    replace(&pki.client_key, &key)?;
    committed.extend(commit_orders(&outbox, &["a", "b"], 20, 0));
    let delivered = check::wait_for_ids(&sub, committed.iter().map(|(id, _)| *id), WAIT);
    assert!(
        delivered,
        "the rotated files were used at the next connection ({:?})",
        relay.status()?.last_error
    );
    let delivery = check::check(&committed, &check::decode_all(&sub.messages()))?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    // `status` says when the certificate in use expires: the test PKI makes them valid for two
    // days from their making.
    let expires = relay
        .status()?
        .credential_expires_at
        .ok_or("the client certificate's expiry in status")?;
    let now = std::time::SystemTime::now();
    let day = Duration::from_secs(86_400);
    assert!(
        expires > now + day && expires <= now + 2 * day,
        "the certificate's notAfter, about two days ahead: {expires:?}"
    );
    relay.shutdown()?;
    Ok(())
}

#[test]
fn a_rotated_password_file_is_used_at_the_next_connection() -> TestResult {
    let broker = Broker::start()?;
    let front = MqttProxy::start(broker.addr())?;
    let expected = Arc::new(Mutex::new(b"first-s3cret".to_vec()));
    let wanted = expected.clone();
    front.authenticate(move |connect| {
        let want = wanted.lock().map_err(|e| e.to_string())?.clone();
        match connect.password.as_deref() {
            Some(given) if given == want.as_slice() => Ok(None),
            _ => Err("wrong password".into()),
        }
    });
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let dir = tempfile::tempdir()?;
    let password = dir.path().join("mqtt-password");
    std::fs::write(&password, "first-s3cret\n")?;
    let outbox = open_device(dir.path());
    let mqtt = MqttConfig::new("127.0.0.1", front.addr().port())
        .client_id("password-device")
        .credentials_file("pump-17", &password)?;
    assert!(!format!("{mqtt:?}").contains("s3cret"), "{mqtt:?}");
    let relay = start_relay(&outbox, mqtt)?;
    let mut committed = commit_orders(&outbox, &["a"], 10, 0);
    assert!(check::wait_for_ids(
        &sub,
        committed.iter().map(|(id, _)| *id),
        WAIT
    ));

    // The broker's password changes, the file with it, and the connection drops.
    std::fs::write(&password, "second-s3cret\n")?;
    *expected.lock().map_err(|e| e.to_string())? = b"second-s3cret".to_vec();
    let before = front.auth_accepted();
    front.cut();
    committed.extend(commit_orders(&outbox, &["a"], 10, 0));
    assert!(
        wait_until(|| front.auth_accepted() > before || !front.auth_refused().is_empty()),
        "the relay came back"
    );
    assert_eq!(
        front.auth_refused(),
        Vec::<String>::new(),
        "the relay reconnected with the rotated password"
    );
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    relay.shutdown()?;
    Ok(())
}

/// A relay that reads its credential files once, at start (mutant `credential-files-read-once`),
/// keeps presenting what it read.
#[test]
fn a_relay_that_reads_its_files_once_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "credential-files-read-once",
        TLS_ROTATION,
        "the rotated files were used at the next connection",
    )?;
    support::mutant::caught_by(
        "credential-files-read-once",
        "a_rotated_password_file_is_used_at_the_next_connection",
        "the relay reconnected with the rotated password",
    )
}
