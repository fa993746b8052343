//! Whatever the command topic delivers, the device shrugs it off:
//!
//! - a delivery above the command size limit (and above the MQTT packet limit) is dead-lettered
//!   without its bytes and acknowledged, and the session goes on;
//! - retained deliveries are ignored by default, and when kept are stored once, however often the
//!   broker sends them again and whatever the retention;
//! - invalid topic filters are refused when the relay starts;
//! - bad UTF-8, bad CBOR, an unknown envelope version, duplicate keys, JSON text and a UUID sent
//!   as text are dead-lettered with a reason that names the problem;
//! - decoding a map of many keys costs work linear in their number (counted, not timed).

mod common;
mod support;

use std::time::Duration;

use ciborium::Value;
use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::envelope::decode_key_comparisons;
use edge_outbox::{
    Command, Envelope, Error, MessageId, MqttConfig, Options, Outbox, Received, Relay, RelayConfig, Tx,
};
use rumqttc::QoS;
use support::device::relay_config;
use support::{Broker, publish_raw, publish_raw_many, publish_retained, wait_until};

const FILTER: &str = "devices/d1/commands/#";
const TOPIC: &str = "devices/d1/commands/credit";

fn open(path: &std::path::Path, options: Options) -> TestResult<Outbox> {
    let outbox = Outbox::open_with(path, options)?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS balance (credits INTEGER NOT NULL);
             INSERT INTO balance SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM balance);",
        )
    })?;
    Ok(outbox)
}

fn start(outbox: &Outbox, config: RelayConfig) -> TestResult<Relay> {
    let relay = Relay::start_with_handler(
        outbox,
        config.commands(FILTER),
        |tx: &mut Tx<'_>, cmd: &Command| {
            let credits: i64 = cmd.payload_as()?;
            tx.execute("UPDATE balance SET credits = credits + ?1", [credits])?;
            Ok::<_, Error>(())
        },
    )?;
    if !wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)) {
        return Err("the command session never subscribed".into());
    }
    Ok(relay)
}

fn balance(outbox: &Outbox) -> i64 {
    query_i64(outbox, "SELECT credits FROM balance").unwrap_or(-1)
}

#[test]
fn an_oversized_delivery_is_dead_lettered_and_acknowledged_and_the_session_goes_on() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new())?;
    // Above the command limit and above the MQTT packet limit the device uses for itself: a
    // session that could not read it would reconnect, and be sent it again, for ever.
    let config = || {
        RelayConfig::new(
            MqttConfig::new(broker.host(), broker.port())
                .client_id("limits-oversize")
                .max_packet_size(8 * 1024)
                .keep_alive(Duration::from_secs(2)),
        )
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
        .max_command_bytes(4 * 1024)
    };
    let relay = start(&outbox, config())?;
    let huge = vec![0x42u8; 100 * 1024];
    let good = command_bytes(MessageId::new_v7(), "acct", &5)?;
    publish_raw_many(broker.addr(), &[(TOPIC, &huge), (TOPIC, &good)], QoS::AtLeastOnce)?;
    assert!(
        wait_until(|| balance(&outbox) == 5),
        "the command behind the oversized one was applied"
    );
    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead.len(), 1, "{dead:#?}");
    assert!(
        dead[0]
            .reason
            .contains("102400 bytes exceeds the limit of 4096 bytes"),
        "{}",
        dead[0].reason
    );
    assert_eq!(
        dead[0].payload, None,
        "an oversized delivery's bytes are not kept"
    );
    let status = relay.status()?;
    assert_eq!(
        (status.commands_malformed, status.connections),
        (1, 1),
        "{status:?}"
    );
    relay.shutdown()?;

    // It was acknowledged: a new session gets no redelivery.
    let relay = start(&outbox, config())?;
    publish_raw(
        broker.addr(),
        TOPIC,
        &command_bytes(MessageId::new_v7(), "acct", &1)?,
        QoS::AtLeastOnce,
    )?;
    assert!(wait_until(|| balance(&outbox) == 6));
    assert_eq!(outbox.dead_letters(10)?.len(), 1);
    relay.shutdown()?;
    Ok(())
}

