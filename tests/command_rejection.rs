//! A command that can never be valid is rejected for good: dead-lettered at once with the
//! handler's reason, never retried, and the next command of its key runs at once (not after the
//! retries and backoff a failure gets). Through the relay, rejections and malformed deliveries
//! are counted in `Status`.

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
        ApplyOutcome::Rejected { id, attempts, error } => {
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

    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].message_id, dead[0].attempts), (Some(bad), 1));
    assert!(
        dead[0].reason.contains("rejected by the handler"),
        "{}",
        dead[0].reason
    );
    assert!(
        dead[0].payload.is_some(),
        "the dead letter keeps the payload for an operator"
    );
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
    assert_eq!(outbox.stats()?.dead_letters, 2);
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
    let reasons: Vec<String> = outbox.dead_letters(10)?.into_iter().map(|d| d.reason).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons.iter().any(|r| r.contains("this is JSON text")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("rejected by the handler")),
        "{reasons:?}"
    );
    relay.shutdown()?;
    Ok(())
}
