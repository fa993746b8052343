//! The replay window holds whichever handle prunes. A signed command's id must be remembered for
//! as long as the signature can still verify (its maximum age plus the clock skew), or a recorded
//! copy replayed later is stored and applied again. The keyed device's retention is checked at
//! open; a second handle with a shorter retention that calls `prune()` must not forget the id
//! sooner.
#![cfg(feature = "signed-commands")]

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::{
    ApplyOutcome, CommandSigner, Envelope, Error, MessageId, Options, Outbox, Received, TrustedKeys,
};

const TOPIC: &str = "devices/pump-17/commands/rate";

#[test]
fn a_short_retention_elsewhere_does_not_open_the_replay_window() -> TestResult {
    let (_dir, path) = temp_db()?;
    let signer = CommandSigner::from_secret_key("cloud-2026", [11u8; 32]);
    let keys = TrustedKeys::new().key(signer.key_id(), signer.public_key());
    let device = Outbox::open_with(&path, Options::new().trusted_command_keys(keys))?;
    let env = Envelope::command(MessageId::new_v7(), "pump-17", &40)?;
    let recorded = signer.sign(TOPIC, &env, Duration::from_secs(600))?;
    assert_eq!(device.receive(TOPIC, &recorded)?, Received::Stored(env.id));
    assert!(matches!(
        device.apply_next(|_tx, _cmd| Ok::<_, Error>(()))?,
        ApplyOutcome::Applied { .. }
    ));
    // Applied a while ago, on both clocks: past a zero retention, well within the replay window.
    device.with_connection(|c| {
        c.execute(
            "UPDATE inbox SET applied_at = applied_at - 1000, done_uptime = NULL",
            [],
        )
    })?;

    let housekeeper = Outbox::open_with(&path, Options::new().inbox_retention(Duration::ZERO))?;
    housekeeper.prune()?;
    // The recorded copy, replayed: still a duplicate.
    assert_eq!(device.receive(TOPIC, &recorded)?, Received::Duplicate(env.id));
    assert_eq!(
        device.apply_next(|_tx, _cmd| Ok::<_, Error>(()))?,
        ApplyOutcome::Idle { next_due: None }
    );
    Ok(())
}

/// The broken build this scenario catches: pruning by the pruning handle's own retention only.
#[cfg(feature = "mutants")]
#[test]
fn the_own_retention_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    let test = "a_short_retention_elsewhere_does_not_open_the_replay_window";
    assert!(support::mutant::caught(test, "own-retention")?, "mutant survived");
    Ok(())
}
