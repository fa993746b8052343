//! A flood of commands after an outage, while the application keeps committing.
//!
//! 10,000 commands (default; about 100-byte envelopes, 16 keys) are queued at the broker for the
//! device's persistent command session while the device is offline. The relay then starts (with
//! a command session, no handler: this measures receiving) and stores and acknowledges every one,
//! each in its own FULL-synced transaction, as it must before acknowledging. Meanwhile an
//! application thread commits a business row and its message every 5 ms through the same store.
//!
//! - `inbox_receive_vs_bare`: commands received, stored and acknowledged per second, over the rate
//!   of the floor measured in the same run: the same rows inserted with bare rusqlite, one
//!   FULL-synced autocommit insert each into a minimal table of the same file, while the same
//!   application load runs. Target: at least 0.8.
//! - `app_p99_during_flood`: the application's transaction latency, p99, during the flood, over
//!   its p99 with the relay connected and idle (same pacing, same store). Target: at most 2.
//!
//! Each round runs idle, flood and bare in that order; the figures are medians over the rounds.
//!
//! Environment:
//! - `EDGE_OUTBOX_BENCH_COMMANDS`: commands per flood (default 10,000);
//! - `EDGE_OUTBOX_BENCH_ROUNDS`: rounds (default 3);
//! - `EDGE_OUTBOX_BENCH_DIR`: where the databases go (default the cargo target tmp dir; a real
//!   disk, not tmpfs: the figures are about fsync).
//!
//! Uses the test broker (`EDGE_OUTBOX_BROKER`, mosquitto when installed: its test configuration
//! queues more than 1,000 messages for an offline session, which a stock mosquitto would drop).
//! The output ends with one `bench: NAME VALUE` line per figure.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::{env_num, median, quantile};
use edge_outbox::{Envelope, MessageId, MqttConfig, Outbox, Relay, RelayConfig};
use rumqttc::QoS;
use support::{Broker, publish_raw_many};

type Result<T, E = Box<dyn StdError>> = std::result::Result<T, E>;

const FILTER: &str = "bench/device/commands/#";
const KEYS: usize = 16;
/// The application commits this often.
const APP_PACE: Duration = Duration::from_millis(5);
/// Application transactions measured for the idle baseline.
const IDLE_SAMPLES: usize = 1500;

fn main() -> Result<()> {
    let commands = env_num("EDGE_OUTBOX_BENCH_COMMANDS", 10_000.0)? as usize;
    let rounds = env_num("EDGE_OUTBOX_BENCH_ROUNDS", 3.0)? as usize;
    let base = match std::env::var_os("EDGE_OUTBOX_BENCH_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(option_env!("CARGO_TARGET_TMPDIR").unwrap_or(".")),
    };
    std::fs::create_dir_all(&base)?;
    let broker = Broker::start()?;
    println!("edge-outbox command flood benchmark");
    println!(
        "  {commands} commands queued offline at {:?}, then received; the application commits every {APP_PACE:?}",
        broker.kind()
    );
    println!("  databases in {}; {rounds} rounds; medians", base.display());
    println!();
    println!("round  idle p99 ms  flood p99 ms  flood cmd/s  bare rows/s  flood s  app tx in flood");

    let mut ratios_rate = Vec::new();
    let mut ratios_p99 = Vec::new();
    for round in 0..rounds {
        let dir = tempfile::Builder::new()
            .prefix("edge-outbox-bench-commands")
            .tempdir_in(&base)?;
        let r = run_round(&broker, dir.path(), commands, round)?;
        println!(
            "{round:>5}  {:>11.2}  {:>12.2}  {:>11.0}  {:>11.0}  {:>7.1}  {:>15}",
            r.idle_p99 * 1e3,
            r.flood_p99 * 1e3,
            r.flood_rate,
            r.bare_rate,
            r.flood_secs,
            r.flood_app_tx
        );
        ratios_rate.push(r.flood_rate / r.bare_rate);
        ratios_p99.push(r.flood_p99 / r.idle_p99);
    }
    let rate = median(&ratios_rate);
    let p99 = median(&ratios_p99);
    println!();
    println!(
        "receive+ack vs bare FULL insert: {rate:.2} (target >= 0.8: {})",
        if rate >= 0.8 { "met" } else { "NOT met" }
    );
    println!(
        "app p99 during the flood vs idle: {p99:.2} (target <= 2: {})",
        if p99 <= 2.0 { "met" } else { "NOT met" }
    );
    println!();
    println!("bench: inbox_receive_vs_bare {rate:.2}");
    println!("bench: app_p99_during_flood {p99:.2}");
    Ok(())
}

struct Round {
    idle_p99: f64,
    flood_p99: f64,
    flood_rate: f64,
    bare_rate: f64,
    flood_secs: f64,
    flood_app_tx: usize,
}

