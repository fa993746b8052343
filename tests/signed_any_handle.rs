//! A device that requires signed commands keeps requiring them whoever touches its file. An
//! unsigned command it refused stays refused when retried through `edge-outbox dead-letters
//! retry` or through a second handle opened without keys, and such a handle verifies what it
//! receives against the keys the file trusts.
#![cfg(all(feature = "signed-commands", feature = "cli"))]

mod common;
mod support;

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

fn keyed() -> Options {
    let signer = cloud();
    Options::new().trusted_command_keys(TrustedKeys::new().key(signer.key_id(), signer.public_key()))
}

fn apply(outbox: &Outbox) -> edge_outbox::Result<ApplyOutcome> {
    outbox.apply_next(|_tx, _cmd| Ok::<_, Error>(()))
}

fn dead_letter_id(received: Received) -> TestResult<i64> {
    match received {
        Received::DeadLettered { dead_letter_id, .. } => Ok(dead_letter_id),
        other => Err(format!("expected a refusal, got {other:?}").into()),
    }
}

#[test]
fn an_unsigned_command_stays_refused_through_the_cli_and_a_keyless_handle() -> TestResult {
    let (_dir, path) = temp_db()?;
    let device = Outbox::open_with(&path, keyed())?;
    let unsigned = Envelope::command(MessageId::new_v7(), "pump-17", &1_000_000)?.encode();
    let dl = dead_letter_id(device.receive(TOPIC, &unsigned)?)?;

    // The operator's documented retry: refused again, the dead letter kept, nothing applicable.
    let out = Command::new(BIN)
        .args(["--db"])
        .arg(&path)
        .args(["dead-letters", "retry", &dl.to_string()])
        .env_remove("RUST_LOG")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the CLI retry succeeded: {out:?}");
    assert!(stderr.contains("not signed"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("put back"),
        "{out:?}"
    );
    assert_eq!(apply(&device)?, ApplyOutcome::Idle { next_due: None });
    assert_eq!(device.dead_letters(10)?.len(), 1, "the dead letter is kept");

    // A second handle without keys: its retry re-verifies with the file's keys.
    let keyless = Outbox::open(&path)?;
    match keyless.retry_dead_letter(dl) {
        Err(Error::RetryRefused {
            dead_letter_id,
            reason,
        }) => {
            assert_eq!(dead_letter_id, dl);
            assert!(reason.contains("not signed"), "{reason}");
        }
        other => return Err(format!("the keyless retry was not refused: {other:?}").into()),
    }
    assert_eq!(apply(&keyless)?, ApplyOutcome::Idle { next_due: None });
    assert_eq!(keyless.dead_letters(10)?.len(), 1, "the dead letter is kept");

    // What the keyless handle receives is verified too: unsigned refused, signed stored.
    dead_letter_id(keyless.receive(TOPIC, &unsigned)?)?;
    let genuine = Envelope::command(MessageId::new_v7(), "pump-17", &40)?;
    let signed = cloud().sign(TOPIC, &genuine, Duration::from_secs(600))?;
    assert_eq!(keyless.receive(TOPIC, &signed)?, Received::Stored(genuine.id));
    assert!(matches!(apply(&keyless)?, ApplyOutcome::Applied { id, .. } if id == genuine.id));
    assert_eq!(apply(&device)?, ApplyOutcome::Idle { next_due: None });
    Ok(())
}

/// The broken build this scenario catches: receiving verifies with the handle's keys only.
#[cfg(feature = "mutants")]
#[test]
fn the_handle_keys_only_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    let test = "an_unsigned_command_stays_refused_through_the_cli_and_a_keyless_handle";
    // The re-run itself tells a failing scenario from a passing one.
    assert!(
        !support::mutant::caught(test, "no-such-mutant")?,
        "the unbroken build failed"
    );
    assert!(
        support::mutant::caught(test, "handle-keys-only")?,
        "mutant survived"
    );
    Ok(())
}
