//! Consumers that shard a fleet and restart: two processes of `examples/cloud_consumer.rs`, one
//! per shard (`fleet/a/#`, `fleet/b/#`), each with its own persistent session and its own file,
//! killed (SIGKILL) and restarted while four devices publish. One of them is also away while its
//! broker drops what it queued for it (mosquitto's `max_queued_messages`): messages the relays
//! had acknowledged, lost after the hand-over. It is restarted again once it knows of that loss
//! (an open gap), which must come back from its file.
//!
//! Each consumer must end with every message that reached it delivered once (its verdicts' count
//! equals the rows its effect wrote, which are keyed by message id), and with exactly the
//! broker's loss as unexplained: counted here independently, as the numbers the relays had
//! acknowledged (everything committed: the devices removed nothing) with no row in the
//! consumer's file.
//!
//! Broken build caught: mutant `consumer-state-unsaved` (a consumer that forgets its state when it
//! restarts, counting from the start: everything before its restart is reported lost).

mod common;
mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::TestResult;
use edge_outbox::{Outbox, Relay};
use support::device::relay_config;
use support::example::{CloudConsumer, TAKEN_TWICE, final_totals, shard_rows as rows};
use support::{Broker, BrokerKind, WAIT, wait_until};

/// What mosquitto keeps for a persistent session that is away; the rest is dropped.
const QUEUE_LIMIT: u64 = 300;

struct Device {
    name: String,
    topic: String,
    outbox: Outbox,
    relay: Relay,
}

fn consumer(broker: &Broker, db: &Path, shard: &str) -> Result<CloudConsumer, Box<dyn std::error::Error>> {
    CloudConsumer::start_shard(&broker.addr().to_string(), db, shard, 10)
}

