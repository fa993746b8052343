//! The relay against raw rumqttc of the same protocol, side by side, against one mosquitto with
//! its default configuration (only a listener and anonymous access are configured).
//!
//! The honest floor is what an application would write with the bare client: raw rumqttc
//! speaking the relay's protocol (MQTT 5 unless `EDGE_OUTBOX_BENCH_MQTT=3.1.1`) with the same
//! in-flight window. Under MQTT 5 the broker's receive maximum lowers both windows alike
//! (mosquitto's default `max_inflight_messages` is 20). A subscriber on its own connection
//! receives everything, as the cloud would; its CPU is counted on neither side.
//!
//! - **a. Drain**: a backlog of N committed messages (default 100,000; about 90-byte CBOR
//!   payloads, 8 keys), committed before the relay starts, timed from `Relay::start` until the
//!   outbox is empty **and** the subscriber holds every message. Against it, raw rumqttc
//!   publishes the same N messages, pre-encoded as envelopes of the same size, QoS 1, from a
//!   publishing thread while another iterates the event loop, timed from `Client::new` until the
//!   subscriber holds every message and the last PUBACK came. Between the two, the drain an
//!   application would write by hand with the bare libraries (`common/hand_relay.rs`: rows of
//!   ready-to-send bytes read in order with rusqlite, published by raw rumqttc with the same
//!   window, deleted once acknowledged by a thread that deletes what has queued up in one
//!   transaction), at FULL and at
//!   NORMAL: the floor for a drain that reads and deletes its rows durably, where raw rumqttc
//!   from memory is the floor for the MQTT part alone. Each round fills four stores first, then
//!   runs raw, the hand-written drain at FULL and NORMAL, relay on a store opened with
//!   `synchronous = FULL` (the default) and relay with `NORMAL` back to back, rotating which goes
//!   first; the table shows medians over the rounds and the median of the per-round ratios. CPU
//!   per message is counted on the client side only: the relay's threads (every thread named
//!   `edge-outbox-*`: publisher, connection, marker, watcher) against raw rumqttc's two and the
//!   hand-written drain's two, from `/proc/self/task/*/schedstat`; the broker's is shown apart.
//! - **b. Latency**: from the call of `Outbox::transaction` (store at FULL, so the commit's fsync
//!   is in it) to the message's arrival at the subscriber, for a connected, idle relay, with
//!   random 1-4 ms gaps between commits; raw rumqttc: from `publish` to arrival. p50, p99, p99.9.
//!   Beside it the relay's own share, from the transaction's return to the PUBACK reaching the
//!   relay's connection thread (timestamped from the crate's `mqtt event` trace), against raw
//!   rumqttc's `publish` to the PUBACK reaching its event thread (`relay_share_over_raw_p99`).
//! - **c. Memory**: a backlog of 1,000,000 rows is filled here, then drained by a child process
//!   (this binary again, `EDGE_OUTBOX_BENCH_CHILD=drain`) so that the fill does not count; the
//!   child samples its own `VmRSS` every 10 ms with its progress and reports `VmHWM`, and this
//!   process also polls the child's `/proc/<pid>/status`.
//!
//! Environment:
//! - `EDGE_OUTBOX_BENCH_SCALE`: multiplies every count (default 1; 0.1 for a quick run);
//! - `EDGE_OUTBOX_BENCH_ROUNDS`: drain rounds per variant (default 7, at least 3);
//! - `EDGE_OUTBOX_BENCH_WINDOW`: in-flight window (default 100; under MQTT 5 the broker's receive
//!   maximum lowers it);
//! - `EDGE_OUTBOX_BENCH_MQTT`: `5` (default) or `3.1.1`, for the relay and raw rumqttc alike;
//! - `EDGE_OUTBOX_BENCH_SECTIONS`: comma-separated subset of `drain,latency,memory` (default all);
//! - `EDGE_OUTBOX_BENCH_THREADS`: set, each relay drain prints its threads' CPU one by one;
//! - `EDGE_OUTBOX_BENCH_DIR`: where the databases go (default the cargo target tmp dir; a real
//!   disk, not tmpfs).
//!
//! Requires mosquitto (on PATH, in /usr/sbin, or `EDGE_OUTBOX_MOSQUITTO`). The output ends with
//! one `bench: NAME VALUE` line per figure.

mod common;
#[path = "common/hand_relay.rs"]
mod hand_relay;
#[path = "common/mqtt.rs"]
mod mqtt;
#[path = "common/puback_probe.rs"]
mod puback_probe;
#[path = "../tests/support/mod.rs"]
mod support;
#[path = "common/threads.rs"]
mod threads;

use std::borrow::Cow;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::{Rng, env_num, median, now_ms, quantile};
use edge_outbox::{Envelope, MessageId, Options, Outbox, Relay, Synchronous};
use mqtt::{Arrivals, BoxResult, RawEvent};
use serde::Serialize;

const CHILD_ENV: &str = "EDGE_OUTBOX_BENCH_CHILD";
/// Set: each drain prints the CPU time of each relay thread.
const THREADS_ENV: &str = "EDGE_OUTBOX_BENCH_THREADS";
const RELAY_ID: &str = "bench-relay";
/// Give up on a run that makes no progress for this long.
const STALL: Duration = Duration::from_secs(60);

