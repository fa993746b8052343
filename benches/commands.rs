//! A flood of commands after an outage, while the application keeps committing.
//!
//! 10,000 commands (default; about 100-byte envelopes, 16 keys) are queued at the broker for the
//! device's persistent command session while the device is offline. The relay then starts (with
//! a command session, no handler: this measures receiving) and stores and acknowledges every one,
//! a burst at a time (the deliveries one network read brings, in one FULL-synced transaction),
//! acknowledging each only after its burst commits. Meanwhile an application thread commits a
//! business row and its message every 5 ms through the same store.
//!
//! - `inbox_receive_vs_bare`: commands received, stored and acknowledged per second, over the rate
//!   of the floor measured in the same run: the same rows inserted with bare rusqlite, one
//!   FULL-synced autocommit insert each into a minimal table of the same file, while the same
//!   application load runs. Target: at least 0.9. The bare writer is not in the crate's writer
//!   queue, so it and the application meet at SQLite's lock, which polls: the table shows how few
//!   application transactions get through then.
//! - `app_p99_during_flood`: the application's transaction latency, p99, during the flood (the
//!   transactions that started between the intake's first burst and its last), over its p99 with
//!   the relay connected and idle (same pacing, same store), the median of the rounds' ratios.
//!   Target: at most 2. `app_p99_during_flood_pooled`: the same from all rounds' transactions
//!   together (one round's flood has a hundred or so).
//! - `app_p99_during_flood_hand` (and `_pooled`): the storage floor for that ratio
//!   (`common/hand_intake.rs`), measured after the flood in each round: the flood's own bursts
//!   (each one's size and moment read from the intake's debug event, `common/burst_probe.rs`)
//!   committed by hand with bare rusqlite beside the same application load written by hand,
//!   sharing one writer lock, on a file of their own. No MQTT and no relay publishing the
//!   application's messages: what one writer at a time costs the application when nothing else
//!   runs.
//!
//! Each round measures idle, then the flood and the bare floor (which of the two goes first
//! alternates: the machine's load drifts), then the storage floor; the figures are medians over
//! the rounds.
//!
//! Environment:
//! - `EDGE_OUTBOX_BENCH_COMMANDS`: commands per flood (default 10,000);
//! - `EDGE_OUTBOX_BENCH_ROUNDS`: rounds (default 5);
//! - `EDGE_OUTBOX_BENCH_NO_APP=1`: flood and bare floor without the application's load (no
//!   latency figures then);
//! - `EDGE_OUTBOX_BENCH_STORE_ONLY=1`: diagnosis, `Outbox::receive` in a loop against the floor,
//!   no MQTT, no application;
//! - `RUST_LOG`: log lines on stderr (the intake's debug events are read by the bench either way);
//! - `EDGE_OUTBOX_BENCH_DIR`: where the databases go (default the cargo target tmp dir; a real
//!   disk, not tmpfs: the figures are about fsync).
//!
//! Uses the test broker (`EDGE_OUTBOX_BROKER`, mosquitto when installed: its test configuration
//! queues more than 1,000 messages for an offline session, which a stock mosquitto would drop).
//! The output ends with one `bench: NAME VALUE` line per figure.

#[path = "common/burst_probe.rs"]
mod burst_probe;
mod common;
#[path = "common/hand_intake.rs"]
mod hand_intake;
#[path = "../tests/support/mod.rs"]
mod support;

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::{env_num, latencies_within, median, quantile};
use edge_outbox::{Envelope, MessageId, MqttConfig, Outbox, Relay, RelayConfig};
use rumqttc::QoS;
use support::{Broker, publish_raw_many};

type Result<T, E = Box<dyn StdError>> = std::result::Result<T, E>;

const FILTER: &str = "bench/device/commands/#";
const KEYS: usize = 16;
/// The application commits this often.
const APP_PACE: Duration = Duration::from_millis(5);
/// Application transactions measured for the idle baseline.
const IDLE_SAMPLES: usize = 1000;

