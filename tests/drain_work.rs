//! The work a drain costs per message does not grow with the backlog, counted in SQLite's own
//! virtual-machine steps (`Status::database_steps`), not timed: a relay whose read walks the
//! whole table at every read batch drains a backlog in quadratic time, while every functional
//! test stays green.
//!
//! Broken builds these catch: a higher lane read without its index (`priority = 1` alone does
//! not let SQLite use the partial index `WHERE priority > 0`: it walks every row of the backlog
//! from the cursor), and a lane-0 read whose cursor stops at its own last row, so that with lane
//! 0 empty every read walks the higher lanes' whole backlog again.

mod common;
mod support;

use common::{TestResult, temp_db};
use edge_outbox::{Error, Message, Outbox, Relay};
use support::device::relay_config_for;
use support::{Broker, wait_until};

/// Backlog sizes compared: the work per message at the largest may not exceed the smallest's by
/// more than [`SLACK`].
const SIZES: [u64; 3] = [1_000, 10_000, 100_000];

/// How much more work per message the largest backlog may cost: reads of a full batch against a
/// last partial one, the end of the drain, a checkpoint. A walk of the backlog per read costs
/// some hundred times more at 100,000 rows.
const SLACK: f64 = 2.0;

/// What message `i` of the backlog looks like: its lane, whether it coalesces, and its key.
type Layout = fn(u64) -> (u8, bool, u64);

/// Commits `backlog` messages offline, starts a relay and waits until every one is acknowledged
/// or announced, and marked; the steps the relay ran per message committed.
fn steps_per_message(broker: &Broker, backlog: u64, layout: Layout) -> TestResult<f64> {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        for i in 0..backlog {
            let (priority, coalescing, key) = layout(i);
            let m = Message::new(format!("work/{priority}"), format!("k{key}"), &i)?
                .priority(priority)
                .coalescing(coalescing);
            tx.send(&m)?;
        }
        Ok::<_, Error>(())
    })?;
    let relay = Relay::start(&outbox, relay_config_for(broker, "drain-work"))?;
    let drained = wait_until(|| {
        relay
            .status()
            .is_ok_and(|s| s.store.pending_messages == 0 && s.store.gaps_unannounced == 0)
    });
    let status = relay.status()?;
    relay.shutdown()?;
    assert!(
        drained,
        "{backlog} messages not drained: {} acknowledged, {} pending, {} gaps unannounced",
        status.acknowledged, status.store.pending_messages, status.store.gaps_unannounced
    );
    Ok(status.database_steps as f64 / backlog as f64)
}

/// The steps per message at each size, and a failure naming them if the work grows.
fn check_flat(name: &str, layout: Layout) -> TestResult {
    let broker = Broker::start()?;
    let mut per_message = Vec::new();
    for backlog in SIZES {
        per_message.push(steps_per_message(&broker, backlog, layout)?);
    }
    let figures: Vec<String> = SIZES
        .iter()
        .zip(&per_message)
        .map(|(n, s)| format!("{n}: {s:.1}"))
        .collect();
    println!(
        "{name}: SQLite steps per message by backlog: {}",
        figures.join(", ")
    );
    let (smallest, largest) = (per_message[0], per_message[SIZES.len() - 1]);
    assert!(smallest > 0.0, "{name}: no steps were counted");
    assert!(
        largest <= smallest * SLACK,
        "{name}: the work per message grows with the backlog ({})",
        figures.join(", ")
    );
    Ok(())
}

#[test]
fn a_backlog_in_lane_0_costs_the_same_per_message_at_any_size() -> TestResult {
    check_flat("lane 0", |i| (0, false, i))
}

#[test]
fn a_backlog_in_a_higher_lane_with_lane_0_empty_costs_the_same_per_message() -> TestResult {
    check_flat("lane 2 alone", |i| (2, false, i))
}

#[test]
fn a_backlog_mixed_across_lanes_with_claims_costs_the_same_per_message() -> TestResult {
    // A key of its own per message: coalescing replaces nothing, but every such row is claimed
    // before it is published.
    check_flat("mixed", |i| ((i % 7 % 4) as u8, i % 3 == 0, i))
}

#[test]
fn a_backlog_where_every_other_message_was_replaced_costs_the_same_per_message() -> TestResult {
    // Each second reading replaces the first: half the backlog is gap rows, each announced in a
    // notice of its own (a delivered reading separates every two).
    check_flat("gap notices", |i| (0, true, i / 2))
}
