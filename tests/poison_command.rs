//! A command whose handler always fails (or panics) is retried with backoff, counted, and moved to
//! the dead letters after `max_attempts`; then the commands behind it run. Other keys are never
//! blocked by it. Dead letters can be retried (with fresh attempts) or dropped.

mod common;

use std::time::Duration;

use common::{TestResult, apply_when_due, command_bytes, query_i64, temp_db};
use edge_outbox::{ApplyOutcome, Command, Error, MessageId, Options, Origin, Outbox, Tx};

const MAX_ATTEMPTS: u32 = 3;

fn open(path: &std::path::Path, options: Options) -> TestResult<Outbox> {
    let outbox = Outbox::open_with(path, options)?;
    outbox.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE applied (n INTEGER PRIMARY KEY AUTOINCREMENT, command_id BLOB NOT NULL)",
        )?;
        Ok::<_, Error>(())
    })?;
    Ok(outbox)
}

fn fast_retries() -> Options {
    Options::new()
        .max_attempts(MAX_ATTEMPTS)
        .retry_backoff(Duration::from_millis(1), Duration::from_millis(4))
}

/// Records the command as applied, unless it is `poison`.
fn handler(poison: MessageId) -> impl FnMut(&mut Tx<'_>, &Command) -> Result<(), String> {
    move |tx, cmd| {
        if cmd.id == poison {
            return Err(format!("cannot apply {} (attempt {})", cmd.id, cmd.attempts + 1));
        }
        tx.execute(
            "INSERT INTO applied (command_id) VALUES (?1)",
            [cmd.id.as_bytes()],
        )
        .map_err(|e| e.to_string())?;
        Ok(())
    }
}

