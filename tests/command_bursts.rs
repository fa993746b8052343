//! A queue of commands after an outage is stored many to a transaction: the intake stores the
//! deliveries one network read brings in one transaction and acknowledges them after it. Counted
//! from the intake's debug line per transaction, through a subscriber that only this file's one
//! relay logs to (its own test binary); a build that commits each delivery on its own (mutant
//! `command-commit-each`) is caught.

mod support;

use edge_outbox::{Outbox, Relay, RelayConfig};
use rumqttc::QoS;
use support::credits::{balance, command, credit_relay, device};
use support::device::relay_config;
use support::{Broker, publish_raw_many, wait_until};

const FILTER: &str = "devices/d1/commands/#";
const TOPIC: &str = "devices/d1/commands/credit";

fn start(outbox: &Outbox, config: RelayConfig) -> Relay {
    credit_relay(outbox, config, FILTER, None)
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
