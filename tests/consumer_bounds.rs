//! The consumer past its memory bound (`Consumer::max_gaps`, 10,000 open gaps by default) never
//! calls a first-time message a duplicate, and a late gap notice still explains what it covers.
//!
//! Priority lanes reach the bound in normal use: after an outage the higher lane drains first,
//! and each of its messages opens a one-number gap below it, filled when the lower lane drains.
//! Here 10,003 lane-1 messages (the even numbers) arrive first, then the lane-0 ones (the odd
//! numbers), of which the first two were removed on the device and are announced late. A
//! consumer that forgets the oldest gaps and then answers from "not missing" that a number was
//! seen tells the service to skip messages it never processed, and reports announced numbers as
//! lost. Past the bound the consumer answers `Verdict::Unknown` for a number it cannot place.
//!
//! Mutant: `consumer-forgotten-seen` (a number below the horizon taken as seen, a notice there
//! ignored), caught here.

mod common;
mod support;

use std::collections::BTreeMap;

use edge_outbox::MessageId;
use edge_outbox::consumer::{Consumer, Verdict};
use edge_outbox::envelope::{Envelope, GapCause, GapNotice, Published};

/// Messages per lane.
const PER_LANE: u64 = 10_003;

fn message(seq: u64) -> Published {
    Published::Message(Envelope {
        id: MessageId::from_key(&format!("pump-17/{seq}")),
        source: "pump-17".into(),
        epoch: 7,
        seq,
        key: format!("sensor-{}", seq % 2).into(),
        created_ms: 0,
        event_type: None,
        headers: vec![],
        payload: vec![0xf6].into(),
    })
}

fn verdict_name(v: Verdict) -> &'static str {
    match v {
        Verdict::New { .. } => "new",
        Verdict::Duplicate => "duplicate",
        Verdict::Unknown => "unknown",
        Verdict::Announced => "announced",
        _ => "other",
    }
}

#[test]
fn past_its_bound_the_consumer_calls_no_first_time_message_a_duplicate() -> common::TestResult {
    let mut consumer = Consumer::new().from_start(true);
    let mut first_time: BTreeMap<&str, u64> = BTreeMap::new();
    // Lane 1 drains first: 2, 4, 6, ...
    for seq in (1..=PER_LANE).map(|i| 2 * i) {
        *first_time
            .entry(verdict_name(consumer.observe(&message(seq))))
            .or_default() += 1;
    }
    // Then lane 0: 1 and 3 were evicted on the device, and their notice arrives now.
    let notice = Published::Gap(GapNotice::new("pump-17", 7, 1, 1, GapCause::Evicted));
    assert_eq!(consumer.observe(&notice), Verdict::Announced);
    let notice = Published::Gap(GapNotice::new("pump-17", 7, 3, 3, GapCause::Evicted));
    assert_eq!(consumer.observe(&notice), Verdict::Announced);
    for seq in (3..=PER_LANE).map(|i| 2 * i - 1) {
        *first_time
            .entry(verdict_name(consumer.observe(&message(seq))))
            .or_default() += 1;
    }
    assert_eq!(
        first_time.get("duplicate"),
        None,
        "first-time messages called duplicates: {first_time:?}"
    );
    // Three one-number gaps were given up on (1, 3, 5): 5 is the one message there.
    assert_eq!(
        first_time.get("unknown"),
        Some(&1),
        "the bound was not passed as planned: {first_time:?}"
    );
    // A message seen before is still a duplicate, past the bound or not (its id is recent).
    assert_eq!(consumer.observe(&message(5)), Verdict::Duplicate);
    assert_eq!(consumer.observe(&message(2 * PER_LANE)), Verdict::Duplicate);

    let report = consumer.report();
    let stream = report.streams.first().ok_or("no stream")?;
    assert_eq!(
        stream.announced_by_cause.get("evicted"),
        Some(&2),
        "the late notice was not counted: {report}"
    );
    assert_eq!(
        (stream.forgotten, stream.unplaced, stream.delivered),
        (3, 3, 2 * PER_LANE - 2),
        "{report}"
    );
    assert_eq!(
        report.totals.unexplained, 0,
        "numbers delivered or announced are reported lost: {report}"
    );
    Ok(())
}

/// The scenario above fails against the mutant that takes a forgotten number as seen.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> common::TestResult {
    support::mutant::caught_by(
        "consumer-forgotten-seen",
        "past_its_bound_the_consumer_calls_no_first_time_message_a_duplicate",
        "first-time messages called duplicates",
    )
}
