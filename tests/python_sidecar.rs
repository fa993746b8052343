//! A non-Rust application: Python's sqlite3 writes through the SQL contract while
//! `edge-outbox relay` runs as a sidecar; the relay is killed and restarted in between, and every
//! message still reaches a subscriber, in order per key.
#![cfg(feature = "cli")]

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::{Broker, ChildGuard, Subscriber, WAIT, check};

fn relay(db: &std::path::Path, broker: std::net::SocketAddr) -> ChildGuard {
    let child = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["relay", "--db"])
        .arg(db)
        .args([
            "--broker",
            &format!("mqtt://{broker}"),
            "--client-id",
            "python-sidecar",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start edge-outbox relay");
    ChildGuard::new(child)
}

fn write(db: &std::path::Path, count: u32, start: u32) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/python/sensor_writer.py");
    let status = Command::new(support::python::python())
        .arg(script)
        .arg(db)
        .args([count.to_string(), start.to_string()])
        .stdout(Stdio::null())
        .status()
        .expect("run the Python writer");
    assert!(status.success(), "python writer failed: {status}");
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn a_python_writer_and_a_killed_sidecar_relay_lose_nothing() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "sensors/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("sensor.db");
    // The sidecar creates the tables; the Python program only ever inserts.
    let mut first = relay(&db, broker.addr());
    let deadline = std::time::Instant::now() + WAIT;
    while !has_schema(&db) {
        assert!(
            std::time::Instant::now() < deadline,
            "the sidecar never created the tables"
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    write(&db, 150, 0);
    assert!(
        sub.wait_for(20, WAIT),
        "the sidecar publishes while Python writes"
    );
    first.kill().expect("SIGKILL the relay");
    first.wait().expect("reap");
    write(&db, 150, 150); // while no relay runs: it all waits in the outbox
    let mut second = relay(&db, broker.addr());

    // Every row Python committed, read back from the file, must have arrived.
    let conn = rusqlite::Connection::open(&db).expect("open");
    let expected = 300;
    let got_all = check::wait_for_unique(&sub, expected, WAIT);
    let readings: i64 = conn
        .query_row("SELECT count(*) FROM readings", [], |r| r.get(0))
        .expect("count");
    assert_eq!(readings, expected as i64);
    let envelopes = check::decode_all(&sub.messages());
    let ns: Vec<(String, u64)> = envelopes
        .iter()
        .map(|e| {
            (
                e.key.to_string(),
                e.payload_as::<Reading>().expect("a reading from Python").n,
            )
        })
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut last: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    for (key, n) in &ns {
        if seen.insert(*n)
            && let Some(prev) = last.insert(key.clone(), *n)
        {
            assert!(prev < *n, "key {key}: {n} arrived after {prev}");
        }
    }
    assert!(got_all, "{} of {expected} readings arrived", seen.len());
    assert_eq!(seen.len(), expected);
    second.kill().expect("stop relay");
    second.wait().expect("reap");
}

/// What the Python writer puts in each payload (`cbor2.dumps({"n": ..., "celsius": ...})`).
#[derive(Debug, serde::Deserialize)]
struct Reading {
    n: u64,
    #[allow(dead_code)]
    celsius: f64,
}

fn has_schema(db: &std::path::Path) -> bool {
    let Ok(conn) = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return false;
    };
    edge_outbox::schema_version(&conn).is_ok_and(|v| v == edge_outbox::SCHEMA_VERSION)
}
