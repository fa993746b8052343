//! Limits at the edges, each with its documented outcome: topics are checked when a message is
//! enqueued (a clear error, nothing written), rows that reach the outbox another way with a topic
//! the rules refuse are dead-lettered by the relay, and a command larger than anything the device
//! accepts is dead-lettered and acknowledged, never left to wedge the command session.

mod common;
mod support;

use std::time::Duration;

use common::TestResult;

use edge_outbox::{Envelope, Error, Limits, MessageId, Options, Outbox, Relay};
use rumqttc::QoS;
use support::device::{open_device, relay_config, wait_drained};
use support::{Broker, Subscriber, WAIT, publish_raw};

#[test]
fn topics_are_checked_at_enqueue_with_the_rule_they_break() {
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = Outbox::open(dir.path().join("t.db")).expect("open");
    let long = "t".repeat(65_536);
    for (topic, rule) in [
        ("", "empty"),
        ("a/+/b", "wildcard"),
        ("a/#", "wildcard"),
        ("a\0b", "NUL"),
        ("$SYS/broker/x", "'$'"),
        (long.as_str(), "65,535"),
    ] {
        let err = outbox
            .transaction(|tx| tx.publish(topic, "k", &1))
            .expect_err("refused");
        assert!(matches!(&err, Error::InvalidTopic { .. }), "{err}");
        assert!(err.to_string().contains(rule), "{topic:.20?}: {err}");
    }
    assert_eq!(
        outbox.stats().expect("stats").pending_messages,
        0,
        "nothing written"
    );
    // At the limit, and `$` when allowed.
    outbox
        .transaction(|tx| tx.publish(&long[1..], "k", &1))
        .expect("65,535 bytes is allowed");
    let dollar = Outbox::open_with(
        dir.path().join("d.db"),
        Options::new().limits(Limits::new().allow_dollar_topics(true)),
    )
    .expect("open");
    dollar
        .transaction(|tx| tx.publish("$aws/things/pump-17/shadow/update", "k", &1))
        .expect("allowed");
}

#[test]
fn rows_with_refused_topics_written_through_sql_are_dead_lettered_by_the_relay() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "sql/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let conn = rusqlite::Connection::open(outbox.path()).expect("foreign connection");
    for topic in ["$SYS/x", "sql/a\0b", "sql/ok"] {
        conn.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES (?1, 'k', x'01')",
            [topic],
        )
        .expect("insert");
    }
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "sql-topics")).expect("relay");
    assert!(sub.wait_for(1, WAIT), "the good row behind the refused ones");
    assert!(wait_drained(&outbox, WAIT));
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 2, "{dead:#?}");
    assert!(
        dead.iter().all(|d| d.reason.contains("not a valid MQTT topic")),
        "{dead:#?}"
    );
    relay.shutdown().expect("shutdown");
}

