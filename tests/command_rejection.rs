//! A command that can never be valid is rejected for good: marked rejected at once with the
//! handler's reason, never retried, and the next command of its key runs at once (not after the
//! retries and backoff a failure gets). A rejection is counted apart from the dead letters (an
//! operator has nothing to do about it), and its reply, if the handler gave one, commits with the
//! rejection: once, and never for an attempt whose rejection was not recorded. Through the relay,
//! rejections and malformed deliveries are counted in `Status`, and the reply reaches the broker.

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::{ApplyOutcome, Command, Error, MessageId, Options, Outbox, Relay, Tx};
use rumqttc::QoS;
use serde::{Deserialize, Serialize};
use support::device::relay_config;
use support::{Broker, publish_raw_many, wait_until};

#[derive(Debug, Serialize, Deserialize)]
struct SetRate {
    set_rate: f64,
}

/// What a new user sends first by mistake: the right field with a value of the wrong type.
#[derive(Serialize)]
struct SetRateText {
    set_rate: &'static str,
}

fn open(path: &std::path::Path) -> TestResult<Outbox> {
    // A long backoff: a command that were retried instead of rejected could not become due
    // during the test, and the one behind it would wait.
    let options = Options::new().retry_backoff(Duration::from_secs(3600), Duration::from_secs(3600));
    let outbox = Outbox::open_with(path, options)?;
    outbox.with_connection(|c| c.execute_batch("CREATE TABLE rate (value REAL NOT NULL)"))?;
    Ok(outbox)
}

/// The handler a new user writes: decode the payload with `?`, apply it.
fn set_rate(tx: &mut Tx<'_>, cmd: &Command) -> Result<(), Error> {
    let rate: SetRate = cmd.payload_as()?;
    tx.execute("INSERT INTO rate VALUES (?1)", [rate.set_rate])?;
    Ok(())
}

#[test]
fn a_payload_that_cannot_decode_is_rejected_at_once_and_its_key_moves_on() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path)?;
    let bad = MessageId::new_v7();
    let good = MessageId::new_v7();
    outbox.receive(
        "pumps/p1/rate",
        &command_bytes(bad, "pump-1", &SetRateText { set_rate: "fast" })?,
    )?;
    outbox.receive(
        "pumps/p1/rate",
        &command_bytes(good, "pump-1", &SetRate { set_rate: 12.5 })?,
    )?;

    match outbox.apply_next(set_rate)? {
        ApplyOutcome::Rejected {
            id,
            attempts,
            error,
            reply: None,
        } => {
            assert_eq!((id, attempts), (bad, 1));
            assert!(error.contains("rejected by the handler"), "{error}");
            assert!(
                error.contains("set_rate") || error.contains("f64") || error.contains("float"),
                "{error}"
            );
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    // The very next call applies the command behind it: no retry, no backoff in between.
    assert_eq!(
        outbox.apply_next(set_rate)?,
        ApplyOutcome::Applied {
            id: good,
            published: 0
        }
    );
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM rate")?, 1);
    assert_eq!(
        outbox.apply_next(set_rate)?,
        ApplyOutcome::Idle { next_due: None }
    );

    // Counted apart: no dead letter, a rejected command kept with its reason and payload.
    let stats = outbox.stats()?;
    assert_eq!((stats.dead_letters, stats.inbox_rejected), (0, 1), "{stats:?}");
    let (reason, has_payload): (String, bool) = outbox.with_connection(|c| {
        c.query_row(
            "SELECT last_error, payload IS NOT NULL FROM inbox WHERE rejected = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
    })?;
    assert!(reason.contains("rejected by the handler"), "{reason}");
    assert!(
        has_payload,
        "the rejected command keeps its payload for an operator"
    );
    // Redelivered, it is recognised: not stored, not rejected again.
    assert!(matches!(
        outbox.receive(
            "pumps/p1/rate",
            &command_bytes(bad, "pump-1", &SetRateText { set_rate: "fast" })?
        )?,
        edge_outbox::Received::Duplicate(id) if id == bad
    ));
    Ok(())
}

#[test]
fn a_handler_rejects_explicitly_plain_or_boxed_and_an_ordinary_error_is_retried() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path)?;
    let plain = MessageId::new_v7();
    let boxed = MessageId::new_v7();
    let ordinary = MessageId::new_v7();
    for (id, key) in [(plain, "a"), (boxed, "b"), (ordinary, "c")] {
        outbox.receive("cmd", &command_bytes(id, key, &1)?)?;
    }

    let outcome = outbox.apply_next(|_tx, _cmd| Err(Error::reject("valve 9 does not exist")))?;
    assert!(
        matches!(&outcome, ApplyOutcome::Rejected { id, error, .. } if *id == plain && error.contains("valve 9")),
        "{outcome:?}"
    );
    let outcome = outbox.apply_next(
        |_tx, _cmd| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            Err(Box::new(Error::reject("boxed reason")))
        },
    )?;
    assert!(
        matches!(&outcome, ApplyOutcome::Rejected { id, error, .. } if *id == boxed && error.contains("boxed reason")),
        "{outcome:?}"
    );
    // Any other error is worth another attempt.
    let outcome = outbox.apply_next(|_tx, _cmd| Err::<(), _>("sensor busy"))?;
    assert!(
        matches!(&outcome, ApplyOutcome::Failed { id, attempts: 1, .. } if *id == ordinary),
        "{outcome:?}"
    );
    let stats = outbox.stats()?;
    assert_eq!((stats.dead_letters, stats.inbox_rejected), (0, 2), "{stats:?}");
    Ok(())
}

