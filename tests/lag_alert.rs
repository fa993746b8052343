//! The lag alert sees an outage of a latest-value stream: while the broker is down a coalescing
//! reading keeps replacing the pending one, so the oldest pending message stays young, but how
//! long publishing has been down, and the last PUBACK's age, grow with the outage, in `Status`,
//! the status file and the metrics alike; both clear once the broker is back.
//!
//! Broken builds these catch: an alert figure taken from the backlog's age (blind here), a
//! disconnection time that restarts at every failed reconnect attempt, and figures that the
//! status file or the metrics do not carry.

mod common;

use std::time::{Duration, SystemTime};

use common::{TestResult, temp_db};
use edge_outbox::{Message, Outbox, Relay, RelayReport, Status};
use support::device::relay_config_for;
use support::{Broker, Subscriber, WAIT, wait_until};

mod support;

/// The outage the alert must see: well above the few milliseconds the oldest reading waits.
const OUTAGE: Duration = Duration::from_secs(3);

fn age(t: Option<SystemTime>) -> Option<Duration> {
    t.map(|t| SystemTime::now().duration_since(t).unwrap_or_default())
}

fn reading(value: u64) -> edge_outbox::Result<Message> {
    Ok(Message::new("lag/temperature", "probe-1", &value)?.coalescing(true))
}

#[test]
fn an_outage_of_a_coalescing_stream_shows_in_the_lag_figures() -> TestResult {
    let mut broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "lag/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let relay = Relay::start(&outbox, relay_config_for(&broker, "lag-device").status_file(true))?;
    outbox.transaction(|tx| tx.send(&reading(0)?))?;
    assert!(sub.wait_for(1, WAIT), "the first reading did not arrive");
    assert!(wait_until(|| relay
        .status()
        .is_ok_and(|s| s.store.pending_messages == 0)));
    let up = relay.status()?;
    assert_eq!(up.disconnected_since, None, "connected, yet: {up:?}");
    assert!(up.last_ack_at.is_some());

    broker.kill()?;
    // The stream starts once the relay knows the broker is gone: a reading it read before that
    // is claimed (it may be on the wire), and a claimed reading is never replaced.
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.disconnected_since.is_some())),
        "the relay did not notice the broker's death"
    );
    let mut value = 0;
    let mut status: Status;
    loop {
        value += 1;
        outbox.transaction(|tx| tx.send(&reading(value)?))?;
        status = relay.status()?;
        if age(status.disconnected_since).is_some_and(|d| d >= OUTAGE) {
            break;
        }
        assert!(
            age(status.last_ack_at) < Some(WAIT),
            "the outage outlasted the test's bound"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Only the latest reading waits: the backlog's age cannot see the outage.
    let oldest = status.store.oldest_pending_age.ok_or("nothing pending")?;
    assert!(oldest < OUTAGE / 2, "oldest pending {oldest:?}");
    assert_eq!(status.store.pending_messages, 1);
    assert!(age(status.last_ack_at) >= Some(OUTAGE), "{status:?}");

    // The status file and the metrics carry the same figures (the file is written on a change).
    assert!(
        wait_until(|| RelayReport::read(&db).is_some_and(|r| r.disconnected_since_ms.is_some())),
        "the status file does not show the outage"
    );
    let report = RelayReport::read(&db).ok_or("no status file")?;
    let since_ms = report.disconnected_since_ms.ok_or("no outage in the file")?;
    let metrics = edge_outbox::metrics::encode(&status.store, Some(&report));
    let gauge = |name: &str| -> Option<i64> {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    assert_eq!(
        gauge("edge_outbox_relay_disconnected_since_seconds"),
        Some(since_ms / 1000),
        "{metrics}"
    );
    assert!(gauge("edge_outbox_relay_last_ack_seconds").is_some_and(|s| s > 0));

    // Back up: the outage figure clears and PUBACKs come again.
    broker.restart()?;
    assert!(
        wait_until(|| relay
            .status()
            .is_ok_and(|s| s.disconnected_since.is_none() && age(s.last_ack_at) < Some(OUTAGE))),
        "{:?}",
        relay.status()?
    );
    relay.shutdown()?;
    Ok(())
}