/// A command far above the inbox's payload limit (and above the relay's own packet limit) is
/// taken, dead-lettered and acknowledged; the command after it is stored. Before, a delivery
/// above rumqttc's incoming limit failed the connection, the broker redelivered it on the next,
/// and the session never got past it.
#[test]
fn an_oversized_command_is_dead_lettered_and_the_session_goes_on() {
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let config = relay_config(broker.addr(), "big-command").commands("big/commands/#");
    let relay = Relay::start(&outbox, config).expect("relay");
    let deadline = std::time::Instant::now() + WAIT;
    while !relay.status().expect("status").commands_connected {
        assert!(std::time::Instant::now() < deadline, "command session ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    let envelope = |payload: Vec<u8>| {
        Envelope {
            id: MessageId::new_v7(),
            source: "cloud".into(),
            epoch: 0,
            seq: 1,
            key: "k".into(),
            created_ms: 0,
            event_type: None,
            headers: vec![],
            payload: edge_outbox::envelope::to_cbor(&serde_bytes(payload))
                .expect("cbor")
                .into(),
        }
        .encode()
    };
    let big = envelope(vec![1u8; 300 * 1024]);
    let small = envelope(vec![2u8; 10]);
    publish_raw(broker.addr(), "big/commands/x", &big, QoS::AtLeastOnce).expect("publish big");
    publish_raw(broker.addr(), "big/commands/x", &small, QoS::AtLeastOnce).expect("publish small");
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let stats = outbox.stats().expect("stats");
        if stats.inbox_unapplied == 1 && stats.dead_letters == 1 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{stats:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let dead = outbox.dead_letters(10).expect("dead letters");
    // Above RelayConfig::max_command_bytes (64 KiB): set aside by the session, bytes not kept.
    assert!(dead[0].reason.contains("exceeds the limit"), "{}", dead[0].reason);
    assert!(relay.status().expect("status").commands_connected);
    relay.shutdown().expect("shutdown");
}

/// Bytes as a CBOR byte string (serde's Vec<u8> is an array of numbers).
fn serde_bytes(v: Vec<u8>) -> ciborium::Value {
    ciborium::Value::Bytes(v)
}

/// Storage policy per class (`Limits::class`): under a limit, telemetry makes room and alarms
/// never do; a message's own setting wins over its class; a class's lifetime and coalescing
/// reach the row. A build that ignored classes would evict nothing (telemetry not evictable by
/// default) and fail the telemetry commits, or evict alarms.
#[test]
fn telemetry_evicts_and_alarms_never_do() -> TestResult {
    use edge_outbox::{Message, MessageClass, OnFull};
    let dir = tempfile::tempdir()?;
    let limits = Limits::new()
        .max_pending_messages(10)
        .on_full(OnFull::EvictOldest)
        .class(
            "telemetry/#",
            MessageClass::new()
                .evictable(true)
                .coalescing(false)
                .expires_after(Duration::from_secs(600)),
        )
        .class("alarms/#", MessageClass::new().priority(3))
        .class("sensors/#", MessageClass::new().coalescing(true));
    let outbox = Outbox::open_with(dir.path().join("t.db"), Options::new().limits(limits))?;
    outbox.transaction(|tx| {
        for i in 0..5 {
            tx.publish("alarms/door", "door", &i)?;
        }
        for i in 0..20 {
            tx.publish("telemetry/t1", "t1", &i)?;
        }
        Ok::<_, Error>(())
    })?;
    let stats = outbox.stats()?;
    assert_eq!((stats.pending_messages, stats.evicted), (10, 15), "{stats}");
    let count = |sql: &str| -> TestResult<i64> {
        Ok(outbox.with_connection(|c| c.query_row(sql, [], |r| r.get(0)))?)
    };
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE topic = 'alarms/door' AND priority = 3 AND evictable = 0")?,
        5
    );
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE topic = 'telemetry/t1' AND expires_at IS NOT NULL")?,
        5
    );
    // Only alarms and a telemetry reading that says it must stay: nothing left to evict.
    outbox.transaction(|tx| tx.send(&Message::new("telemetry/t1", "t1", &99)?.evictable(false)))?;
    // It evicted one of the five; four more alarms evict the other four.
    for i in 0..4 {
        outbox.transaction(|tx| tx.publish("alarms/door", "door", &(10 + i)))?;
    }
    assert_eq!(count("SELECT count(*) FROM outbox WHERE evictable = 1")?, 0);
    let full = outbox.transaction(|tx| tx.publish("alarms/door", "door", &100));
    assert!(matches!(full, Err(Error::StorageFull { .. })), "{full:?}");
    // A class's coalescing: the second sensor reading replaces the first.
    let outbox2 = Outbox::open_with(
        dir.path().join("s.db"),
        Options::new().limits(Limits::new().class("sensors/#", MessageClass::new().coalescing(true))),
    )?;
    outbox2.transaction(|tx| {
        tx.publish("sensors/t", "t", &1)?;
        tx.publish("sensors/t", "t", &2)
    })?;
    assert_eq!(outbox2.stats()?.coalesced, 1);
    // A class with a priority above the highest is refused when the store is opened.
    let bad = Options::new().limits(Limits::new().class("x/#", MessageClass::new().priority(9)));
    assert!(matches!(
        Outbox::open_with(dir.path().join("b.db"), bad),
        Err(Error::InvalidConfig(_))
    ));
    Ok(())
}
