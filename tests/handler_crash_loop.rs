//! A command whose handler takes the process down does not crash-loop the device for ever.
//!
//! The device runs in a child process whose handler calls `std::process::abort()` on one command
//! (as an out-of-memory kill or a watchdog would end it). Each attempt is committed before the
//! handler runs, so every run of the device counts one; when the relay starts after the last
//! allowed attempt, it dead-letters the command ("handler did not return") and applies the next
//! one of the same key. A build that counted attempts after the handler returned would abort on
//! every start: the test gives up after more starts than that takes.

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::{Command, Error, MessageId, Options, Outbox, Relay, Tx};
use support::child::{self, Child};
use support::device::relay_config;
use support::{Broker, WAIT};

const MAX_ATTEMPTS: u32 = 3;

fn options() -> Options {
    Options::new()
        .max_attempts(MAX_ATTEMPTS)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(20))
}

fn open(path: &std::path::Path) -> TestResult<Outbox> {
    let outbox = Outbox::open_with(path, options())?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS effects (command_id BLOB NOT NULL, amount INTEGER NOT NULL)",
        )
    })?;
    Ok(outbox)
}

/// The device: applies commands until the one it waits for (`CRASH_LOOP_LAST`) is applied; its
/// handler aborts the process on a payload of -1.
#[test]
#[ignore = "entry point of the child process of a_handler_that_aborts_is_dead_lettered_after_its_attempts"]
fn crash_loop_child() {
    let Some(_mode) = child::mode() else { return };
    if let Err(e) = device() {
        child::say(&format!("error {e}"));
        std::process::exit(3);
    }
}

fn device() -> TestResult {
    let path = std::env::var("CRASH_LOOP_DB")?;
    let broker: std::net::SocketAddr = std::env::var("CRASH_LOOP_BROKER")?.parse()?;
    let last: MessageId = std::env::var("CRASH_LOOP_LAST")?.parse()?;
    let outbox = open(path.as_ref())?;
    let relay = Relay::start_with_handler(
        &outbox,
        relay_config(broker, "crash-loop-device"),
        |tx: &mut Tx<'_>, cmd: &Command| {
            let amount: i64 = cmd.payload_as()?;
            if amount == -1 {
                child::say(&format!("aborting on {} (attempt {})", cmd.id, cmd.attempts + 1));
                std::process::abort();
            }
            tx.execute(
                "INSERT INTO effects VALUES (?1, ?2)",
                (cmd.id.as_bytes().as_slice(), amount),
            )?;
            Ok::<_, Error>(())
        },
    )?;
    child::say("started");
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        let applied: i64 = outbox.with_connection(|c| {
            c.query_row(
                "SELECT count(*) FROM effects WHERE command_id = ?1",
                [last.as_bytes()],
                |r| r.get(0),
            )
        })?;
        if applied > 0 {
            child::say(&format!("status {:?}", relay.status()?));
            relay.shutdown()?;
            child::say("done");
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Err("the last command was never applied".into())
}

#[test]
fn a_handler_that_aborts_is_dead_lettered_after_its_attempts_and_the_next_command_runs() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path)?;
    let before = MessageId::new_v7();
    let poison = MessageId::new_v7();
    let after = MessageId::new_v7();
    outbox.receive("pumps/p1/run", &command_bytes(before, "pump-1", &5)?)?;
    outbox.receive("pumps/p1/run", &command_bytes(poison, "pump-1", &-1)?)?;
    outbox.receive("pumps/p1/run", &command_bytes(after, "pump-1", &7)?)?;
    drop(outbox);

    let env = [
        ("CRASH_LOOP_DB", path.display().to_string()),
        ("CRASH_LOOP_BROKER", broker.addr().to_string()),
        ("CRASH_LOOP_LAST", after.to_string()),
    ];
    // One start per allowed attempt aborts; the next one dead-letters and goes on. Twice that
    // many starts is plenty for a correct build and ends a crash loop.
    let mut aborted = 0;
    let mut finished = false;
    for start in 1..=2 * (MAX_ATTEMPTS + 1) {
        let (status, said) = Child::start("crash_loop_child", "device", &env)?.wait(WAIT)?;
        eprintln!("start {start}: {status}: {said:?}");
        if said.iter().any(|l| l.starts_with("aborting on")) {
            assert!(!status.success(), "it said it aborted: {status}");
            aborted += 1;
        } else {
            assert!(status.success(), "start {start} failed: {status}: {said:?}");
            assert!(said.iter().any(|l| l == "done"), "{said:?}");
            let status_line = said
                .iter()
                .find(|l| l.starts_with("status "))
                .ok_or("no status")?;
            assert!(status_line.contains("commands_dead_lettered: 1"), "{status_line}");
            finished = true;
            break;
        }
    }
    assert!(
        finished,
        "the device crash-looped: {aborted} aborting starts and still going"
    );
    assert_eq!(aborted, MAX_ATTEMPTS, "one abort per allowed attempt");

    let outbox = open(&path)?;
    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead.len(), 1, "{dead:#?}");
    assert_eq!(
        (dead[0].message_id, dead[0].attempts),
        (Some(poison), MAX_ATTEMPTS)
    );
    assert!(
        dead[0].reason.contains("handler did not return"),
        "{}",
        dead[0].reason
    );
    // The commands around it were applied once each, in order; the poison one never.
    let rows: Vec<(Vec<u8>, i64)> = outbox.with_connection(|c| {
        c.prepare("SELECT command_id, amount FROM effects ORDER BY rowid")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()
    })?;
    assert_eq!(
        rows,
        vec![(before.as_bytes().to_vec(), 5), (after.as_bytes().to_vec(), 7)]
    );
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM inbox WHERE attempt_started_at IS NOT NULL"
        )?,
        0
    );
    Ok(())
}