fn main() -> Result<()> {
    burst_probe::install()?;
    let commands = env_num("EDGE_OUTBOX_BENCH_COMMANDS", 10_000.0)? as usize;
    let rounds = env_num("EDGE_OUTBOX_BENCH_ROUNDS", 5.0)? as usize;
    let base = match std::env::var_os("EDGE_OUTBOX_BENCH_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(option_env!("CARGO_TARGET_TMPDIR").unwrap_or(".")),
    };
    std::fs::create_dir_all(&base)?;
    if std::env::var_os("EDGE_OUTBOX_BENCH_STORE_ONLY").is_some() {
        return store_only(&base, commands);
    }
    let broker = Broker::start()?;
    println!("edge-outbox command flood benchmark");
    println!(
        "  {commands} commands queued offline at {:?}, then received; the application commits every {APP_PACE:?}",
        broker.kind()
    );
    println!("  databases in {}; {rounds} rounds; medians", base.display());
    println!();
    println!(
        "round  idle p99 ms  flood p99 ms  flood cmd/s  bare rows/s  flood s  app tx: flood  bare  bursts  \
         hand: idle p99 ms  flood p99 ms  app tx"
    );

    let (mut ratios_rate, mut ratios_p99, mut ratios_hand) = (Vec::new(), Vec::new(), Vec::new());
    // The application's latencies are also pooled over the rounds: a flood lasts about a second,
    // so one round's p99 is its second or third slowest transaction.
    let (mut idle, mut flood, mut hand_idle, mut hand_flood) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let dir = tempfile::Builder::new()
            .prefix("edge-outbox-bench-commands")
            .tempdir_in(&base)?;
        let r = run_round(&broker, dir.path(), commands, round)?;
        println!(
            "{round:>5}  {:>11.2}  {:>12.2}  {:>11.0}  {:>11.0}  {:>7.1}  {:>12}  {:>4}  {:>6}  {:>17.2}  {:>12.2}  {:>6}",
            p99(&r.idle) * 1e3,
            p99(&r.flood) * 1e3,
            r.flood_rate,
            r.bare_rate,
            r.flood_secs,
            r.flood.len(),
            r.bare_app_tx,
            r.bursts,
            p99(&r.hand_idle) * 1e3,
            p99(&r.hand_flood) * 1e3,
            r.hand_flood.len(),
        );
        ratios_rate.push(r.flood_rate / r.bare_rate);
        ratios_p99.push(p99(&r.flood) / p99(&r.idle));
        ratios_hand.push(p99(&r.hand_flood) / p99(&r.hand_idle));
        idle.extend(r.idle);
        flood.extend(r.flood);
        hand_idle.extend(r.hand_idle);
        hand_flood.extend(r.hand_flood);
    }
    let rate = median(&ratios_rate);
    println!();
    println!(
        "receive+ack vs bare FULL insert: {rate:.2} (target >= 0.9: {})",
        if rate >= 0.9 { "met" } else { "NOT met" }
    );
    if no_app() {
        println!("no application load (EDGE_OUTBOX_BENCH_NO_APP): no latency figures");
        println!();
        println!("bench: inbox_receive_vs_bare {rate:.2}");
        return Ok(());
    }
    let flood_ratio = median(&ratios_p99);
    let hand = median(&ratios_hand);
    let (pooled, pooled_hand) = (p99(&flood) / p99(&idle), p99(&hand_flood) / p99(&hand_idle));
    println!(
        "app p99 during the flood vs idle: {flood_ratio:.2} (target <= 2: {}); all rounds' transactions pooled: {pooled:.2} \
         ({} during floods)",
        if flood_ratio <= 2.0 { "met" } else { "NOT met" },
        flood.len()
    );
    println!(
        "the same, both writers by hand with bare rusqlite, no MQTT (the storage floor): {hand:.2}; pooled: {pooled_hand:.2} \
         ({} during floods)",
        hand_flood.len()
    );
    println!();
    println!("bench: inbox_receive_vs_bare {rate:.2}");
    println!("bench: app_p99_during_flood {flood_ratio:.2}");
    println!("bench: app_p99_during_flood_pooled {pooled:.2}");
    println!("bench: app_p99_during_flood_hand {hand:.2}");
    println!("bench: app_p99_during_flood_hand_pooled {pooled_hand:.2}");
    Ok(())
}

struct Round {
    /// The application's transaction latencies (seconds): idle, during the flood, and the same
    /// beside the hand-written intake.
    idle: Vec<f64>,
    flood: Vec<f64>,
    hand_idle: Vec<f64>,
    hand_flood: Vec<f64>,
    flood_rate: f64,
    bare_rate: f64,
    flood_secs: f64,
    bare_app_tx: usize,
    /// The intake's transactions during the flood.
    bursts: usize,
}

