//! The JSON envelope (`RelayConfig::envelope_format(EnvelopeFormat::Json)`): the same fields as
//! the CBOR one, read here with a plain JSON parser, not the crate's decoder; messages, a batch
//! and a gap notice through a real broker; the consumer module reads the stream with the same
//! dedupe and gap rules as CBOR. A payload JSON cannot carry is set aside with the reason, never
//! altered to fit (mutant `json-lossy-payload` sends a byte string as hex text, and is caught).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use edge_outbox::consumer::Consumer;
use edge_outbox::{
    Batching, Compression, EnvelopeFormat, Error, Limits, Message, MqttConfig, Options, Outbox, Protocol,
    Relay, RelayConfig,
};
use serde_json::{Value, json};
use support::{Broker, BrokerKind, MqttProxy, Subscriber, WAIT};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const DEVICE: &str = "pump-17";
const SCENARIO: &str = "the_relay_publishes_json_envelopes_with_the_cbor_fields";
const SET_ASIDE: &str = "a payload JSON cannot carry was set aside, not altered";

/// A CBOR byte string: a payload JSON has no form for.
const BYTES_PAYLOAD: [u8; 3] = [0x42, 0xca, 0xfe];

fn relay_config(front: &MqttProxy, broker: &Broker) -> RelayConfig {
    // rumqttd 0.20 cannot pass a publish with MQTT 5 properties (a JSON publish's content type)
    // to the 3.1.1 subscriber: 3.1.1 there.
    let protocol = if broker.kind() == BrokerKind::Rumqttd {
        Protocol::V311
    } else {
        Protocol::V5
    };
    let mqtt = MqttConfig::new("127.0.0.1", front.addr().port())
        .protocol(protocol)
        .client_id(DEVICE)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2))
        .message_expiry(false);
    RelayConfig::new(mqtt)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
        .envelope_format(EnvelopeFormat::Json)
}

#[test]
fn the_relay_publishes_json_envelopes_with_the_cbor_fields() -> TestResult {
    let broker = Broker::start()?;
    let front = MqttProxy::start(broker.addr())?;
    front.record_publishes(true);
    let sub = Subscriber::start(broker.addr(), "pumps/#")?;
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open(dir.path().join("device.db"))?;
    let payload = json!({"flow": 12.5, "ok": true, "n": -3, "tags": ["a", "é"], "none": null});
    let mut expected: BTreeMap<String, (String, Value)> = BTreeMap::new();
    outbox.transaction(|tx| {
        let id = tx.send(
            &Message::new("pumps/17/readings", "pump-17", &payload)?
                .event_type("Reading.v1")
                .header("trace", "t-1"),
        )?;
        expected.insert(id.to_string(), ("pump-17".into(), payload.clone()));
        let id = tx.publish("pumps/17/log", "", &"text")?;
        expected.insert(id.to_string(), (String::new(), json!("text")));
        for i in 0..4_u64 {
            let id = tx.publish("pumps/17/batched", "b", &i)?;
            expected.insert(id.to_string(), ("b".into(), json!(i)));
        }
        Ok::<_, Error>(())
    })?;
    outbox.transaction(|tx| tx.send(&Message::from_cbor("pumps/17/raw", "r", BYTES_PAYLOAD.to_vec())?))?;
    let config = relay_config(&front, &broker).batch(
        "pumps/17/batched",
        Batching::new().linger(Duration::from_millis(200)),
    );
    let relay = Relay::start(&outbox, config)?;
    let mut consumer = Consumer::new();
    let mut seen: BTreeMap<String, (String, Value)> = BTreeMap::new();
    let mut notices = Vec::new();
    let mut batches = 0;
    let items = |got: &[support::Message]| -> usize {
        got.iter()
            .filter_map(|m| edge_outbox::Published::decode_all(&m.payload).ok())
            .map(|items| items.len())
            .sum()
    };
    let done = sub.wait_messages(WAIT, |got| items(got) > expected.len());
    relay.shutdown()?;
    assert!(
        done,
        "the messages, one batch and the notice arrived: {:?}",
        sub.messages()
    );
    for m in sub.messages() {
        let v: Value = serde_json::from_slice(&m.payload)?;
        consumer.observe_all(&m.payload)?;
        let items = match v.get("batch") {
            Some(Value::Array(members)) => {
                batches += 1;
                assert_eq!(v["v"], json!(3), "{v}");
                members.clone()
            }
            _ => vec![v],
        };
        for item in items {
            assert_eq!(item["src"], json!(DEVICE), "{item}");
            assert!(item["ep"].as_u64().is_some_and(|e| e > 0), "{item}");
            if let Some(gap) = item.get("gap") {
                notices.push(gap.clone());
                continue;
            }
            assert_eq!(item["v"], json!(2), "{item}");
            assert!(
                item["seq"].as_u64().is_some() && item["ts"].as_u64().is_some(),
                "{item}"
            );
            let id = item["id"].as_str().ok_or("id is text")?.to_owned();
            let key = item["key"].as_str().ok_or("key is text")?.to_owned();
            seen.insert(id, (key, item["p"].clone()));
            if item["key"] == json!("pump-17") {
                assert_eq!(item["type"], json!("Reading.v1"));
                assert_eq!(item["hdr"], json!({"trace": "t-1"}));
            }
        }
    }
    assert_eq!(
        outbox.dead_letters(10)?.len(),
        1,
        "{SET_ASIDE}: {:?}",
        outbox.dead_letters(10)
    );
    assert_eq!(seen, expected, "every message, its key and its payload, as JSON");
    assert!(batches >= 1, "the batched topic went out as a JSON batch");
    let dead = &outbox.dead_letters(10)?[0];
    assert!(
        dead.reason.contains("JSON envelope cannot carry") && dead.reason.contains("byte string"),
        "{}",
        dead.reason
    );
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert_eq!(notices[0]["cause"], json!("dead-lettered"));
    let report = consumer.report();
    assert_eq!(
        (report.totals.unexplained, report.totals.duplicates),
        (0, 0),
        "the consumer reads JSON with the same rules: {report:?}"
    );
    assert_eq!(report.totals.delivered, expected.len() as u64);
    assert_eq!(report.totals.announced, 1);
    // Under MQTT 5 each publish says it is JSON text.
    if broker.kind() != BrokerKind::Rumqttd {
        for p in front.recorded() {
            assert_eq!(p.content_type.as_deref(), Some("application/json"), "{}", p.topic);
            assert_eq!(p.payload_format, Some(1), "{}", p.topic);
        }
    }
    Ok(())
}

