//! The floor for the application's latency during a command flood: the same two writers written
//! by hand with bare rusqlite, on a file of their own. One thread commits bursts of bare inbox
//! rows (FULL, one transaction per burst), each of the size and at the moment the crate's intake
//! stored one in the same round; the application thread commits a business row and a bare outbox
//! row every `app_pace`. They share one writer lock, and the intake lets a waiting application go
//! first (a plain mutex would let the intake take it again before the woken application runs,
//! which no careful user would ship). Nothing else: no envelope, no counters, no indexes beyond
//! the primary keys, and no third writer (in the crate the relay also publishes the
//! application's messages and marks them sent, in its idle phase and its flood alike).
//!
//! Whatever the design, one file has one writer at a time: an application transaction that
//! arrives while a burst commits waits for that commit, sync included. This measures what that
//! wait costs when nothing else does.
//!
//! `#[path = "common/hand_intake.rs"] mod hand_intake;`

#![allow(dead_code, reason = "each benchmark uses a part")]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use rusqlite::{Connection, params};

use crate::common::{Sample, latencies_within, paced};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The application's transaction latencies (seconds), alone and beside the hand-written intake
/// (those that started between its first burst and its last).
pub struct HandFlood {
    pub idle: Vec<f64>,
    pub flood: Vec<f64>,
}

/// How the hand-written intake runs: one transaction per entry of `bursts`, that long after the
/// first (or as soon as the one before is done), of that many rows of `payload` bytes.
pub struct Intake {
    pub bursts: Vec<(Duration, usize)>,
    pub payload: usize,
}

fn open(path: &Path) -> BoxResult<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}

/// Measures the application alone (`idle_samples` transactions), then beside `intake`, in a new
/// database at `path`.
pub fn measure(
    path: &Path,
    intake: &Intake,
    app_pace: Duration,
    idle_samples: usize,
) -> BoxResult<HandFlood> {
    let setup = open(path)?;
    setup.execute_batch(
        "CREATE TABLE readings (n INTEGER PRIMARY KEY, celsius REAL NOT NULL);
         CREATE TABLE outbox (seq INTEGER PRIMARY KEY, topic TEXT NOT NULL, payload BLOB NOT NULL);
         CREATE TABLE inbox (id BLOB PRIMARY KEY, topic TEXT NOT NULL, payload BLOB NOT NULL);",
    )?;
    drop(setup);
    let lock = Arc::new(Mutex::new(()));
    let app_waits = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));

    let idle = latencies_within(
        &app(path, &lock, &app_waits, app_pace, Some(idle_samples), &stop)?,
        None,
    );

    let app_thread = {
        let (path, lock, app_waits, stop) =
            (path.to_path_buf(), lock.clone(), app_waits.clone(), stop.clone());
        thread::spawn(move || app(&path, &lock, &app_waits, app_pace, None, &stop).map_err(|e| e.to_string()))
    };
    let span = run_intake(path, intake, &lock, &app_waits);
    stop.store(true, Ordering::SeqCst);
    let flood = app_thread.join().map_err(|_| "hand app thread panicked")??;
    let flood = latencies_within(&flood, Some(span?));
    Ok(HandFlood { idle, flood })
}

/// Commits the bursts; returns when the first and the last were committed.
fn run_intake(
    path: &Path,
    intake: &Intake,
    lock: &Mutex<()>,
    app_waits: &AtomicBool,
) -> BoxResult<(Instant, Instant)> {
    let mut conn = open(path)?;
    let payload = vec![0x5a_u8; intake.payload];
    let started = Instant::now();
    let mut id = 0u128;
    let mut span = (started, started);
    for (b, &(offset, rows)) in intake.bursts.iter().enumerate() {
        let due = started + offset;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        while app_waits.load(Ordering::SeqCst) {
            thread::yield_now();
        }
        let _writer = lock.lock().unwrap_or_else(PoisonError::into_inner);
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        {
            let mut insert =
                tx.prepare_cached("INSERT INTO inbox (id, topic, payload) VALUES (?1, ?2, ?3)")?;
            for _ in 0..rows {
                id += 1;
                insert.execute(params![
                    id.to_be_bytes().as_slice(),
                    "bench/device/commands/valve",
                    &payload
                ])?;
            }
        }
        tx.commit()?;
        let now = Instant::now();
        if b == 0 {
            span.0 = now;
        }
        span.1 = now;
    }
    Ok(span)
}

/// Commits a reading and its message every `pace`, `count` times or until `stop`.
fn app(
    path: &Path,
    lock: &Mutex<()>,
    app_waits: &AtomicBool,
    pace: Duration,
    count: Option<usize>,
    stop: &AtomicBool,
) -> BoxResult<Vec<Sample>> {
    let mut conn = open(path)?;
    paced(
        pace,
        count,
        || stop.load(Ordering::SeqCst),
        || {
            app_waits.store(true, Ordering::SeqCst);
            let writer = lock.lock().unwrap_or_else(PoisonError::into_inner);
            app_waits.store(false, Ordering::SeqCst);
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            tx.execute("INSERT INTO readings (celsius) VALUES (21.5)", [])?;
            tx.execute(
                "INSERT INTO outbox (topic, payload) VALUES ('bench/device/readings', ?1)",
                [&[0xf9_u8, 0x4d, 0x60][..]],
            )?;
            tx.commit()?;
            drop(writer);
            Ok(())
        },
    )
}
