//! A durable consumer (`edge_outbox::consumer::DurableConsumer`) restarted mid-stream says what
//! one that never stopped would have said: no message whose effect committed is new again, no
//! message whose transaction rolled back is a duplicate, and a loss while it was down is an
//! unexplained gap.
//!
//! - `a_restarted_consumer_neither_repeats_nor_misses`: effects counted in the consumer's own
//!   table; broken builds caught: mutant `consumer-state-unsaved` (nothing saved: after the
//!   restart a delivered message is new again and the loss while down goes unseen).
//! - `a_failed_effect_takes_its_verdict_back` (an effect that fails, one that panics): mutant `consumer-kept-after-rollback` (the
//!   verdicts kept after the rollback: the message comes again as a duplicate and its effect
//!   never happens).
//! - `restarts_anywhere_change_no_verdict_and_no_count` (proptest): streams of messages, gap
//!   notices, redeliveries and reorderings on small bounds, fed to one consumer that never stops
//!   and to a durable one reopened at random points: every verdict and the final report must be
//!   equal. It catches a save that misses part of the state (a gap closed or split, a key moved or
//!   forgotten, an id that left the window, the horizon).

mod common;
mod support;

use std::path::Path;

use common::TestResult;
use edge_outbox::consumer::{Consumer, DurableConsumer, Report, Verdict};
use edge_outbox::envelope::{Envelope, GapCause, GapNotice, Published};
use edge_outbox::{Error, MessageId};
use proptest::prelude::*;

fn message(source: &str, epoch: u64, seq: u64, key: &str) -> Published {
    Published::Message(Envelope {
        id: MessageId::from_key(&format!("{source}/{epoch}/{seq}")),
        source: source.to_owned().into(),
        epoch,
        seq,
        key: key.to_owned().into(),
        created_ms: 0,
        event_type: None,
        headers: vec![],
        payload: vec![0xf6].into(),
    })
}

/// Observes `items` in one transaction, inserting a row per new message into `effects`.
fn feed(consumer: &mut DurableConsumer, items: Vec<Published>) -> Result<Vec<Verdict>, Error> {
    let seen = consumer.observe(items, |tx, item, verdict| {
        if let (Published::Message(env), Verdict::New { .. } | Verdict::Unknown) = (item, verdict) {
            tx.execute(
                "INSERT INTO effects (seq) VALUES (?1)",
                [i64::try_from(env.seq).unwrap_or(-1)],
            )?;
        }
        Ok::<_, Error>(())
    })?;
    Ok(seen.into_iter().map(|(_, v)| v).collect())
}

fn open(path: &Path, from_start: bool) -> Result<DurableConsumer, Error> {
    let consumer = DurableConsumer::open(path, Consumer::new().from_start(from_start))?;
    consumer
        .connection()
        .execute_batch("CREATE TABLE IF NOT EXISTS effects (seq INTEGER NOT NULL)")?;
    Ok(consumer)
}

