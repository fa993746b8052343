//! What each message costs the flash: bytes written to the database, WAL and shared-memory
//! files, and fsyncs, over its whole life (insert, publish, mark, checkpoint, vacuum).
//!
//! The store lives on the power-cut file system of the test suite (`tests/support/powercut.rs`,
//! FUSE, in memory), which counts every `write` and `fsync` per file as the kernel hands it over
//! (no page cache in between: every `write(2)` reaches it, and the shared-memory file's mapped
//! pages are written back by the kernel). For each configuration (`synchronous` FULL and NORMAL,
//! 1 and 100 messages per transaction, and 1 with 1024-byte pages) a fresh store, a relay connected to mosquitto, then
//! transactions committed 5 ms apart (the device's pace) until `EDGE_OUTBOX_BENCH_FLASH_MSGS`
//! messages (default 2,000) are committed; the run ends once every message is published and
//! marked, the WAL checkpointed (`wal_checkpoint(TRUNCATE)`) and free pages vacuumed
//! (`Outbox::prune`), every connection closed and the shared-memory file synced (that sync is
//! not counted).
//!
//! Then a 10 Hz latest-value stream (one sensor, coalescing, the relay batching its topic) for
//! `EDGE_OUTBOX_BENCH_FLASH_SECS` (default 60), relay included, in bytes per reading: as a new
//! user writes it (a coalescing message per reading, each its own transaction), and through
//! `LatestValues` committing every second and every `EDGE_OUTBOX_BENCH_FLASH_INTERVAL_MS`
//! (default 5,000), whose figure is `flash_bytes_per_reading_10hz`. A run with no reading gives
//! what a fresh store costs once (creating the schema, the relay's first connection, the final
//! checkpoint and vacuum): it is taken off each stream's total, so the figures are per reading
//! in a long run.
//!
//! Requires mosquitto and FUSE (`/dev/fuse`, root or `fusermount3`). The output ends with one
//! `bench: NAME VALUE` line per figure.

mod common;
#[path = "common/mqtt.rs"]
mod mqtt;
#[path = "../tests/support/mod.rs"]
mod support;

use std::thread;
use std::time::{Duration, Instant};

use common::env_num;
use edge_outbox::{Batching, LatestValues, Message, Options, Outbox, Relay, Synchronous};
use mqtt::BoxResult;
use support::powercut::{FileCount, PowerCutFs};

struct Config {
    name: &'static str,
    sync: Synchronous,
    per_tx: usize,
    page_size: u32,
}

const CONFIGS: [Config; 6] = [
    Config {
        name: "full_1",
        sync: Synchronous::Full,
        per_tx: 1,
        page_size: 4096,
    },
    Config {
        name: "full_100",
        sync: Synchronous::Full,
        per_tx: 100,
        page_size: 4096,
    },
    Config {
        name: "normal_1",
        sync: Synchronous::Normal,
        per_tx: 1,
        page_size: 4096,
    },
    Config {
        name: "normal_100",
        sync: Synchronous::Normal,
        per_tx: 100,
        page_size: 4096,
    },
    // What `Options::page_size` trades (docs/operations.md, "Flash wear").
    Config {
        name: "full_1_page1024",
        sync: Synchronous::Full,
        per_tx: 1,
        page_size: 1024,
    },
    Config {
        name: "normal_1_page1024",
        sync: Synchronous::Normal,
        per_tx: 1,
        page_size: 1024,
    },
];

/// Between two transactions.
const PACE: Duration = Duration::from_millis(5);

struct Outcome {
    msgs: usize,
    files: Vec<FileCount>,
    dir_syncs: u64,
}

impl Outcome {
    fn bytes(&self, suffix: &str) -> u64 {
        self.files
            .iter()
            .filter(|f| f.name.ends_with(suffix))
            .map(|f| f.bytes)
            .sum()
    }

    fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }

    fn syncs(&self) -> u64 {
        self.files.iter().map(|f| f.syncs).sum::<u64>() + self.dir_syncs
    }
}

