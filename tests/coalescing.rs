//! Latest-value coalescing (`Message::coalescing`): a sensor's readings piled up during an outage
//! go out as one message, each replaced reading is announced as a gap, and a message the relay
//! may already have on the wire is never replaced.
//!
//! Broken builds these catch: a trigger that does not replace (ten thousand messages published),
//! one that forgets the gap rows (the consumer sees unexplained gaps), one that replaces
//! non-coalescing messages, other keys or other topics (messages missing), one that announces each
//! replaced reading alone (thousands of notices), a relay that does not claim what it publishes
//! (the in-flight value deleted and announced as a gap while it was delivered) or publishes a row
//! replaced between its read and its claim (a number delivered and announced), and limits that
//! make room before the trigger frees the old value (another sensor's value evicted).

mod common;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::envelope::Published;
use edge_outbox::{Batching, Message, Options, Outbox, Relay, Synchronous};
use support::device::relay_config;
use support::{Broker, Proxy, Subscriber, WAIT, wait_until};

fn reading(sensor: &str, value: u64) -> Message {
    reading_on("coal", sensor, value)
}

fn reading_on(prefix: &str, sensor: &str, value: u64) -> Message {
    Message::new(format!("{prefix}/{sensor}"), sensor, &value)
        .expect("message")
        .coalescing(true)
}

/// What the cloud made of a run: every envelope (gap notices aside) as (key, value) in arrival
/// order, the announced gaps by cause, and the unexplained ones.
struct Received {
    messages: Vec<(String, u64)>,
    /// Gap notices received (publishes, not numbers covered).
    notices: usize,
    by_cause: BTreeMap<String, u64>,
    unexplained: u64,
}

fn received(sub: &Subscriber) -> TestResult<Received> {
    let mut messages = Vec::new();
    let mut notices = 0;
    let mut consumer = Consumer::new().from_start(true);
    for m in sub.messages() {
        match consumer.observe_bytes(&m.payload)?.0 {
            Published::Message(env) => messages.push((env.key.to_string(), env.payload_as::<u64>()?)),
            Published::Gap(_) => notices += 1,
            other => return Err(format!("unexpected item {other:?}").into()),
        }
    }
    let report = consumer.report();
    let mut by_cause = BTreeMap::new();
    for s in &report.streams {
        for (cause, n) in &s.announced_by_cause {
            *by_cause.entry(cause.clone()).or_insert(0) += n;
        }
    }
    Ok(Received {
        messages,
        notices,
        by_cause,
        unexplained: report.totals.unexplained,
    })
}

fn settled(outbox: &Outbox) -> bool {
    wait_until(|| {
        outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)
    })
}