/// How many times each number's effect happened, for those that happened more than once.
fn repeated_effects(consumer: &DurableConsumer) -> Result<Vec<(i64, i64)>, Error> {
    let mut stmt = consumer
        .connection()
        .prepare("SELECT seq, count(*) FROM effects GROUP BY seq HAVING count(*) > 1")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

#[test]
fn a_restarted_consumer_neither_repeats_nor_misses() -> TestResult {
    if support::mutant::in_mutant_run() && std::env::var("EDGE_OUTBOX_MUTANT")? != "consumer-state-unsaved" {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("consumer.db");
    // A consumer that joined late (it counts from the first number it sees): the case a memory
    // one gets wrong after a restart, as it joins late again.
    let mut consumer = open(&path, false)?;
    for seq in 100..=150 {
        feed(&mut consumer, vec![message("pump-1", 7, seq, "k")])?;
    }
    drop(consumer);

    // Restarted. The broker redelivers 150 (acknowledged after the commit, which the kill beat),
    // then 151; 152..=160 were lost with the broker's queue while the consumer was down.
    let mut consumer = open(&path, false)?;
    let again = feed(&mut consumer, vec![message("pump-1", 7, 150, "k")])?;
    let next = feed(&mut consumer, vec![message("pump-1", 7, 151, "k")])?;
    for seq in 161..=170 {
        feed(&mut consumer, vec![message("pump-1", 7, seq, "k")])?;
    }
    let report = consumer.report();
    let repeated = repeated_effects(&consumer)?;
    assert!(
        again == [Verdict::Duplicate] && repeated.is_empty(),
        "a message whose effect committed before the restart was taken for a new one: \
         verdict {again:?}, effects repeated {repeated:?}"
    );
    assert!(matches!(next[..], [Verdict::New { late: false, .. }]));
    assert_eq!(
        report.streams[0].unexplained,
        vec![(152, 160)],
        "the loss while the consumer was down was missed:\n{report}"
    );
    assert_eq!(
        (report.totals.delivered, report.totals.duplicates),
        (51 + 1 + 10, 1)
    );
    Ok(())
}

#[test]
fn a_failed_effect_takes_its_verdict_back() -> TestResult {
    if support::mutant::in_mutant_run()
        && std::env::var("EDGE_OUTBOX_MUTANT")? != "consumer-kept-after-rollback"
    {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let mut consumer = open(&dir.path().join("consumer.db"), true)?;
    feed(&mut consumer, vec![message("pump-1", 7, 1, "k")])?;
    // The service's effect fails on message 2 (its database was locked, say): nothing commits.
    let failed = consumer.observe(
        vec![message("pump-1", 7, 2, "k"), message("pump-1", 7, 3, "k")],
        |_, item, _| match item {
            Published::Message(env) if env.seq == 3 => Err(Error::Busy),
            _ => Ok(()),
        },
    );
    assert!(matches!(failed, Err(Error::Busy)));
    // The broker delivers both again (neither was acknowledged).
    let again = feed(
        &mut consumer,
        vec![message("pump-1", 7, 2, "k"), message("pump-1", 7, 3, "k")],
    )?;
    assert!(
        again
            .iter()
            .all(|v| matches!(v, Verdict::New { late: false, .. })),
        "messages whose transaction rolled back came again as {again:?}: their effects never happen"
    );
    // An effect that panics, caught by a supervisor loop that carries on: the same.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        consumer.observe(
            vec![message("pump-1", 7, 4, "k")],
            |_, _, _| -> Result<(), Error> { panic!("the effect panicked") },
        )
    }));
    assert!(panicked.is_err());
    let again = feed(&mut consumer, vec![message("pump-1", 7, 4, "k")])?;
    assert!(
        matches!(again[..], [Verdict::New { late: false, .. }]),
        "a message whose effect panicked came again as {again:?}: its effect never happens"
    );
    let effects: i64 = consumer
        .connection()
        .query_row("SELECT count(*) FROM effects", [], |r| r.get(0))?;
    assert_eq!(effects, 4);
    let report = consumer.report();
    assert_eq!((report.totals.delivered, report.totals.duplicates), (4, 0));
    // And what it counted survives a restart with the effects.
    drop(consumer);
    let consumer = open(&dir.path().join("consumer.db"), true)?;
    assert_eq!(consumer.report(), report);
    Ok(())
}

#[test]
fn the_mutants_of_the_durable_consumer_are_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "consumer-state-unsaved",
        "a_restarted_consumer_neither_repeats_nor_misses",
        "was taken for a new one",
    )?;
    support::mutant::caught_by(
        "consumer-kept-after-rollback",
        "a_failed_effect_takes_its_verdict_back",
        "rolled back came again",
    )?;
    Ok(())
}

#[test]
fn a_file_of_another_layout_is_refused_and_left_alone() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("consumer.db");
    drop(open(&path, true)?);
    let conn = rusqlite::Connection::open(&path)?;
    conn.execute("UPDATE consumer_meta SET value = 99 WHERE name = 'format'", [])?;
    drop(conn);
    let err = DurableConsumer::open(&path, Consumer::new()).map(|_| ()).err();
    assert!(
        matches!(&err, Some(Error::InvalidConfig(m)) if m.contains("format 99")),
        "{err:?}"
    );
    let conn = rusqlite::Connection::open(&path)?;
    let format: i64 = conn.query_row("SELECT value FROM consumer_meta WHERE name = 'format'", [], |r| {
        r.get(0)
    })?;
    assert_eq!(format, 99);
    Ok(())
}

