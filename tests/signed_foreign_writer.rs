//! A foreign writer (plain SQL, the contract in docs/schema.md) cannot slip an unsigned command
//! into the inbox of a device that requires signed commands: its insert fails with a message
//! saying why, and nothing is applied.
#![cfg(feature = "signed-commands")]

mod common;

use common::{TestResult, temp_db};
use edge_outbox::{ApplyOutcome, CommandSigner, Error, MessageId, Options, Outbox, TrustedKeys};
use rusqlite::Connection;

#[test]
fn an_unsigned_insert_into_the_inbox_is_refused_with_the_reason() -> TestResult {
    let (_dir, path) = temp_db()?;
    let signer = CommandSigner::from_secret_key("cloud-2026", [11u8; 32]);
    let keys = TrustedKeys::new().key(signer.key_id(), signer.public_key());
    let device = Outbox::open_with(&path, Options::new().trusted_command_keys(keys))?;

    let foreign = Connection::open(&path)?;
    let id = MessageId::new_v7();
    let payload = edge_outbox::envelope::to_cbor(&1_000_000)?;
    let refused = foreign.execute(
        "INSERT INTO inbox (id, topic, key, payload) VALUES (?1, 'devices/pump-17/commands/rate', 'pump-17', ?2)",
        rusqlite::params![id.as_bytes(), payload],
    );
    match refused {
        Err(e) => assert!(e.to_string().contains("requires signed commands"), "{e}"),
        Ok(n) => return Err(format!("the foreign insert was accepted ({n} row)").into()),
    }
    assert_eq!(
        device.apply_next(|_tx, _cmd| Ok::<_, Error>(()))?,
        ApplyOutcome::Idle { next_due: None }
    );
    Ok(())
}