#[test]
fn ten_thousand_readings_during_an_outage_publish_only_the_latest() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "coal/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    // Offline: 10,000 readings of t1 in 100 transactions, a non-coalescing message of t1 in the
    // middle (kept, and in order), and two readings of t2 (the latest kept: another key).
    for batch in 0..100u64 {
        outbox.transaction(|tx| {
            for i in 0..100 {
                tx.send(&reading("t1", batch * 100 + i))?;
            }
            if batch == 50 {
                tx.send(&Message::new("coal/t1", "t1", &777_777u64)?)?;
                // Same key, another topic: another stream, not replaced.
                tx.send(&Message::new("coal/other", "t1", &555_555u64)?.coalescing(true))?;
                tx.send(&reading("t2", 1))?;
                tx.send(&reading("t2", 2))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
    }
    let stats = outbox.stats()?;
    assert_eq!(stats.coalesced, 9_999 + 1, "{stats}");
    assert_eq!(stats.pending_messages, 4, "{stats}");

    let _relay = Relay::start(&outbox, relay_config(broker.addr(), "coal-device"))?;
    assert!(
        settled(&outbox),
        "the relay did not publish and announce everything"
    );
    assert!(
        sub.wait_messages(WAIT, |m| m.len() >= 3),
        "too few messages arrived"
    );
    let Received {
        messages,
        by_cause,
        unexplained,
        ..
    } = received(&sub)?;
    let t1: Vec<u64> = messages
        .iter()
        .filter(|(k, _)| k == "t1")
        .map(|(_, v)| *v)
        .collect();
    assert_eq!(
        t1,
        vec![777_777, 555_555, 9_999],
        "t1: its kept message, its value on another topic, then its latest reading"
    );
    let t2: Vec<u64> = messages
        .iter()
        .filter(|(k, _)| k == "t2")
        .map(|(_, v)| *v)
        .collect();
    assert_eq!(t2, vec![2]);
    assert_eq!(
        by_cause.get("coalesced"),
        Some(&10_000),
        "every replaced reading announced"
    );
    assert_eq!(unexplained, 0);
    Ok(())
}

/// Ten sensors, each on its own topic, read in turn during an outage: the replaced readings form
/// one run of numbers across topics, announced in a few notices, not one per reading.
#[test]
fn interleaved_sensors_cost_one_message_each_and_a_few_notices() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "coal/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    for round in 0..100u64 {
        outbox.transaction(|tx| {
            for i in 0..10 {
                for sensor in 0..10 {
                    tx.send(&reading(&format!("s{sensor}"), round * 10 + i))?;
                }
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
    }
    let _relay = Relay::start(&outbox, relay_config(broker.addr(), "coal-many"))?;
    assert!(
        settled(&outbox),
        "the relay did not publish and announce everything"
    );
    assert!(
        sub.wait_messages(WAIT, |m| m.len() >= 10),
        "too few messages arrived"
    );
    // Settled means the broker acknowledged every notice; the subscriber may still be receiving
    // the last ones.
    wait_until(|| received(&sub).is_ok_and(|g| g.by_cause.get("coalesced") >= Some(&9_990)));
    let got = received(&sub)?;
    let mut latest: Vec<(String, u64)> = got.messages.clone();
    latest.sort();
    let expected: Vec<(String, u64)> = (0..10).map(|s| (format!("s{s}"), 999)).collect();
    assert_eq!(latest, expected, "one message per sensor, its latest reading");
    assert_eq!(got.by_cause.get("coalesced"), Some(&9_990));
    assert_eq!(got.unexplained, 0);
    // 9,990 replaced readings in one run of numbers: a notice per few thousand, by read batch.
    assert!(
        got.notices <= 5,
        "{} gap notices for one run of replaced readings",
        got.notices
    );
    Ok(())
}

#[test]
fn a_reading_the_relay_has_taken_is_not_replaced() -> TestResult {
    let broker = Broker::start()?;
    let proxy = Proxy::start(broker.addr())?;
    let sub = Subscriber::start(broker.addr(), "coal/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let relay = Relay::start(&outbox, relay_config(proxy.addr(), "coal-claim"))?;
    assert!(proxy.wait_active(1, WAIT), "the relay did not connect");
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.connected)),
        "the relay did not connect"
    );
    // The link stalls: what the relay publishes now waits for its PUBACK.
    proxy.stall();
    outbox.transaction(|tx| tx.send(&reading("t9", 1)))?;
    assert!(
        wait_until(|| query_i64(&outbox, "SELECT count(*) FROM outbox WHERE claimed = 1").ok() == Some(1)),
        "the relay did not take the reading"
    );
    outbox.transaction(|tx| tx.send(&reading("t9", 2)))?;
    assert_eq!(
        outbox.stats()?.coalesced,
        0,
        "a reading possibly on the wire was replaced"
    );
    assert_eq!(outbox.stats()?.pending_messages, 2);
    proxy.resume();
    assert!(settled(&outbox), "the relay did not publish both");
    assert!(sub.wait_messages(WAIT, |m| m.len() >= 2));
    let Received {
        messages,
        by_cause,
        unexplained,
        ..
    } = received(&sub)?;
    let values: Vec<u64> = messages.iter().map(|(_, v)| *v).collect();
    assert_eq!(values, vec![1, 2]);
    assert!(by_cause.is_empty(), "{by_cause:?}");
    assert_eq!(unexplained, 0);
    Ok(())
}

/// A reading the relay has read but not yet handed over (here: waiting in a batch that lingers)
/// is still replaced by a newer one: only the newer value goes out, and the older one is
/// announced as coalesced. A relay that claims rows when it reads them keeps both.
#[test]
fn a_reading_waiting_in_a_batch_is_still_replaced() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "coalb/#")?;
    let (_dir, db) = temp_db()?;
    // NORMAL: the relay syncs the WAL once for each read of new rows, which shows when it has
    // read one.
    let outbox = Outbox::open_with(&db, Options::new().synchronous(Synchronous::Normal))?;
    let config = relay_config(broker.addr(), "coal-batch")
        .batch("coalb/#", Batching::new().linger(Duration::from_secs(3)));
    let relay = Relay::start(&outbox, config)?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.connected)),
        "the relay did not connect"
    );
    let syncs = relay.status()?.wal_syncs;
    outbox.transaction(|tx| tx.send(&reading_on("coalb", "t1", 1)))?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.wal_syncs > syncs)),
        "the relay did not read the first reading"
    );
    // Read, lingering in its batch: the newer value replaces it.
    outbox.transaction(|tx| tx.send(&reading_on("coalb", "t1", 2)))?;
    assert!(settled(&outbox), "the relay did not settle");
    let has_latest = |payload: &[u8]| {
        Published::decode_all(payload).is_ok_and(|items| {
            items.iter().any(
                |i| matches!(i, Published::Message(env) if env.payload_as::<u64>().is_ok_and(|v| v == 2)),
            )
        })
    };
    assert!(
        sub.wait_messages(WAIT, |m| m.iter().any(|m| has_latest(&m.payload))),
        "the latest reading did not arrive"
    );
    let mut values = Vec::new();
    let mut consumer = Consumer::new().from_start(true);
    for m in sub.messages() {
        for (item, _) in consumer.observe_all(&m.payload)? {
            if let Published::Message(env) = item {
                values.push(env.payload_as::<u64>()?);
            }
        }
    }
    assert_eq!(values, vec![2], "the replaced reading went out too");
    assert_eq!(outbox.stats()?.coalesced, 1);
    let report = consumer.report();
    assert_eq!(report.totals.announced, 1, "{report}");
    assert_eq!(report.totals.unexplained, 0, "{report}");
    Ok(())
}