/// One step of a generated stream.
#[derive(Debug, Clone)]
enum Step {
    Message {
        source: u8,
        epoch: u8,
        seq: u64,
        key: u8,
    },
    Notice {
        source: u8,
        epoch: u8,
        first: u64,
        len: u64,
    },
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (0u8..2, 1u8..3, 1u64..40, 0u8..4)
            .prop_map(|(source, epoch, seq, key)| Step::Message { source, epoch, seq, key }),
        2 => (0u8..2, 1u8..3, 1u64..40, 0u64..4)
            .prop_map(|(source, epoch, first, len)| Step::Notice { source, epoch, first, len }),
        1 => Just(Step::Restart),
    ]
}

fn settings() -> Consumer {
    // Small bounds, so that gaps are given up on, keys forgotten and ids leave the window.
    Consumer::new().dedupe_window(12).max_gaps(3).max_keys(2)
}

fn item(step: &Step) -> Option<Published> {
    match *step {
        Step::Message {
            source,
            epoch,
            seq,
            key,
        } => Some(message(
            &format!("dev-{source}"),
            u64::from(epoch),
            seq,
            &format!("key-{key}"),
        )),
        Step::Notice {
            source,
            epoch,
            first,
            len,
        } => {
            let mut notice = GapNotice::new(
                &format!("dev-{source}"),
                u64::from(epoch),
                first,
                first + len,
                GapCause::Evicted,
            );
            // The same notice sent again has the same id.
            notice.id = MessageId::from_key(&format!("notice/{source}/{epoch}/{first}/{len}"));
            Some(Published::Gap(notice))
        }
        Step::Restart => None,
    }
}

fn without_findings(mut report: Report) -> Report {
    // The findings (examples of schema violations) are kept in memory only; none arise here.
    report.schema_findings.clear();
    report
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn restarts_anywhere_change_no_verdict_and_no_count(
        steps in proptest::collection::vec(step(), 1..120),
        from_start in any::<bool>(),
        per_tx in 1usize..4,
    ) {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let path = dir.path().join("consumer.db");
        let fail = |e: Error| TestCaseError::fail(e.to_string());
        let mut memory = settings().from_start(from_start);
        let mut durable = DurableConsumer::open(&path, settings().from_start(from_start)).map_err(fail)?;
        let mut pending = Vec::new();
        let flush = |durable: &mut DurableConsumer, pending: &mut Vec<Published>| -> Result<Vec<Verdict>, Error> {
            let items = std::mem::take(pending);
            Ok(durable.observe(items, |_, _, _| Ok::<_, Error>(()))?.into_iter().map(|(_, v)| v).collect())
        };
        let mut expected = Vec::new();
        let mut got = Vec::new();
        for step in &steps {
            match item(step) {
                Some(item) => {
                    expected.push(memory.observe(&item));
                    pending.push(item);
                    if pending.len() >= per_tx {
                        got.extend(flush(&mut durable, &mut pending).map_err(fail)?);
                    }
                }
                None => {
                    got.extend(flush(&mut durable, &mut pending).map_err(fail)?);
                    drop(durable);
                    durable = DurableConsumer::open(&path, settings().from_start(from_start)).map_err(fail)?;
                }
            }
        }
        got.extend(flush(&mut durable, &mut pending).map_err(fail)?);
        prop_assert_eq!(&got, &expected);
        prop_assert_eq!(without_findings(durable.report()), without_findings(memory.report()));
        // The saved window is bounded like the one in memory.
        let ids: i64 = durable
            .connection()
            .query_row("SELECT count(*) FROM consumer_ids", [], |r| r.get(0))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(ids <= 12, "{} ids saved for a window of 12", ids);
        drop(durable);
        let reopened = DurableConsumer::open(&path, settings().from_start(from_start)).map_err(fail)?;
        prop_assert_eq!(without_findings(reopened.report()), without_findings(memory.report()));
    }
}