fn relay_config(port: u16, window: usize) -> edge_outbox::RelayConfig {
    mqtt::relay_config(RELAY_ID, port, window)
}

// ---------------------------------------------------------------------------------------------
// The workload

const DEVICES: [&str; 8] = [
    "pump-01", "pump-02", "pump-03", "pump-04", "pump-05", "pump-06", "pump-07", "pump-08",
];
const SENSORS: [(&str, &str); 3] = [
    ("discharge_pressure", "kPa"),
    ("motor_temperature", "degC"),
    ("flow", "m3/h"),
];

/// A pump reading: 80 to 100 bytes of CBOR.
#[derive(Serialize)]
struct Reading {
    device: &'static str,
    sensor: &'static str,
    seq: u64,
    value: f64,
    unit: &'static str,
    ok: bool,
    ts_ms: i64,
}

fn reading(i: u64) -> Reading {
    let (sensor, unit) = SENSORS[(i % 3) as usize];
    Reading {
        device: DEVICES[(i % 8) as usize],
        sensor,
        seq: 1_000_000 + i,
        value: 100.0 + (i % 997) as f64 * 0.37,
        unit,
        ok: !i.is_multiple_of(13),
        ts_ms: now_ms(),
    }
}

fn topic(device: &str) -> String {
    format!("plant/line-3/{device}/telemetry")
}

impl Rng {
    /// A gap of 1 to 4 ms, between latency samples.
    fn gap(&mut self) -> Duration {
        Duration::from_micros(1_000 + self.next_u64() % 3_000)
    }
}

