//! Routing fields (`RelayConfig::routing_fields`): every publish repeats its envelope's `id`,
//! `src`, `ep`, `seq`, `key` and `type` where a cloud's rules engine reads them without decoding
//! CBOR, and they say exactly what the payload says.
//!
//! - MQTT 5: user properties and the Content Type property, read off the wire by an MQTT-aware
//!   proxy in front of the real broker, for messages, a batch and a gap notice;
//! - Azure IoT Hub (MQTT 3.1.1): the property bag after the events topic, parsed the way the hub
//!   parses it (pairs split on `&` and `=`, then URL-decoded), with keys that hold the bag's own
//!   separators. A relay that writes the bag unencoded (mutant `property-bag-unencoded`) is
//!   caught: the hub reads other values than the envelope's.
//!
//! Nothing here needs a subscriber: what the broker got is what the proxy forwarded, and the
//! outbox draining says the broker acknowledged all of it.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use edge_outbox::{
    Batching, CloudProfile, Limits, Message, MqttConfig, Options, Outbox, Protocol, Published, Relay,
    RelayConfig,
};
use support::mqtt_proxy::Publish;
use support::{Broker, MqttProxy, wait_until};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const DEVICE: &str = "pump-17";
const EVENTS: &str = "devices/pump-17/messages/events/";
/// Keys holding what would end a bag's pair or value, add a topic level, or be a wildcard.
const AWKWARD_KEYS: [&str; 4] = ["a/b", "c&d=e", "f+g#h", "50% é"];
const HUB_SCENARIO: &str = "the_azure_profile_puts_them_in_the_property_bag_url_encoded";

fn mqtt(front: &MqttProxy, protocol: Protocol) -> MqttConfig {
    MqttConfig::new("127.0.0.1", front.addr().port())
        .protocol(protocol)
        .client_id(DEVICE)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2))
}

fn drained(outbox: &Outbox) -> bool {
    wait_until(|| outbox.stats().is_ok_and(|s| s.pending_messages == 0))
}

/// The fields a rules engine should read for one decoded item, by name.
fn expected(item: &Published) -> BTreeMap<String, String> {
    let mut want = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        want.insert(k.to_owned(), v);
    };
    match item {
        Published::Message(e) => {
            put("id", e.id.to_string());
            put("src", e.source.to_string());
            put("ep", e.epoch.to_string());
            put("seq", e.seq.to_string());
            put("key", e.key.to_string());
            if let Some(t) = &e.event_type {
                put("type", t.to_string());
            }
        }
        Published::Gap(g) => {
            put("id", g.id.to_string());
            put("src", g.source.clone());
            put("ep", g.epoch.to_string());
            put("gap", format!("{}-{}", g.first, g.last));
            put("cause", g.cause.to_string());
        }
        _ => {}
    }
    want
}

/// What a batch's fields should be: its first message's source and epoch, the range of numbers
/// and how many.
fn expected_batch(items: &[Published]) -> BTreeMap<String, String> {
    let seqs: Vec<u64> = items
        .iter()
        .filter_map(|i| match i {
            Published::Message(e) => Some(e.seq),
            _ => None,
        })
        .collect();
    let first = expected(&items[0]);
    let mut want = BTreeMap::new();
    for k in ["src", "ep"] {
        want.insert(k.to_owned(), first[k].clone());
    }
    want.insert(
        "seq".into(),
        format!("{}-{}", seqs.first().unwrap_or(&0), seqs.last().unwrap_or(&0)),
    );
    want.insert("n".into(), items.len().to_string());
    want
}

