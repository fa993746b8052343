//! The whole path on a broker cluster: 20 devices, each with its own database and relay and a
//! failover list of the three nodes of a RabbitMQ cluster (MQTT 3.1.1, quorum queues), publish
//! under two shards; one `examples/cloud_consumer.rs` process per shard, with its own file and
//! persistent session, reads them. Mid-run the node holding shard a's session (its quorum queue's
//! leader) is killed with SIGKILL and started again later, and shard b's consumer is killed and
//! restarted.
//!
//! With quorum queues the cluster loses nothing it acknowledged, so each consumer must end with 0
//! unexplained gaps, every device's last number delivered, and its count of new messages equal to
//! the rows its effect stored. The devices' own record (what each relay had acknowledged) is the
//! independent count.
//!
//! Broken build caught: mutant `consumer-state-unsaved` (shard b's consumer forgets its state
//! when it restarts: its count of new messages starts again, and counting from the start, it
//! reports everything before the restart lost). The test runs itself again with it, after its own
//! run, and must fail.
//!
//! Needs Debian's `rabbitmq-server` (`.ci/run` installs it); without it the tests are reported
//! ignored with the reason (`eo_skip_rabbitmq`, build.rs), and `EDGE_OUTBOX_REQUIRE_ALL=1` makes
//! that a build error.

mod common;
mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::TestResult;
use edge_outbox::{MqttConfig, Outbox, Protocol, Relay, RelayConfig};
use support::example::{CloudConsumer, TAKEN_TWICE, final_totals, shard_rows as rows};
use support::rabbit::{Queues, RabbitCluster};
use support::{WAIT, wait_until};

const DEVICES: usize = 20;

struct Device {
    name: String,
    topic: String,
    outbox: Outbox,
    relay: Relay,
}

fn shard_of(device: usize) -> &'static str {
    if device.is_multiple_of(2) { "a" } else { "b" }
}

fn consumer(
    cluster: &RabbitCluster,
    db: &Path,
    shard: &str,
) -> Result<CloudConsumer, Box<dyn std::error::Error>> {
    let brokers: Vec<String> = cluster.mqtt_addrs().iter().map(|a| a.to_string()).collect();
    CloudConsumer::start_shard(&brokers.join(","), db, shard, 6)
}

