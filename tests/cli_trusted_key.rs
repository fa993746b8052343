//! The standalone relay with `--trusted-key KEY_ID=FILE` stores only commands signed by that key,
//! and records the requirement in the file, so a later start without the flag is held to it.
//! A key file that is not a key is a usage error (exit 2) before anything is opened.
#![cfg(all(feature = "signed-commands", feature = "cli"))]

mod common;
mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{TestResult, temp_db, to_hex};
use edge_outbox::{CommandSigner, Envelope, MessageId, Outbox};
use rumqttc::QoS;
use support::{Broker, ChildGuard, publish_raw_many, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_edge-outbox");
const TOPIC: &str = "devices/pump-17/commands/rate";

#[test]
fn the_relay_with_a_trusted_key_stores_only_signed_commands() -> TestResult {
    let broker = Broker::start()?;
    let (dir, path) = temp_db()?;
    let signer = CommandSigner::from_secret_key("cloud-2026", [11u8; 32]);
    let key_file = dir.path().join("cloud-2026.pub");
    std::fs::write(&key_file, format!("{}\n", to_hex(&signer.public_key())))?;

    let junk = dir.path().join("junk.pub");
    std::fs::write(&junk, "not a key")?;
    let bad = Command::new(BIN)
        .args([
            "relay",
            "--broker",
            &format!("mqtt://127.0.0.1:{}", broker.port()),
        ])
        .args(["--client-id", "d", "--trusted-key"])
        .arg(format!("cloud-2026={}", junk.display()))
        .arg("--db")
        .arg(&path)
        .env_remove("RUST_LOG")
        .output()?;
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("64 hex digits"),
        "{bad:?}"
    );
    assert!(!path.exists(), "nothing was created for a bad key file");

    let relay = ChildGuard::new(
        Command::new(BIN)
            .args([
                "relay",
                "--broker",
                &format!("mqtt://127.0.0.1:{}", broker.port()),
            ])
            .args([
                "--client-id",
                "d",
                "--commands",
                "devices/pump-17/commands/#",
                "--trusted-key",
            ])
            .arg(format!("cloud-2026={}", key_file.display()))
            .arg("--db")
            .arg(&path)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let subscribed = || edge_outbox::RelayReport::read(&path).is_some_and(|r| r.commands_connected);
    assert!(wait_until(subscribed), "the command session never subscribed");
    let outbox = Outbox::open(&path)?;

    let genuine = Envelope::command(MessageId::new_v7(), "pump-17", &40)?;
    let signed = signer.sign(TOPIC, &genuine, Duration::from_secs(600))?;
    let unsigned = Envelope::command(MessageId::new_v7(), "pump-17", &1_000_000)?.encode();
    publish_raw_many(
        broker.addr(),
        &[(TOPIC, &unsigned), (TOPIC, &signed)],
        QoS::AtLeastOnce,
    )?;
    let counts = |o: &Outbox| -> (i64, i64) {
        o.with_connection(|c| {
            c.query_row(
                "SELECT (SELECT count(*) FROM inbox), (SELECT count(*) FROM dead_letters)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })
        .unwrap_or((-1, -1))
    };
    assert!(wait_until(|| counts(&outbox) == (1, 1)), "{:?}", counts(&outbox));
    let signed_by: String =
        outbox.with_connection(|c| c.query_row("SELECT signed_by FROM inbox", [], |r| r.get(0)))?;
    assert_eq!(signed_by, "cloud-2026");
    let trusted = outbox.trusted_command_keys()?.ok_or("the file records no keys")?;
    assert_eq!(trusted.key_ids().collect::<Vec<_>>(), ["cloud-2026"]);
    // And the operator sees it.
    let status = Command::new(BIN)
        .arg("--db")
        .arg(&path)
        .args(["status", "--json"])
        .env_remove("RUST_LOG")
        .output()?;
    let json: serde_json::Value = serde_json::from_slice(&status.stdout)?;
    assert_eq!(json["signed_commands"]["required"], true, "{json}");
    assert_eq!(
        json["signed_commands"]["keys"],
        serde_json::json!(["cloud-2026"]),
        "{json}"
    );
    drop(relay);
    Ok(())
}
