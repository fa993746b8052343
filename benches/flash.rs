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
use edge_outbox::{Options, Outbox, Relay, Synchronous};
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

fn measure(config: &Config, port: u16, msgs: usize) -> BoxResult<Outcome> {
    let fs = PowerCutFs::mount().map_err(|e| format!("this benchmark needs FUSE: {e}"))?;
    let path = fs.path().join("device.db");
    let payload = (
        "pump-01",
        "discharge_pressure",
        412.5_f64,
        "kPa",
        true,
        1_700_000_000_000_i64,
    );
    {
        let outbox = Outbox::open_with(
            &path,
            Options::new()
                .synchronous(config.sync)
                .page_size(config.page_size),
        )?;
        outbox.with_connection(|c| {
            c.execute_batch("CREATE TABLE readings (id INTEGER PRIMARY KEY, value REAL NOT NULL)")
        })?;
        let relay = Relay::start(
            &outbox,
            mqtt::relay_config(&format!("bench-flash-{}", config.name), port, 100),
        )?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !relay.status()?.connected {
            if Instant::now() > deadline {
                return Err("relay did not connect".into());
            }
            thread::sleep(Duration::from_millis(5));
        }
        let mut committed = 0;
        while committed < msgs {
            let n = config.per_tx.min(msgs - committed);
            outbox.transaction(|tx| {
                for _ in 0..n {
                    tx.execute("INSERT INTO readings (value) VALUES (?1)", [payload.2])?;
                    tx.publish("plant/line-3/pump-01/telemetry", "pump-01", &payload)?;
                }
                Ok::<_, edge_outbox::Error>(())
            })?;
            committed += n;
            thread::sleep(PACE);
        }
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
    drop(broker);
    println!();
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
