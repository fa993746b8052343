//! Issue 13's figures for a metered link.
//!
//! - **Alarm behind a backlog**: `EDGE_OUTBOX_BENCH_BACKLOG` (default 1,000,000) telemetry rows
//!   are queued in lane 0; a relay starts draining them into mosquitto; once the subscriber has
//!   seen the drain start, one alarm (priority 3) is committed and timed from the `transaction`
//!   call to its arrival at a subscriber of the alarm topic. Printed with the part of it the
//!   commit took, and how much of the backlog was still pending then (the alarm did not wait for
//!   it). Beside it, the drain's rate while the alarm waited (rows acknowledged from its commit to
//!   its arrival), and the whole backlog's drain time and rate, from `Relay::start` to an empty
//!   outbox: an alarm that overtakes a drain which has slowed to a crawl proves nothing.
//! - **Paced replay**: `EDGE_OUTBOX_BENCH_PACED` (default 1,000) messages drained with
//!   `pace_messages(200)`, then with `pace_bytes(20,000)`; the achieved rate is measured at the
//!   subscriber from the first arrival to the last, against the set rate (target within 10%).
//!
//! Requires mosquitto. The output ends with one `bench: NAME VALUE` line per figure.

mod common;
#[path = "common/mqtt.rs"]
mod mqtt;
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use edge_outbox::{Message, Outbox, Relay, RelayConfig};
use mqtt::BoxResult;
use support::Subscriber;

const WAIT: Duration = Duration::from_secs(600);

/// What the alarm behind a backlog measured.
struct AlarmRun {
    /// From the alarm's `transaction` call to its arrival, and the commit's part of it.
    alarm_ms: f64,
    commit_ms: f64,
    /// Telemetry rows still pending when it arrived.
    pending: u64,
    /// Rows acknowledged per second while the alarm waited.
    rate_during_alarm: f64,
    /// The whole backlog, from `Relay::start` to an empty outbox.
    drain_secs: f64,
}

fn alarm_behind_backlog(port: u16, backlog: u64) -> BoxResult<AlarmRun> {
    let base = common::bench_dir()?;
    let dir = tempfile::Builder::new().prefix("metered-").tempdir_in(&base)?;
    let outbox = Outbox::open(dir.path().join("outbox.db"))?;
    let t = Instant::now();
    let reading = edge_outbox::envelope::to_cbor(&(21.5f64, 1_700_000_000u64))?;
    let mut left = backlog;
    while left > 0 {
        let n = left.min(50_000);
        outbox.transaction(|tx| {
            for i in 0..n {
                let key = format!("s{}", i % 64);
                let m = Message::from_cbor("metered/telemetry", key, reading.clone())?;
                tx.send(&m)?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        left -= n;
    }
    println!(
        "queued {backlog} telemetry rows in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let telemetry = Subscriber::start(addr, "metered/telemetry")?;
    let alarms = Subscriber::start(addr, "metered/alarms")?;
    let started = Instant::now();
    let relay = Relay::start(&outbox, mqtt::relay_config("bench-metered", port, 100))?;
    if !telemetry.wait_for(1_000, WAIT) {
        return Err("the drain did not start".into());
    }
    let acked_before = relay.status()?.acknowledged;
    let sent = Instant::now();
    outbox.transaction(|tx| tx.send(&Message::new("metered/alarms", "door-1", "open")?.priority(3)))?;
    let commit_ms = sent.elapsed().as_secs_f64() * 1000.0;
    if !alarms.wait_for(1, WAIT) {
        return Err("the alarm did not arrive".into());
    }
    let waited = sent.elapsed();
    let status = relay.status()?;
    let rate_during_alarm = status.acknowledged.saturating_sub(acked_before) as f64 / waited.as_secs_f64();
    let pending = status.store.pending_messages;
    while relay.status()?.store.pending_messages > 0 {
        if started.elapsed() > WAIT {
            return Err("the backlog did not drain".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let drain_secs = started.elapsed().as_secs_f64();
    relay.shutdown()?;
    Ok(AlarmRun {
        alarm_ms: waited.as_secs_f64() * 1000.0,
        commit_ms,
        pending,
        rate_during_alarm,
        drain_secs,
    })
}

/// Drains `n` messages through a relay with `pace`, and returns the achieved rate in messages
/// and bytes (topic and payload) per second at the subscriber, first arrival to last.
fn paced(
    port: u16,
    n: u64,
    id: &str,
    pace: impl FnOnce(RelayConfig) -> RelayConfig,
) -> BoxResult<(f64, f64)> {
    let base = common::bench_dir()?;
    let dir = tempfile::Builder::new().prefix("paced-").tempdir_in(&base)?;
    let outbox = Outbox::open(dir.path().join("outbox.db"))?;
    outbox.transaction(|tx| {
        for i in 0..n {
            tx.publish("metered/paced", "k", &i)?;
        }
        Ok::<_, edge_outbox::Error>(())
    })?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let sub = Subscriber::start(addr, "metered/paced")?;
    let relay = Relay::start(&outbox, pace(mqtt::relay_config(id, port, 100)))?;
    if !sub.wait_for(1, WAIT) {
        return Err("nothing arrived".into());
    }
    let first = Instant::now();
    if !sub.wait_for(n as usize, WAIT) {
        return Err("the paced drain did not finish".into());
    }
    let secs = first.elapsed().as_secs_f64();
    let messages = sub.messages();
    // The first message's bytes were spent before the clock started.
    let bytes: usize = messages
        .iter()
        .skip(1)
        .map(|m| m.topic.len() + m.payload.len())
        .sum();
    relay.shutdown()?;
    Ok(((n - 1) as f64 / secs, bytes as f64 / secs))
}

fn main() -> BoxResult<()> {
    let backlog = common::env_num("EDGE_OUTBOX_BENCH_BACKLOG", 1_000_000.0)? as u64;
    let n = common::env_num("EDGE_OUTBOX_BENCH_PACED", 1_000.0)? as u64;
    let broker = mqtt::stock_mosquitto()?;
    let port = broker.port();
    println!(
        "edge-outbox metered-link benchmark (MQTT {})",
        mqtt::protocol().as_str()
    );

    let alarm = alarm_behind_backlog(port, backlog)?;
    println!(
        "alarm arrived with {} of {backlog} telemetry rows still pending; the backlog drained in {:.1} s",
        alarm.pending, alarm.drain_secs
    );

    let (rate, _) = paced(port, n, "bench-paced-msgs", |c| c.pace_messages(200))?;
    let (_, byte_rate) = paced(port, n, "bench-paced-bytes", |c| c.pace_bytes(20_000))?;

    println!("bench: alarm_behind_backlog_ms {:.1}", alarm.alarm_ms);
    println!("bench: alarm_commit_ms {:.1}", alarm.commit_ms);
    println!("bench: alarm_backlog_pending {}", alarm.pending);
    println!(
        "bench: drain_rate_while_alarm_waited {:.0}",
        alarm.rate_during_alarm
    );
    println!("bench: backlog_drain_secs {:.1}", alarm.drain_secs);
    println!(
        "bench: backlog_drain_rate {:.0}",
        backlog as f64 / alarm.drain_secs
    );
    println!("bench: paced_msgs_per_s {rate:.1} (set 200)");
    println!("bench: paced_msgs_ratio {:.3}", rate / 200.0);
    println!("bench: paced_bytes_per_s {byte_rate:.0} (set 20000)");
    println!("bench: paced_bytes_ratio {:.3}", byte_rate / 20_000.0);
    Ok(())
}
