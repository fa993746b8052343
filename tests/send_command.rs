//! Sending a command from the cloud side, as docs/wire-format.md ("Sending a command") says:
//! with `edge-outbox send-command` (and `encode-command`), and with the Python script of that
//! page (cbor2). The device applies each command once, resends with the same id included.
#![cfg(feature = "cli")]

mod common;
mod support;

use std::process::{Command, Stdio};

use common::{TestResult, query_i64, temp_db};
use edge_outbox::{Command as DeviceCommand, Envelope, Error, MessageId, Outbox, Relay, Tx};
use rumqttc::QoS;
use serde::Deserialize;
use support::device::relay_config;
use support::{Broker, publish_raw, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_edge-outbox");
const FILTER: &str = "devices/pump-17/commands/#";
const TOPIC: &str = "devices/pump-17/commands/rate";

#[derive(Deserialize)]
struct SetRate {
    set_rate: f64,
}

fn device(path: &std::path::Path, broker: &Broker, name: &str) -> TestResult<(Outbox, Relay)> {
    let outbox = Outbox::open(path)?;
    outbox.with_connection(|c| {
        c.execute_batch("CREATE TABLE IF NOT EXISTS rates (command_id BLOB, type TEXT, rate REAL)")
    })?;
    let relay = Relay::start_with_handler(
        &outbox,
        relay_config(broker.addr(), name).commands(FILTER),
        |tx: &mut Tx<'_>, cmd: &DeviceCommand| {
            let rate: SetRate = cmd.payload_as()?;
            tx.execute(
                "INSERT INTO rates VALUES (?1, ?2, ?3)",
                (cmd.id.as_bytes().as_slice(), &cmd.event_type, rate.set_rate),
            )?;
            Ok::<_, Error>(())
        },
    )?;
    if !wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)) {
        return Err("command session never subscribed".into());
    }
    Ok((outbox, relay))
}

fn cli(args: &[&str]) -> TestResult<std::process::Output> {
    Ok(Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()?)
}

#[test]
fn send_command_delivers_once_even_when_sent_twice_with_the_same_request_id() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let (outbox, relay) = device(&path, &broker, "send-cli")?;
    let url = format!("mqtt://{}", broker.addr());
    let args = [
        "send-command",
        "--broker",
        &url,
        "--topic",
        TOPIC,
        "--key",
        "pump-17",
        "--type",
        "SetRate.v1",
        "--id-from",
        "request-1",
        "--payload",
        r#"{"set_rate": 12.5}"#,
    ];
    let expected = MessageId::from_key("request-1");
    for attempt in 1..=2 {
        let out = cli(&args)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "attempt {attempt}: {out:?}");
        assert!(stdout.contains(&expected.to_string()), "{stdout}");
    }
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.commands_duplicate >= 1)),
        "the resend arrived"
    );
    assert!(wait_until(
        || query_i64(&outbox, "SELECT count(*) FROM rates").is_ok_and(|n| n == 1)
    ));
    let (rate, event_type): (f64, String) = outbox.with_connection(|c| {
        c.query_row("SELECT rate, type FROM rates", [], |r| Ok((r.get(0)?, r.get(1)?)))
    })?;
    assert_eq!((rate, event_type.as_str()), (12.5, "SetRate.v1"));

    // encode-command writes the same envelope's bytes.
    let out = cli(&[
        "encode-command",
        "--key",
        "pump-17",
        "--id-from",
        "request-1",
        "--payload",
        r#"{"set_rate": 12.5}"#,
    ])?;
    assert!(out.status.success(), "{out:?}");
    let env = Envelope::decode(&out.stdout)?;
    assert_eq!((env.id, env.key.as_ref()), (expected, "pump-17"));
    assert_eq!(
        env.payload_as::<std::collections::BTreeMap<String, f64>>()?["set_rate"],
        12.5
    );
    let hex = cli(&[
        "encode-command",
        "--hex",
        "--key",
        "k",
        "--id-from",
        "request-1",
        "--payload",
        "[1, 2]",
    ])?;
    assert!(hex.status.success() && String::from_utf8_lossy(&hex.stdout).trim().starts_with('a'));

    // Bad input is a usage error that says what is wrong.
    for (bad, says) in [
        (
            vec!["encode-command", "--key", "k", "--payload", "{nope"],
            "--payload is not valid JSON",
        ),
        (
            vec!["encode-command", "--key", "k", "--payload", "1", "--id", "x"],
            "--id",
        ),
        (
            vec![
                "send-command",
                "--broker",
                &url,
                "--topic",
                "a/#",
                "--key",
                "k",
                "--payload",
                "1",
            ],
            "not a valid MQTT topic",
        ),
    ] {
        let out = cli(&bad)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.contains(says), "{bad:?}: {stderr}");
    }
    relay.shutdown()?;
    Ok(())
}

/// The Python sender of docs/wire-format.md, extracted from the page.
fn python_sender() -> TestResult<String> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/wire-format.md"))?;
    let after = page
        .split_once("<!-- python-sender: run by tests/send_command.rs -->")
        .ok_or("no python-sender marker in docs/wire-format.md")?
        .1;
    let code = after
        .split_once("```python\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .ok_or("no python block after the marker")?
        .0;
    Ok(code.to_owned())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn the_python_sender_of_the_docs_is_applied_by_the_device() -> TestResult {
    let python = support::python::python();
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let (outbox, relay) = device(&path, &broker, "send-python")?;
    let out = Command::new(&python)
        .args(["-c", &python_sender()?])
        .stdin(Stdio::null())
        .output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Published as `mosquitto_pub -q 1 -s` would, the bytes unchanged.
    publish_raw(broker.addr(), TOPIC, &out.stdout, QoS::AtLeastOnce)?;
    assert!(wait_until(
        || query_i64(&outbox, "SELECT count(*) FROM rates").is_ok_and(|n| n == 1)
    ));
    let (id, rate): (Vec<u8>, f64) = outbox.with_connection(|c| {
        c.query_row("SELECT command_id, rate FROM rates", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
    })?;
    // uuid5(ID_NAMESPACE, "request-4711"), as the page says MessageId::from_key computes.
    assert_eq!(MessageId::from_slice(&id)?, MessageId::from_key("request-4711"));
    assert_eq!(rate, 12.5);
    assert_eq!(outbox.stats()?.dead_letters, 0);

    // The usual first try, JSON text: dead-lettered, and the operator's listing says why.
    publish_raw(broker.addr(), TOPIC, br#"{"set_rate": 12.5}"#, QoS::AtLeastOnce)?;
    assert!(wait_until(|| outbox.stats().is_ok_and(|s| s.dead_letters == 1)));
    let db = path.display().to_string();
    let out = cli(&["--db", &db, "dead-letters", "list"])?;
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        listing.contains("this is JSON text; commands are CBOR envelopes")
            && listing.contains("docs/wire-format.md"),
        "{listing}"
    );
    relay.shutdown()?;
    Ok(())
}
