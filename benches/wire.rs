//! Wire bytes per sensor reading (issue 13, item 4): one message per publish, batched, and
//! batched with zlib compression.
//!
//! A backlog of N typical sensor readings (a CBOR map of about 40 bytes: sensor name,
//! temperature, humidity, battery; 8 sensors, one key each) on one topic is committed, one
//! transaction per reading, then a relay
//! drains it to a real broker through the test suite's MQTT proxy, which counts every byte of every
//! MQTT packet the relay sends (fixed header, topic or topic alias, packet id, properties, payload).
//! Three runs on fresh stores: no batching, `Batching::new()` (16 KiB), and the same with
//! `Compression::Zlib`. The subscriber checks that every reading arrived.
//!
//! Per reading = (MQTT bytes counted by the proxy + the framing estimate) / N, where the framing
//! estimate is, per publish:
//! - the PUBACK coming back: 4 bytes of MQTT (a metered link bills both directions);
//! - TCP/IPv4 with timestamps: 52 bytes per segment (20 IP + 20 TCP + 12 options), one segment per
//!   1,448 bytes of the publish (an MSS of 1,500-byte Ethernet less those headers), and one for
//!   the PUBACK; bare TCP ACKs are taken as piggybacked on the PUBACKs and publishes;
//! - TLS 1.3 with an AEAD cipher: 22 bytes per record (5 header, 1 content type, 16 tag), one
//!   record per 16 KiB of the publish, and one for the PUBACK.
//!
//! Each publish is taken to go in its own segments: the trickle case of a device that sends as it
//! measures, and the worst case for single messages; a backlog drained over one connection may
//! share segments between small publishes, which this does not credit.
//!
//! Environment: `EDGE_OUTBOX_BENCH_SCALE` multiplies N (default 1: 2,000 readings). Requires a
//! broker (mosquitto, or rumqttd with `EDGE_OUTBOX_BROKER=rumqttd`). The output ends with one
//! `bench: NAME VALUE` line per figure.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use common::env_num;
use edge_outbox::{
    Batching, Compression, MqttConfig, Options, Outbox, Published, Relay, RelayConfig, Synchronous,
};
use support::{Broker, MqttProxy, Subscriber};

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TOPIC: &str = "sensors/pump-17/climate";
const MSS: u64 = 1448;
const TCP_IP: u64 = 52;
const TLS_RECORD: u64 = 22;
const TLS_MAX_RECORD: u64 = 16 * 1024;
const PUBACK: u64 = 4;

#[derive(serde::Serialize)]
struct Reading {
    sensor: String,
    t: f32,
    rh: f32,
    bat: u16,
}

fn reading(i: usize) -> Reading {
    Reading {
        sensor: format!("temp-{:02}", i % 8),
        t: 20.0 + (i * 7 % 500) as f32 / 100.0,
        rh: 40.0 + (i * 13 % 1000) as f32 / 100.0,
        bat: 3000 + (i % 300) as u16,
    }
}

struct Run {
    publishes: u64,
    mqtt_bytes: u64,
    framing: u64,
    payload_bytes: u64,
}

fn run(broker: &Broker, name: &str, n: usize, batching: Option<Batching>) -> BoxResult<Run> {
    let dir = tempfile::tempdir()?;
    let options = Options::default().synchronous(Synchronous::Normal);
    let outbox = Outbox::open_with(dir.path().join("device.db"), options)?;
    // One transaction per reading, as a device commits them: each has its own timestamp (and
    // its id its own time bits), which compression cannot fold away as it could for a batch
    // committed at once.
    for i in 0..n {
        outbox.transaction(|tx| tx.publish(TOPIC, &format!("temp-{:02}", i % 8), &reading(i)))?;
    }
    let proxy = MqttProxy::start(broker.addr())?;
    proxy.record_publishes(true);
    let sub = Subscriber::start(broker.addr(), "sensors/#")?;
    let mut config =
        RelayConfig::new(MqttConfig::new("127.0.0.1", proxy.addr().port()).client_id(format!("wire-{name}")));
    if let Some(b) = batching {
        config = config.batch("sensors/#", b);
    }
    let relay = Relay::start(&outbox, config)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while relay.status()?.acknowledged < n as u64 || outbox.stats()?.pending_messages > 0 {
        if Instant::now() > deadline {
            return Err(format!("{name}: not drained: {:?}", relay.status()?).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    relay.shutdown()?;
    let received: usize = sub
        .messages()
        .iter()
        .map(|m| Published::decode_all(&m.payload).map(|v| v.len()))
        .sum::<edge_outbox::Result<usize>>()?;
    if received != n {
        return Err(format!("{name}: {received} of {n} readings arrived").into());
    }
    let recorded = proxy.recorded();
    let publishes = recorded.len() as u64;
    let payloads: u64 = recorded.iter().map(|p| p.payload.len() as u64).sum();
    // Every packet the relay sent on its connection (CONNECT and any PINGREQ included: a few
    // bytes in thousands).
    let mqtt_publish_bytes = proxy.bytes_to_broker();
    let header = (mqtt_publish_bytes - payloads) / publishes.max(1);
    let framing: u64 = recorded
        .iter()
        .map(|p| {
            let packet = p.payload.len() as u64 + header;
            TCP_IP * (packet.div_ceil(MSS) + 1) + TLS_RECORD * (packet.div_ceil(TLS_MAX_RECORD) + 1)
        })
        .sum();
    let first_payload = sub.messages().first().map_or(0, |m| m.payload.len());
    println!(
        "{name:<11} {publishes:>6} publishes, {mqtt_publish_bytes:>8} MQTT bytes up, first payload {first_payload} bytes"
    );
    Ok(Run {
        publishes,
        mqtt_bytes: mqtt_publish_bytes + PUBACK * publishes,
        framing,
        payload_bytes: payloads,
    })
}

fn main() -> BoxResult<()> {
    let n = (2000.0 * env_num("EDGE_OUTBOX_BENCH_SCALE", 1.0)?)
        .round()
        .max(10.0) as usize;
    let broker = Broker::start()?;
    let payload = edge_outbox::envelope::to_cbor(&reading(1))?.len();
    println!(
        "{n} readings of a {payload}-byte CBOR payload on {TOPIC:?}, broker {:?}",
        broker.kind()
    );
    let single = run(&broker, "single", n, None)?;
    let batched = run(&broker, "batched", n, Some(Batching::new()))?;
    let compressed = run(
        &broker,
        "compressed",
        n,
        Some(Batching::new().compression(Compression::Zlib)),
    )?;
    println!();
    println!(
        "{:<11} {:>10} {:>12} {:>10} {:>10}",
        "per reading", "payload", "MQTT+PUBACK", "TCP/TLS", "total"
    );
    let mut lines = Vec::new();
    for (name, r) in [
        ("single", &single),
        ("batched", &batched),
        ("compressed", &compressed),
    ] {
        let per = |b: u64| b as f64 / n as f64;
        let total = per(r.mqtt_bytes + r.framing);
        println!(
            "{name:<11} {:>10.1} {:>12.1} {:>10.1} {:>10.1}   ({} publishes)",
            per(r.payload_bytes),
            per(r.mqtt_bytes),
            per(r.framing),
            total,
            r.publishes
        );
        lines.push((name, total));
    }
    println!(
        "compressed / single: {:.3} (target at most 0.2)",
        lines[2].1 / lines[0].1
    );
    println!();
    for (name, total) in lines {
        println!("bench: wire_bytes_per_reading_{name} {total:.1}");
    }
    Ok(())
}
