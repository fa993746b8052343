//! Batching (issue 13, item 4): with `RelayConfig::batch`, many small messages of one topic go out
//! as one QoS 1 publish, each still a full envelope with its own id, sequence number and key; the
//! batch is acknowledged and marked as a whole, refused as a whole, and a bad row inside one is
//! still isolated alone. Against a real broker (and the MQTT proxy where the broker must
//! misbehave).
//!
//! What each test catches:
//! - `a_backlog_goes_out_in_full_batches...`: a relay that ignores the option (one publish per
//!   message), a batch that loses, duplicates or reorders its rows, a batch acknowledged but only
//!   partly marked (the outbox never drains).
//! - `compressed_batches...`: compression not applied, or a decoder that cannot inflate it.
//! - `linger...`: a partial batch never sent (no timer), or sent at once (no linger).
//! - `per_key_order...`: a batch that takes rows of its topic past an older row of another topic.
//! - `a_refused_batch...`: a batch whose refusal dead-letters one row and marks the others.
//! - `a_poison_row...`: a batch struck as a whole (all rows dead-lettered), or batches kept while
//!   probing (the poison never alone on the wire).

mod support;

use std::time::{Duration, Instant};

use edge_outbox::{Batching, Compression, MessageId, Outbox, Published, Relay};
use support::device::{open_device, relay_config, wait_drained};
use support::{Broker, MqttProxy, Subscriber, WAIT, check};

/// A typical sensor reading: a small CBOR map.
#[derive(serde::Serialize)]
struct Reading {
    sensor: String,
    t: f32,
    rh: f32,
    bat: u16,
}

fn reading(i: usize) -> Reading {
    Reading {
        sensor: format!("temp-{:02}", i % 4),
        t: 20.0 + (i % 50) as f32 / 10.0,
        rh: 40.0 + (i % 30) as f32 / 10.0,
        bat: 3000 + (i % 100) as u16,
    }
}

/// Commits `n` readings on `topic` in one transaction, keys round-robin over four sensors.
fn commit_readings(outbox: &Outbox, topic: &str, n: usize) -> Vec<(MessageId, String)> {
    outbox
        .transaction(|tx| {
            (0..n)
                .map(|i| {
                    let key = format!("temp-{:02}", i % 4);
                    Ok((tx.publish(topic, &key, &reading(i))?, key))
                })
                .collect::<edge_outbox::Result<Vec<_>>>()
        })
        .expect("commit")
        .value
}

/// Every publish unpacked: (items in it, whether it was a batch, whether compressed).
fn publishes(sub: &Subscriber) -> Vec<(Vec<Published>, bool, bool)> {
    sub.messages()
        .iter()
        .map(|m| {
            let raw: ciborium::Value = ciborium::from_reader(&m.payload[..]).expect("CBOR");
            let map = raw.as_map().expect("a map");
            let has = |k: &str| map.iter().any(|(key, _)| key.as_text() == Some(k));
            let items = Published::decode_all(&m.payload).expect("decodes");
            (items, has("batch") || has("zlib"), has("zlib"))
        })
        .collect()
}

fn seqs(items: &[Published]) -> Vec<u64> {
    items
        .iter()
        .filter_map(|i| match i {
            Published::Message(e) => Some(e.seq),
            _ => None,
        })
        .collect()
}