fn config(broker: &Broker, round: usize) -> RelayConfig {
    RelayConfig::new(MqttConfig::new(broker.host(), broker.port()).client_id(format!("bench-device-{round}")))
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

    // Idle: connected relay, nothing arriving. This also creates the persistent session.
    let relay = Relay::start(&outbox, config(broker, round))?;
    wait_subscribed(&relay)?;
    let idle = latencies_within(&app_load(&outbox, Some(IDLE_SAMPLES), None)?, None);
    relay.shutdown()?;

    let envelopes: Vec<(String, Vec<u8>)> = (0..commands)
        .map(|i| {
            let key = format!("valve-{}", i % KEYS);
            let bytes = Envelope::command(MessageId::new_v7(), &key, &("set", i as u64, 21.5f64))
                .map(|e| e.encode())?;
            Ok((format!("bench/device/commands/{key}"), bytes))
        })
        .collect::<Result<_, edge_outbox::Error>>()?;
    // Which goes first alternates: the machine's load drifts.
    let (flood, bare) = if round.is_multiple_of(2) {
        let flood = flood(broker, &outbox, &envelopes, round)?;
        (flood, bare(&outbox, &path, &envelopes)?)
    } else {
        let bare = bare(&outbox, &path, &envelopes)?;
        (flood(broker, &outbox, &envelopes, round)?, bare)
    };
    drop(outbox);
    let bursts = burst_probe::take();
    let (Some(&(first, _)), Some(&(last, _))) = (bursts.first(), bursts.last()) else {
        return Err("the intake reported no burst (its debug event changed?)".into());
    };
    // The application's transactions that started while the bursts came: not those while the
    // relay connected and subscribed, or stopped.
    let flood_app = latencies_within(&flood.app, Some((first, last)));
    // The floor for the application's latency: the flood's own bursts, committed by hand at the
    // moments the intake reported them, beside the same application load written by hand.
    let (hand_idle, hand_flood) = if no_app() {
        (Vec::new(), Vec::new())
    } else {
        let intake = hand_intake::Intake {
            bursts: bursts
                .iter()
                .map(|&(at, n)| (at.duration_since(first), n as usize))
                .collect(),
            payload: envelopes.iter().map(|(_, b)| b.len()).sum::<usize>() / envelopes.len(),
        };
        let hand = hand_intake::measure(&dir.join("hand.db"), &intake, APP_PACE, IDLE_SAMPLES)?;
        (hand.idle, hand.flood)
    };
    Ok(Round {
        idle,
        flood_rate: commands as f64 / flood.secs,
        bare_rate: commands as f64 / bare.secs,
        flood_secs: flood.secs,
        bare_app_tx: bare.app.len(),
        flood: flood_app,
        bursts: bursts.len(),
        hand_idle,
        hand_flood,
    })
}

/// `EDGE_OUTBOX_BENCH_NO_APP`: no application load, so no latency figures.
fn no_app() -> bool {
    std::env::var_os("EDGE_OUTBOX_BENCH_NO_APP").is_some()
}

/// The p99 of `v`; not a number when there is none (`EDGE_OUTBOX_BENCH_NO_APP`).
fn p99(v: &[f64]) -> f64 {
    if v.is_empty() { f64::NAN } else { quantile(v, 0.99) }
}