#[test]
fn a_backlog_queued_offline_is_received_on_one_connection() -> TestResult {
    const BACKLOG: usize = 2_000;
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(
        &path,
        Options::new().synchronous(edge_outbox::Synchronous::Normal),
    )?;
    // The default keep-alive: the backlog is read as fast as it is stored, and a debug build
    // stores slowly.
    let config = || {
        RelayConfig::new(MqttConfig::new(broker.host(), broker.port()).client_id("limits-backlog"))
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
    };
    start(&outbox, config())?.shutdown()?;
    let commands: Vec<Vec<u8>> = (0..BACKLOG)
        .map(|i| command_bytes(MessageId::new_v7(), &format!("acct-{}", i % 8), &1))
        .collect::<TestResult<_>>()?;
    let messages: Vec<(&str, &[u8])> = commands.iter().map(|c| (TOPIC, c.as_slice())).collect();
    publish_raw_many(broker.addr(), &messages, QoS::AtLeastOnce)?;

    // mosquitto sends a queued backlog without waiting for acks, faster than they are sent: the
    // acks queue up in the client, and a full queue would force a reconnect (and redeliveries).
    let relay = Relay::start(&outbox, config().commands(FILTER))?;
    assert!(
        wait_until(|| relay
            .status()
            .is_ok_and(|s| s.commands_received == BACKLOG as u64)),
        "{:?}",
        relay.status()?
    );
    let status = relay.status()?;
    assert_eq!(
        (status.commands_duplicate, status.last_error.as_deref()),
        (0, None),
        "the backlog was received on one connection: {status:?}"
    );
    relay.shutdown()?;
    Ok(())
}

#[test]
fn retained_deliveries_are_ignored_by_default() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new())?;
    let retained_topic = "devices/d1/commands/retained";
    publish_retained(
        broker.addr(),
        retained_topic,
        &command_bytes(MessageId::new_v7(), "acct", &100)?,
        QoS::AtLeastOnce,
    )?;
    // A new command session each run: every broker sends retained messages to a new
    // subscription (mosquitto also to a persistent session that subscribes again; rumqttd not).
    for run in 0..2 {
        let config = relay_config(broker.addr(), "limits-retained-ignored")
            .commands_client_id(format!("ignoring-{run}"));
        let relay = start(&outbox, config)?;
        assert!(
            wait_until(|| relay.status().is_ok_and(|s| s.commands_retained_ignored >= 1)),
            "run {run}: the retained delivery was not seen ({:?})",
            broker.kind()
        );
        // A live command behind it is applied; the retained one never is.
        publish_raw(
            broker.addr(),
            TOPIC,
            &command_bytes(MessageId::new_v7(), "acct", &1)?,
            QoS::AtLeastOnce,
        )?;
        assert!(wait_until(|| balance(&outbox) == run + 1));
        let status = relay.status()?;
        assert_eq!(status.commands_received, 1, "{status:?}");
        relay.shutdown()?;
    }
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM inbox")?, 2);
    assert_eq!(outbox.stats()?.dead_letters, 0);
    publish_retained(broker.addr(), retained_topic, &[], QoS::AtLeastOnce)?;
    Ok(())
}

