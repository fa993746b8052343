//! A wall clock that jumps hours ahead and back (an NTP step, a board without a real-time clock
//! that boots in 1970 and syncs later, an operator fixing the time), through the crate's
//! injectable clock (`failpoint::shift_wall_clock`, feature `failpoints`):
//!
//! - retention deletes nothing early: a jump ahead does not make minutes-old sent rows, or the
//!   ids of applied commands a broker may still redeliver, look hours old;
//! - a failed command's retry never waits for hours after a jump back.
//!
//! The shift is process-wide, so everything runs in one test.
#![cfg(feature = "failpoints")]

mod common;

use std::time::Duration;

use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::failpoint::shift_wall_clock;
use edge_outbox::{ApplyOutcome, MessageId, Options, Outbox, Received};

const HOUR_MS: i64 = 3_600_000;

#[test]
fn retention_and_retries_survive_a_wall_clock_that_jumps() -> TestResult {
    let (_dir, path) = temp_db()?;
    let options = Options::new()
        .sent_retention(Duration::from_secs(3600))
        .inbox_retention(Duration::from_secs(3600))
        .retry_backoff(Duration::from_millis(100), Duration::from_secs(300));
    let outbox = Outbox::open_with(&path, options)?;

    // A sent row, as the relay's marker leaves it, and an applied command.
    outbox.transaction(|tx| tx.publish("t/sent", "k", &1))?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "INSERT INTO outbox_sent (seq, id, topic, key, payload, created_at, sent_at, sent_uptime)
             SELECT seq, id, topic, key, payload, created_at, created_at,
                    (SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms')
             FROM outbox;
             DELETE FROM outbox;",
        )
    })?;
    let applied_id = MessageId::new_v7();
    assert!(matches!(
        outbox.receive("cmd/x", &command_bytes(applied_id, "a", &1)?)?,
        Received::Stored(_)
    ));
    assert!(matches!(
        outbox.apply_next(|_, _| Ok::<_, edge_outbox::Error>(()))?,
        ApplyOutcome::Applied { .. }
    ));

    // Three hours ahead on the wall clock, a minute of real time: nothing is old yet.
    shift_wall_clock(3 * HOUR_MS);
    outbox.prune()?;
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM outbox_sent")?,
        1,
        "sent row pruned early"
    );
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM inbox")?,
        1,
        "applied id pruned early"
    );
    // The id is still known: a redelivery is a duplicate, not a second apply.
    assert!(matches!(
        outbox.receive("cmd/x", &command_bytes(applied_id, "a", &1)?)?,
        Received::Duplicate(_)
    ));

    // Once they are old on the uptime clock too (as after two hours of a relay running), they go.
    outbox.with_connection(|c| {
        c.execute(
            "UPDATE edge_outbox_meta SET value = value + ?1 WHERE name = 'uptime_ms'",
            [2 * HOUR_MS],
        )
    })?;
    outbox.prune()?;
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM outbox_sent")?, 0);
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM inbox")?, 0);

    // A handler fails; its retry is due 100 ms later. Then the wall clock goes back six hours.
    let retried = MessageId::new_v7();
    outbox.receive("cmd/y", &command_bytes(retried, "b", &2)?)?;
    let failed =
        outbox.apply_next(|_, _| Err::<(), _>(edge_outbox::Error::InvalidConfig("not yet".into())))?;
    assert!(matches!(failed, ApplyOutcome::Failed { .. }), "{failed:?}");
    shift_wall_clock(-6 * HOUR_MS);
    std::thread::sleep(Duration::from_millis(150));
    // Due now, not in six hours.
    let outcome = outbox.apply_next(|_, _| Ok::<_, edge_outbox::Error>(()))?;
    assert!(
        matches!(outcome, ApplyOutcome::Applied { id, .. } if id == retried),
        "{outcome:?}"
    );
    shift_wall_clock(3 * HOUR_MS);
    Ok(())
}
