//! The drain an application would write by hand with the bare libraries: a table of ready-to-send
//! rows (plain rusqlite), read in `seq` order by one thread and published QoS 1 by raw rumqttc
//! with the relay's window, each row deleted once its PUBACK came, by a thread of its own that
//! deletes whatever PUBACKs have queued up in one transaction (so a delete's fsync never stops the
//! event loop). No envelope is built (the rows hold the bytes to send), no order per key, lane,
//! expiry, gap or counter is kept.
//!
//! It is the floor for a drain that must read and delete its rows durably; raw rumqttc publishing
//! from memory is the floor for the MQTT part alone.
//!
//! `#[path = "common/hand_relay.rs"] mod hand_relay;` beside `mqtt` and `threads`.

#![allow(dead_code, reason = "each benchmark uses a part")]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rusqlite::{Connection, params};

use crate::mqtt::{self, Arrivals, BoxResult, RawEvent};

/// The threads whose CPU counts: the reader-publisher, the event loop, the deleter.
pub const THREADS: &[&str] = &["hand-publisher", "hand-events", "hand-deleter"];

/// A bare outbox file with a committed backlog of ready-to-send rows.
pub struct HandBacklog {
    _dir: tempfile::TempDir,
    path: PathBuf,
    n: usize,
    synchronous: &'static str,
}

/// What a hand-written drain took: wall time, the CPU of `THREADS` and the broker's over it.
pub struct HandRun {
    pub took: Duration,
    pub cpu: f64,
    /// The broker's CPU seconds over `took`.
    pub broker: f64,
}

fn open(path: &Path, synchronous: &str) -> rusqlite::Result<Connection> {
    let c = Connection::open(path)?;
    c.busy_timeout(Duration::from_secs(10))?;
    c.execute_batch(&format!(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = {synchronous}"
    ))?;
    Ok(c)
}

impl HandBacklog {
    /// Writes `msgs` (numbered from 1) into a fresh file, 1,000 rows per transaction, at
    /// `synchronous` (`FULL` or `NORMAL`).
    pub fn fill(dir: &Path, msgs: &[(String, Vec<u8>)], synchronous: &'static str) -> BoxResult<Self> {
        let dir = tempfile::Builder::new().prefix("hand-").tempdir_in(dir)?;
        let path = dir.path().join("outbox.db");
        let mut c = open(&path, synchronous)?;
        c.execute_batch(
            "CREATE TABLE outbox (seq INTEGER PRIMARY KEY, topic TEXT NOT NULL, payload BLOB NOT NULL)",
        )?;
        for (chunk_no, chunk) in msgs.chunks(1000).enumerate() {
            let tx = c.transaction()?;
            {
                let mut insert =
                    tx.prepare_cached("INSERT INTO outbox (seq, topic, payload) VALUES (?1, ?2, ?3)")?;
                for (i, (topic, payload)) in chunk.iter().enumerate() {
                    insert.execute(params![(chunk_no * 1000 + i + 1) as i64, topic, payload])?;
                }
            }
            tx.commit()?;
        }
        c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")?;
        Ok(HandBacklog {
            _dir: dir,
            path,
            n: msgs.len(),
            synchronous,
        })
    }