#[test]
fn mqtt5_publishes_carry_them_as_user_properties() -> TestResult {
    let broker = Broker::start()?;
    let front = MqttProxy::start(broker.addr())?;
    front.record_publishes(true);
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open(dir.path().join("device.db"))?;
    outbox.transaction(|tx| {
        for (i, key) in AWKWARD_KEYS.iter().enumerate() {
            tx.send(&Message::new("pumps/17/readings", *key, &(i as u64))?.event_type("Reading.v1"))?;
        }
        tx.publish("pumps/17/log", "", &"no key, no type")?;
        for i in 0..5_u64 {
            tx.publish("pumps/17/batched", "b", &i)?;
        }
        Ok::<_, edge_outbox::Error>(())
    })?;
    // A row no broker could take: dead-lettered, and announced with a gap notice.
    outbox.with_connection(|c| {
        c.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES ('pumps/17/log', 'x', x'ff')",
            [],
        )
    })?;
    let config = RelayConfig::new(mqtt(&front, Protocol::V5))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
        .batch(
            "pumps/17/batched",
            Batching::new().linger(Duration::from_millis(200)),
        )
        .routing_fields(true);
    let relay = Relay::start(&outbox, config)?;
    assert!(drained(&outbox), "the broker acknowledged everything");
    assert!(
        wait_until(|| front.recorded().iter().any(|p| p.payload_contains(b"gap"))),
        "the gap notice was published"
    );
    relay.shutdown()?;
    let (mut messages, mut batches, mut notices) = (0, 0, 0);
    for p in front.recorded() {
        let items = Published::decode_all(&p.payload)?;
        let got: BTreeMap<String, String> = p.user_properties.iter().cloned().collect();
        assert_eq!(got.len(), p.user_properties.len(), "no field twice: {p:?}");
        let want = if items.len() > 1 {
            batches += 1;
            expected_batch(&items)
        } else {
            match &items[0] {
                Published::Gap(_) => notices += 1,
                _ => messages += 1,
            }
            expected(&items[0])
        };
        assert_eq!(got, want, "the fields of the publish on {}", p.topic);
        assert_eq!(p.content_type.as_deref(), Some("application/cbor"), "{}", p.topic);
    }
    assert_eq!(
        (messages, notices),
        (AWKWARD_KEYS.len() + 1, 1),
        "every message and the notice"
    );
    assert!(batches >= 1, "the batched topic went out in at least one batch");
    Ok(())
}

#[test]
fn a_message_that_fits_only_without_its_fields_is_set_aside_naming_the_limit() -> TestResult {
    let broker = Broker::start()?;
    let front = MqttProxy::start(broker.addr())?;
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open(dir.path().join("device.db"))?;
    let limit = 2000;
    // About 40 bytes below the limit without its fields (the envelope's size varies by a few
    // bytes with its numbers); its fields take well over 100.
    let big = "x".repeat(limit - 160);
    outbox.transaction(|tx| {
        tx.publish("pumps/17/big", "k", &big)?;
        tx.publish("pumps/17/small", "k", &1)
    })?;
    let config = RelayConfig::new(mqtt(&front, Protocol::V5).max_packet_size(limit))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
        .routing_fields(true);
    let relay = Relay::start(&outbox, config)?;
    let settled = wait_until(|| {
        outbox.stats().is_ok_and(|s| s.pending_messages == 0)
            && outbox.dead_letters(10).is_ok_and(|d| !d.is_empty())
    });
    relay.shutdown()?;
    let dead = outbox.dead_letters(10)?;
    assert!(
        settled,
        "the big one set aside, the small one delivered: {dead:?}"
    );
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].topic, "pumps/17/big");
    assert!(
        dead[0].reason.contains(&format!("above the {limit}-byte limit")),
        "the relay counted the fields in the packet: {}",
        dead[0].reason
    );
    Ok(())
}

#[test]
fn under_mqtt_3_1_1_they_have_nowhere_to_go_and_are_refused() -> TestResult {
    let front = MqttProxy::start("127.0.0.1:9".parse()?)?;
    let v311 = RelayConfig::new(mqtt(&front, Protocol::V311)).routing_fields(true);
    let refused = v311.check().expect_err("3.1.1 without IoT Hub's bag");
    assert!(refused.to_string().contains("MQTT 5"), "{refused}");
    // A profile turns them on, and they can be turned off again.
    let aws = RelayConfig::new(mqtt(&front, Protocol::V5)).cloud(CloudProfile::AwsIotCore);
    assert!(aws.has_routing_fields());
    assert!(!aws.routing_fields(false).has_routing_fields());
    Ok(())
}

