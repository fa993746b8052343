//! A salvage keeps the signature policy. A damaged file is copied into a fresh one (by hand, or
//! on open); if the copy lost the policy tables, the device would accept unsigned commands from
//! then on without anyone asking for it. After `Outbox::salvage`, a handle opened without keys
//! still refuses an unsigned command, and the change log is kept.
#![cfg(feature = "signed-commands")]

mod common;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::{CommandSigner, Envelope, MessageId, Options, Outbox, Received, TrustedKeys};

#[test]
fn the_policy_survives_a_salvage() -> TestResult {
    let (_dir, path) = temp_db()?;
    let signer = CommandSigner::from_secret_key("cloud-2026", [11u8; 32]);
    let keys = TrustedKeys::new().key(signer.key_id(), signer.public_key());
    drop(Outbox::open_with(
        &path,
        Options::new().trusted_command_keys(keys),
    )?);

    Outbox::salvage(&path, &Options::new())?;
    let keyless = Outbox::open(&path)?;
    let trusted = keyless
        .trusted_command_keys()?
        .ok_or("the salvage dropped the policy")?;
    assert_eq!(trusted.key_ids().collect::<Vec<_>>(), ["cloud-2026"]);
    let unsigned = Envelope::command(MessageId::new_v7(), "pump-17", &1)?.encode();
    match keyless.receive("devices/pump-17/commands/rate", &unsigned)? {
        Received::DeadLettered { reason, .. } => assert!(reason.contains("not signed"), "{reason}"),
        other => return Err(format!("an unsigned command was accepted after the salvage: {other:?}").into()),
    }
    assert_eq!(
        query_i64(&keyless, "SELECT count(*) FROM edge_outbox_command_policy_log")?,
        1
    );
    Ok(())
}