#[test]
fn the_relay_counts_rejections_and_malformed_deliveries_in_its_status() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path)?;
    let relay = Relay::start_with_handler(
        &outbox,
        relay_config(broker.addr(), "rejecting-device").commands("pumps/p1/#"),
        set_rate,
    )?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)),
        "command session ready"
    );

    let rejected = command_bytes(MessageId::new_v7(), "pump-1", &SetRateText { set_rate: "fast" })?;
    let good = command_bytes(MessageId::new_v7(), "pump-1", &SetRate { set_rate: 7.0 })?;
    let json: &[u8] = br#"{"set_rate": 7.0}"#;
    publish_raw_many(
        broker.addr(),
        &[
            ("pumps/p1/rate", &rejected),
            ("pumps/p1/rate", json),
            ("pumps/p1/rate", &good),
        ],
        QoS::AtLeastOnce,
    )?;
    assert!(
        wait_until(|| query_i64(&outbox, "SELECT count(*) FROM rate").is_ok_and(|n| n == 1)),
        "the valid command behind the rejected one was applied"
    );
    let status = relay.status()?;
    assert_eq!(
        (
            status.commands_rejected,
            status.commands_malformed,
            status.commands_applied,
            status.commands_dead_lettered
        ),
        (1, 1, 1, 0),
        "{status:?}"
    );
    // The malformed delivery is a dead letter; the rejection is not.
    let reasons: Vec<String> = outbox.dead_letters(10)?.into_iter().map(|d| d.reason).collect();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons.iter().any(|r| r.contains("this is JSON text")),
        "{reasons:?}"
    );
    assert_eq!(outbox.stats()?.inbox_rejected, 1);
    relay.shutdown()?;
    Ok(())
}

/// What the device tells the cloud about a refused command.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Refusal {
    command: String,
    reason: String,
}

/// A handler that refuses every command and answers on `pumps/p1/replies`.
fn refuse_with_reply(tx: &mut Tx<'_>, cmd: &Command) -> Result<(), Error> {
    tx.execute("INSERT INTO rate VALUES (-1)", [])?; // rolled back with the rejection
    let answer = Refusal {
        command: cmd.id.to_string(),
        reason: "pump 1 takes no rate".into(),
    };
    Err(
        Error::reject("pump 1 takes no rate").with_reply(edge_outbox::Message::new(
            "pumps/p1/replies",
            &cmd.key,
            &answer,
        )?),
    )
}

fn replies(outbox: &Outbox) -> TestResult<Vec<(Vec<u8>, String)>> {
    Ok(outbox.with_connection(|c| {
        c.prepare("SELECT id, topic FROM outbox WHERE topic LIKE '%/replies' ORDER BY seq")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?)
}

#[test]
fn a_rejection_publishes_its_reply_and_is_counted_apart_from_dead_letters() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path)?;
    let id = MessageId::new_v7();
    outbox.receive(
        "pumps/p1/rate",
        &command_bytes(id, "pump-1", &SetRate { set_rate: 3.0 })?,
    )?;

    let outcome = outbox.apply_next(refuse_with_reply)?;
    let ApplyOutcome::Rejected {
        id: rejected,
        reply: Some(reply),
        error,
        ..
    } = outcome
    else {
        panic!("expected a rejection with its reply, got {outcome:?}");
    };
    assert_eq!(rejected, id);
    assert!(error.contains("pump 1 takes no rate"), "{error}");
    // The reply is in the outbox, the handler's own effect is not.
    assert_eq!(
        replies(&outbox)?,
        [(reply.as_bytes().to_vec(), "pumps/p1/replies".to_owned())]
    );
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM rate")?, 0);
    let stats = outbox.stats()?;
    assert_eq!(
        (stats.inbox_rejected, stats.dead_letters, stats.pending_messages),
        (1, 0, 1),
        "{stats:?}"
    );
    assert!(stats.to_string().contains("/ 1 rejected"), "{stats}");
    Ok(())
}

#[test]
fn a_reply_that_cannot_be_published_leaves_the_rejection_standing_and_says_why() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path)?;
    let id = MessageId::new_v7();
    outbox.receive("pumps/p1/rate", &command_bytes(id, "pump-1", &1)?)?;
    // A wildcard topic can never be published.
    let outcome = outbox.apply_next(|_tx, cmd| {
        Err::<(), _>(Error::reject("no").with_reply(edge_outbox::Message::new(
            "pumps/+/replies",
            &cmd.key,
            &"no",
        )?))
    })?;
    match outcome {
        ApplyOutcome::Rejected {
            reply: None, error, ..
        } => assert!(error.contains("its reply was not published"), "{error}"),
        other => panic!("expected a rejection without a reply, got {other:?}"),
    }
    let last_error: String =
        outbox.with_connection(|c| c.query_row("SELECT last_error FROM inbox", [], |r| r.get(0)))?;
    assert!(last_error.contains("its reply was not published"), "{last_error}");
    let stats = outbox.stats()?;
    assert_eq!(
        (stats.inbox_rejected, stats.pending_messages),
        (1, 0),
        "{stats:?}"
    );
    Ok(())
}

