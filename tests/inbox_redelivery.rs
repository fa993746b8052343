//! A redelivered command is a no-op: the inbox stores it once and applies it once; the handler's
//! reply commits with its effect, and a failed handler leaves neither.

mod common;

use std::time::Duration;

use common::{TestResult, apply_when_due, command_bytes, query_i64, temp_db};
use edge_outbox::{
    ApplyOutcome, Command, Error, MessageId, Options, Outbox, Received, Tx, envelope::from_cbor,
};

fn open(path: &std::path::Path, options: Options) -> TestResult<Outbox> {
    let outbox = Outbox::open_with(path, options)?;
    outbox.transaction(|tx| {
        tx.execute_batch("CREATE TABLE account (balance INTEGER NOT NULL); INSERT INTO account VALUES (0);")?;
        Ok::<_, Error>(())
    })?;
    Ok(outbox)
}

/// Credits the account and publishes a reply naming the command.
fn credit(tx: &mut Tx<'_>, cmd: &Command) -> Result<(), Error> {
    let amount: i64 = cmd.payload_as()?;
    tx.execute("UPDATE account SET balance = balance + ?1", [amount])?;
    tx.publish(
        "replies/credit",
        &cmd.key,
        &("credited", cmd.id.to_string(), amount),
    )?;
    Ok(())
}

fn balance(outbox: &Outbox) -> TestResult<i64> {
    query_i64(outbox, "SELECT balance FROM account")
}

#[test]
fn a_redelivered_command_is_stored_once_and_applied_once() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new())?;
    let id = MessageId::new_v7();
    let bytes = command_bytes(id, "acct-1", &25)?;

    assert_eq!(outbox.receive("commands/credit", &bytes)?, Received::Stored(id));
    assert_eq!(
        outbox.receive("commands/credit", &bytes)?,
        Received::Duplicate(id)
    );
    assert_eq!(outbox.stats()?.inbox_unapplied, 1);

    let mut calls = 0;
    let outcome = outbox.apply_next(|tx, cmd| {
        calls += 1;
        assert_eq!(cmd.id, id);
        assert_eq!(
            (cmd.topic.as_str(), cmd.key.as_str()),
            ("commands/credit", "acct-1")
        );
        assert_eq!(
            (cmd.source.as_str(), cmd.event_type.as_deref()),
            ("cloud", Some("Credit.v1"))
        );
        assert_eq!(cmd.headers, vec![("trace-id".to_owned(), "t-1".to_owned())]);
        assert_eq!(cmd.attempts, 0);
        credit(tx, cmd)
    })?;
    assert_eq!(outcome, ApplyOutcome::Applied { id, published: 1 });
    assert_eq!(calls, 1);

    // Redelivered after it was applied: still a duplicate, nothing to apply, no second effect.
    assert_eq!(
        outbox.receive("commands/credit", &bytes)?,
        Received::Duplicate(id)
    );
    let outcome = outbox.apply_next(|tx, cmd| {
        calls += 1;
        credit(tx, cmd)
    })?;
    assert_eq!(outcome, ApplyOutcome::Idle { next_due: None });
    assert_eq!(calls, 1);
    assert_eq!(balance(&outbox)?, 25);

    // The reply committed with the effect, once.
    let replies: Vec<Vec<u8>> = outbox.with_connection(|c| {
        c.prepare("SELECT payload FROM outbox WHERE topic = 'replies/credit'")?
            .query_map([], |r| r.get::<_, Vec<u8>>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?;
    assert_eq!(replies.len(), 1);
    assert_eq!(
        from_cbor::<(String, String, i64)>(&replies[0])?,
        ("credited".to_owned(), id.to_string(), 25)
    );
    let stats = outbox.stats()?;
    assert_eq!(
        (stats.inbox_applied, stats.inbox_unapplied, stats.pending_messages),
        (1, 0, 1)
    );

    // The applied id is kept, its payload dropped (the default).
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM inbox WHERE payload IS NULL")?,
        1
    );
    Ok(())
}

#[test]
fn a_failing_handler_leaves_no_effect_and_no_reply() -> TestResult {
    let (_dir, path) = temp_db()?;
    let options = Options::new().retry_backoff(Duration::from_millis(1), Duration::from_millis(4));
    let outbox = open(&path, options)?;
    let id = MessageId::new_v7();
    outbox.receive("commands/credit", &command_bytes(id, "acct-1", &25)?)?;

    let outcome = outbox.apply_next(|tx, cmd| {
        credit(tx, cmd).map_err(|e| e.to_string())?;
        Err("downstream refused".to_owned())
    })?;
    let ApplyOutcome::Failed {
        id: failed,
        attempts,
        error,
        ..
    } = outcome
    else {
        panic!("expected Failed, got {outcome:?}");
    };
    assert_eq!((failed, attempts, error.as_str()), (id, 1, "downstream refused"));
    assert_eq!(balance(&outbox)?, 0, "the failed handler's effect was kept");
    assert_eq!(
        outbox.stats()?.pending_messages,
        0,
        "the failed handler's reply was kept"
    );
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM outbox")?, 0);

    // A redelivery while it is backing off is still a duplicate.
    let bytes = command_bytes(id, "acct-1", &25)?;
    assert_eq!(
        outbox.receive("commands/credit", &bytes)?,
        Received::Duplicate(id)
    );

    let outcome = apply_when_due(&outbox, |tx, cmd| {
        assert_eq!(cmd.attempts, 1);
        credit(tx, cmd)
    })?;
    assert_eq!(outcome, ApplyOutcome::Applied { id, published: 1 });
    assert_eq!(balance(&outbox)?, 25);
    assert_eq!(outbox.stats()?.pending_messages, 1);
    Ok(())
}

#[test]
fn applied_ids_are_kept_for_the_retention_window() -> TestResult {
    // Default retention (7 days): prune keeps the id, so a redelivery stays a duplicate.
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new().keep_applied_payloads(true))?;
    let id = MessageId::new_v7();
    let bytes = command_bytes(id, "acct-1", &5)?;
    outbox.receive("commands/credit", &bytes)?;
    assert!(matches!(outbox.apply_next(credit)?, ApplyOutcome::Applied { .. }));
    assert_eq!(outbox.prune()?, 0);
    assert_eq!(
        outbox.receive("commands/credit", &bytes)?,
        Received::Duplicate(id)
    );
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM inbox WHERE payload IS NOT NULL")?,
        1
    );

    // Zero retention: once pruned, the id is forgotten and a redelivery is applied again. This is
    // why the retention must outlast any redelivery the broker can make.
    let (_dir2, path2) = temp_db()?;
    let forgetful = open(&path2, Options::new().inbox_retention(Duration::ZERO))?;
    forgetful.receive("commands/credit", &bytes)?;
    assert!(matches!(
        forgetful.apply_next(credit)?,
        ApplyOutcome::Applied { .. }
    ));
    // `applied_at < now`: wait for the clock to pass the applied millisecond.
    let mut pruned = 0;
    for _ in 0..10_000 {
        pruned = forgetful.prune()?;
        if pruned > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(pruned, 1);
    assert_eq!(
        forgetful.receive("commands/credit", &bytes)?,
        Received::Stored(id)
    );
    assert!(matches!(
        forgetful.apply_next(credit)?,
        ApplyOutcome::Applied { .. }
    ));
    assert_eq!(balance(&forgetful)?, 10);
    Ok(())
}
