//! Every refusal of `tests/signed_commands.rs` holds through every handle: a tampered, wrongly
//! signed, unknown-key, unsigned, misdirected, expired or garbled command refused by the keyed
//! device is refused again, for the same reason, when retried through `edge-outbox dead-letters
//! retry` or through a second handle opened without keys, and when that handle receives it.
#![cfg(all(feature = "signed-commands", feature = "cli"))]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::{
    ApplyOutcome, CommandSigner, Envelope, Error, MessageId, Options, Outbox, Received, TrustedKeys,
};

const TOPIC: &str = "devices/pump-17/commands/rate";
const BIN: &str = env!("CARGO_BIN_EXE_edge-outbox");

fn cloud() -> CommandSigner {
    CommandSigner::from_secret_key("cloud-2026", [11u8; 32])
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Each bad command, and what its refusal says.
fn refusals() -> TestResult<Vec<(&'static str, Vec<u8>)>> {
    let env = Envelope::command(MessageId::new_v7(), "pump-17", &1_000_000)?;
    let valid = Duration::from_secs(600);
    let mut tampered = cloud().sign(TOPIC, &env, valid)?;
    let inner = env.encode();
    let at = tampered
        .windows(inner.len())
        .position(|w| w == inner.as_slice())
        .ok_or("the envelope inside the COSE_Sign1")?;
    tampered[at + inner.len() - 1] ^= 0x01;
    let t = now();
    Ok(vec![
        ("does not verify", tampered),
        (
            "does not verify with key \"cloud-2026\"",
            CommandSigner::from_secret_key("cloud-2026", [99u8; 32]).sign(TOPIC, &env, valid)?,
        ),
        (
            "is not a trusted key",
            CommandSigner::from_secret_key("someone", [98u8; 32]).sign(TOPIC, &env, valid)?,
        ),
        ("not signed", env.encode()),
        (
            "signed for another topic",
            cloud().sign("devices/pump-18/commands/rate", &env, valid)?,
        ),
        ("expired", cloud().sign_at(TOPIC, &env, t - 600, t - 1)?),
        ("not a COSE_Sign1", b"\xd2\x84garbage".to_vec()),
    ])
}

#[test]
fn every_signature_refusal_holds_through_the_cli_and_a_keyless_handle() -> TestResult {
    let (_dir, path) = temp_db()?;
    let signer = cloud();
    let keys = TrustedKeys::new().key(signer.key_id(), signer.public_key());
    let device = Outbox::open_with(&path, Options::new().trusted_command_keys(keys))?;
    let keyless = Outbox::open(&path)?;
    let cases = refusals()?;
    for (why, bytes) in &cases {
        let dl = match device.receive(TOPIC, bytes)? {
            Received::DeadLettered {
                dead_letter_id,
                reason,
            } => {
                assert!(reason.contains(why), "{why}: {reason}");
                dead_letter_id
            }
            other => return Err(format!("{why}: not refused by the device: {other:?}").into()),
        };
        match keyless.retry_dead_letter(dl) {
            Err(Error::RetryRefused { reason, .. }) => assert!(reason.contains(why), "{why}: {reason}"),
            other => return Err(format!("{why}: the keyless retry was not refused: {other:?}").into()),
        }
        let out = Command::new(BIN)
            .arg("--db")
            .arg(&path)
            .args(["dead-letters", "retry", &dl.to_string()])
            .env_remove("RUST_LOG")
            .output()?;
        assert_eq!(out.status.code(), Some(1), "{why}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(why),
            "{why}: {out:?}"
        );
        match keyless.receive(TOPIC, bytes)? {
            Received::DeadLettered { reason, .. } => assert!(reason.contains(why), "{why}: {reason}"),
            other => return Err(format!("{why}: the keyless handle stored it: {other:?}").into()),
        }
    }
    assert_eq!(
        device.dead_letters(100)?.len(),
        2 * cases.len(),
        "every refusal kept"
    );
    assert_eq!(
        device.stats()?.inbox_unapplied,
        0,
        "nothing refused was stored as applicable"
    );
    assert_eq!(
        keyless.apply_next(|_tx, _cmd| Ok::<_, Error>(()))?,
        ApplyOutcome::Idle { next_due: None }
    );
    Ok(())
}