/// The property bag after `topic`'s events prefix, read as IoT Hub reads it.
fn hub_properties(topic: &str) -> Option<BTreeMap<String, String>> {
    let bag = topic.strip_prefix(EVENTS)?;
    let mut out = BTreeMap::new();
    for pair in bag.split('&') {
        let (name, value) = pair.split_once('=')?;
        let previous = out.insert(url_decode(name)?, url_decode(value)?);
        if previous.is_some() {
            return None;
        }
    }
    Some(out)
}

fn url_decode(s: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(s.len());
    let mut rest = s.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        if b == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(b);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

/// The property bag `p` should have: its envelope's fields and the content type.
fn bag_of(p: &Publish) -> Option<BTreeMap<String, String>> {
    let mut want = expected(&Published::decode(&p.payload).ok()?);
    want.insert("$.ct".into(), "application/cbor".into());
    Some(want)
}

/// What IoT Hub refuses of a device's publish, and a topic the broker would refuse too (a
/// wildcard in a PUBLISH).
fn hub_refuses(p: &Publish) -> bool {
    p.retain || !p.topic.starts_with(EVENTS) || p.topic.contains(['+', '#'])
}

#[test]
fn the_azure_profile_puts_them_in_the_property_bag_url_encoded() -> TestResult {
    let broker = Broker::start()?;
    let front = MqttProxy::start(broker.addr())?;
    front.record_publishes(true);
    front.close_on_publish(hub_refuses);
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open_with(
        dir.path().join("device.db"),
        Options::new().limits(Limits::new().cloud(CloudProfile::AzureIotHub, DEVICE)),
    )?;
    outbox.transaction(|tx| {
        for (i, key) in AWKWARD_KEYS.iter().enumerate() {
            tx.send(&Message::new(EVENTS, *key, &(i as u64))?.event_type("Reading.v1"))?;
        }
        tx.publish(EVENTS, "", &"no key")
    })?;
    // A row no hub could take (not CBOR): dead-lettered, and its gap notice goes out with a bag.
    outbox.with_connection(|c| {
        c.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES (?1, 'x', x'ff')",
            [EVENTS],
        )
    })?;
    let config = RelayConfig::new(mqtt(&front, Protocol::V311))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
        .cloud(CloudProfile::AzureIotHub);
    let relay = Relay::start(&outbox, config)?;
    // Until drained, or until the hub would read a wrong field (a relay that gets them wrong may
    // also wedge on a topic no broker takes).
    let delivered = wait_until(|| {
        outbox.stats().is_ok_and(|s| s.pending_messages == 0)
            || front
                .recorded()
                .iter()
                .any(|p| hub_properties(&p.topic) != bag_of(p))
    }) && outbox.stats()?.pending_messages == 0;
    relay.shutdown()?;
    let recorded = front.recorded();
    for p in &recorded {
        assert!(p.user_properties.is_empty(), "3.1.1 has no properties");
        assert_eq!(
            hub_properties(&p.topic),
            bag_of(p),
            "the hub reads the property bag's fields as the envelope's: {}",
            p.topic
        );
    }
    assert_eq!(
        front.closed_on_publish(),
        0,
        "nothing the hub refuses was published"
    );
    assert!(delivered, "the broker acknowledged everything");
    assert_eq!(
        recorded.len(),
        AWKWARD_KEYS.len() + 2,
        "the messages and the notice: {recorded:?}"
    );
    assert!(
        recorded.iter().any(|p| p.topic.contains("&gap=")),
        "the gap notice carried its range in the bag"
    );
    Ok(())
}

#[test]
fn a_property_bag_written_unencoded_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "property-bag-unencoded",
        HUB_SCENARIO,
        "the hub reads the property bag's fields as the envelope's",
    )
}