/// Waits until the consumer's file has stopped growing for a second: it has what the broker
/// had queued for it.
fn caught_up(db: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = std::time::Instant::now() + WAIT;
    let mut last = rows(db)?;
    let mut since = std::time::Instant::now();
    while since.elapsed() < Duration::from_secs(1) {
        if std::time::Instant::now() > deadline {
            return Err("the consumer never caught up".into());
        }
        std::thread::sleep(Duration::from_millis(100));
        let now = rows(db)?;
        if now != last {
            (last, since) = (now, std::time::Instant::now());
        }
    }
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn sharded_consumers_killed_and_restarted_neither_repeat_nor_miss() -> TestResult {
    if support::mutant::in_mutant_run() && std::env::var("EDGE_OUTBOX_MUTANT")? != "consumer-state-unsaved" {
        return Ok(());
    }
    let broker = Broker::builder()
        .kind(BrokerKind::Mosquitto)
        .mosquitto_option(format!("max_queued_messages {QUEUE_LIMIT}"))
        .start()?;
    let dir = tempfile::tempdir()?;
    let (db_a, db_b) = (dir.path().join("cloud-a.db"), dir.path().join("cloud-b.db"));
    let mut a = Some(consumer(&broker, &db_a, "a")?);
    let mut b = Some(consumer(&broker, &db_b, "b")?);

    let mut devices = Vec::new();
    for (shard, name) in [("a", "d1"), ("a", "d2"), ("b", "d3"), ("b", "d4")] {
        let outbox = Outbox::open(dir.path().join(format!("{name}.db")))?;
        let relay = Relay::start(&outbox, relay_config(broker.addr(), name))?;
        devices.push(Device {
            name: name.to_owned(),
            topic: format!("fleet/{shard}/{name}"),
            outbox,
            relay,
        });
    }
    let commit = |device: &Device, n: u64| -> Result<(), edge_outbox::Error> {
        device.outbox.transaction(|tx| {
            for i in 0..n {
                tx.publish(&device.topic, &device.name, &i)?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        Ok(())
    };
    let drained = |devices: &[Device]| {
        wait_until(|| {
            devices
                .iter()
                .all(|d| d.outbox.stats().is_ok_and(|s| s.pending_messages == 0))
        })
    };

    // Phase 1: a steady stream, each consumer killed and restarted in turn while it flows.
    let writing = Arc::new(AtomicBool::new(true));
    std::thread::scope(|scope| -> TestResult {
        let writer = scope.spawn(|| -> Result<(), edge_outbox::Error> {
            while writing.load(Ordering::Relaxed) {
                for device in &devices {
                    commit(device, 1)?;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(())
        });
        // Killed and restarted while the stream flows: a, then b, then a again.
        let pause = || std::thread::sleep(Duration::from_millis(600));
        let mut restarts = || -> TestResult {
            for (slot, db, shard) in [(&mut a, &db_a, "a"), (&mut b, &db_b, "b")] {
                pause();
                slot.take().ok_or("consumer")?.kill();
                pause();
                *slot = Some(consumer(&broker, db, shard)?);
            }
            pause();
            a.take().ok_or("consumer a")?.kill();
            pause();
            a = Some(consumer(&broker, &db_a, "a")?);
            pause();
            Ok(())
        };
        // The writer stops whatever happened, or the scope would wait for it forever.
        let result = restarts();
        writing.store(false, Ordering::Relaxed);
        writer.join().map_err(|_| "writer panicked")??;
        result
    })?;
    assert!(drained(&devices), "the relays drained phase 1");

    // Phase 2: shard a's consumer is away while d1 sends more than the broker keeps for it.
    a.take().ok_or("consumer a")?.kill();
    commit(&devices[0], QUEUE_LIMIT * 2)?;
    assert!(drained(&devices), "the relays drained phase 2");
    a = Some(consumer(&broker, &db_a, "a")?);
    // Before more arrives: a queue still full would drop that too, at the end of the stream,
    // where no later message shows it.
    caught_up(&db_a)?;

    // Phase 3: every device sends more, so that a loss shows as a gap (the stream went on).
    for device in &devices {
        commit(device, 20)?;
    }
    assert!(drained(&devices), "the relays drained phase 3");

    // Phase 4: shard a's consumer restarts with that loss known as an open gap, which must come
    // back from its file.
    caught_up(&db_a)?;
    a.take().ok_or("consumer a")?.kill();
    a = Some(consumer(&broker, &db_a, "a")?);
    for device in &devices {
        commit(device, 10)?;
    }
    assert!(drained(&devices), "the relays drained phase 4");

    let mut acknowledged = BTreeMap::new();
    for device in devices {
        let status = device.relay.status()?;
        assert_eq!(status.dead_lettered, 0);
        device.relay.shutdown()?;
        assert_eq!(device.outbox.stats()?.pending_messages, 0);
        acknowledged.insert(device.name.clone(), status.acknowledged);
    }
    let mut lost_somewhere = 0;
    for (consumer, db, shard) in [(a, &db_a, "a"), (b, &db_b, "b")] {
        let (status, said) = consumer.ok_or("consumer")?.wait(WAIT)?;
        let (delivered, _duplicates, announced, unexplained) = final_totals(&said)?;
        let rows = rows(db)?;
        let mut stored = 0;
        let mut lost = 0;
        for (source, acked) in acknowledged
            .iter()
            .filter(|(name, _)| ["d1", "d2"].contains(&name.as_str()) == (shard == "a"))
        {
            let (count, high) = rows.get(source).copied().unwrap_or((0, 0));
            assert_eq!(
                high, *acked,
                "shard {shard}: {source}'s last messages never arrived (lost where no later \
                 message shows it): {said:#?}"
            );
            stored += count;
            lost += high - count;
        }
        lost_somewhere += lost;
        assert_eq!(
            announced, 0,
            "shard {shard}: the devices removed nothing: {said:#?}"
        );
        assert_eq!(
            delivered, stored,
            "shard {shard}: the consumer called {delivered} messages new but their effects wrote \
             {stored} rows (a message taken for new twice, or one whose effect never happened): \
             {said:#?}"
        );
        assert_eq!(
            unexplained, lost,
            "shard {shard}: {lost} messages the relays had acknowledged never reached the consumer, \
             but it reported {unexplained} unexplained: {said:#?}"
        );
        assert_eq!(status.success(), lost == 0, "{status:?}: {said:#?}");
    }
    // The broker did drop what it could not keep for the consumer away: the loss was there to see.
    assert!(lost_somewhere >= QUEUE_LIMIT, "only {lost_somewhere} lost");
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn a_consumer_that_forgets_on_restart_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "consumer-state-unsaved",
        "sharded_consumers_killed_and_restarted_neither_repeat_nor_miss",
        TAKEN_TWICE,
    )?;
    Ok(())
}
