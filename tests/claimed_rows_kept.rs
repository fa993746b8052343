//! The store never removes, on its own, a row the relay has claimed: a claimed row may be on the
//! wire (claimed, then published; its PUBACK not yet back, or lost with a connection), and a
//! removal announces it, so the cloud would get the message and a notice saying it was removed.
//! Neither eviction at a storage limit nor expiry takes it; they take the next row instead, or
//! leave it to the relay, which knows what it has published.
//!
//! The claim is set here as the relay sets it (`outbox.claimed = 1`, before it publishes a
//! coalescing row). A store that evicts or expires claimed rows removes row 1 twice over.
//!
//! Mutant: `remove-claimed` (eviction and expiry ignore the claim), caught here.

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::{Limits, Message, MessageClass, OnFull, Options, Outbox};

#[test]
fn eviction_and_expiry_leave_a_claimed_row_alone() -> TestResult {
    let (_dir, db) = temp_db()?;
    let limits = Limits::new()
        .max_pending_messages(3)
        .on_full(OnFull::EvictOldest)
        .class("claim/#", MessageClass::new().evictable(true).coalescing(true));
    let outbox = Outbox::open_with(&db, Options::new().limits(limits))?;
    outbox.transaction(|tx| {
        tx.send(&Message::new("claim/a", "a", &1u64)?.expires_after(Duration::from_millis(1)))?;
        tx.publish("claim/b", "b", &1u64)?;
        tx.publish("claim/c", "c", &1u64)?;
        Ok::<_, edge_outbox::Error>(())
    })?;
    // The relay read row 1 and claimed it; it may be on the wire from now on.
    outbox.with_connection(|c| c.execute_batch("UPDATE outbox SET claimed = 1 WHERE seq = 1"))?;

    // At the limit, the oldest evictable row that is not claimed makes room.
    outbox.transaction(|tx| tx.publish("claim/d", "d", &1u64))?;
    // Row 1's lifetime has passed: expiry is the relay's to decide for a claimed row.
    outbox.prune()?;

    let pending = |seq: i64| query_i64(&outbox, &format!("SELECT count(*) FROM outbox WHERE seq = {seq}"));
    let gap = |seq: i64| {
        query_i64(
            &outbox,
            &format!("SELECT count(*) FROM outbox_gaps WHERE seq = {seq}"),
        )
    };
    assert_eq!(
        (pending(1)?, gap(1)?),
        (1, 0),
        "a claimed row was removed and announced"
    );
    assert_eq!(
        (pending(2)?, gap(2)?),
        (0, 1),
        "the oldest unclaimed evictable row made room"
    );
    assert_eq!(outbox.stats()?.pending_messages, 3);
    Ok(())
}

/// The scenario above fails against the mutant that ignores the claim.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "remove-claimed",
        "eviction_and_expiry_leave_a_claimed_row_alone",
        "a claimed row was removed and announced",
    )
}