#[test]
fn a_backlog_goes_out_in_full_batches_each_message_with_its_own_id_and_all_are_marked() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "sensors/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let committed = commit_readings(&outbox, "sensors/hall", 1000);
    let config = relay_config(broker.addr(), "batcher").batch("sensors/#", Batching::new().max_bytes(4096));
    let relay = Relay::start(&outbox, config).expect("relay");

    let delivery = check::wait_and_check(&sub, &committed, WAIT).expect("every message, in order per key");
    assert_eq!(delivery.duplicates, 0, "{delivery:?}");
    assert!(
        wait_drained(&outbox, WAIT),
        "the whole batch is marked on its PUBACK"
    );

    let got = publishes(&sub);
    let envelope_len = sub.messages()[0].payload.len() / seqs(&got[0].0).len().max(1);
    // About 4096 / envelope bytes per publish; fewer than a tenth of one publish per message.
    assert!(
        got.len() * 10 < committed.len(),
        "{} publishes for {} messages",
        got.len(),
        committed.len()
    );
    assert!(
        got.iter().all(|(_, batch, zlib)| *batch && !*zlib),
        "every publish a plain batch"
    );
    for (items, _, _) in &got[..got.len() - 1] {
        let bytes: usize = items.len() * envelope_len;
        assert!(bytes <= 4096 + envelope_len, "a batch within max_bytes: {bytes}");
    }
    // Sequence numbers run on across batches: 1, 2, 3, ... with no gap or repeat.
    let all: Vec<u64> = got.iter().flat_map(|(items, _, _)| seqs(items)).collect();
    assert_eq!(all, (1..=1000).collect::<Vec<u64>>());
    let status = relay.status().expect("status");
    assert_eq!(
        (status.published, status.acknowledged),
        (1000, 1000),
        "{status:?}"
    );
    relay.shutdown().expect("shutdown");
}

#[test]
fn compressed_batches_are_smaller_and_decode_to_every_message() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "sensors/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let committed = commit_readings(&outbox, "sensors/hall", 400);
    let config = relay_config(broker.addr(), "zipper").batch(
        "sensors/+",
        Batching::new().max_bytes(8192).compression(Compression::Zlib),
    );
    let relay = Relay::start(&outbox, config).expect("relay");

    check::wait_and_check(&sub, &committed, WAIT).expect("every message, in order per key");
    assert!(wait_drained(&outbox, WAIT));
    let got = publishes(&sub);
    assert!(
        got.iter().all(|(_, batch, zlib)| *batch && *zlib),
        "every publish compressed"
    );
    let wire: usize = sub.messages().iter().map(|m| m.payload.len()).sum();
    let plain: usize = got
        .iter()
        .flat_map(|(items, _, _)| items)
        .map(|i| match i {
            Published::Message(e) => e.encode().len(),
            other => panic!("{other:?}"),
        })
        .sum();
    assert!(
        wire * 2 < plain,
        "zlib at least halves the envelopes: {wire} of {plain} bytes"
    );
    relay.shutdown().expect("shutdown");
}

#[test]
fn linger_waits_for_more_rows_then_sends_a_partial_batch() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "sensors/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let linger = Duration::from_millis(600);
    let config = relay_config(broker.addr(), "lingerer").batch("sensors/#", Batching::new().linger(linger));
    let relay = Relay::start(&outbox, config).expect("relay");
    assert!(support::wait_until(|| relay.status().is_ok_and(|s| s.connected)));

    let start = Instant::now();
    let mut committed = commit_readings(&outbox, "sensors/hall", 2);
    std::thread::sleep(Duration::from_millis(150));
    committed.extend(commit_readings(&outbox, "sensors/hall", 1));
    assert!(
        sub.wait_for(1, WAIT),
        "the partial batch is sent without more rows"
    );
    let waited = start.elapsed();
    check::wait_and_check(&sub, &committed, WAIT).expect("all three");
    let got = publishes(&sub);
    assert_eq!(got.len(), 1, "one publish for the three rows: {got:?}");
    assert_eq!(seqs(&got[0].0), vec![1, 2, 3]);
    assert!(
        waited >= linger - Duration::from_millis(100),
        "it waited for the linger: {waited:?}"
    );
    relay.shutdown().expect("shutdown");
}

