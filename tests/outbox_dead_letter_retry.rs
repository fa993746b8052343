//! An outgoing message the relay dead-lettered goes back, when retried, as it was written: in its
//! priority lane, with its lifetime (counted from when it was written, not from the retry), its
//! evictability and its coalescing. A coalescing message is not put back behind a newer value of
//! its topic and key, where it would be published last and leave the cloud with the stale value:
//! that retry is refused, and the dead letter stays.

mod common;
mod support;

use common::TestResult;
use edge_outbox::{Error, Relay};
use support::device::{open_device, relay_config, wait_drained};
use support::{Broker, WAIT, wait_until};

/// The settings of the one pending row on `topic`: priority, coalescing, expires_at, evictable.
fn settings(conn: &rusqlite::Connection, topic: &str) -> rusqlite::Result<(i64, i64, Option<i64>, i64)> {
    conn.query_row(
        "SELECT priority, coalescing, expires_at, evictable FROM outbox WHERE topic = ?1",
        [topic],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    )
}

#[test]
fn a_retried_dead_letter_keeps_its_lane_lifetime_evictability_and_coalescing() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let conn = rusqlite::Connection::open(outbox.path())?;
    // Written through the SQL contract with a topic the relay refuses: dead-lettered.
    let expires_at: i64 = 4_000_000_000_000;
    conn.execute(
        "INSERT INTO outbox (topic, key, payload, priority, coalescing, expires_at, evictable)
         VALUES ('$SYS/alarm', 'pump-1', x'01', 2, 1, ?1, 1)",
        [expires_at],
    )?;
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "retry-settings"))?;
    assert!(
        wait_until(|| outbox.dead_letters(10).is_ok_and(|d| d.len() == 1)),
        "dead-lettered"
    );
    relay.shutdown()?;
    // The operator repairs the topic and retries.
    conn.execute("UPDATE dead_letters SET topic = 'alarms/pump-1'", [])?;
    let dl = outbox.dead_letters(10)?[0].dead_letter_id;
    outbox.retry_dead_letter(dl)?;
    assert_eq!(
        settings(&conn, "alarms/pump-1")?,
        (2, 1, Some(expires_at), 1),
        "priority, coalescing, lifetime and evictability as written"
    );
    // Still coalescing: a newer value of its key replaces it.
    outbox.transaction(|tx| {
        tx.send(&edge_outbox::Message::new("alarms/pump-1", "pump-1", &2)?.coalescing(true))
    })?;
    let pending: i64 = conn.query_row(
        "SELECT count(*) FROM outbox WHERE topic = 'alarms/pump-1'",
        [],
        |r| r.get(0),
    )?;
    assert_eq!(pending, 1, "the retried value was replaced by the newer one");
    Ok(())
}

#[test]
fn a_coalescing_dead_letter_is_not_put_back_behind_a_newer_value() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let conn = rusqlite::Connection::open(outbox.path())?;
    conn.execute(
        "INSERT INTO outbox (topic, key, payload, coalescing) VALUES ('$SYS/level', 'tank-1', x'01', 1)",
        [],
    )?;
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "retry-stale"))?;
    assert!(
        wait_until(|| outbox.dead_letters(10).is_ok_and(|d| d.len() == 1)),
        "dead-lettered"
    );
    assert!(wait_drained(&outbox, WAIT));
    relay.shutdown()?;
    conn.execute("UPDATE dead_letters SET topic = 'levels/tank-1'", [])?;
    // A newer reading of the same topic and key is pending now.
    outbox.transaction(|tx| {
        tx.send(&edge_outbox::Message::new("levels/tank-1", "tank-1", &7)?.coalescing(true))
    })?;
    let dl = outbox.dead_letters(10)?[0].dead_letter_id;
    match outbox.retry_dead_letter(dl) {
        Err(Error::RetryRefused { reason, .. }) => assert!(reason.contains("newer value"), "{reason}"),
        other => panic!("expected the retry refused, got {other:?}"),
    }
    assert_eq!(outbox.dead_letters(10)?.len(), 1, "the dead letter stays");
    let pending: i64 = conn.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
    assert_eq!(pending, 1, "only the newer reading is pending");
    Ok(())
}

/// The broken build this file catches: a retry that puts the message back with the defaults.
#[cfg(feature = "mutants")]
#[test]
fn the_retry_loses_settings_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "retry-loses-settings",
        "a_retried_dead_letter_keeps_its_lane_lifetime_evictability_and_coalescing",
        "priority, coalescing, lifetime and evictability as written",
    )?;
    Ok(())
}

#[test]
fn a_dead_letter_whose_lifetime_ended_is_not_put_back() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let conn = rusqlite::Connection::open(outbox.path())?;
    // Refused by the relay (its topic), with a lifetime that ends soon after.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    conn.execute(
        "INSERT INTO outbox (topic, key, payload, expires_at) VALUES ('$SYS/short', 'k', x'01', ?1)",
        [now + 1_500],
    )?;
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "retry-expired"))?;
    assert!(
        wait_until(|| outbox.dead_letters(10).is_ok_and(|d| d.len() == 1)),
        "dead-lettered"
    );
    relay.shutdown()?;
    conn.execute("UPDATE dead_letters SET topic = 'short/k'", [])?;
    while std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64
        <= now + 1_500
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let dl = outbox.dead_letters(10)?[0].dead_letter_id;
    match outbox.retry_dead_letter(dl) {
        Err(Error::RetryRefused { reason, .. }) => assert!(reason.contains("lifetime"), "{reason}"),
        other => panic!("expected the retry refused, got {other:?}"),
    }
    assert_eq!(outbox.dead_letters(10)?.len(), 1, "the dead letter stays");
    assert_eq!(outbox.stats()?.pending_messages, 0);
    Ok(())
}