#[test]
fn retained_commands_when_kept_are_stored_once_across_resubscriptions_and_the_retention() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    // No retention at all: only the retained flag keeps the id.
    let outbox = open(&path, Options::new().inbox_retention(Duration::ZERO))?;
    let retained_topic = "devices/d1/commands/setpoint";
    // A new command session each time: every broker sends retained messages to a new
    // subscription (mosquitto also to a persistent session that subscribes again; rumqttd not).
    let config = |session: &str| {
        relay_config(broker.addr(), "limits-retained-kept")
            .retained_commands(true)
            .commands_client_id(format!("keeping-{session}"))
    };
    publish_retained(
        broker.addr(),
        retained_topic,
        &command_bytes(MessageId::new_v7(), "acct", &100)?,
        QoS::AtLeastOnce,
    )?;
    let relay = start(&outbox, config("first"))?;
    assert!(
        wait_until(|| balance(&outbox) == 100),
        "the retained command was applied"
    );
    relay.shutdown()?;
    std::thread::sleep(Duration::from_millis(5));
    outbox.prune()?;
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM inbox WHERE retained = 1")?,
        1
    );

    // Every new subscription gets the retained command again.
    for run in 0..2 {
        let relay = start(&outbox, config(&run.to_string()))?;
        assert!(
            wait_until(|| relay.status().is_ok_and(|s| s.commands_duplicate >= 1)),
            "run {run}: the retained command was not sent again ({:?})",
            broker.kind()
        );
        relay.shutdown()?;
        outbox.prune()?;
    }
    assert_eq!(balance(&outbox), 100, "applied once");

    // A newer retained command replaces it at the broker: now the old id may go.
    let relay = start(&outbox, config("last"))?;
    publish_retained(
        broker.addr(),
        retained_topic,
        &command_bytes(MessageId::new_v7(), "acct", &1)?,
        QoS::AtLeastOnce,
    )?;
    assert!(wait_until(|| balance(&outbox) == 101));
    relay.shutdown()?;
    std::thread::sleep(Duration::from_millis(5));
    outbox.prune()?;
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM inbox")?, 1);
    publish_retained(broker.addr(), retained_topic, &[], QoS::AtLeastOnce)?;
    Ok(())
}

#[test]
fn invalid_topic_filters_are_refused_when_the_relay_starts() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new())?;
    let long = "a".repeat(65_536);
    for (filter, rule) in [
        ("", "empty"),
        ("devices/#/commands", "'#' must be a whole level and the last one"),
        ("devices/d1#", "'#' must be a whole level"),
        ("devices/d+/commands", "'+' must be a whole level"),
        ("devices/\u{0}/commands", "control character"),
        (long.as_str(), "65535"),
    ] {
        let config = relay_config(broker.addr(), "limits-filters").commands(filter);
        match Relay::start(&outbox, config) {
            Err(Error::InvalidConfig(why)) => assert!(why.contains(rule), "{filter:.40?}: {why}"),
            Err(other) => panic!("{filter:.40?}: expected InvalidConfig, got {other}"),
            Ok(relay) => {
                relay.shutdown()?;
                panic!("{filter:.40?} was accepted");
            }
        }
    }
    // Nothing was left running or locked.
    start(&outbox, relay_config(broker.addr(), "limits-filters"))?.shutdown()?;
    Ok(())
}

/// A CBOR map from `pairs`, keys written as given (duplicates included).
fn map(pairs: Vec<(&str, Value)>) -> TestResult<Vec<u8>> {
    let value = Value::Map(
        pairs
            .into_iter()
            .map(|(k, v)| (Value::Text(k.into()), v))
            .collect(),
    );
    let mut out = Vec::new();
    ciborium::into_writer(&value, &mut out)?;
    Ok(out)
}

fn id_value() -> Value {
    Value::Bytes(MessageId::new_v7().as_bytes().to_vec())
}