#[test]
fn a_payload_altered_to_fit_json_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by("json-lossy-payload", SCENARIO, SET_ASIDE)
}

#[test]
fn what_json_cannot_carry_is_refused_where_it_is_written_when_asked() -> TestResult {
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open_with(
        dir.path().join("device.db"),
        Options::new().limits(Limits::new().json_payloads(true)),
    )?;
    outbox.transaction(|tx| tx.publish("pumps/17", "", &json!({"ok": [1, 2.5, "x"]})))?;
    for (cbor, what) in [
        (BYTES_PAYLOAD.to_vec(), "a byte string at p"),
        (vec![0xa1, 0x01, 0x02], "a map key that is not text"),
        (vec![0xc1, 0x00], "a tag"),
        (vec![0xf9, 0x7e, 0x00], "NaN"),
    ] {
        let refused = outbox
            .transaction(|tx| tx.send(&Message::from_cbor("pumps/17", "", cbor.clone())?))
            .expect_err(what);
        assert!(matches!(refused, Error::Encode(_)), "{refused:?}");
        assert!(refused.to_string().contains(what), "{refused}");
    }
    assert_eq!(
        outbox.stats()?.pending_messages,
        1,
        "nothing of a refused transaction kept"
    );
    // A JSON batch cannot be compressed: refused before anything starts.
    let mqtt = MqttConfig::new("127.0.0.1", 1883).client_id(DEVICE);
    let zlib = RelayConfig::new(mqtt)
        .envelope_format(EnvelopeFormat::Json)
        .batch("pumps/#", Batching::new().compression(Compression::Zlib));
    let refused = zlib.check().expect_err("zlib with JSON");
    assert!(refused.to_string().contains("zlib"), "{refused}");
    Ok(())
}

#[test]
fn the_decoders_read_a_json_envelope_and_refuse_bad_json_clearly() -> TestResult {
    let id = "0190f3a4-7b2c-7d3e-8f00-0123456789ab";
    let text = format!(
        r#" {{"v":2,"id":"{id}","src":"pump-17","ep":7,"seq":3,"key":"k","ts":1,"p":{{"a":[1,2]}}}}"#
    );
    let edge_outbox::Published::Message(env) = edge_outbox::Published::decode(text.as_bytes())? else {
        return Err("a message".into());
    };
    // Commands stay CBOR: the inbox's decoder does not take JSON.
    let refused = edge_outbox::Envelope::decode(text.as_bytes()).expect_err("JSON is not a command");
    assert!(refused.to_string().contains("this is JSON text"), "{refused}");
    assert_eq!((env.id.to_string(), env.epoch, env.seq), (id.to_owned(), 7, 3));
    let p: serde_json::Value = env.payload_as()?;
    assert_eq!(p, json!({"a": [1, 2]}));
    for (bad, why) in [
        (r#"{"v":2,"id":"nope","p":1}"#, "id"),
        (r#"{"v":2,"#, "JSON"),
        (r#"{"v":3,"batch":[1]}"#, "batch"),
    ] {
        let e = edge_outbox::Published::decode_all(bad.as_bytes()).expect_err(bad);
        assert!(matches!(e, Error::Decode(_)), "{e:?}");
        assert!(e.to_string().contains(why), "{bad}: {e}");
    }
    Ok(())
}
