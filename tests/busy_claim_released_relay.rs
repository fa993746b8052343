//! The relay's handler thread does not strand a claim on a busy error either. It keeps its
//! connection, so its startup recovery never runs again: before, a record step that found the
//! database locked past the busy timeout left the key blocked for `attempt_timeout`. Now, once
//! the lock is free, the same command is claimed again, its attempt not counted, and applied.

mod common;
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::{TestResult, command_bytes, temp_db};
use edge_outbox::{Command, Error, MessageId, Options, Outbox, Relay, Tx};
use support::device::relay_config;
use support::{Broker, wait_until};

#[test]
fn the_relay_handler_releases_a_claim_its_record_step_could_not_write() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open_with(&path, Options::new().busy_timeout(Duration::from_millis(200)))?;
    let id = MessageId::new_v7();
    outbox.receive("cmd", &command_bytes(id, "valve-1", &1)?)?;

    // The first outside step has another process take the write lock and keep it.
    let (free_tx, free_rx) = mpsc::channel::<()>();
    let free_rx = Arc::new(Mutex::new(Some(free_rx)));
    let blocked = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let blocker = {
        let (path, free_rx, blocked, seen) = (path.clone(), free_rx.clone(), blocked.clone(), seen.clone());
        move |cmd: &Command| -> Result<(), String> {
            seen.lock().map_err(|e| e.to_string())?.push(cmd.attempts);
            if blocked.swap(true, Ordering::SeqCst) {
                return Ok(());
            }
            let free_rx = free_rx
                .lock()
                .map_err(|e| e.to_string())?
                .take()
                .ok_or("no channel")?;
            let (locked_tx, locked_rx) = mpsc::channel();
            let path = path.clone();
            std::thread::spawn(move || -> rusqlite::Result<()> {
                let conn = rusqlite::Connection::open(path)?;
                conn.execute_batch("BEGIN IMMEDIATE")?;
                let _ = locked_tx.send(());
                let _ = free_rx.recv();
                conn.execute_batch("COMMIT")
            });
            locked_rx.recv().map_err(|e| e.to_string())
        }
    };
    let relay = Relay::start_with_two_phase_handler(
        &outbox,
        relay_config(broker.addr(), "busy-claim"),
        blocker,
        |_tx: &mut Tx<'_>, _cmd: &Command, ()| Ok::<_, Error>(()),
    )?;
    let failed = wait_until(|| {
        relay.status().is_ok_and(|s| {
            s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("applying commands"))
        })
    });
    free_tx.send(())?;
    assert!(failed, "the record step never failed: {:?}", relay.status()?);
    let applied = wait_until(|| relay.status().is_ok_and(|s| s.commands_applied == 1));
    let status = relay.status()?;
    relay.shutdown()?;
    assert!(applied, "the command stayed claimed: {status:?}");
    assert_eq!(
        *seen.lock().map_err(|e| e.to_string())?,
        [0, 0],
        "the busy attempt was not counted"
    );
    Ok(())
}