/// The payload of every message and reading.
type Reading = (&'static str, &'static str, f64, &'static str, bool, i64);
const READING: Reading = (
    "pump-01",
    "discharge_pressure",
    412.5,
    "kPa",
    true,
    1_700_000_000_000,
);
const TOPIC: &str = "plant/line-3/pump-01/telemetry";

fn measure(config: &Config, port: u16, msgs: usize) -> BoxResult<Outcome> {
    let relay = mqtt::relay_config(&format!("bench-flash-{}", config.name), port, 100);
    on_fuse(config.sync, config.page_size, relay, |outbox| {
        outbox.with_connection(|c| {
            c.execute_batch("CREATE TABLE readings (id INTEGER PRIMARY KEY, value REAL NOT NULL)")
        })?;
        let mut committed = 0;
        while committed < msgs {
            let n = config.per_tx.min(msgs - committed);
            outbox.transaction(|tx| {
                for _ in 0..n {
                    tx.execute("INSERT INTO readings (value) VALUES (?1)", [READING.2])?;
                    tx.publish(TOPIC, "pump-01", &READING)?;
                }
                Ok::<_, edge_outbox::Error>(())
            })?;
            committed += n;
            thread::sleep(PACE);
        }
        Ok(committed)
    })
}

/// A 10 Hz latest-value stream, as a new user writes it (a coalescing message per reading, each
/// in its own transaction) or through `LatestValues` committing every `interval`; the relay
/// batches the topic either way.
fn measure_stream(name: &str, port: u16, secs: f64, latest: Option<Duration>) -> BoxResult<Outcome> {
    let relay = mqtt::relay_config(&format!("bench-flash-{name}"), port, 100).batch(TOPIC, Batching::new());
    on_fuse(Synchronous::Full, 4096, relay, |outbox| {
        let readings = (secs * 10.0).round() as usize;
        let values = latest.map(|i| LatestValues::start(outbox, i)).transpose()?;
        let start = Instant::now();
        for n in 0..readings {
            let due = start + Duration::from_millis(100 * n as u64);
            thread::sleep(due.saturating_duration_since(Instant::now()));
            match &values {
                Some(v) => v.set(TOPIC, "pump-01", &READING)?,
                None => {
                    let reading = Message::new(TOPIC, "pump-01", &READING)?.coalescing(true);
                    outbox.transaction(|tx| tx.send(&reading))?;
                }
            }
        }
        if let Some(v) = values {
            v.close()?;
        }
        Ok(readings)
    })
}

/// A fresh store on the power-cut file system with a relay; `load` writes and returns how many
/// messages (or readings) it wrote; then the drain, checkpoint and vacuum, and the counts.
fn on_fuse(
    sync: Synchronous,
    page_size: u32,
    relay_config: edge_outbox::RelayConfig,
    load: impl FnOnce(&Outbox) -> BoxResult<usize>,
) -> BoxResult<Outcome> {
    let fs = PowerCutFs::mount().map_err(|e| format!("this benchmark needs FUSE: {e}"))?;
    let path = fs.path().join("device.db");
    let msgs;
    {
        let outbox = Outbox::open_with(&path, Options::new().synchronous(sync).page_size(page_size))?;
        let relay = Relay::start(&outbox, relay_config)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !relay.status()?.connected {
            if Instant::now() > deadline {
                return Err("relay did not connect".into());
            }
            thread::sleep(Duration::from_millis(5));
        }
        msgs = load(&outbox)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let st = relay.status()?;
            if st.store.pending_messages == 0 {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("not drained: {st:?}").into());
            }
            thread::sleep(Duration::from_millis(5));
        }
        relay.shutdown()?;
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
        outbox.prune()?;
    }
    // Every connection is closed: what the kernel still holds of the mapped wal-index goes out.
    let shm = fs.path().join("device.db-shm");
    if shm.exists() {
        std::fs::File::open(&shm)?.sync_data()?;
    }
    let mut files = fs.file_counters();
    for f in &mut files {
        if f.name.ends_with("-shm") {
            f.syncs = f.syncs.saturating_sub(1);
        }
    }
    Ok(Outcome {
        msgs,
        files,
        dir_syncs: fs.counters().dir_syncs,
    })
}

fn main() -> BoxResult<()> {
    let msgs = env_num("EDGE_OUTBOX_BENCH_FLASH_MSGS", 2000.0)?.round() as usize;
    let broker = mqtt::stock_mosquitto()?;
    println!("edge-outbox flash benchmark: {msgs} messages per configuration, one transaction every 5 ms");
    println!(
        "   {:<18} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "", "db B/msg", "wal B/msg", "shm B/msg", "all B/msg", "fsync/msg"
    );
    let mut lines = Vec::new();
    for config in &CONFIGS {
        let o = measure(config, broker.port(), msgs)?;
        let per = |b: u64| b as f64 / o.msgs as f64;
        println!(
            "   {:<18} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>10.3}",
            config.name,
            per(o.bytes(".db")),
            per(o.bytes("-wal")),
            per(o.bytes("-shm")),
            per(o.total_bytes()),
            o.syncs() as f64 / o.msgs as f64
        );
        lines.push(format!(
            "bench: flash_bytes_per_msg_{} {:.0}",
            config.name,
            per(o.total_bytes())
        ));
        lines.push(format!(
            "bench: fsyncs_per_msg_{} {:.3}",
            config.name,
            o.syncs() as f64 / o.msgs as f64
        ));
    }
    let secs = env_num("EDGE_OUTBOX_BENCH_FLASH_SECS", 60.0)?;
    let interval =
        Duration::from_millis(env_num("EDGE_OUTBOX_BENCH_FLASH_INTERVAL_MS", 5000.0)?.round() as u64);
    println!();
    // What opening a fresh store, starting the relay, draining, checkpointing and vacuuming cost
    // with no reading at all: written once in a file's life, not per reading, so it is taken
    // off each stream's total (and printed).
    let fixed = measure_stream("stream_none", broker.port(), 0.0, Some(interval))?;
    println!();
    println!(
        "a 10 Hz latest-value stream for {secs} s (FULL, 4 KiB pages, the relay batching its topic), bytes \
         per reading beyond the {} B a fresh store costs with no reading:",
        fixed.total_bytes()
    );
    for (name, latest, line) in [
        ("stream_tx_each", None, "flash_bytes_per_reading_10hz_tx_each"),
        (
            "stream_latest_1s",
            Some(Duration::from_secs(1)),
            "flash_bytes_per_reading_10hz_commit_1s",
        ),
        ("stream_latest", Some(interval), "flash_bytes_per_reading_10hz"),
    ] {
        let o = measure_stream(name, broker.port(), secs, latest)?;
        let per = o.total_bytes().saturating_sub(fixed.total_bytes()) as f64 / o.msgs as f64;
        let how = match latest {
            Some(i) => format!("LatestValues, a commit every {} ms", i.as_millis()),
            None => "a coalescing message per reading, one transaction each".into(),
        };
        println!(
            "   {:<58} {:>10.0} B/reading {:>8.3} fsync/reading",
            how,
            per,
            o.syncs().saturating_sub(fixed.syncs()) as f64 / o.msgs as f64
        );
        lines.push(format!("bench: {line} {per:.0}"));
        if line == "flash_bytes_per_reading_10hz" {
            let verdict = if per <= 2_000.0 { "met" } else { "MISSED" };
            println!("   target for LatestValues at its default interval: <= 2,000 B/reading: {verdict}");
        }
    }
    drop(broker);
    println!();
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
