//! Key rotation from the command line, for devices whose application is not written in Rust:
//! `edge-outbox trusted-keys set --trusted-key KEY_ID=FILE` replaces the keys the file trusts
//! (logged), and every handle verifies with the new ones at once; `trusted-keys clear` stops
//! requiring signatures, and `status` says so.
#![cfg(all(feature = "signed-commands", feature = "cli"))]

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::{TestResult, query_i64, temp_db, to_hex};
use edge_outbox::{CommandSigner, Envelope, MessageId, Options, Outbox, Received, TrustedKeys};

const BIN: &str = env!("CARGO_BIN_EXE_edge-outbox");
const TOPIC: &str = "devices/pump-17/commands/rate";

fn cli(db: &Path, args: &[&str]) -> std::io::Result<Output> {
    Command::new(BIN)
        .arg("--db")
        .arg(db)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
}

fn receive(outbox: &Outbox, signer: &CommandSigner) -> TestResult<Received> {
    let env = Envelope::command(MessageId::new_v7(), "pump-17", &1)?;
    Ok(outbox.receive(TOPIC, &signer.sign(TOPIC, &env, Duration::from_secs(600))?)?)
}

#[test]
fn keys_are_rotated_and_cleared_through_the_cli() -> TestResult {
    let (dir, path) = temp_db()?;
    let (old, new) = (
        CommandSigner::from_secret_key("cloud-2026", [11u8; 32]),
        CommandSigner::from_secret_key("cloud-2027", [12u8; 32]),
    );
    let device = Outbox::open_with(
        &path,
        Options::new().trusted_command_keys(TrustedKeys::new().key(old.key_id(), old.public_key())),
    )?;
    let key_file = dir.path().join("cloud-2027.pub");
    std::fs::write(&key_file, to_hex(&new.public_key()))?;

    let set = cli(
        &path,
        &[
            "trusted-keys",
            "set",
            "--trusted-key",
            &format!("cloud-2027={}", key_file.display()),
        ],
    )?;
    assert!(set.status.success(), "{set:?}");
    assert!(
        String::from_utf8_lossy(&set.stdout).contains("[cloud-2027]"),
        "{set:?}"
    );
    assert!(
        String::from_utf8_lossy(&set.stderr).contains("policy changed"),
        "logged: {set:?}"
    );
    // The device's own handle, opened with the old key, verifies with the file's new one.
    assert!(
        matches!(receive(&device, &old)?, Received::DeadLettered { reason, .. } if reason.contains("not a trusted key"))
    );
    assert!(matches!(receive(&device, &new)?, Received::Stored(_)));
    assert_eq!(
        query_i64(&device, "SELECT count(*) FROM edge_outbox_command_policy_log")?,
        2
    );

    let clear = cli(&path, &["trusted-keys", "clear"])?;
    assert!(clear.status.success(), "{clear:?}");
    let status = cli(&path, &["status", "--json"])?;
    let json: serde_json::Value = serde_json::from_slice(&status.stdout)?;
    assert_eq!(json["signed_commands"]["required"], false, "{json}");
    assert_eq!(
        query_i64(&device, "SELECT count(*) FROM edge_outbox_command_policy_log")?,
        3
    );
    Ok(())
}
