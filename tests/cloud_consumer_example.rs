//! `examples/cloud_consumer.rs`, the program a new user copies for the cloud side, run as a child
//! process against a relay that publishes compressed batches and announces replaced readings: it
//! must account for every message (delivered or announced), report 0 unexplained and exit 0.
//!
//! Broken build this catches: a consumer that decodes one envelope per MQTT payload
//! (`observe_bytes`): every batch is then "not an edge-outbox envelope", and its messages are
//! reported lost although nothing was.

mod common;
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{TestResult, temp_db};
use edge_outbox::{Batching, Compression, Error, Message, Outbox, Relay};
use support::device::relay_config_for;
use support::{Broker, ChildGuard, WAIT, wait_until};

/// The example's binary, which `cargo test` builds beside the test binaries.
fn example() -> TestResult<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let debug = exe
        .parent()
        .and_then(|deps| deps.parent())
        .ok_or("no target dir")?;
    let path = debug.join("examples").join("cloud_consumer");
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).map_err(|e| {
        format!(
            "{} was not built ({e}): `cargo test` builds it, `cargo test --test` does not",
            path.display()
        )
    })?;
    let source =
        std::fs::metadata(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/cloud_consumer.rs"))?.modified()?;
    if source > built {
        return Err(format!(
            "{} is older than its source: run `cargo build --examples --all-features`",
            path.display()
        )
        .into());
    }
    Ok(path)
}

#[test]
fn the_cloud_consumer_example_accounts_for_batched_and_announced_messages() -> TestResult {
    let broker = Broker::start()?;
    let (dir, db) = temp_db()?;
    let cloud_db = dir.path().join("cloud.db");
    let mut child = ChildGuard::new(
        Command::new(example()?)
            .args([
                &broker.addr().to_string(),
                cloud_db.to_str().ok_or("path")?,
                "fleet/#",
            ])
            .args(["--exit-when-idle", "3", "--report-every", "3600"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?,
    );
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut said = Vec::new();
    let deadline = Instant::now() + WAIT;
    while !said
        .iter()
        .any(|l: &String| l.starts_with("subscribed to fleet/#"))
    {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| format!("the example did not subscribe: {said:?}"))?;
        said.push(line);
    }

    // The device: 100 events and 200 readings of 50 sensors committed offline, each reading
    // replacing its sensor's pending one (150 replaced, announced), then drained in batches.
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        for i in 0..100u64 {
            tx.publish("fleet/d1/events", "door", &i)?;
        }
        for i in 0..200u64 {
            tx.send(
                &Message::new("fleet/d1/temperature", format!("s{}", i % 50), &(i as f64 / 10.0))?
                    .coalescing(true),
            )?;
        }
        Ok::<_, Error>(())
    })?;
    let config = relay_config_for(&broker, "fleet-d1").batch(
        "fleet/#",
        Batching::new()
            .linger(Duration::from_millis(50))
            .compression(Compression::Zlib),
    );
    let relay = Relay::start(&outbox, config)?;
    assert!(wait_until(|| relay.status().is_ok_and(|s| s
        .store
        .pending_messages
        == 0
        && s.store.gaps_unannounced == 0)));
    relay.shutdown()?;

    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            return Err("the example did not exit when idle".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    said.extend(lines.try_iter());
    while let Ok(line) = lines.recv_timeout(Duration::from_secs(2)) {
        said.push(line);
    }
    let totals = said
        .iter()
        .find(|l| l.starts_with("totals:"))
        .ok_or_else(|| format!("no totals: {said:#?}"))?;
    assert_eq!(
        totals, "totals: 150 delivered, 0 duplicates, 150 announced, 0 unexplained",
        "{said:#?}"
    );
    assert!(status.success(), "{status:?}: {said:#?}");
    assert!(
        !said
            .iter()
            .any(|l| l.starts_with("not an edge-outbox envelope") || l.starts_with("malformed")),
        "{said:#?}"
    );
    // Each event's effect committed once in the consumer's own inbox.
    let cloud = Outbox::open(&cloud_db)?;
    let effects = common::query_i64(&cloud, "SELECT count(DISTINCT message_id) FROM events")?;
    let rows = common::query_i64(&cloud, "SELECT count(*) FROM events")?;
    assert_eq!((effects, rows), (150, 150));
    Ok(())
}