fn applied_ids(outbox: &Outbox) -> TestResult<Vec<MessageId>> {
    let rows: Vec<Vec<u8>> = outbox.with_connection(|c| {
        c.prepare("SELECT command_id FROM applied ORDER BY n")?
            .query_map([], |r| r.get::<_, Vec<u8>>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?;
    Ok(rows
        .iter()
        .map(|id| MessageId::from_slice(id))
        .collect::<Result<_, _>>()?)
}

fn receive(outbox: &Outbox, key: &str, n: i64) -> TestResult<MessageId> {
    let id = MessageId::new_v7();
    outbox.receive("commands/do", &command_bytes(id, key, &n)?)?;
    Ok(id)
}

#[test]
fn a_poison_command_is_dead_lettered_and_stops_blocking_its_key() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, fast_retries())?;
    let poison = receive(&outbox, "k", 1)?;
    let behind = receive(&outbox, "k", 2)?;

    let mut handle = handler(poison);
    for attempt in 1..MAX_ATTEMPTS {
        match apply_when_due(&outbox, &mut handle)? {
            ApplyOutcome::Failed {
                id,
                attempts,
                error,
                retry_in,
            } => {
                assert_eq!((id, attempts), (poison, attempt));
                assert!(error.contains("cannot apply"), "{error}");
                assert!(retry_in >= Duration::from_millis(1) && retry_in <= Duration::from_millis(4));
            }
            other => panic!("attempt {attempt}: expected Failed, got {other:?}"),
        }
        assert!(
            applied_ids(&outbox)?.is_empty(),
            "a command ran ahead of an older one of its key"
        );
        let failures = query_i64(&outbox, "SELECT attempts FROM inbox ORDER BY seq LIMIT 1")?;
        assert_eq!(failures, i64::from(attempt));
    }
    match apply_when_due(&outbox, &mut handle)? {
        ApplyOutcome::DeadLettered { id, attempts, error } => {
            assert_eq!((id, attempts), (poison, MAX_ATTEMPTS));
            assert!(error.contains("attempt 3"), "{error}");
        }
        other => panic!("expected DeadLettered, got {other:?}"),
    }

    // Now the command behind it runs, and nothing is left.
    assert_eq!(
        apply_when_due(&outbox, &mut handle)?,
        ApplyOutcome::Applied {
            id: behind,
            published: 0
        }
    );
    assert_eq!(
        outbox.apply_next(&mut handle)?,
        ApplyOutcome::Idle { next_due: None }
    );
    assert_eq!(applied_ids(&outbox)?, vec![behind]);

    let stats = outbox.stats()?;
    assert_eq!(
        (stats.dead_letters, stats.inbox_unapplied, stats.inbox_applied),
        (1, 0, 1)
    );
    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!(
        (d.origin, d.message_id, d.attempts),
        (Origin::Inbox, Some(poison), MAX_ATTEMPTS)
    );
    assert_eq!((d.topic.as_str(), d.key.as_str()), ("commands/do", "k"));
    assert!(d.reason.contains("cannot apply"), "{}", d.reason);
    assert_eq!(
        d.payload.as_deref(),
        Some(&edge_outbox::envelope::to_cbor(&1)?[..]),
        "the dead letter keeps the command's payload"
    );
    Ok(())
}

#[test]
fn a_backing_off_command_does_not_block_other_keys() -> TestResult {
    let (_dir, path) = temp_db()?;
    // A long backoff: the poison command cannot become due during this test.
    let options = Options::new()
        .max_attempts(MAX_ATTEMPTS)
        .retry_backoff(Duration::from_secs(3600), Duration::from_secs(3600));
    let outbox = open(&path, options)?;
    let poison = receive(&outbox, "k", 1)?;
    let same_key = receive(&outbox, "k", 2)?;
    let other_key = receive(&outbox, "other", 3)?;

    let mut handle = handler(poison);
    assert!(matches!(
        outbox.apply_next(&mut handle)?,
        ApplyOutcome::Failed { id, attempts: 1, .. } if id == poison
    ));
    assert_eq!(
        outbox.apply_next(&mut handle)?,
        ApplyOutcome::Applied {
            id: other_key,
            published: 0
        }
    );
    // Only `same_key` is left, and it waits behind the poison command: idle until that one is
    // due in about an hour, not "due now" (which would make a worker spin).
    match outbox.apply_next(&mut handle)? {
        ApplyOutcome::Idle { next_due: Some(wait) } => {
            assert!(
                wait > Duration::from_secs(3000),
                "next_due {wait:?} should be the poison backoff"
            )
        }
        other => panic!("expected Idle with a next_due, got {other:?}"),
    }
    assert_eq!(applied_ids(&outbox)?, vec![other_key]);
    assert_eq!(outbox.stats()?.inbox_unapplied, 2);
    let _ = same_key;
    Ok(())
}

#[test]
fn a_panicking_handler_ends_in_the_dead_letters_too() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, fast_retries())?;
    let bad = receive(&outbox, "k", 1)?;
    let good = receive(&outbox, "k", 2)?;

    let mut outcomes = Vec::new();
    loop {
        let outcome = apply_when_due(&outbox, |tx: &mut Tx<'_>, cmd: &Command| {
            if cmd.id == bad {
                tx.execute("INSERT INTO applied (command_id) VALUES (x'00')", [])?;
                panic!("handler bug");
            }
            tx.execute(
                "INSERT INTO applied (command_id) VALUES (?1)",
                [cmd.id.as_bytes()],
            )?;
            Ok::<_, rusqlite::Error>(())
        })?;
        if outcome == (ApplyOutcome::Idle { next_due: None }) {
            break;
        }
        outcomes.push(outcome);
    }
    assert_eq!(outcomes.len(), MAX_ATTEMPTS as usize + 1, "{outcomes:?}");
    for (i, outcome) in outcomes[..MAX_ATTEMPTS as usize - 1].iter().enumerate() {
        assert!(
            matches!(outcome, ApplyOutcome::Failed { id, attempts, error, .. }
                if *id == bad && *attempts == i as u32 + 1 && error.contains("handler panicked: handler bug")),
            "{outcome:?}"
        );
    }
    assert!(matches!(
        &outcomes[MAX_ATTEMPTS as usize - 1],
        ApplyOutcome::DeadLettered { id, attempts: MAX_ATTEMPTS, .. } if *id == bad
    ));
    assert_eq!(
        outcomes[MAX_ATTEMPTS as usize],
        ApplyOutcome::Applied {
            id: good,
            published: 0
        }
    );
    // The panicking attempts' writes were rolled back.
    assert_eq!(applied_ids(&outbox)?, vec![good]);
    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead.len(), 1);
    assert!(dead[0].reason.contains("handler panicked"), "{}", dead[0].reason);
    Ok(())
}