/// The SQL contract: a foreign writer coalesces by setting the column; the trigger does the rest
/// in its transaction (gap row, counter), and a rolled-back insert replaces nothing.
#[test]
fn a_foreign_writer_coalesces_by_setting_the_column() -> TestResult {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let conn = rusqlite::Connection::open(&db)?;
    let insert = "INSERT INTO outbox (topic, key, payload, coalescing) VALUES ('coal/x', 'x', ?1, 1)";
    conn.execute(insert, [vec![0x01u8]])?;
    conn.execute(insert, [vec![0x02u8]])?;
    conn.execute_batch("BEGIN")?;
    conn.execute(insert, [vec![0x03u8]])?;
    conn.execute_batch("ROLLBACK")?;
    let payloads: Vec<Vec<u8>> = conn
        .prepare("SELECT payload FROM outbox ORDER BY seq")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    assert_eq!(payloads, vec![vec![0x02u8]]);
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM outbox_gaps WHERE cause = 'coalesced'"
        )?,
        1
    );
    assert_eq!(outbox.stats()?.coalesced, 1);
    Ok(())
}

/// A writer replaces one key's value as fast as it commits while the relay drains under a pace,
/// so values are replaced between the relay's read and its claim. A relay that publishes a row it
/// failed to claim sends a replaced value: its number is then both delivered and announced.
#[test]
fn no_number_is_both_delivered_and_announced_while_values_race_the_relay() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "race/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let _relay = Relay::start(&outbox, relay_config(broker.addr(), "race").pace_messages(300))?;
    for i in 0..2_000u64 {
        outbox.transaction(|tx| {
            tx.send(&reading_on("race", "a", i))?;
            tx.send(&Message::new("race/b", "b", &i)?)
        })?;
    }
    assert!(settled(&outbox), "the relay did not settle");
    let (mut delivered, mut announced, mut values) = (BTreeSet::new(), BTreeSet::new(), Vec::new());
    for m in sub.messages() {
        match Published::decode(&m.payload)? {
            Published::Message(env) => {
                delivered.insert(env.seq);
                if env.key == "a" {
                    values.push(env.payload_as::<u64>()?);
                }
            }
            Published::Gap(g) => announced.extend(g.first..=g.last),
            other => return Err(format!("unexpected item {other:?}").into()),
        }
    }
    let both: Vec<_> = delivered.intersection(&announced).take(10).collect();
    assert!(both.is_empty(), "delivered and announced: {both:?}");
    assert!(values.windows(2).all(|w| w[0] < w[1]), "a's values out of order");
    assert_eq!(values.last(), Some(&1_999), "a's latest value");
    assert_eq!(delivered.len() + announced.len(), 4_000);
    Ok(())
}

/// At a storage limit, a new value of a sensor takes its predecessor's place: nothing else is
/// evicted, and under `OnFull::Reject` it is not refused. A build that made room before the
/// trigger freed the old value evicts another sensor's only value (or refuses the update).
#[test]
fn a_new_value_at_the_storage_limit_replaces_its_own_predecessor_only() -> TestResult {
    use edge_outbox::{Limits, MessageClass, OnFull, Options};
    for policy in [OnFull::EvictOldest, OnFull::Reject] {
        let (_dir, db) = temp_db()?;
        let limits = Limits::new()
            .max_pending_messages(3)
            .on_full(policy)
            .class("coal/#", MessageClass::new().evictable(true).coalescing(true));
        let outbox = Outbox::open_with(&db, Options::new().limits(limits))?;
        outbox.transaction(|tx| {
            for s in ["s1", "s2", "s3"] {
                tx.publish(&format!("coal/{s}"), s, &1u64)?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        outbox.transaction(|tx| tx.publish("coal/s3", "s3", &2u64))?;
        let stats = outbox.stats()?;
        assert_eq!(
            (stats.evicted, stats.coalesced, stats.pending_messages),
            (0, 1, 3),
            "{policy:?}: {stats}"
        );
    }
    Ok(())
}