fn config(broker: &Broker, round: usize) -> RelayConfig {
    RelayConfig::new(
        MqttConfig::new(broker.host(), broker.port())
            .client_id(format!("bench-device-{round}"))
            .keep_alive(Duration::from_secs(5)),
    )
    .commands(FILTER)
}

fn open(path: &Path) -> Result<Outbox> {
    let outbox = Outbox::open(path)?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS readings (n INTEGER PRIMARY KEY, celsius REAL NOT NULL);
             CREATE TABLE IF NOT EXISTS bare (id BLOB PRIMARY KEY, topic TEXT, key TEXT, payload BLOB);",
        )
    })?;
    Ok(outbox)
}

fn run_round(broker: &Broker, dir: &Path, commands: usize, round: usize) -> Result<Round> {
    let path = dir.join("device.db");
    let outbox = open(&path)?;
    let wait_subscribed = |relay: &Relay| -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !relay.status()?.commands_connected {
            if Instant::now() > deadline {
                return Err("the command session never subscribed".into());
            }
            thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    };

    // Idle: connected relay, nothing arriving. This also creates the persistent session.
    let relay = Relay::start(&outbox, config(broker, round))?;
    wait_subscribed(&relay)?;
    let idle = app_load(&outbox, Some(IDLE_SAMPLES), None)?;
    relay.shutdown()?;

    // Offline: the broker queues the flood for the device's command session.
    let envelopes: Vec<(String, Vec<u8>)> = (0..commands)
        .map(|i| {
            let key = format!("valve-{}", i % KEYS);
            let bytes = Envelope::command(MessageId::new_v7(), &key, &("set", i as u64, 21.5f64))
                .map(|e| e.encode())?;
            Ok((format!("bench/device/commands/{key}"), bytes))
        })
        .collect::<Result<_, edge_outbox::Error>>()?;
    for chunk in envelopes.chunks(1000) {
        let batch: Vec<(&str, &[u8])> = chunk.iter().map(|(t, b)| (t.as_str(), b.as_slice())).collect();
        publish_raw_many(broker.addr(), &batch, QoS::AtLeastOnce)?;
    }

    // The flood, with the application committing meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let app = {
        let (outbox, stop) = (outbox.clone(), stop.clone());
        thread::spawn(move || app_load(&outbox, None, Some(&stop)).map_err(|e| e.to_string()))
    };
    let started = Instant::now();
    let relay = Relay::start(&outbox, config(broker, round))?;
    let deadline = started + Duration::from_secs(600);
    while relay.status()?.commands_received < commands as u64 {
        if Instant::now() > deadline {
            return Err(format!("flood not received: {:?}", relay.status()?).into());
        }
        thread::sleep(Duration::from_millis(1));
    }
    let flood_secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    let flood = app.join().map_err(|_| "app thread panicked")??;
    relay.shutdown()?;

    // The floor: the same rows, bare rusqlite, one FULL autocommit insert each, same app load.
    let stop = Arc::new(AtomicBool::new(false));
    let app = {
        let (outbox, stop) = (outbox.clone(), stop.clone());
        thread::spawn(move || app_load(&outbox, None, Some(&stop)).map_err(|e| e.to_string()))
    };
    let conn = rusqlite::Connection::open(&path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    let started = Instant::now();
    {
        let mut insert =
            conn.prepare("INSERT INTO bare (id, topic, key, payload) VALUES (?1, ?2, ?3, ?4)")?;
        for (topic, bytes) in &envelopes {
            let env = Envelope::decode(bytes)?;
            insert.execute((
                env.id.as_bytes().as_slice(),
                topic,
                env.key.as_ref(),
                env.payload.as_ref(),
            ))?;
        }
    }
    let bare_secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    app.join().map_err(|_| "app thread panicked")??;

    Ok(Round {
        idle_p99: quantile(&idle, 0.99),
        flood_p99: quantile(&flood, 0.99),
        flood_rate: commands as f64 / flood_secs,
        bare_rate: commands as f64 / bare_secs,
        flood_secs,
        flood_app_tx: flood.len(),
    })
}

/// Commits a reading and its message every `APP_PACE`, `count` times or until `stop`; returns
/// each transaction's latency in seconds.
fn app_load(outbox: &Outbox, count: Option<usize>, stop: Option<&AtomicBool>) -> Result<Vec<f64>> {
    let mut latencies = Vec::new();
    let mut next = Instant::now();
    loop {
        if count.is_some_and(|n| latencies.len() >= n) || stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Ok(latencies);
        }
        let started = Instant::now();
        outbox.transaction(|tx| {
            tx.execute("INSERT INTO readings (celsius) VALUES (21.5)", [])?;
            tx.publish("bench/device/readings", "probe-1", &21.5)?;
            Ok::<_, edge_outbox::Error>(())
        })?;
        latencies.push(started.elapsed().as_secs_f64());
        next += APP_PACE;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        } else {
            next = Instant::now();
        }
    }
}
