//! A delivery refused as too large keeps its readable id in the dead letters, so that once the
//! sender resends it (under raised limits) and it is applied, retrying the old dead letter cannot
//! apply it a second time, even after the inbox retention: the id is kept while a dead letter
//! names it, and the retry says why it did not put anything back.

mod common;

use std::time::Duration;

use common::{TestResult, command_bytes, temp_db};
use edge_outbox::{ApplyOutcome, Error, Limits, MessageId, Options, Outbox, Received};

#[test]
fn a_retry_of_an_oversized_refusal_cannot_apply_its_resent_command_again() -> TestResult {
    let (_dir, path) = temp_db()?;
    let id = MessageId::new_v7();
    let big = command_bytes(id, "valve-1", &vec![1u8; 100])?;
    let strict = Outbox::open_with(&path, Options::new().limits(Limits::new().max_payload_bytes(16)))?;
    let dl = match strict.receive("cmd", &big)? {
        Received::DeadLettered { dead_letter_id, .. } => dead_letter_id,
        other => return Err(format!("not refused: {other:?}").into()),
    };
    assert_eq!(
        strict.dead_letters(10)?[0].message_id,
        Some(id),
        "its id was readable"
    );
    drop(strict);

    // The limit raised, the sender resends: applied once.
    let device = Outbox::open(&path)?;
    assert_eq!(device.receive("cmd", &big)?, Received::Stored(id));
    let mut applied = 0;
    let mut apply = |device: &Outbox| -> edge_outbox::Result<ApplyOutcome> {
        device.apply_next(|_tx, _cmd| {
            applied += 1;
            Ok::<_, Error>(())
        })
    };
    assert!(matches!(apply(&device)?, ApplyOutcome::Applied { .. }));

    let refused = |device: &Outbox| match device.retry_dead_letter(dl) {
        Err(Error::RetryRefused { reason, .. }) => Ok(reason),
        other => Err(format!("the retry was not refused: {other:?}")),
    };
    let reason = refused(&device)?;
    assert!(reason.contains("already in the inbox"), "{reason}");

    // Past the retention too: the id stays while its dead letter does.
    device.with_connection(|c| {
        c.execute(
            "UPDATE inbox SET applied_at = applied_at - 1000, done_uptime = NULL",
            [],
        )
    })?;
    Outbox::open_with(&path, Options::new().inbox_retention(Duration::ZERO))?.prune()?;
    refused(&device)?;
    assert_eq!(apply(&device)?, ApplyOutcome::Idle { next_due: None });
    assert_eq!(applied, 1);
    assert_eq!(device.dead_letters(10)?.len(), 1, "the dead letter is kept");
    Ok(())
}