#[test]
fn malformed_deliveries_are_dead_lettered_with_a_reason_that_names_the_problem() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new())?;
    let relay = start(&outbox, relay_config(broker.addr(), "limits-malformed"))?;

    let mut bad_utf8 = map(vec![
        ("v", Value::Integer(1.into())),
        ("id", id_value()),
        ("key", Value::Text("@@".into())),
        ("p", Value::Integer(1.into())),
    ])?;
    let at = bad_utf8.windows(2).position(|w| w == b"@@").ok_or("no marker")?;
    bad_utf8[at..at + 2].copy_from_slice(&[0xff, 0xfe]);
    let good = command_bytes(MessageId::new_v7(), "acct", &3)?;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("envelope field \"key\": text is not UTF-8", bad_utf8),
        ("truncated CBOR", good[..good.len() - 3].to_vec()),
        (
            "envelope version 3 is not supported",
            map(vec![
                ("v", Value::Integer(3.into())),
                ("id", id_value()),
                ("p", Value::Null),
            ])?,
        ),
        (
            "envelope key \"p\" appears twice",
            map(vec![
                ("v", Value::Integer(1.into())),
                ("id", id_value()),
                ("p", Value::Null),
                ("p", Value::Integer(9.into())),
            ])?,
        ),
        (
            "this is JSON text; commands are CBOR envelopes",
            br#"{"v": 1, "id": "0b9e1c3e-0000-4000-8000-000000000000", "key": "acct", "p": 5}"#.to_vec(),
        ),
        (
            "envelope field \"id\": expected a byte string, found a text string (this is a UUID as text",
            map(vec![
                ("v", Value::Integer(1.into())),
                ("id", Value::Text(MessageId::new_v7().to_string())),
                ("p", Value::Null),
            ])?,
        ),
        (
            "envelope field \"seq\": expected an unsigned integer, found a text string",
            map(vec![
                ("v", Value::Integer(1.into())),
                ("id", id_value()),
                ("seq", Value::Text("1".into())),
                ("p", Value::Null),
            ])?,
        ),
    ];
    let mut messages: Vec<(&str, &[u8])> = cases.iter().map(|(_, b)| (TOPIC, b.as_slice())).collect();
    messages.push((TOPIC, &good));
    publish_raw_many(broker.addr(), &messages, QoS::AtLeastOnce)?;
    assert!(
        wait_until(|| balance(&outbox) == 3),
        "the good command behind them was applied"
    );
    let dead = outbox.dead_letters(100)?;
    assert_eq!(dead.len(), cases.len(), "{dead:#?}");
    for ((expected, bytes), d) in cases.iter().zip(&dead) {
        assert!(
            d.reason.contains(expected),
            "reason {:?} lacks {expected:?}",
            d.reason
        );
        assert_eq!(
            d.payload.as_deref(),
            Some(bytes.as_slice()),
            "the raw bytes are kept"
        );
    }
    assert_eq!(relay.status()?.commands_malformed, cases.len() as u64);
    relay.shutdown()?;
    Ok(())
}

/// An envelope with `n` keys this version does not know, each with a small value.
fn many_keys(n: usize, id: MessageId) -> TestResult<Vec<u8>> {
    let names: Vec<String> = (0..n).map(|i| format!("x{i:06}")).collect();
    let mut pairs = vec![
        ("v", Value::Integer(1.into())),
        ("id", Value::Bytes(id.as_bytes().to_vec())),
        ("key", Value::Text("acct".into())),
    ];
    pairs.extend(names.iter().map(|k| (k.as_str(), Value::Integer(0.into()))));
    pairs.push(("p", Value::Integer(1.into())));
    map(pairs)
}

#[test]
fn a_map_of_many_keys_decodes_in_work_linear_in_its_size() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new().limits(edge_outbox::Limits::new()))?;
    let mut work = Vec::new();
    for keys in [4_000, 16_000, 64_000] {
        let id = MessageId::new_v7();
        let bytes = many_keys(keys, id)?;
        let comparisons = decode_key_comparisons(&bytes);
        eprintln!(
            "{keys} unknown keys ({} bytes): {comparisons} key comparisons",
            bytes.len()
        );
        // Comparing each key with every earlier one would take keys²/2 (8 million at 4,000).
        assert!(
            comparisons <= keys as u64,
            "{comparisons} key comparisons for {keys} keys"
        );
        work.push(comparisons);
        // The unknown keys are ignored: the command is stored.
        assert_eq!(outbox.receive(TOPIC, &bytes)?, Received::Stored(id));
        assert_eq!(Envelope::decode(&bytes)?.key, "acct");
    }
    // A repeated unknown key is still caught, however many keys there are.
    let mut repeated = many_keys(16_000, MessageId::new_v7())?;
    let first = repeated
        .windows(8)
        .position(|w| w == b"\x67x000001")
        .ok_or("no key")?;
    repeated[first + 7] = b'0'; // "x000001" becomes a second "x000000"
    let err = Envelope::decode(&repeated).expect_err("a repeated key");
    assert!(err.to_string().contains("\"x000000\" appears twice"), "{err}");
    eprintln!("key comparisons per size: {work:?}");
    Ok(())
}
