//! `examples/cloud_consumer.rs`, the program a new user copies for the cloud side, run as a child
//! process against a relay that publishes compressed batches and announces replaced readings: it
//! must account for every message (delivered or announced), report 0 unexplained and exit 0.
//!
//! Broken build this catches: a consumer that decodes one envelope per MQTT payload
//! (`observe_bytes`): every batch is then "not an edge-outbox envelope", and its messages are
//! reported lost although nothing was.

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::{Batching, Compression, Error, Message, Outbox, Relay};
use support::device::relay_config_for;
use support::example::{CloudConsumer, totals};
use support::{Broker, WAIT, wait_until};

#[test]
fn the_cloud_consumer_example_accounts_for_batched_and_announced_messages() -> TestResult {
    let broker = Broker::start()?;
    let (dir, db) = temp_db()?;
    let cloud_db = dir.path().join("cloud.db");
    let consumer = CloudConsumer::start(&[
        &broker.addr().to_string(),
        cloud_db.to_str().ok_or("path")?,
        "fleet/#",
        "--exit-when-idle",
        "3",
        "--report-every",
        "3600",
    ])?;

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

    let (status, said) = consumer.wait(WAIT)?;
    assert_eq!(totals(&said)?, (150, 0, 150, 0), "{said:#?}");
    assert!(status.success(), "{status:?}: {said:#?}");
    assert!(
        !said
            .iter()
            .any(|l| l.starts_with("not an edge-outbox envelope") || l.starts_with("malformed")),
        "{said:#?}"
    );
    // Each event's effect committed once, in the consumer's own file.
    let cloud = rusqlite::Connection::open(&cloud_db)?;
    let (effects, rows): (i64, i64) = cloud.query_row(
        "SELECT count(DISTINCT message_id), count(*) FROM events",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    assert_eq!((effects, rows), (150, 150));
    Ok(())
}
