//! Commands arrive through a persistent session, are stored before they are acknowledged, and
//! are applied exactly once: redeliveries are no-ops, offline commands are delivered on
//! reconnect, and malformed bytes are acknowledged and dead-lettered without stopping the session.
//! A queue of commands after an outage is stored many to a transaction (counted from the intake's
//! debug line per transaction); a build that commits each on its own (mutant
//! `command-commit-each`) is caught.

mod support;

use edge_outbox::{Outbox, Relay, RelayConfig};
use rumqttc::QoS;
use support::credits::{balance, command, device};
use support::device::relay_config;
use support::{Broker, Subscriber, WAIT, publish_raw, publish_raw_many, wait_until};

const FILTER: &str = "devices/d1/commands/#";
const TOPIC: &str = "devices/d1/commands/credit";

/// Starts a relay whose handler adds credits (an increment: not idempotent on its own) and
/// publishes a receipt in the same transaction.
fn start(outbox: &Outbox, config: RelayConfig) -> Relay {
    let relay = Relay::start_with_handler(outbox, config.commands(FILTER), |tx, cmd| {
        let credits: i64 = cmd.payload_as()?;
        tx.execute(
            "UPDATE balance SET credits = credits + ?1 WHERE account = ?2",
            (credits, &cmd.key),
        )?;
        tx.publish("devices/d1/receipts", &cmd.key, &cmd.id.to_string())?;
        Ok::<_, edge_outbox::Error>(())
    })
    .expect("relay");
    assert!(
        wait_until(|| relay.status().expect("status").commands_connected),
        "command session ready"
    );
    relay
}

#[test]
fn a_redelivered_command_is_applied_once() {
    let broker = Broker::start().expect("broker");
    let receipts = Subscriber::start(broker.addr(), "devices/d1/receipts").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = device(dir.path());
    let relay = start(&outbox, relay_config(broker.addr(), "cmd-dup"));
    let bytes = command(40);
    // The same command id delivered twice, as a broker redelivers after a lost ack.
    publish_raw(broker.addr(), TOPIC, &bytes, QoS::AtLeastOnce).expect("first delivery");
    publish_raw(broker.addr(), TOPIC, &bytes, QoS::AtLeastOnce).expect("second delivery");
    assert!(
        wait_until(|| relay.status().expect("status").commands_duplicate >= 1),
        "duplicate seen"
    );
    assert!(
        wait_until(|| relay.status().expect("status").commands_applied >= 1),
        "applied"
    );
    assert!(receipts.wait_for(1, WAIT), "receipt published with the effect");
    let status = relay.status().expect("status");
    assert_eq!(
        (status.commands_received, status.commands_applied),
        (1, 1),
        "{status:?}"
    );
    assert_eq!(balance(&outbox), 40);
    relay.shutdown().expect("shutdown");
    assert_eq!(balance(&outbox), 40);
}

#[test]
fn a_command_sent_while_the_device_is_offline_is_applied_when_it_reconnects() {
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = device(dir.path());
    // First run: establishes the persistent command session on the broker.
    start(&outbox, relay_config(broker.addr(), "cmd-offline"))
        .shutdown()
        .expect("shutdown");

    // Offline: the broker queues this for the device's command session.
    publish_raw(broker.addr(), TOPIC, &command(25), QoS::AtLeastOnce).expect("publish while offline");
    assert_eq!(balance(&outbox), 0);

    let relay = start(&outbox, relay_config(broker.addr(), "cmd-offline"));
    assert!(
        wait_until(|| balance(&outbox) == 25),
        "queued command applied after reconnect ({:?})",
        broker.kind()
    );
    relay.shutdown().expect("shutdown");
}

#[test]
fn malformed_command_bytes_are_acknowledged_and_dead_lettered_without_stopping_the_session() {
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = device(dir.path());
    let relay = start(&outbox, relay_config(broker.addr(), "cmd-bad"));
    let good = command(7);
    let truncated = &good[..good.len() / 2];
    let messages: Vec<(&str, &[u8])> = vec![
        (TOPIC, b"not cbor at all"),
        (TOPIC, truncated),
        ("devices/d1/commands/x/y/z/\u{e9}", &[0xa0]), // an empty map: no id, odd topic shape
        (TOPIC, &good),
    ];
    publish_raw_many(broker.addr(), &messages, QoS::AtLeastOnce).expect("publish");
    assert!(
        wait_until(|| balance(&outbox) == 7),
        "the good command behind the bad ones was applied"
    );
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 3, "{dead:#?}");
    assert!(dead.iter().all(|d| !d.reason.is_empty() && d.payload.is_some()));
    assert!(relay.status().expect("status").commands_connected);
    relay.shutdown().expect("shutdown");

    // They were acknowledged: a new session gets no redelivery, so no new dead letters.
    let relay = start(&outbox, relay_config(broker.addr(), "cmd-bad"));
    publish_raw(broker.addr(), TOPIC, &command(1), QoS::AtLeastOnce).expect("publish");
    assert!(wait_until(|| balance(&outbox) == 8));
    assert_eq!(outbox.dead_letters(10).expect("dead letters").len(), 3);
    relay.shutdown().expect("shutdown");
}

const BURST: &str = "a_burst_of_queued_commands_is_stored_many_to_a_transaction";

/// Collects the intake's "stored a burst" lines (a global subscriber: the relay's threads log
/// there). Returns the size of each burst stored so far.
fn burst_sizes() -> impl Fn() -> Vec<usize> {
    use std::sync::{Arc, Mutex};
    #[derive(Clone)]
    struct Lines(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log buffer").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let lines = Lines(Arc::new(Mutex::new(Vec::new())));
    let writer = lines.clone();
    tracing_subscriber::fmt()
        .with_env_filter("edge_outbox::commands=debug")
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .without_time()
        .try_init()
        .expect("the only subscriber in this test binary");
    move || {
        let text = String::from_utf8_lossy(&lines.0.lock().expect("log buffer")).into_owned();
        text.lines()
            .filter(|l| l.contains("stored a burst of commands"))
            .filter_map(|l| {
                l.split("commands=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .collect()
    }
}

#[test]
fn a_burst_of_queued_commands_is_stored_many_to_a_transaction() {
    const N: usize = 200;
    let bursts = burst_sizes();
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = device(dir.path());
    start(&outbox, relay_config(broker.addr(), "cmd-burst"))
        .shutdown()
        .expect("shutdown");
    // Offline: the broker queues them all for the device's command session.
    let commands: Vec<Vec<u8>> = (0..N).map(|_| command(1)).collect();
    let messages: Vec<(&str, &[u8])> = commands.iter().map(|c| (TOPIC, c.as_slice())).collect();
    publish_raw_many(broker.addr(), &messages, QoS::AtLeastOnce).expect("publish while offline");

    let relay = start(&outbox, relay_config(broker.addr(), "cmd-burst"));
    assert!(
        wait_until(|| balance(&outbox) == N as i64),
        "every command applied once"
    );
    relay.shutdown().expect("shutdown");
    let sizes = bursts();
    // Each "stored a burst" line is one transaction; one command per transaction is what a
    // queue after an outage cost before.
    assert!(
        sizes.iter().sum::<usize>() >= N,
        "every command stored: {sizes:?}"
    );
    assert!(
        sizes.len() * 3 <= N,
        "{} transactions for {N} commands, as if one commit per command: {sizes:?}",
        sizes.len()
    );
}

#[test]
fn a_commit_per_command_is_caught() -> Result<(), Box<dyn std::error::Error>> {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by("command-commit-each", BURST, "as if one commit per command")
}
