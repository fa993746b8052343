//! Priority lanes (`Message::priority`): with a backlog, higher lanes drain first, each lane in
//! commit order per key; eviction takes the lowest priority first; a bad priority is refused.
//!
//! Broken builds these catch: a relay that reads in seq order only (the alarms arrive last), one
//! that reads the higher lanes once per connection (an alarm committed during a drain waits for
//! the whole backlog), one that mixes up a lane's order, and eviction by age alone.

mod common;
mod support;

use common::{TestResult, temp_db};
use edge_outbox::envelope::Published;
use edge_outbox::{Error, Limits, Message, OnFull, Options, Outbox, Relay};
use support::device::relay_config;
use support::{Broker, Subscriber, WAIT};

/// (key, value) of every envelope received, in arrival order.
fn arrivals(sub: &Subscriber) -> TestResult<Vec<(String, u64)>> {
    let mut out = Vec::new();
    for m in sub.messages() {
        if let Published::Message(env) = Published::decode(&m.payload)? {
            out.push((env.key.to_string(), env.payload_as::<u64>()?));
        }
    }
    Ok(out)
}

fn message(key: &str, value: u64, priority: u8) -> Message {
    Message::new(format!("prio/{key}"), key, &value)
        .expect("message")
        .priority(priority)
}

#[test]
fn a_backlog_drains_highest_priority_first_each_lane_in_order() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "prio/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    // Offline, interleaved: telemetry (lane 0), warnings (lane 1), alarms (lane 3).
    outbox.transaction(|tx| {
        for i in 0..2_000u64 {
            tx.send(&message("telemetry", i, 0))?;
            if i % 400 == 399 {
                tx.send(&message("warning", i, 1))?;
                tx.send(&message("alarm", i, 3))?;
            }
        }
        Ok::<_, Error>(())
    })?;
    let _relay = Relay::start(&outbox, relay_config(broker.addr(), "prio-device"))?;
    assert!(sub.wait_for(2_010, WAIT), "only {} of 2,010 arrived", sub.len());
    let got = arrivals(&sub)?;
    let keys: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(&keys[..5], &["alarm"; 5], "alarms first: {:?}", &keys[..12]);
    assert_eq!(&keys[5..10], &["warning"; 5], "then warnings");
    for key in ["telemetry", "warning", "alarm"] {
        let values: Vec<u64> = got.iter().filter(|(k, _)| k == key).map(|(_, v)| *v).collect();
        assert!(values.windows(2).all(|w| w[0] < w[1]), "{key} out of order");
    }
    Ok(())
}

#[test]
fn an_alarm_committed_during_a_drain_overtakes_the_backlog() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "prio/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let backlog = 20_000u64;
    outbox.transaction(|tx| {
        for i in 0..backlog {
            tx.send(&message("telemetry", i, 0))?;
        }
        Ok::<_, Error>(())
    })?;
    let _relay = Relay::start(&outbox, relay_config(broker.addr(), "prio-drain"))?;
    assert!(sub.wait_for(100, WAIT), "the drain did not start");
    outbox.transaction(|tx| tx.send(&message("alarm", 1, 3)))?;
    assert!(
        sub.wait_for(backlog as usize + 1, WAIT),
        "only {} arrived",
        sub.len()
    );
    let got = arrivals(&sub)?;
    let at = got.iter().position(|(k, _)| k == "alarm").ok_or("no alarm")?;
    // The relay reads the higher lanes at every read and when the file changes: the alarm goes
    // out within a read batch and a window of its commit, not after the rest of the backlog.
    let behind = got.len() - at - 1;
    assert!(
        behind as u64 > backlog / 2,
        "the alarm arrived at position {at}, with only {behind} telemetry messages behind it"
    );
    Ok(())
}

#[test]
fn eviction_takes_the_lowest_priority_first() -> TestResult {
    let (_dir, db) = temp_db()?;
    let limits = Limits::new()
        .max_pending_messages(10)
        .on_full(OnFull::EvictOldest);
    let outbox = Outbox::open_with(&db, Options::new().limits(limits))?;
    outbox.transaction(|tx| {
        for i in 0..5 {
            tx.send(&message("alarm", i, 2).evictable(true))?;
        }
        for i in 0..10 {
            tx.send(&message("telemetry", i, 0).evictable(true))?;
        }
        Ok::<_, Error>(())
    })?;
    assert_eq!(outbox.stats()?.evicted, 5);
    let kept: Vec<(String, i64)> = outbox.with_connection(|c| {
        c.prepare("SELECT key, priority FROM outbox ORDER BY seq")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<Vec<_>, _>>()
    })?;
    assert_eq!(kept.iter().filter(|(k, _)| k == "alarm").count(), 5, "{kept:?}");
    Ok(())
}

#[test]
fn a_priority_above_the_highest_is_refused_and_nothing_is_written() -> TestResult {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let err = outbox
        .transaction(|tx| {
            tx.send(&message("ok", 1, 0))?;
            tx.send(&message("bad", 2, edge_outbox::MAX_PRIORITY + 1))
        })
        .expect_err("refused");
    assert!(
        matches!(err, Error::InvalidConfig(ref why) if why.contains("priority")),
        "{err}"
    );
    assert_eq!(outbox.stats()?.pending_messages, 0);
    // Through SQL, the column's CHECK refuses it.
    let conn = rusqlite::Connection::open(&db)?;
    let sql = conn.execute(
        "INSERT INTO outbox (topic, key, payload, priority) VALUES ('prio/x', 'x', x'01', 9)",
        [],
    );
    assert!(sql.is_err(), "a priority of 9 was stored");
    Ok(())
}

/// Batching and lanes together: telemetry packed into batches still waits for the alarms, and
/// each lane keeps its order inside and across batches.
#[test]
fn batched_telemetry_waits_for_the_alarms() -> TestResult {
    use edge_outbox::Batching;
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "prio/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        for i in 0..1_000u64 {
            tx.send(&message("telemetry", i, 0))?;
            if i % 250 == 249 {
                tx.send(&message("alarm", i, 3))?;
            }
        }
        Ok::<_, Error>(())
    })?;
    let config = relay_config(broker.addr(), "prio-batched").batch("prio/telemetry", Batching::new());
    let _relay = Relay::start(&outbox, config)?;
    assert!(
        sub.wait_messages(WAIT, |m| {
            m.iter()
                .filter_map(|m| Published::decode_all(&m.payload).ok())
                .map(|items| items.len())
                .sum::<usize>()
                >= 1_004
        }),
        "not everything arrived"
    );
    let publishes = sub.messages();
    let mut keys = Vec::new();
    let mut telemetry = Vec::new();
    for m in &publishes {
        for item in Published::decode_all(&m.payload)? {
            if let Published::Message(env) = item {
                keys.push(env.key.to_string());
                if env.key == "telemetry" {
                    telemetry.push(env.payload_as::<u64>()?);
                }
            }
        }
    }
    assert_eq!(&keys[..4], &["alarm"; 4], "alarms first: {:?}", &keys[..6]);
    assert!(
        publishes.len() < 100,
        "{} publishes for 1,004 messages: no batches",
        publishes.len()
    );
    assert_eq!(telemetry, (0..1_000).collect::<Vec<u64>>());
    Ok(())
}

/// The scenario above fails against the mutant that breaks it.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "lanes-lowest-first",
        "a_backlog_drains_highest_priority_first_each_lane_in_order",
        "alarms first",
    )
}