    /// Drains the file to an empty table, timed from the first open until the subscriber holds
    /// every message and the last delete committed. `broker_cpu` reads the broker's CPU seconds:
    /// it is read at the same two points, so the figure covers the same span.
    pub fn drain(
        self,
        port: u16,
        arrivals: &Arrivals,
        window: usize,
        stall: Duration,
        broker_cpu: impl Fn() -> f64,
    ) -> BoxResult<HandRun> {
        let n = self.n;
        arrivals.expect(n);
        let cpu0 = crate::threads::usage(THREADS);
        let broker0 = broker_cpu();
        let start = Instant::now();
        let (client, mut connection) = mqtt::raw(port, "bench-hand", window);
        let client = Arc::new(client);
        // The publisher names each row's seq just before publishing it; rumqttc reports the
        // outgoing publishes in that order, with the packet id they took.
        let (order_tx, order_rx) = crossbeam_channel::unbounded::<i64>();
        let (acked_tx, acked_rx) = crossbeam_channel::unbounded::<i64>();
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
        let (deleted_tx, deleted_rx) = crossbeam_channel::bounded::<Result<(), String>>(1);
        let publisher = {
            let (client, done_rx, path, sync) = (
                client.clone(),
                done_rx.clone(),
                self.path.clone(),
                self.synchronous,
            );
            thread::Builder::new()
                .name("hand-publisher".into())
                .spawn(move || -> Result<(), String> {
                    let run = || -> BoxResult<()> {
                        let c = open(&path, sync)?;
                        let mut read = c.prepare(
                            "SELECT seq, topic, payload FROM outbox WHERE seq > ?1 ORDER BY seq LIMIT 1000",
                        )?;
                        let mut after = 0i64;
                        loop {
                            let rows = read
                                .query_map([after], |r| Ok((r.get::<_, i64>(0)?, r.get(1)?, r.get(2)?)))?
                                .collect::<rusqlite::Result<Vec<(i64, String, Vec<u8>)>>>()?;
                            let Some(last) = rows.last() else { break };
                            after = last.0;
                            for (seq, topic, payload) in rows {
                                order_tx.send(seq)?;
                                client.publish(topic, payload)?;
                            }
                        }
                        Ok(())
                    };
                    let result = run().map_err(|e| e.to_string());
                    let _ = done_rx.recv();
                    result
                })?
        };
        // The event loop only maps PUBACKs to rows, so that a delete's fsync never stops it
        // reading PUBACKs; on failure it drops the connection, which ends a blocked publish.
        let events = {
            let done_rx = done_rx.clone();
            thread::Builder::new().name("hand-events".into()).spawn(move || {
                let mut on_wire: Vec<Option<i64>> = vec![None; usize::from(u16::MAX) + 1];
                let mut acked = 0;
                let mut run = || -> BoxResult<()> {
                    while acked < n {
                        match connection.next(stall)? {
                            RawEvent::Sent(pkid) => {
                                on_wire[usize::from(pkid)] = Some(order_rx.recv_timeout(stall)?);
                            }
                            RawEvent::PubAck(pkid) => {
                                let seq = on_wire[usize::from(pkid)]
                                    .take()
                                    .ok_or_else(|| format!("PUBACK for packet id {pkid}, not on the wire"))?;
                                acked_tx.send(seq)?;
                                acked += 1;
                            }
                            _ => {}
                        }
                    }
                    Ok(())
                };
                let result = run();
                drop(acked_tx);
                let _ = done_rx.recv();
                result.map(|()| connection).map_err(|e| e.to_string())
            })?
        };
        // Deletes whatever PUBACKs have queued up, in one transaction each time.
        let deleter = {
            let (done_rx, path, sync) = (done_rx.clone(), self.path.clone(), self.synchronous);
            thread::Builder::new()
                .name("hand-deleter".into())
                .spawn(move || {
                    let run = || -> BoxResult<()> {
                        let mut c = open(&path, sync)?;
                        let mut deleted = 0;
                        while deleted < n {
                            let first = acked_rx.recv_timeout(stall)?;
                            let tx = c.transaction()?;
                            {
                                let mut delete = tx.prepare_cached("DELETE FROM outbox WHERE seq = ?1")?;
                                for seq in std::iter::once(first).chain(acked_rx.try_iter()) {
                                    deleted += delete.execute([seq])?;
                                }
                            }
                            tx.commit()?;
                        }
                        Ok(())
                    };
                    let _ = deleted_tx.send(run().map_err(|e| e.to_string()));
                    let _ = done_rx.recv();
                })?
        };
        // Every thread waits on `done_rx` until the CPU is read, then they are joined.
        let wait = || -> BoxResult<()> {
            deleted_rx.recv().map_err(|_| "hand deleter died")??;
            arrivals.wait_all(stall)?;
            Ok(())
        };
        let waited = wait();
        let took = start.elapsed();
        let cpu = crate::threads::usage(THREADS).since(cpu0).cpu_secs;
        let broker = broker_cpu() - broker0;
        drop(done_tx);
        let connection = events.join().map_err(|_| "hand event thread panicked")?;
        let published = publisher.join().map_err(|_| "hand publisher panicked")?;
        deleter.join().map_err(|_| "hand deleter panicked")?;
        waited?;
        connection?.close(&client);
        published?;
        let left: i64 =
            open(&self.path, self.synchronous)?.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
        if left != 0 {
            return Err(format!("hand-written drain left {left} rows").into());
        }
        Ok(HandRun { took, cpu, broker })
    }
}