#[test]
fn dead_letters_can_be_retried_with_fresh_attempts_or_dropped() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, fast_retries())?;
    let poison = receive(&outbox, "k", 1)?;
    let mut handle = handler(poison);

    let dead_letter = |outbox: &Outbox| -> TestResult<i64> {
        loop {
            match apply_when_due(outbox, &mut handler(poison))? {
                ApplyOutcome::Failed { .. } => {}
                ApplyOutcome::DeadLettered { attempts, .. } => {
                    assert_eq!(attempts, MAX_ATTEMPTS);
                    let dead = outbox.dead_letters(10)?;
                    assert_eq!(dead.len(), 1);
                    return Ok(dead[0].dead_letter_id);
                }
                other => panic!("expected Failed or DeadLettered, got {other:?}"),
            }
        }
    };

    // Retry: the command gets a full new set of attempts (it fails MAX_ATTEMPTS more times
    // before it is dead again), and the dead letter is gone meanwhile.
    let dl = dead_letter(&outbox)?;
    outbox.retry_dead_letter(dl)?;
    assert_eq!(outbox.stats()?.dead_letters, 0);
    assert_eq!(outbox.stats()?.inbox_unapplied, 1);
    match apply_when_due(&outbox, &mut handle)? {
        ApplyOutcome::Failed { id, attempts: 1, .. } => assert_eq!(id, poison),
        other => panic!("a retried command should start again at attempt 1, got {other:?}"),
    }
    let dl = dead_letter(&outbox)?;

    // Retry once more, this time with a handler that works: it is applied once.
    outbox.retry_dead_letter(dl)?;
    let outcome = apply_when_due(&outbox, |tx: &mut Tx<'_>, cmd: &Command| {
        assert_eq!(cmd.attempts, 0);
        tx.execute(
            "INSERT INTO applied (command_id) VALUES (?1)",
            [cmd.id.as_bytes()],
        )
        .map(drop)
    })?;
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            id: poison,
            published: 0
        }
    );
    assert_eq!(applied_ids(&outbox)?, vec![poison]);
    assert_eq!(outbox.stats()?.dead_letters, 0);

    // Drop: gone for good; unknown ids are NotFound.
    let other = receive(&outbox, "k2", 2)?;
    let dl = loop {
        match apply_when_due(&outbox, handler(other))? {
            ApplyOutcome::DeadLettered { .. } => break outbox.dead_letters(10)?[0].dead_letter_id,
            ApplyOutcome::Failed { .. } => {}
            o => panic!("{o:?}"),
        }
    };
    outbox.drop_dead_letter(dl)?;
    assert!(outbox.dead_letters(10)?.is_empty());
    assert!(matches!(outbox.drop_dead_letter(dl), Err(Error::NotFound(_))));
    assert!(matches!(outbox.retry_dead_letter(dl), Err(Error::NotFound(_))));
    assert_eq!(
        outbox.apply_next(&mut handle)?,
        ApplyOutcome::Idle { next_due: None }
    );
    Ok(())
}

#[test]
fn a_dropped_dead_command_is_forgotten_after_the_retention_like_an_applied_one() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, fast_retries().inbox_retention(Duration::ZERO))?;
    let poison = receive(&outbox, "k", 1)?;
    while !matches!(
        apply_when_due(&outbox, handler(poison))?,
        ApplyOutcome::DeadLettered { .. }
    ) {}
    let inbox_rows = |outbox: &Outbox| query_i64(outbox, "SELECT count(*) FROM inbox");

    // While its dead letter exists the inbox row stays whatever the retention: a retry needs it.
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(outbox.prune()?, 0);
    assert_eq!(inbox_rows(&outbox)?, 1);

    // Dropped: its id is kept for the retention (a redelivery meanwhile is a duplicate), then
    // pruned like an applied command's, so dropped commands do not pile up in the inbox.
    outbox.drop_dead_letter(outbox.dead_letters(10)?[0].dead_letter_id)?;
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(outbox.prune()?, 1);
    assert_eq!(inbox_rows(&outbox)?, 0);
    Ok(())
}