/// Commits `n` readings (numbered from `first`) in transactions of `per_tx`, through the public API.
fn fill(outbox: &Outbox, first: u64, n: u64, per_tx: u64) -> BoxResult<()> {
    let mut i = first;
    let end = first + n;
    while i < end {
        let stop = (i + per_tx).min(end);
        outbox.transaction(|tx| {
            for j in i..stop {
                let r = reading(j);
                tx.publish(&topic(r.device), r.device, &r)?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        i = stop;
    }
    outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
    Ok(())
}

/// The raw side's messages: the same readings as envelopes of the relay's size (same fields,
/// same source, sequence numbers from 1 like a fresh outbox).
fn raw_messages(n: u64) -> BoxResult<Vec<(String, Vec<u8>)>> {
    (0..n)
        .map(|i| {
            let r = reading(i);
            let envelope = Envelope {
                id: MessageId::new_v7(),
                source: Cow::Borrowed(RELAY_ID),
                epoch: 0,
                seq: i + 1,
                key: Cow::Borrowed(r.device),
                created_ms: now_ms() as u64,
                event_type: None,
                headers: Vec::new(),
                payload: Cow::Owned(edge_outbox::envelope::to_cbor(&r)?),
            };
            Ok((topic(r.device), envelope.encode()))
        })
        .collect()
}

const RAW_THREADS: &[&str] = &["raw-publisher", "raw-events"];

// ---------------------------------------------------------------------------------------------
// a. Drain

struct DrainRun {
    /// From start until the outbox is empty (relay) and the subscriber holds every message.
    took: Duration,
    /// CPU of the threads under test over that time.
    cpu: f64,
    /// The broker's CPU over that time.
    broker: f64,
}

fn drain_raw(
    port: u16,
    broker: Option<&str>,
    arrivals: &Arrivals,
    msgs: &[(String, Vec<u8>)],
    window: usize,
) -> BoxResult<DrainRun> {
    let n = msgs.len();
    let owned = msgs.to_vec();
    arrivals.expect(n);
    // Both threads stay alive (so their CPU time can be read) until `done_tx` is dropped.
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
    let (acked_tx, acked_rx) = crossbeam_channel::bounded::<Result<(), String>>(1);
    let cpu0 = threads::usage(RAW_THREADS);
    let broker0 = broker.map_or(0.0, threads::process_cpu_secs);
    let start = Instant::now();
    let (client, mut connection) = mqtt::raw(port, "bench-raw", window);
    let client = std::sync::Arc::new(client);
    let publisher = {
        let (client, done_rx) = (client.clone(), done_rx.clone());
        thread::Builder::new()
            .name("raw-publisher".into())
            .spawn(move || -> Result<(), String> {
                for (topic, payload) in owned {
                    client.publish(topic, payload).map_err(|e| e.to_string())?;
                }
                let _ = done_rx.recv();
                Ok(())
            })?
    };
    let events = thread::Builder::new().name("raw-events".into()).spawn(move || {
        let mut acked = 0;
        let result = loop {
            if acked == n {
                break Ok(());
            }
            match connection.next(STALL) {
                Ok(RawEvent::PubAck(_)) => acked += 1,
                Ok(_) => {}
                Err(e) => break Err(format!("{e} after {acked} PUBACKs")),
            }
        };
        let _ = acked_tx.send(result);
        let _ = done_rx.recv();
        connection
    })?;
    acked_rx.recv().map_err(|_| "raw event thread died")??;
    arrivals.wait_all(STALL)?;
    let took = start.elapsed();
    let cpu = threads::usage(RAW_THREADS).since(cpu0).cpu_secs;
    let broker = broker.map_or(0.0, threads::process_cpu_secs) - broker0;
    drop(done_tx);
    publisher.join().map_err(|_| "raw publisher panicked")??;
    let connection = events.join().map_err(|_| "raw event thread panicked")?;
    connection.close(&client);
    Ok(DrainRun { took, cpu, broker })
}

/// A store with a committed backlog, ready to drain.
struct Backlog {
    dir: tempfile::TempDir,
    n: u64,
    sync: Synchronous,
}

impl Backlog {
    /// Fills a fresh store with `n` rows (1000 per transaction).
    fn fill(dir: &Path, n: u64, sync: Synchronous) -> BoxResult<Backlog> {
        let dir = tempfile::Builder::new().prefix("drain-").tempdir_in(dir)?;
        let outbox = Outbox::open_with(dir.path().join("outbox.db"), Options::new().synchronous(sync))?;
        fill(&outbox, 0, n, 1000)?;
        Ok(Backlog { dir, n, sync })
    }
}

/// Times a relay draining `backlog`.
fn drain_relay(
    port: u16,
    broker: Option<&str>,
    arrivals: &Arrivals,
    backlog: Backlog,
    window: usize,
) -> BoxResult<DrainRun> {
    let n = backlog.n;
    arrivals.expect(n as usize);
    // A fresh handle, as after a restart with a backlog.
    let outbox = Outbox::open_with(
        backlog.dir.path().join("outbox.db"),
        Options::new().synchronous(backlog.sync),
    )?;
    let cpu0 = threads::usage(threads::RELAY);
    let broker0 = broker.map_or(0.0, threads::process_cpu_secs);
    let start = Instant::now();
    let relay = Relay::start(&outbox, relay_config(port, window))?;
    arrivals.wait_all(STALL)?;
    // Marking is given its own bound from the last arrival: a bound from the start would also
    // count a slow drain and report it as marks that never came.
    let delivered = Instant::now();
    loop {
        let st = relay.status()?;
        if st.store.pending_messages == 0 {
            break;
        }
        if delivered.elapsed() > STALL {
            return Err(format!("delivered rows not marked: {st:?}").into());
        }
        thread::sleep(Duration::from_millis(1));
    }
    let took = start.elapsed();
    let cpu = threads::usage(threads::RELAY).since(cpu0).cpu_secs;
    let broker = broker.map_or(0.0, threads::process_cpu_secs) - broker0;
    if std::env::var_os(THREADS_ENV).is_some() {
        // The relay's threads start with it, so their whole CPU time is this drain's.
        let each: Vec<String> = threads::usage_by_name(threads::RELAY)
            .iter()
            .map(|(name, u)| format!("{name} {:.2}", u.cpu_secs * 1e6 / n as f64))
            .collect();
        println!("  relay threads, CPU us per message: {}", each.join(", "));
    }
    let st = relay.status()?;
    if st.published != n || st.connections != 1 {
        println!(
            "  note: relay published {} for {n} rows over {} connection(s)",
            st.published, st.connections
        );
    }
    relay.shutdown()?;
    Ok(DrainRun { took, cpu, broker })
}

/// One variant's figures over the rounds.
#[derive(Default)]
struct Series {
    /// Messages per second, start to drained and delivered.
    rate: Vec<f64>,
    /// CPU microseconds per message: the client's threads, the broker.
    own_us: Vec<f64>,
    broker_us: Vec<f64>,
    /// Per-round ratios to raw rumqttc (all but raw): rate, and client CPU per message.
    ratio: Vec<f64>,
    cpu_ratio: Vec<f64>,
    /// Per-round ratios to the hand-written drain at the same `synchronous` (relay only).
    hand_ratio: Vec<f64>,
    hand_cpu_ratio: Vec<f64>,
}

struct DrainOutcome {
    n: u64,
    window: usize,
    rounds: usize,
    envelope_bytes: f64,
    payload_bytes: f64,
    /// In the order of `VARIANTS`.
    series: [Series; 5],
}

const VARIANTS: [&str; 5] = [
    "raw rumqttc QoS1, from memory",
    "by hand (rusqlite+rumqttc), FULL",
    "by hand (rusqlite+rumqttc), NORMAL",
    "relay, store synchronous=FULL",
    "relay, store synchronous=NORMAL",
];
/// Short names, for the per-round lines and the `bench:` lines.
const SHORT: [&str; 5] = ["raw", "hand_full", "hand_normal", "full", "normal"];

fn drain_section(
    dir: &Path,
    port: u16,
    broker: Option<&str>,
    arrivals: &Arrivals,
    n: u64,
    window: usize,
    rounds: usize,
) -> BoxResult<DrainOutcome> {
    let msgs = raw_messages(n)?;
    let envelope_bytes = msgs.iter().map(|(_, p)| p.len()).sum::<usize>() as f64 / n as f64;
    let payload_bytes = (0..n.min(1000))
        .map(|i| edge_outbox::envelope::to_cbor(&reading(i)).map(|p| p.len()))
        .sum::<Result<usize, _>>()? as f64
        / n.min(1000) as f64;
    println!(
        "a. drain: {n} messages, envelopes {envelope_bytes:.0} bytes (payload {payload_bytes:.0}), \
         window {window}, {rounds} rounds"
    );
    // Warm-up: mosquitto's allocations, the page cache, code paths.
    let warm = (n / 10).max(100);
    drain_raw(port, broker, arrivals, &msgs[..warm as usize], window)?;
    drain_relay(
        port,
        broker,
        arrivals,
        Backlog::fill(dir, warm, Synchronous::Full)?,
        window,
    )?;
    hand_relay::HandBacklog::fill(dir, &msgs[..warm as usize], "FULL")?.drain(
        port,
        arrivals,
        window,
        STALL,
        || 0.0,
    )?;

    let rate = |d: Duration| n as f64 / d.as_secs_f64();
    let per_msg = |secs: f64| secs * 1e6 / n as f64;
    let mut series: [Series; 5] = Default::default();
    for round in 0..rounds {
        // Every backlog first, so that the timed runs follow each other closely.
        let mut full = Some(Backlog::fill(dir, n, Synchronous::Full)?);
        let mut normal = Some(Backlog::fill(dir, n, Synchronous::Normal)?);
        let mut hand_full = Some(hand_relay::HandBacklog::fill(dir, &msgs, "FULL")?);
        let mut hand_normal = Some(hand_relay::HandBacklog::fill(dir, &msgs, "NORMAL")?);
        let mut runs: [Option<DrainRun>; 5] = Default::default();
        for k in 0..5 {
            let variant = (round + k) % 5;
            let hand = |b: Option<hand_relay::HandBacklog>| -> BoxResult<DrainRun> {
                let run = b.ok_or("backlog")?.drain(port, arrivals, window, STALL, || {
                    broker.map_or(0.0, threads::process_cpu_secs)
                })?;
                Ok(DrainRun {
                    took: run.took,
                    cpu: run.cpu,
                    broker: run.broker,
                })
            };
            runs[variant] = Some(match variant {
                0 => drain_raw(port, broker, arrivals, &msgs, window)?,
                1 => hand(hand_full.take())?,
                2 => hand(hand_normal.take())?,
                3 => drain_relay(port, broker, arrivals, full.take().ok_or("backlog")?, window)?,
                _ => drain_relay(port, broker, arrivals, normal.take().ok_or("backlog")?, window)?,
            });
        }
        let [
            Some(raw),
            Some(hand_full),
            Some(hand_normal),
            Some(full),
            Some(normal),
        ] = runs
        else {
            return Err("a variant did not run".into());
        };
        let mut line = format!("  round {}:", round + 1);
        for (v, run) in [&raw, &hand_full, &hand_normal, &full, &normal]
            .into_iter()
            .enumerate()
        {
            let s = &mut series[v];
            s.rate.push(rate(run.took));
            s.own_us.push(per_msg(run.cpu));
            s.broker_us.push(per_msg(run.broker));
            if v > 0 {
                s.ratio.push(rate(run.took) / rate(raw.took));
                s.cpu_ratio.push(run.cpu / raw.cpu);
            }
            if v > 2 {
                let hand = [&hand_full, &hand_normal][v - 3];
                s.hand_ratio.push(rate(run.took) / rate(hand.took));
                s.hand_cpu_ratio.push(run.cpu / hand.cpu);
            }
            line.push_str(&format!(
                "  {} {:.0}/s {:.2}+{:.2}us",
                SHORT[v],
                rate(run.took),
                per_msg(run.cpu),
                per_msg(run.broker)
            ));
        }
        println!("{line}");
    }
    Ok(DrainOutcome {
        n,
        window,
        rounds,
        envelope_bytes,
        payload_bytes,
        series,
    })
}

fn wait_connected(relay: &Relay) -> BoxResult<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !relay.status()?.connected {
        if Instant::now() > deadline {
            return Err(format!("relay did not connect: {:?}", relay.status()?).into());
        }
        thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// b. Latency

struct LatencyOutcome {
    samples: usize,
    /// `Outbox::transaction` call to its return: the commit itself (BEGIN, insert, COMMIT, fsync).
    commit: Vec<f64>,
    /// `Outbox::transaction` call to arrival at the subscriber.
    relay: Vec<f64>,
    /// `publish` to arrival at the subscriber.
    raw: Vec<f64>,
    /// The relay's own share: `Outbox::transaction`'s return to the PUBACK reaching the relay's
    /// connection thread (read by the probe from the crate's `mqtt event` trace).
    relay_puback: Vec<f64>,
    /// `publish` to the PUBACK reaching raw rumqttc's event thread.
    raw_puback: Vec<f64>,
}

fn ms_between(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1e3
}

fn latency_section(
    dir: &Path,
    port: u16,
    arrivals: &Arrivals,
    samples: usize,
    window: usize,
) -> BoxResult<LatencyOutcome> {
    println!("b. latency: {samples} samples per side, random 1-4 ms gaps");
    let warm = (samples / 20).max(10);
    let total = warm + samples;
    let dir = tempfile::Builder::new().prefix("latency-").tempdir_in(dir)?;
    let outbox = Outbox::open(dir.path().join("outbox.db"))?;
    let relay = Relay::start(&outbox, relay_config(port, window))?;
    wait_connected(&relay)?;
    arrivals.expect(total);
    let mut rng = Rng(42);
    let mut out = LatencyOutcome {
        samples,
        commit: Vec::new(),
        relay: Vec::new(),
        raw: Vec::new(),
        relay_puback: Vec::new(),
        raw_puback: Vec::new(),
    };
    puback_probe::arm(true);
    for i in 0..total {
        thread::sleep(rng.gap());
        let r = reading(i as u64);
        let called = Instant::now();
        outbox.transaction(|tx| {
            tx.publish(&topic(r.device), r.device, &r)?;
            Ok::<_, edge_outbox::Error>(())
        })?;
        let returned = Instant::now();
        // A fresh outbox numbers its rows from 1.
        let at = arrivals.wait_seq(i + 1, Duration::from_secs(10))?;
        // Let the mark commit before the next sample, so every sample starts from an idle relay
        // (and the PUBACK, which comes before the mark, has been seen).
        let deadline = Instant::now() + Duration::from_secs(10);
        while relay.status()?.store.pending_messages != 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_micros(200));
        }
        let acks = puback_probe::take();
        let [acked] = acks[..] else {
            return Err(format!("sample {i}: {} PUBACKs seen by the probe, not 1", acks.len()).into());
        };
        if i >= warm {
            out.commit.push(ms_between(called, returned));
            out.relay.push(ms_between(called, at));
            out.relay_puback.push(ms_between(returned, acked));
        }
    }
    puback_probe::arm(false);
    relay.shutdown()?;

    // Raw rumqttc: publish, then arrival at the subscriber.
    let (client, mut connection) = mqtt::raw(port, "bench-raw-latency", window);
    let (conn_tx, conn_rx) = crossbeam_channel::bounded::<()>(1);
    let (ack_tx, ack_rx) = crossbeam_channel::unbounded::<Instant>();
    let event_loop = thread::Builder::new().name("raw-events".into()).spawn(move || {
        loop {
            match connection.next(Duration::from_secs(60)) {
                Ok(RawEvent::ConnAck) => {
                    let _ = conn_tx.try_send(());
                }
                Ok(RawEvent::PubAck(_)) => {
                    let _ = ack_tx.send(Instant::now());
                }
                Ok(RawEvent::DisconnectSent) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })?;
    conn_rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "raw client did not connect")?;
    arrivals.expect(total);
    let msgs = raw_messages(total as u64)?;
    for (i, (topic, payload)) in msgs.into_iter().enumerate() {
        thread::sleep(rng.gap());
        let t0 = Instant::now();
        client.publish(topic, payload)?;
        let at = arrivals.wait_seq(i + 1, Duration::from_secs(10))?;
        let acked = ack_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| format!("raw sample {i}: no PUBACK"))?;
        if i >= warm {
            out.raw.push(ms_between(t0, at));
            out.raw_puback.push(ms_between(t0, acked));
        }
    }
    client.try_disconnect();
    let _ = event_loop.join();
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// c. Memory while draining a large backlog (child process)

struct MemoryOutcome {
    rows: u64,
    fill_secs: f64,
    db_mib: f64,
    drain_secs: f64,
    baseline_kib: u64,
    /// (fraction acknowledged, VmRSS KiB) samples from the child.
    samples: Vec<(f64, u64)>,
    /// (fraction acknowledged, RssAnon, RssFile, RssShmem KiB), same samples.
    parts: Vec<(f64, u64, u64, u64)>,
    hwm_kib: u64,
    parent_seen_max_kib: u64,
}

fn memory_section(dir: &Path, port: u16, rows: u64, window: usize) -> BoxResult<MemoryOutcome> {
    println!("c. memory: draining {rows} rows in a child process");
    let dir = tempfile::Builder::new().prefix("memory-").tempdir_in(dir)?;
    let path = dir.path().join("outbox.db");
    let fill_start = Instant::now();
    {
        let outbox = Outbox::open_with(&path, Options::new().synchronous(Synchronous::Normal))?;
        fill(&outbox, 0, rows, 10_000)?;
    }
    let fill_secs = fill_start.elapsed().as_secs_f64();
    let db_mib = std::fs::metadata(&path)?.len() as f64 / (1 << 20) as f64;
    println!("  filled in {fill_secs:.1} s, {db_mib:.0} MiB");

    let mut child = Command::new(std::env::current_exe()?)
        .env(CHILD_ENV, "drain")
        .env("EDGE_OUTBOX_BENCH_CHILD_DB", &path)
        .env("EDGE_OUTBOX_BENCH_CHILD_PORT", port.to_string())
        .env("EDGE_OUTBOX_BENCH_CHILD_ROWS", rows.to_string())
        .env("EDGE_OUTBOX_BENCH_CHILD_WINDOW", window.to_string())
        .stdout(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let stdout = child.stdout.take().ok_or("child stdout")?;
    let reader = thread::spawn(move || BufReader::new(stdout).lines().collect::<Result<Vec<_>, _>>());
    let mut parent_seen_max_kib = 0;
    let status_file = PathBuf::from(format!("/proc/{pid}/status"));
    let exit = loop {
        if let Some(exit) = child.try_wait()? {
            break exit;
        }
        if let Some(kib) = std::fs::read_to_string(&status_file)
            .ok()
            .and_then(|s| proc_field(&s, "VmRSS:"))
        {
            parent_seen_max_kib = parent_seen_max_kib.max(kib);
        }
        thread::sleep(Duration::from_millis(10));
    };
    let lines = reader.join().map_err(|_| "child reader panicked")??;
    if !exit.success() {
        return Err(format!("drain child failed ({exit}): {}", lines.join("\n")).into());
    }
    let mut out = MemoryOutcome {
        rows,
        fill_secs,
        db_mib,
        drain_secs: 0.0,
        baseline_kib: 0,
        samples: Vec::new(),
        parts: Vec::new(),
        hwm_kib: 0,
        parent_seen_max_kib,
    };
    for line in &lines {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["baseline", kib] => out.baseline_kib = kib.parse()?,
            ["sample", acked, kib, anon, file, shmem] => {
                let f = acked.parse::<f64>()? / rows as f64;
                out.samples.push((f, kib.parse()?));
                out.parts.push((f, anon.parse()?, file.parse()?, shmem.parse()?));
            }
            ["done", secs, hwm] => {
                out.drain_secs = secs.parse()?;
                out.hwm_kib = hwm.parse()?;
            }
            _ => println!("  child: {line}"),
        }
    }
    if out.samples.is_empty() || out.hwm_kib == 0 {
        return Err(format!("drain child reported nothing: {lines:?}").into());
    }
    Ok(out)
}

fn proc_field(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn self_status(name: &str) -> BoxResult<u64> {
    let s = std::fs::read_to_string("/proc/self/status")?;
    proc_field(&s, name).ok_or_else(|| format!("{name} not in /proc/self/status").into())
}

/// The child: drains the store and reports its memory. Prints `baseline KIB`, then
/// `sample ACKED RSS ANON FILE SHMEM` (KiB) every 10 ms, then `done SECS HWM_KIB`.
fn drain_child() -> BoxResult<()> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} not set"));
    let path = PathBuf::from(var("EDGE_OUTBOX_BENCH_CHILD_DB")?);
    let port: u16 = var("EDGE_OUTBOX_BENCH_CHILD_PORT")?.parse()?;
    let rows: u64 = var("EDGE_OUTBOX_BENCH_CHILD_ROWS")?.parse()?;
    let window: usize = var("EDGE_OUTBOX_BENCH_CHILD_WINDOW")?.parse()?;
    let outbox = Outbox::open(&path)?;
    println!("baseline {}", self_status("VmRSS:")?);
    let start = Instant::now();
    let relay = Relay::start(&outbox, relay_config(port, window))?;
    let mut progress = (0, Instant::now());
    loop {
        thread::sleep(Duration::from_millis(10));
        let st = relay.status()?;
        let status = std::fs::read_to_string("/proc/self/status")?;
        let field = |name: &str| proc_field(&status, name).unwrap_or(0);
        println!(
            "sample {} {} {} {} {}",
            st.acknowledged,
            field("VmRSS:"),
            field("RssAnon:"),
            field("RssFile:"),
            field("RssShmem:")
        );
        if st.acknowledged >= rows && st.store.pending_messages == 0 {
            break;
        }
        if st.acknowledged != progress.0 {
            progress = (st.acknowledged, Instant::now());
        } else if progress.1.elapsed() > STALL {
            return Err(format!("relay stalled: {st:?}").into());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let hwm = self_status("VmHWM:")?;
    relay.shutdown()?;
    println!("done {secs:.3} {hwm}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Reporting

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// VmRSS at the first sample at or past `fraction` of the rows.
fn rss_at(samples: &[(f64, u64)], fraction: f64) -> u64 {
    samples
        .iter()
        .find(|(f, _)| *f >= fraction)
        .or(samples.last())
        .map_or(0, |s| s.1)
}

fn main() -> BoxResult<()> {
    if std::env::var(CHILD_ENV).as_deref() == Ok("drain") {
        return drain_child();
    }
    let scale = env_num("EDGE_OUTBOX_BENCH_SCALE", 1.0)?;
    let rounds = (env_num("EDGE_OUTBOX_BENCH_ROUNDS", 7.0)?.round() as usize).max(3);
    let window = env_num("EDGE_OUTBOX_BENCH_WINDOW", 100.0)?.round() as usize;
    let sections =
        std::env::var("EDGE_OUTBOX_BENCH_SECTIONS").unwrap_or_else(|_| "drain,latency,memory".into());
    let on = |s: &str| sections.split(',').any(|x| x.trim() == s);
    let scaled = |n: f64| ((n * scale).round() as u64).max(100);
    let base = common::bench_dir()?;

    let broker = mqtt::stock_mosquitto()?;
    let port = broker.port();
    let broker_pid = broker.pid().map(|p| p.to_string());
    let mosquitto_version = Command::new(support::broker::mosquitto_path().ok_or("mosquitto")?)
        .arg("-h")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_default();
    println!("edge-outbox relay benchmark");
    println!(
        "  broker: {mosquitto_version}, default configuration (listener 127.0.0.1:{port}, \
         allow_anonymous), one instance for every section"
    );
    println!(
        "  protocol: MQTT {} for the relay and raw rumqttc alike",
        mqtt::protocol().as_str()
    );
    println!("  databases in {}; scale {scale}", base.display());
    println!();
    let started = Instant::now();
    puback_probe::install()?;
    let arrivals = Arrivals::start(port)?;

    let drain = if on("drain") {
        Some(drain_section(
            &base,
            port,
            broker_pid.as_deref(),
            &arrivals,
            scaled(100_000.0),
            window,
            rounds,
        )?)
    } else {
        None
    };
    let latency = if on("latency") {
        Some(latency_section(
            &base,
            port,
            &arrivals,
            scaled(2_000.0) as usize,
            window,
        )?)
    } else {
        None
    };
    drop(arrivals);
    let memory = if on("memory") {
        Some(memory_section(&base, port, scaled(1_000_000.0), window)?)
    } else {
        None
    };
    println!();

    let mut bench: Vec<(String, String)> = Vec::new();
    if let Some(d) = &drain {
        println!(
            "a. drain {} messages, window {}, {} rounds; envelope {:.0} bytes, payload {:.0} bytes",
            d.n, d.window, d.rounds, d.envelope_bytes, d.payload_bytes
        );
        println!(
            "   until the outbox is empty and the subscriber holds every message; medians; a ratio \
             is the median of the per-round ratios [min-max]; CPU in us per message, client threads only"
        );
        println!(
            "   {:<36} {:>8} {:>8} {:>8}  {:<20} {:<20} {:<20} {:<20}",
            "",
            "msg/s",
            "cpu",
            "broker",
            "over raw: msg/s",
            "over raw: CPU",
            "over hand: msg/s",
            "over hand: CPU"
        );
        let range = |v: &[f64]| {
            if v.is_empty() {
                "-".to_owned()
            } else {
                format!(
                    "{:.3} [{:.2}-{:.2}]",
                    median(v),
                    quantile(v, 0.0),
                    quantile(v, 1.0)
                )
            }
        };
        for (v, s) in d.series.iter().enumerate() {
            println!(
                "   {:<36} {:>8.0} {:>8.2} {:>8.2}  {:<20} {:<20} {:<20} {:<20}",
                VARIANTS[v],
                median(&s.rate),
                median(&s.own_us),
                median(&s.broker_us),
                range(&s.ratio),
                range(&s.cpu_ratio),
                range(&s.hand_ratio),
                range(&s.hand_cpu_ratio)
            );
        }
        let (fr, nr) = (median(&d.series[3].ratio), median(&d.series[4].ratio));
        let (fc, nc) = (median(&d.series[3].cpu_ratio), median(&d.series[4].cpu_ratio));
        println!(
            "   target drain relay/raw >= 0.95: FULL {fr:.3} {}, NORMAL {nr:.3} {}",
            verdict(fr >= 0.95),
            verdict(nr >= 0.95)
        );
        println!(
            "   target CPU relay/raw <= 1.2: FULL {fc:.3} {}, NORMAL {nc:.3} {}",
            verdict(fc <= 1.2),
            verdict(nc <= 1.2)
        );
        println!();
        for (v, name) in SHORT.iter().enumerate() {
            let s = &d.series[v];
            // The hand-written drain's lines start with `hand_`, the relay's and raw's with
            // `relay_` (their names before the hand-written drain came).
            let (who, name) = match name.strip_prefix("hand_") {
                Some(sync) => ("hand", sync),
                None => ("relay", *name),
            };
            bench.push((
                format!("{who}_drain_{name}_msg_per_s"),
                format!("{:.0}", median(&s.rate)),
            ));
            bench.push((
                format!("{who}_drain_{name}_cpu_us_per_msg"),
                format!("{:.2}", median(&s.own_us)),
            ));
            if v > 0 {
                bench.push((
                    format!("{who}_drain_{name}_over_raw"),
                    format!("{:.3}", median(&s.ratio)),
                ));
                bench.push((
                    format!("{who}_cpu_over_raw_{name}"),
                    format!("{:.3}", median(&s.cpu_ratio)),
                ));
            }
            if v > 2 {
                bench.push((
                    format!("relay_drain_{name}_over_hand"),
                    format!("{:.3}", median(&s.hand_ratio)),
                ));
                bench.push((
                    format!("relay_cpu_over_hand_{name}"),
                    format!("{:.3}", median(&s.hand_cpu_ratio)),
                ));
            }
        }
        bench.push(("relay_cpu_over_raw".into(), format!("{:.3}", fc.max(nc))));
    }
    if let Some(l) = &latency {
        println!(
            "b. latency to the subscriber, idle connected relay, store synchronous=FULL, {} samples (ms)",
            l.samples
        );
        println!(
            "   {:<52} {:>7} {:>7} {:>7} {:>7} {:>7}",
            "", "p50", "p90", "p99", "p99.9", "max"
        );
        let row = |name: &str, v: &[f64]| {
            println!(
                "   {:<52} {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>7.3}",
                name,
                quantile(v, 0.5),
                quantile(v, 0.9),
                quantile(v, 0.99),
                quantile(v, 0.999),
                quantile(v, 1.0)
            );
        };
        row("the commit itself (transaction call -> return)", &l.commit);
        row("relay: transaction call -> arrival at the subscriber", &l.relay);
        row("raw rumqttc: publish -> arrival at the subscriber", &l.raw);
        row("relay's share: transaction return -> PUBACK", &l.relay_puback);
        row("raw rumqttc: publish -> PUBACK", &l.raw_puback);
        let (p50, p99) = (quantile(&l.relay, 0.5), quantile(&l.relay, 0.99));
        println!(
            "   target p50 < 2 ms: {p50:.3} {}; p99 < 10 ms: {p99:.3} {}",
            verdict(p50 < 2.0),
            verdict(p99 < 10.0),
        );
        let share = quantile(&l.relay_puback, 0.99) / quantile(&l.raw_puback, 0.99);
        println!(
            "   relay's share over raw at p99 (to PUBACK), target <= 2: {share:.2} {}",
            verdict(share <= 2.0)
        );
        bench.push(("relay_share_over_raw_p99".into(), format!("{share:.3}")));
        println!();
        for (name, v) in [
            ("relay_latency", &l.relay),
            ("raw_latency", &l.raw),
            ("commit", &l.commit),
            ("relay_share_puback", &l.relay_puback),
            ("raw_puback", &l.raw_puback),
        ] {
            bench.push((format!("{name}_p50_ms"), format!("{:.3}", quantile(v, 0.5))));
            bench.push((format!("{name}_p99_ms"), format!("{:.3}", quantile(v, 0.99))));
            bench.push((format!("{name}_p999_ms"), format!("{:.3}", quantile(v, 0.999))));
        }
    }
    if let Some(m) = &memory {
        let at = |f: f64| rss_at(&m.samples, f);
        let (r10, r50, r90) = (at(0.1), at(0.5), at(0.9));
        let max_sample = m.samples.iter().map(|s| s.1).max().unwrap_or(0);
        // Flat: RSS does not grow with the rows drained. Streaming keeps it a few MiB whatever the
        // backlog; loading rows would add about their size. The allocator keeps some freed heap
        // in steps of a few MiB (they vanish with MALLOC_TRIM_THRESHOLD_=0), so the test is that
        // 10% -> 90% grows by less than a tenth of the data drained in between.
        let growth = r90 as f64 - r10 as f64;
        let drained_kib = m.db_mib * 1024.0 * 0.8;
        let flat = growth < 0.1 * drained_kib;
        println!(
            "c. memory draining {} rows ({:.0} MiB file, filled in {:.1} s) in a child process",
            m.rows, m.db_mib, m.fill_secs
        );
        println!(
            "   drained in {:.1} s ({:.0} msg/s), {} samples; VmRSS before the relay started {:.1} MiB",
            m.drain_secs,
            m.rows as f64 / m.drain_secs,
            m.samples.len(),
            mib(m.baseline_kib),
        );
        println!(
            "   {:<10} {:>7} {:>7} {:>7} {:>7}",
            "drained", "VmRSS", "anon", "file", "shmem"
        );
        for d in 1..=10 {
            let f = f64::from(d) / 10.0;
            if let Some(p) = m.parts.iter().find(|p| p.0 >= f).or(m.parts.last()) {
                println!(
                    "   {:<10} {:>7.1} {:>7.1} {:>7.1} {:>7.1}",
                    format!("{}%", d * 10),
                    mib(rss_at(&m.samples, f)),
                    mib(p.1),
                    mib(p.2),
                    mib(p.3)
                );
            }
        }
        println!(
            "   max sampled {:.1} MiB (this process polling the child saw {:.1})",
            mib(max_sample),
            mib(m.parent_seen_max_kib)
        );
        println!(
            "   peak VmHWM {:.1} MiB: target < 64 MiB {}; 10% -> 50% -> 90%: {:+.1}, {:+.1} MiB; \
             flat (10% -> 90% < a tenth of the {:.0} MiB drained in between) {}",
            mib(m.hwm_kib),
            verdict(m.hwm_kib < 64 * 1024),
            (r50 as f64 - r10 as f64) / 1024.0,
            (r90 as f64 - r50 as f64) / 1024.0,
            drained_kib / 1024.0,
            verdict(flat)
        );
        println!();
        bench.push((
            "relay_backlog_peak_rss_mib".into(),
            format!("{:.1}", mib(m.hwm_kib)),
        ));
        bench.push((
            "relay_backlog_rss_growth_10_90_mib".into(),
            format!("{:.1}", growth / 1024.0),
        ));
        bench.push((
            "relay_backlog_drain_msg_per_s".into(),
            format!("{:.0}", m.rows as f64 / m.drain_secs),
        ));
    }
    println!("measured in {:.0} s", started.elapsed().as_secs_f64());
    println!();
    for (name, value) in bench {
        println!("bench: {name} {value}");
    }
    drop(broker);
    Ok(())
}