#[test]
#[cfg_attr(
    eo_skip_rabbitmq,
    ignore = "needs RabbitMQ: Debian's rabbitmq-server is not installed, or EDGE_OUTBOX_SKIP=rabbitmq (the build warning says which)"
)]
fn a_fleet_on_a_cluster_losing_a_node_loses_nothing() -> TestResult {
    if support::mutant::in_mutant_run() && std::env::var("EDGE_OUTBOX_MUTANT")? != "consumer-state-unsaved" {
        return Ok(());
    }
    let mut cluster = RabbitCluster::start(Queues::Quorum)?;
    let nodes = cluster.mqtt_addrs();
    let dir = tempfile::tempdir()?;
    let (db_a, db_b) = (dir.path().join("cloud-a.db"), dir.path().join("cloud-b.db"));
    let mut b = Some(consumer(&cluster, &db_b, "b")?);
    let a = consumer(&cluster, &db_a, "a")?;

    let mut devices = Vec::new();
    for i in 0..DEVICES {
        let name = format!("dev-{i:02}");
        // Spread over the nodes, each with the other two to fall back on.
        let first = nodes[i % 3];
        let mut mqtt = MqttConfig::new(first.ip().to_string(), first.port())
            .client_id(&name)
            .protocol(Protocol::V311)
            .keep_alive(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(2));
        for other in (1..3).map(|k| nodes[(i + k) % 3]) {
            mqtt = mqtt.failover(other.ip().to_string(), other.port());
        }
        // No poison isolation: while a node is down the cluster may close a publisher's
        // connection several times over the same message (its queue's leader moving), which the
        // heuristic would take for a poison message and dead-letter. This test is about loss.
        let config = RelayConfig::new(mqtt)
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
            .poison_disconnects(0);
        let outbox = Outbox::open(dir.path().join(format!("{name}.db")))?;
        let relay = Relay::start(&outbox, config)?;
        devices.push(Device {
            topic: format!("fleet/{}/{name}", shard_of(i)),
            name,
            outbox,
            relay,
        });
    }

    let writing = AtomicBool::new(true);
    let killed = std::thread::scope(|scope| -> Result<usize, Box<dyn std::error::Error>> {
        let writer = scope.spawn(|| -> Result<(), edge_outbox::Error> {
            // Each device about 10 messages a second.
            while writing.load(Ordering::Relaxed) {
                for d in &devices {
                    d.outbox
                        .transaction(|tx| tx.publish(&d.topic, &d.name, &0u8).map(|_| ()))?;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        });
        let mut run = || -> Result<usize, Box<dyn std::error::Error>> {
            std::thread::sleep(Duration::from_secs(3));
            let victim = cluster
                .session_node("cloud-a")?
                .ok_or("shard a's session queue was not found")?;
            eprintln!("killing node {} (shard a's session leader)", victim + 1);
            cluster.kill(victim)?;
            std::thread::sleep(Duration::from_secs(2));
            b.take().ok_or("consumer b")?.kill();
            std::thread::sleep(Duration::from_secs(1));
            b = Some(consumer(&cluster, &db_b, "b")?);
            let since = Instant::now();
            cluster.restart(victim)?;
            eprintln!("node {} back after {:?}", victim + 1, since.elapsed());
            std::thread::sleep(Duration::from_secs(2));
            Ok(victim)
        };
        let result = run();
        writing.store(false, Ordering::Relaxed);
        writer.join().map_err(|_| "writer panicked")??;
        result
    })?;
    assert!(
        wait_until(|| devices
            .iter()
            .all(|d| d.outbox.stats().is_ok_and(|s| s.pending_messages == 0))),
        "the relays did not drain after node {} came back",
        killed + 1
    );
    let mut acknowledged = BTreeMap::new();
    for device in devices {
        let status = device.relay.status()?;
        assert_eq!(
            status.dead_lettered,
            0,
            "{} dead-lettered a message: {:?}",
            device.name,
            device.outbox.dead_letters(10)
        );
        device.relay.shutdown()?;
        acknowledged.insert(device.name.clone(), status.acknowledged);
    }
    for (consumer, db, shard) in [(a, &db_a, "a"), (b.take().ok_or("consumer b")?, &db_b, "b")] {
        let (status, said) = consumer.wait(WAIT * 2)?;
        let (delivered, _duplicates, announced, unexplained) = final_totals(&said)?;
        let rows = rows(db)?;
        let mut stored = 0;
        for (i, (source, acked)) in acknowledged.iter().enumerate() {
            if shard_of(i) != shard {
                continue;
            }
            let (count, high) = rows.get(source).copied().unwrap_or((0, 0));
            assert_eq!(
                (count, high),
                (*acked, *acked),
                "shard {shard}: {source} had {acked} messages acknowledged by the cluster, the \
                 consumer stored {count} up to number {high}: {said:#?}"
            );
            stored += count;
        }
        assert_eq!(announced, 0, "shard {shard}: {said:#?}");
        assert_eq!(
            (delivered, unexplained),
            (stored, 0),
            "shard {shard}: the consumer called {delivered} messages new and {unexplained} \
             unexplained, for {stored} stored and none lost ({TAKEN_TWICE}, or a loss that did \
             not happen): {said:#?}"
        );
        assert!(status.success(), "{status:?}: {said:#?}");
    }
    drop(cluster);
    // Then, alone on the machine (two clusters at once strain a small one), the same scenario
    // with a consumer that forgets its state on restart must fail.
    if !support::mutant::in_mutant_run() {
        support::mutant::caught_by(
            "consumer-state-unsaved",
            "a_fleet_on_a_cluster_losing_a_node_loses_nothing",
            TAKEN_TWICE,
        )?;
    }
    Ok(())
}