/// The scenario of the `rejection-reply-apart` mutant: an attempt that runs past the attempt
/// timeout is recovered by another worker, which applies the command again and rejects it. The
/// late attempt's rejection is not recorded (its claim is gone), so its reply must not be
/// published either: one reply for one rejection.
#[test]
fn a_late_attempt_whose_rejection_is_not_recorded_publishes_no_reply() -> TestResult {
    let (_dir, path) = temp_db()?;
    let options = || {
        Options::new()
            .attempt_timeout(Duration::from_millis(100))
            .retry_backoff(Duration::ZERO, Duration::ZERO)
    };
    let late = Outbox::open_with(&path, options())?;
    let other = Outbox::open_with(&path, options())?;
    late.with_connection(|c| c.execute_batch("CREATE TABLE rate (value REAL NOT NULL)"))?;
    let id = MessageId::new_v7();
    late.receive("pumps/p1/rate", &command_bytes(id, "pump-1", &1)?)?;

    let (claimed_tx, claimed) = std::sync::mpsc::channel();
    let (recovered_tx, recovered) = std::sync::mpsc::channel::<()>();
    let slow = std::thread::spawn(move || {
        late.apply_next_two_phase(
            |cmd| -> Result<(), Error> {
                let _ = claimed_tx.send(());
                // Held past the attempt timeout until the other worker has taken the command over.
                let _ = recovered.recv_timeout(Duration::from_secs(10));
                Err(Error::reject("late").with_reply(edge_outbox::Message::new(
                    "pumps/p1/replies",
                    &cmd.key,
                    &"late",
                )?))
            },
            |_tx, _cmd, ()| Ok::<_, Error>(()),
        )
    });
    claimed.recv_timeout(Duration::from_secs(10))?;
    std::thread::sleep(Duration::from_millis(200));
    // Recovers the abandoned attempt (a failure, no backoff) and rejects the command itself.
    let mut outcome = other.apply_next(refuse_with_reply)?;
    if matches!(outcome, ApplyOutcome::Idle { .. }) {
        outcome = other.apply_next(refuse_with_reply)?;
    }
    assert!(
        matches!(outcome, ApplyOutcome::Rejected { reply: Some(_), .. }),
        "{outcome:?}"
    );
    recovered_tx.send(())?;
    let late_outcome = slow.join().map_err(|_| "the late worker panicked")??;
    assert_eq!(late_outcome, ApplyOutcome::Idle { next_due: None });
    let replies = replies(&other)?;
    assert_eq!(
        replies.len(),
        1,
        "one reply for one rejection, not one for the attempt whose rejection was not recorded: {replies:?}"
    );
    Ok(())
}

/// Through the relay: the reply is published, and the rejection counted.
#[test]
fn the_relay_publishes_a_rejections_reply() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path)?;
    let cloud = support::Subscriber::start(broker.addr(), "pumps/p1/replies")?;
    let relay = Relay::start_with_handler(
        &outbox,
        relay_config(broker.addr(), "replying-device").commands("pumps/p1/rate"),
        refuse_with_reply,
    )?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)),
        "command session ready"
    );
    let id = MessageId::new_v7();
    publish_raw_many(
        broker.addr(),
        &[(
            "pumps/p1/rate",
            &command_bytes(id, "pump-1", &SetRate { set_rate: 1.0 })?,
        )],
        QoS::AtLeastOnce,
    )?;
    assert!(
        cloud.wait_for(1, Duration::from_secs(20)),
        "the reply reached the cloud"
    );
    let envelopes = support::check::decode_all(&cloud.messages());
    let answer: Refusal = envelopes[0].payload_as()?;
    assert_eq!(
        answer,
        Refusal {
            command: id.to_string(),
            reason: "pump 1 takes no rate".into()
        }
    );
    let status = relay.status()?;
    assert_eq!(
        (status.commands_rejected, status.commands_applied),
        (1, 0),
        "{status:?}"
    );
    relay.shutdown()?;
    Ok(())
}

/// The broken builds these scenarios catch.
#[cfg(feature = "mutants")]
#[test]
fn the_rejection_mutants_are_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "rejection-reply-apart",
        "a_late_attempt_whose_rejection_is_not_recorded_publishes_no_reply",
        "one reply for one rejection",
    )?;
    support::mutant::caught_by(
        "rejection-dead-lettered",
        "a_rejection_publishes_its_reply_and_is_counted_apart_from_dead_letters",
        "(1, 0, 1)",
    )?;
    Ok(())
}
