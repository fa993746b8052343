//! Latest-value coalescing (`Message::coalescing`): a sensor's readings piled up during an outage
//! go out as one message, each replaced reading is announced as a gap, and a message the relay
//! may already have on the wire is never replaced.
//!
//! Broken builds these catch: a trigger that does not replace (ten thousand messages published),
//! one that forgets the gap rows (the consumer sees unexplained gaps), one that replaces
//! non-coalescing messages or other keys (messages missing), and a relay that does not claim
//! what it publishes (the in-flight value deleted and announced as a gap while it was delivered).

mod common;
mod support;

use std::collections::BTreeMap;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::envelope::Published;
use edge_outbox::{Message, Outbox, Relay};
use support::device::relay_config;
use support::{Broker, Proxy, Subscriber, WAIT, wait_until};

fn reading(sensor: &str, value: u64) -> Message {
    Message::new(format!("coal/{sensor}"), sensor, &value)
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
                tx.send(&reading("t2", 1))?;
                tx.send(&reading("t2", 2))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
    }
    let stats = outbox.stats()?;
    assert_eq!(stats.coalesced, 9_999 + 1, "{stats}");
    assert_eq!(stats.pending_messages, 3, "{stats}");

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
        vec![777_777, 9_999],
        "t1's kept message, then its latest reading"
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
