//! A busy error after the claim never strands it. Another connection holds the write lock past
//! the busy timeout while a two-phase handler's outside step runs: `apply_next` fails with
//! `Error::Busy`, and once the lock is free the same command is applied by the next call, its
//! attempt not counted against the handler, and the command behind it on the same key follows.
//! (Before, the claim stayed set for `attempt_timeout`: every call returned `Idle`.)

mod common;
mod support;

use std::sync::mpsc;
use std::time::Duration;

use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::{ApplyOutcome, Error, MessageId, Options, Outbox};

#[test]
fn a_busy_record_step_releases_its_claim() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open_with(&path, Options::new().busy_timeout(Duration::from_millis(200)))?;
    let (first, second) = (MessageId::new_v7(), MessageId::new_v7());
    outbox.receive("cmd", &command_bytes(first, "valve-1", &1)?)?;
    outbox.receive("cmd", &command_bytes(second, "valve-1", &2)?)?;

    // The outside step has another process take the write lock and keep it: only once the claim
    // has committed, so that the record step is the one that finds it locked.
    let (free_tx, free_rx) = mpsc::channel::<()>();
    let mut blocker = None;
    let busy = outbox.apply_next_two_phase(
        |_cmd| -> Result<(), String> {
            let (locked_tx, locked_rx) = mpsc::channel::<()>();
            let path = path.clone();
            blocker = Some(std::thread::spawn(move || -> rusqlite::Result<()> {
                let conn = rusqlite::Connection::open(path)?;
                conn.execute_batch("BEGIN IMMEDIATE")?;
                let _ = locked_tx.send(());
                let _ = free_rx.recv();
                conn.execute_batch("COMMIT")
            }));
            locked_rx.recv().map_err(|e| e.to_string())
        },
        |_tx, _cmd, ()| Ok::<_, Error>(()),
    );
    assert!(matches!(busy, Err(Error::Busy)), "{busy:?}");
    // Still locked: the claim could not be released yet either.
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM inbox WHERE attempt_started_at IS NOT NULL"
        )?,
        1,
        "the record step was the one that found the database locked"
    );
    free_tx.send(())?;
    blocker
        .ok_or("the outside step never ran")?
        .join()
        .map_err(|_| "blocker panicked")??;

    let mut seen = Vec::new();
    for _ in 0..2 {
        let outcome = outbox.apply_next(|_tx, cmd| {
            seen.push((cmd.id, cmd.attempts));
            Ok::<_, Error>(())
        })?;
        assert!(matches!(outcome, ApplyOutcome::Applied { .. }), "{outcome:?}");
    }
    assert_eq!(
        seen,
        [(first, 0), (second, 0)],
        "the busy attempt was not counted"
    );
    Ok(())
}

/// The broken build this scenario catches: a claim left set after a busy error.
#[cfg(feature = "mutants")]
#[test]
fn the_strand_claim_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    let caught = support::mutant::caught("a_busy_record_step_releases_its_claim", "strand-claim")?;
    assert!(caught, "mutant survived");
    Ok(())
}