fn wait_subscribed(relay: &Relay) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !relay.status()?.commands_connected {
        if Instant::now() > deadline {
            return Err("the command session never subscribed".into());
        }
        thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// How long a phase took, and the application's transactions meanwhile.
struct Phase {
    secs: f64,
    app: Vec<common::Sample>,
}

/// Runs `work` while the application commits (unless `EDGE_OUTBOX_BENCH_NO_APP` is set).
fn with_app_load(outbox: &Outbox, work: impl FnOnce() -> Result<f64>) -> Result<Phase> {
    let stop = Arc::new(AtomicBool::new(no_app()));
    let app = {
        let (outbox, stop) = (outbox.clone(), stop.clone());
        thread::spawn(move || app_load(&outbox, None, Some(&stop)).map_err(|e| e.to_string()))
    };
    let secs = work();
    stop.store(true, Ordering::SeqCst);
    let app = app.join().map_err(|_| "app thread panicked")??;
    Ok(Phase { secs: secs?, app })
}

/// The flood: queued while the device is offline, then received, stored and acknowledged.
fn flood(broker: &Broker, outbox: &Outbox, envelopes: &[(String, Vec<u8>)], round: usize) -> Result<Phase> {
    burst_probe::take();
    for chunk in envelopes.chunks(1000) {
        let batch: Vec<(&str, &[u8])> = chunk.iter().map(|(t, b)| (t.as_str(), b.as_slice())).collect();
        publish_raw_many(broker.addr(), &batch, QoS::AtLeastOnce)?;
    }
    let before =
        outbox.with_connection(|c| c.query_row("SELECT count(*) FROM inbox", [], |r| r.get::<_, i64>(0)))?;
    with_app_load(outbox, || {
        let started = Instant::now();
        let relay = Relay::start(outbox, config(broker, round))?;
        let deadline = started + Duration::from_secs(600);
        // Counted from the intake's own reports, not `status()`: that reads the store's counts
        // on the connection the application's transactions use, and would slow them.
        while burst_probe::stored() < envelopes.len() as u64 {
            if Instant::now() > deadline {
                return Err(format!("flood not received: {:?}", relay.status()?).into());
            }
            thread::sleep(Duration::from_millis(10));
        }
        let secs = started.elapsed().as_secs_f64();
        relay.shutdown()?;
        let after = outbox
            .with_connection(|c| c.query_row("SELECT count(*) FROM inbox", [], |r| r.get::<_, i64>(0)))?;
        if after - before != envelopes.len() as i64 {
            return Err(format!("{} commands stored, {} sent", after - before, envelopes.len()).into());
        }
        Ok(secs)
    })
}

/// The floor: the same rows, bare rusqlite, one FULL autocommit insert each, into a minimal table
/// of the same file, with the same application load.
fn bare(outbox: &Outbox, path: &Path, envelopes: &[(String, Vec<u8>)]) -> Result<Phase> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute("DELETE FROM bare", [])?;
    with_app_load(outbox, || {
        let started = Instant::now();
        let mut insert =
            conn.prepare("INSERT INTO bare (id, topic, key, payload) VALUES (?1, ?2, ?3, ?4)")?;
        for (topic, bytes) in envelopes {
            let env = Envelope::decode(bytes)?;
            insert.execute((
                env.id.as_bytes().as_slice(),
                topic,
                env.key.as_ref(),
                env.payload.as_ref(),
            ))?;
        }
        Ok(started.elapsed().as_secs_f64())
    })
}

/// Commits a reading and its message every `APP_PACE`, `count` times or until `stop`; returns
/// each transaction's latency in seconds.
fn app_load(outbox: &Outbox, count: Option<usize>, stop: Option<&AtomicBool>) -> Result<Vec<common::Sample>> {
    let stopped = || stop.is_some_and(|s| s.load(Ordering::SeqCst));
    common::paced(APP_PACE, count, stopped, || {
        let committed = outbox.transaction(|tx| {
            tx.execute("INSERT INTO readings (celsius) VALUES (21.5)", [])?;
            tx.publish("bench/device/readings", "probe-1", &21.5)?;
            Ok::<_, edge_outbox::Error>(())
        });
        match committed {
            // The bare phase's connection is a foreign writer that never lets go for long:
            // the application may time out then, and tries again.
            Err(edge_outbox::Error::Busy) => Ok(()),
            other => other.map(drop).map_err(Into::into),
        }
    })
}

/// Diagnosis: Outbox::receive in a loop against the bare insert, no MQTT, no app.
fn store_only(base: &Path, commands: usize) -> Result<()> {
    for _ in 0..3 {
        let dir = tempfile::Builder::new()
            .prefix("edge-outbox-bench-store")
            .tempdir_in(base)?;
        let outbox = open(&dir.path().join("device.db"))?;
        let envelopes: Vec<Vec<u8>> = (0..commands)
            .map(|i| {
                Envelope::command(
                    MessageId::new_v7(),
                    &format!("valve-{}", i % KEYS),
                    &("set", i as u64, 21.5f64),
                )
                .map(|e| e.encode())
            })
            .collect::<Result<_, edge_outbox::Error>>()?;
        let started = Instant::now();
        for e in &envelopes {
            outbox.receive("bench/device/commands/x", e)?;
        }
        let receive = commands as f64 / started.elapsed().as_secs_f64();
        let conn = rusqlite::Connection::open(dir.path().join("device.db"))?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        let started = Instant::now();
        {
            let mut insert =
                conn.prepare("INSERT INTO bare (id, topic, key, payload) VALUES (?1, ?2, ?3, ?4)")?;
            for bytes in &envelopes {
                let env = Envelope::decode(bytes)?;
                insert.execute((
                    env.id.as_bytes().as_slice(),
                    "bench/device/commands/x",
                    env.key.as_ref(),
                    env.payload.as_ref(),
                ))?;
            }
        }
        let bare = commands as f64 / started.elapsed().as_secs_f64();
        println!(
            "store only: receive {receive:.0}/s, bare {bare:.0}/s, ratio {:.2}",
            receive / bare
        );
    }
    Ok(())
}