#[test]
fn per_key_order_holds_with_other_topics_interleaved() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    // One key on a batched and an unbatched topic: five readings, an alarm, five readings, ...
    let committed: Vec<(MessageId, String)> = outbox
        .transaction(|tx| {
            let mut ids = Vec::new();
            for i in 0..300 {
                let topic = if i % 6 == 5 { "alarms/pump" } else { "sensors/pump" };
                ids.push((tx.publish(topic, "pump", &reading(i))?, "pump".to_owned()));
            }
            Ok::<_, edge_outbox::Error>(ids)
        })
        .expect("commit")
        .value;
    let config = relay_config(broker.addr(), "interleaver").batch("sensors/#", Batching::new());
    let relay = Relay::start(&outbox, config).expect("relay");
    check::wait_and_check(&sub, &committed, WAIT).expect("the key's order holds");
    let all: Vec<u64> = publishes(&sub)
        .iter()
        .flat_map(|(items, _, _)| seqs(items))
        .collect();
    assert_eq!(
        all,
        (1..=300).collect::<Vec<u64>>(),
        "publishes leave in commit order"
    );
    // Fifty alarms alone, and the fifty runs of five readings between them as batches.
    assert_eq!(sub.len(), 100);
    relay.shutdown().expect("shutdown");
}

#[test]
fn a_refused_batch_dead_letters_every_row_in_it_with_the_reason() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "sensors/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let refused = commit_readings(&outbox, "sensors/hall", 20);
    proxy.answer_pubacks_with(1, 0x87);
    let config = relay_config(proxy.addr(), "refused").batch("sensors/#", Batching::new());
    let relay = Relay::start(&outbox, config).expect("relay");
    assert!(support::wait_until(|| outbox
        .dead_letters(100)
        .is_ok_and(|d| d.len() == 20)));
    let next = commit_readings(&outbox, "sensors/hall", 5);
    assert!(check::wait_for_ids(&sub, next.iter().map(|(id, _)| *id), WAIT));
    assert!(wait_drained(&outbox, WAIT));
    let dead = outbox.dead_letters(100).expect("dead letters");
    let mut dead_ids: Vec<MessageId> = dead.iter().filter_map(|d| d.message_id).collect();
    dead_ids.sort();
    let mut want: Vec<MessageId> = refused.iter().map(|(id, _)| *id).collect();
    want.sort();
    assert_eq!(dead_ids, want, "every row of the refused batch, and only those");
    assert!(dead.iter().all(|d| d.reason.contains("0x87")), "{dead:#?}");
    assert_eq!(relay.status().expect("status").refused, 20);
    relay.shutdown().expect("shutdown");
}

/// The poison row's payload: nothing else in an envelope contains it.
const POISON: &str = "toxic-7f3a";

#[test]
fn a_poison_row_inside_a_batch_is_isolated_alone() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "sensors/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let mut good = commit_readings(&outbox, "sensors/hall", 5);
    let poison = outbox
        .transaction(|tx| tx.publish("sensors/hall", "temp-00", POISON))
        .expect("commit")
        .ids[0];
    good.extend(commit_readings(&outbox, "sensors/hall", 100));
    proxy.close_on_publish(|p| p.payload_contains(POISON.as_bytes()));
    let config = relay_config(proxy.addr(), "poisoned").batch("sensors/#", Batching::new());
    let relay = Relay::start(&outbox, config).expect("relay");

    check::wait_and_check(&sub, &good, WAIT).expect("every other row delivered, in order per key");
    assert!(wait_drained(&outbox, WAIT));
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 1, "the poison alone: {dead:#?}");
    assert_eq!(dead[0].message_id, Some(poison));
    // The first close had a batch on the wire, which blames no row; three with the poison
    // alone on the wire isolate it.
    assert_eq!(proxy.closed_on_publish(), 4);
    // Batching resumes once the poison is isolated: the rest of the cut need not be probed.
    assert!(
        publishes(&sub).iter().any(|(items, _, _)| items.len() > 1),
        "batching did not resume after the poison was isolated"
    );
    relay.shutdown().expect("shutdown");
}

/// The scenario above fails against the mutant that keeps publishing one row at a time after
/// the poison was isolated.
#[test]
#[cfg(feature = "mutants")]
fn the_poison_in_a_batch_scenario_catches_its_mutant() -> Result<(), Box<dyn std::error::Error>> {
    support::mutant::caught_by(
        "probe-kept-after-isolation",
        "a_poison_row_inside_a_batch_is_isolated_alone",
        "batching did not resume after the poison was isolated",
    )
}
