//! What an idle relay costs, and how soon it publishes what another process commits.
//!
//! - **a. Idle**: a relay (publish only, MQTT keep-alive 30 s) connected to mosquitto with an
//!   empty outbox, for `EDGE_OUTBOX_BENCH_IDLE_SECS` (default 30). Wake-ups are the context
//!   switches (voluntary and involuntary) of its threads (every thread named `edge-outbox-*`),
//!   from `/proc/self/task/*/status`; the keep-alive's PINGREQ and PINGRESP are among them.
//! - **b. Foreign commits**: another connection (not the relay's `Outbox` handle, so nothing in
//!   this process tells the relay: as for another process writing through the SQL contract)
//!   inserts one row at a time, 20 to 120 ms apart, while the relay idles in between; each is
//!   timed from the insert's call to its arrival at a subscriber; the relay's wake-ups over all of
//!   them are counted too, per commit.
//!
//! Targets (issue 14): at most 1 wake-up per second idle apart from the keep-alive; a foreign
//! writer's row published within 100 ms (p99). Requires mosquitto. The output ends with one
//! `bench: NAME VALUE` line per figure.

mod common;
#[path = "common/mqtt.rs"]
mod mqtt;
#[path = "../tests/support/mod.rs"]
mod support;
#[path = "common/threads.rs"]
mod threads;

use std::thread;
use std::time::{Duration, Instant};

use common::{Rng, env_num, quantile};
use edge_outbox::{Outbox, Relay};
use mqtt::{Arrivals, BoxResult};

fn wait_connected(relay: &Relay) -> BoxResult<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !relay.status()?.connected {
        if Instant::now() > deadline {
            return Err(format!("relay did not connect: {:?}", relay.status()?).into());
        }
        thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn main() -> BoxResult<()> {
    let idle_secs = env_num("EDGE_OUTBOX_BENCH_IDLE_SECS", 30.0)?;
    let samples = env_num("EDGE_OUTBOX_BENCH_FOREIGN_SAMPLES", 200.0)?.round() as usize;
    let base = common::bench_dir()?;
    let broker = mqtt::stock_mosquitto()?;
    let port = broker.port();
    let arrivals = Arrivals::start(port)?;
    let dir = tempfile::Builder::new().prefix("idle-").tempdir_in(&base)?;
    let path = dir.path().join("outbox.db");
    let outbox = Outbox::open(&path)?;
    let relay = Relay::start(&outbox, mqtt::relay_config("bench-idle", port, 100))?;
    wait_connected(&relay)?;
    println!("edge-outbox idle benchmark (MQTT {})", mqtt::protocol().as_str());

    // a. Idle: let start-up settle, then count.
    thread::sleep(Duration::from_secs(2));
    let before = threads::usage_by_name(threads::RELAY);
    let t0 = Instant::now();
    thread::sleep(Duration::from_secs_f64(idle_secs));
    let secs = t0.elapsed().as_secs_f64();
    let after = threads::usage_by_name(threads::RELAY);
    println!("a. idle, connected, {secs:.0} s: wake-ups per second by thread (keep-alive 30 s included)");
    let mut total = threads::Usage::default();
    for (name, u) in &after {
        let earlier = before
            .iter()
            .find(|(n, _)| n == name)
            .map_or(threads::Usage::default(), |(_, u)| *u);
        let d = u.since(earlier);
        total.switches += d.switches;
        total.cpu_secs += d.cpu_secs;
        println!(
            "   {name:<18} {:>7.2}/s  cpu {:>8.3} ms/s",
            d.switches as f64 / secs,
            d.cpu_secs * 1e3 / secs
        );
    }
    let wakeups = total.switches as f64 / secs;
    println!(
        "   {:<18} {:>7.2}/s  cpu {:>8.3} ms/s; target <= 1/s: {}",
        "all",
        wakeups,
        total.cpu_secs * 1e3 / secs,
        if wakeups <= 1.0 { "met" } else { "MISSED" }
    );

    // b. Foreign commits.
    let foreign = rusqlite::Connection::open(&path)?;
    foreign.busy_timeout(Duration::from_secs(5))?;
    let payload = edge_outbox::envelope::to_cbor(&("pump-01", 42.5))?;
    arrivals.expect(samples);
    let mut rng = Rng(7);
    let mut took = Vec::with_capacity(samples);
    let before_b = threads::usage(threads::RELAY);
    for i in 0..samples {
        thread::sleep(Duration::from_millis(20 + rng.next_u64() % 100));
        let called = Instant::now();
        foreign.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES ('plant/line-3/pump-01/telemetry', 'pump-01', ?1)",
            [&payload],
        )?;
        let seq = usize::try_from(foreign.last_insert_rowid())?;
        if seq != i + 1 {
            return Err(format!("expected row {} to get seq {}, got {seq}", i + 1, i + 1).into());
        }
        let at = arrivals.wait_seq(seq, Duration::from_secs(30))?;
        took.push(at.saturating_duration_since(called).as_secs_f64() * 1e3);
    }
    let per_commit = threads::usage(threads::RELAY).since(before_b).switches as f64 / samples as f64;
    let p99 = quantile(&took, 0.99);
    println!(
        "b. foreign commit -> arrival at the subscriber, {samples} samples (ms): p50 {:.1}, p90 {:.1}, \
         p99 {p99:.1}, max {:.1}; target p99 <= 100 ms: {}",
        quantile(&took, 0.5),
        quantile(&took, 0.9),
        quantile(&took, 1.0),
        if p99 <= 100.0 { "met" } else { "MISSED" }
    );
    println!(
        "   the relay's wake-ups per foreign commit (all its threads, the idle time between included): {per_commit:.1}"
    );
    relay.shutdown()?;
    drop(arrivals);
    drop(broker);
    println!();
    println!("bench: idle_wakeups_per_s {wakeups:.2}");
    println!("bench: idle_cpu_ms_per_s {:.3}", total.cpu_secs * 1e3 / secs);
    println!(
        "bench: foreign_commit_to_publish_p50_ms {:.1}",
        quantile(&took, 0.5)
    );
    println!("bench: foreign_commit_to_publish_p99_ms {p99:.1}");
    println!("bench: foreign_commit_wakeups_per_commit {per_commit:.1}");
    Ok(())
}
